"""Command line of globalrouter (placeholder until the service lands)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="globalrouter", description="globalrouter (not built yet)")
    parser.parse_args(argv)
    return 0

"""Command line of globaldiscovery (placeholder until the service lands)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="globaldiscovery", description="globaldiscovery (not built yet)")
    parser.parse_args(argv)
    return 0

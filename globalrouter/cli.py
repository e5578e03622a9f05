"""Command line of the global frontend: `globalrouter serve | generate | simulate | replay`.

The one place that parses globalrouter flags. Each subcommand's module defines
`add_parser(subparsers)`, which adds its parser and sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `--help` lists them. Each is imported lazily so that a
# missing or broken one does not take the others down.
SUBCOMMANDS = ("serve_cli", "client", "simulate", "replay")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="globalrouter",
        description="The global frontend: routes LLM inference requests across serving pools.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"globalrouter.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"globalrouter.{name}":
                continue  # not built yet
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

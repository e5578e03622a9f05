"""Command line of the global frontend: `globalrouter serve | generate | simulate | replay`.

The one place that parses globalrouter flags. Each subcommand's module defines
`add_parser(subparsers)`, which adds its parser and sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from globalrouter import client, replay, serve_cli, simulate
from meshkit import settings
from meshkit.cli import security_config

# Subcommand modules, in the order `--help` lists them. Imported plainly: a broken one fails loudly.
SUBCOMMANDS: tuple[ModuleType, ...] = (serve_cli, client, simulate, replay)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="globalrouter",
        description="The global frontend: routes LLM inference requests across serving pools.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = settings.parse_args(parser, argv)  # flags over GLOBALROUTER_* over --config FILE (serve)
    # The process's own command line (not an in-process call): `serve` may end the process itself.
    args.whole_process = argv is None
    if hasattr(args, "tls_cert"):  # the subcommand dials or serves: its security flags, checked once
        args.security = security_config(parser, args)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

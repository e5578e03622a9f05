"""Writes docs/configuration.md, the settings reference of every `serve` command, from the parsers
themselves (meshkit.settings): `python -m tests.config_doc` (`make config-doc`) rewrites it;
tests/test_config_doc.py fails when the committed file is not current."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from globaldiscovery import cli as discovery_cli
from globalrouter import cli as router_cli
from meshkit import settings
from mocker import cli as mocker_cli
from poolrelay import cli as relay_cli

PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# (command, its top-level parser): each binary's `serve` is the settings-enabled parser.
BINARIES: list[tuple[str, Callable[[], argparse.ArgumentParser]]] = [
    ("globaldiscovery", lambda: discovery_cli._parser()[0]),
    ("poolrelay", relay_cli.build_parser),
    ("globalrouter", router_cli.build_parser),
    ("mocker", mocker_cli.build_parser),
]

INTRO = """\
# Configuration reference

<!-- Generated from the command parsers by `make config-doc` (python -m tests.config_doc);
tests/test_config_doc.py fails when this file is stale. Do not edit by hand. -->

Every `serve` command takes each of its settings three ways, with one set of defaults (the
binary's config dataclass) and one validator per setting:

| source | form | example |
|---|---|---|
| flag | `--NAME VALUE` | `globalrouter serve --stall-timeout 1.5` |
| environment | `<BINARY>_<KEY upper>` | `GLOBALROUTER_STALL_TIMEOUT=1.5` |
| TOML file | `KEY = VALUE` in the file `--config FILE` (or `<BINARY>_CONFIG`) names | `stall_timeout = 1.5` |

- **Precedence**: flag > environment > file > default.
- **Keys** are the option's name with underscores (`--stall-timeout` is `stall_timeout`), at the
  top level of the file. An unknown key, an unknown `<BINARY>_…` variable, a value of the wrong
  type or one the flag would refuse stops the command (exit 2) with a message naming the variable,
  or the file and the key.
- **Switches** (`--insecure`, ...) take `true` / `false` in TOML; in the environment also
  `1`/`0`, `yes`/`no`, `on`/`off`.
- **Repeatable options** (`--tokenizer`, `--engine-worker`, `--model`, ...) take a TOML array of
  strings (or one string); in the environment a TOML array literal (`'["a=/x", "b=/y"]'`) or one
  plain value. Given as flags, they replace what the environment or the file gave.
- **Comma-separated lists** (`--discovery`, `--global-frontends`, ...) take a string, or an array
  of strings (joined with commas).
- **`--print-config`** prints the effective settings as TOML and exits 0: the output is a file
  `--config` reads back. Secrets are never values here: the security settings name files.
- The client commands (`globalrouter generate`, `poolrelay status`, `globaldiscovery pools`) and the
  offline tools (`globalrouter simulate`, `replay`) take flags only.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def serve_parser(top: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `serve` sub-parser of a binary's parser."""
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser: argparse.ArgumentParser = action.choices["serve"]
            return parser
    raise LookupError(f"{top.prog} has no serve command")


def table(command: str, parser: argparse.ArgumentParser) -> str:
    prefix = settings.prefix_of(parser)
    assert prefix is not None, f"{command} serve is not settings-enabled"
    lines = [
        f"## `{command} serve`",
        "",
        f"Environment prefix `{prefix}_`; `{prefix}_CONFIG` names the TOML file when `--config` is not given.",
        "",
        "| flag | environment | TOML key | default | description |",
        "|---|---|---|---|---|",
    ]
    for action in settings.settings_actions(parser):
        flag = ", ".join(f"`{s}`" for s in action.option_strings)
        if settings.is_list(action):
            flag += " (repeatable)" if isinstance(action, argparse._AppendAction) else " (list)"
        default = settings.default_text(action)
        default = default if default.startswith("(") else f"`{_cell(default)}`"
        lines.append(
            f"| {flag} | `{settings.env_name(prefix, action)}` | `{action.dest}` | {default} "
            f"| {_cell(settings.help_text(parser, action))} |"
        )
    return "\n".join(lines)


def render() -> str:
    parts = [INTRO]
    for command, build in BINARIES:
        parts.append(table(command, serve_parser(build())))
    return "\n\n".join(parts) + "\n"


def main() -> int:
    text = render()
    if PATH.exists() and PATH.read_text() == text:
        print(f"{PATH} is current")
        return 0
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(text)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Settings of a binary from its flags, its environment and a TOML file, layered on one argparse parser.

`enable(parser, PREFIX)` gives a parser (a binary's `serve`) two more flags, --config FILE and
--print-config; `parse_args(parser, argv)` then parses with every option of that parser reachable
three ways, with one set of validators and one set of defaults (the parser's, which come from the
binary's config dataclass):

- flag `--stall-timeout 1.5`
- environment variable `<PREFIX>_<DEST>`: `GLOBALROUTER_STALL_TIMEOUT=1.5`
- TOML key `<dest>` (the option's dest, with underscores) in the file `--config` (or
  `<PREFIX>_CONFIG`) names: `stall_timeout = 1.5`

Precedence is flag > environment > file > default. A value from the environment or the file goes
through the flag's own `type=` validator and `choices`, so a bad one gets the flag's message,
naming the variable or the file and key. An unknown key, an unknown `<PREFIX>_…` variable, a value
of the wrong TOML type or an unreadable file is refused the same way (exit 2). Switches
(store_true) take TOML booleans, or true/false/1/0/yes/no/on/off in the environment. Repeatable
options take a TOML array (or one value); in the environment, a TOML array literal
(`'["a=/x", "b=/y"]'`) or one plain value. A repeatable option given as a flag replaces what the
environment or file gave (it does not add to it).

`--print-config` prints the effective settings as TOML (a file `--config` accepts back) and exits 0.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TextIO

CONFIG_DEST = "config"
PRINT_DEST = "print_config"
_PREFIX_ATTR = "_mesh_settings_prefix"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NOT_SETTINGS = frozenset({"help", CONFIG_DEST, PRINT_DEST, argparse.SUPPRESS})


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (its default_factory called): flag defaults
    come from here, so the dataclass stays the one place a default is written."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise ValueError(f"{cls.__name__} has no field {name!r}")


def enable(parser: argparse.ArgumentParser, prefix: str) -> None:
    """Adds --config and --print-config to `parser`; its options become settable by `<prefix>_<DEST>`
    environment variables and by keys of the --config file (see the module docstring)."""
    setattr(parser, _PREFIX_ATTR, prefix)
    group = parser.add_argument_group("configuration")
    group.add_argument(
        "--config",
        dest=CONFIG_DEST,
        metavar="FILE",
        default=None,
        help=f"a TOML file of settings, one key per option (its dest: --stall-timeout is stall_timeout); "
        f"precedence: flag > environment ({prefix}_<DEST>) > file > default; also {prefix}_CONFIG",
    )
    group.add_argument(
        "--print-config",
        dest=PRINT_DEST,
        action="store_true",
        help="print the effective settings as TOML (a --config file) and exit",
    )


def prefix_of(parser: argparse.ArgumentParser) -> str | None:
    """The environment prefix `enable` gave `parser` (None: not enabled)."""
    prefix = getattr(parser, _PREFIX_ATTR, None)
    return prefix if isinstance(prefix, str) else None


def settings_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options of `parser` that are settings (every option with a dest, but help and --config's own)."""
    return [
        a
        for a in parser._actions
        if a.option_strings and a.dest not in _NOT_SETTINGS and not isinstance(a, argparse._VersionAction)
    ]


def env_name(prefix: str, action: argparse.Action) -> str:
    """The environment variable of an option: `<PREFIX>_<DEST upper>`."""
    return f"{prefix}_{action.dest.upper()}"


def is_switch(action: argparse.Action) -> bool:
    """A flag that takes no value (store_true / store_false / store_const)."""
    return action.nargs == 0


def is_list(action: argparse.Action) -> bool:
    """A repeatable option (append) or one that takes several values (nargs + / * / N)."""
    return (
        isinstance(action, argparse._AppendAction)
        or action.nargs in ("+", "*")
        or (isinstance(action.nargs, int) and action.nargs > 0)  # 0: a switch
    )


def _convert(action: argparse.Action, raw: str) -> Any:
    """`raw` through the option's own validator and choices; ValueError with argparse's message."""
    convert: Callable[[str], Any] | None = action.type  # type: ignore[assignment]
    try:
        value = convert(raw) if convert is not None else raw
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    except (TypeError, ValueError):
        name = getattr(action.type, "__name__", repr(action.type))
        raise ValueError(f"invalid {name} value: {raw!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ValueError(f"invalid choice: {raw!r} (choose from {choices})")
    return value


class _Layer:
    """The value one source (environment or file) gives one option: converted, and as written."""

    __slots__ = ("raw", "value")

    def __init__(self, value: Any, raw: Any) -> None:
        self.value = value
        self.raw = raw


def _scalar_text(value: Any) -> str | None:
    """A TOML scalar as the string a flag would take (None: not a scalar)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return repr(value) if isinstance(value, float) else str(value)
    return None


def _from_env(action: argparse.Action, text: str) -> tuple[Any, Any]:
    if is_switch(action):
        word = text.strip().lower()
        if word in _TRUE:
            return True, True
        if word in _FALSE:
            return False, False
        raise ValueError(f"expected true or false (or 1/0, yes/no, on/off), got {text!r}")
    if is_list(action):
        items: list[Any] = [text]
        if text.lstrip().startswith("["):
            try:
                items = tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"not a TOML array of values: {exc}") from None
        return _items(action, items)
    return _convert(action, text), text


def _items(action: argparse.Action, items: list[Any]) -> tuple[list[Any], list[str]]:
    raws: list[str] = []
    for item in items:
        text = _scalar_text(item)
        if text is None:
            raise ValueError(f"expected strings or numbers in the array, got {item!r}")
        raws.append(text)
    return [_convert(action, r) for r in raws], raws


def _from_toml(action: argparse.Action, value: Any) -> tuple[Any, Any]:
    if is_switch(action):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value, value
    if is_list(action):
        return _items(action, value if isinstance(value, list) else [value])
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = ",".join(value)  # the mesh's comma-separated lists (--global-frontends, ...)
    text = _scalar_text(value)
    if text is None:
        raise ValueError(f"expected a string or a number, got {type(value).__name__} {value!r}")
    return _convert(action, text), text


def _close(word: str, known: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _config_path(argv: Sequence[str], prefix: str, environ: Mapping[str, str]) -> str | None:
    """--config's value as given on the command line (before `--`), else `<PREFIX>_CONFIG`."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.partition("=")[2]
    if path is None:
        path = environ.get(f"{prefix}_CONFIG") or None
    return path


def read_layers(
    parser: argparse.ArgumentParser, prefix: str, config_path: str | None, environ: Mapping[str, str]
) -> dict[str, _Layer]:
    """dest -> the value the environment (else the file) gives it; parser.error on a bad one."""
    actions = {a.dest: a for a in settings_actions(parser)}
    layers: dict[str, _Layer] = {}
    if config_path is not None:
        try:
            table = tomllib.loads(Path(config_path).read_text(encoding="utf-8"))
        except OSError as exc:
            parser.error(f"--config {config_path}: cannot read it: {exc.strerror or exc}")
        except UnicodeDecodeError:
            parser.error(f"--config {config_path}: not UTF-8 text")
        except tomllib.TOMLDecodeError as exc:
            parser.error(f"--config {config_path}: not valid TOML: {exc}")
        for key, value in table.items():
            action = actions.get(key)
            if action is None:
                hint = _close(key.replace("-", "_"), list(actions))
                parser.error(f"--config {config_path}: unknown key {key!r}{hint}")
            if isinstance(value, dict):
                parser.error(f"--config {config_path}: key {key!r}: expected a value, got a table")
            try:
                converted, raw = _from_toml(action, value)
            except ValueError as exc:
                parser.error(f"--config {config_path}: key {key!r}: {exc}")
            layers[key] = _Layer(converted, raw)
    names = {env_name(prefix, a): a for a in actions.values()}
    for var in sorted(environ):
        if not var.startswith(prefix + "_") or var == f"{prefix}_CONFIG":
            continue
        action = names.get(var)
        if action is None:
            parser.error(
                f"environment variable {var}: not a setting of {parser.prog}{_close(var, list(names))}"
            )
        try:
            converted, raw = _from_env(action, environ[var])
        except ValueError as exc:
            parser.error(f"environment variable {var}: {exc}")
        layers[action.dest] = _Layer(converted, raw)
    return layers


def _target(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.ArgumentParser, list[str]] | None:
    """The settings-enabled parser `argv` selects (the parser itself or its subcommand) and its arguments."""
    if prefix_of(parser) is not None:
        return parser, list(argv)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            choices: dict[str, argparse.ArgumentParser] = action.choices
            for i, arg in enumerate(argv):
                if arg == "--":
                    return None
                if arg in choices:
                    sub = choices[arg]
                    return (sub, list(argv[i + 1 :])) if prefix_of(sub) is not None else None
    return None


class _Recorder:
    """Wraps an option's type to remember the strings given on the command line (for --print-config)."""

    def __init__(self, action: argparse.Action, layered: bool) -> None:
        self.action = action
        self.original: Callable[[str], Any] | None = action.type  # type: ignore[assignment]
        self.layered = layered
        self.given: list[str] = []
        self.__name__ = getattr(action.type, "__name__", "value")  # argparse names it in its errors

    def __call__(self, raw: str) -> Any:
        if raw is self.action.default:
            # argparse converts a string default at the end; one from a layer is converted already.
            return raw if self.layered or self.original is None else self.original(raw)
        value = self.original(raw) if self.original is not None else raw
        self.given.append(raw)
        return value


@contextmanager
def _layered(parser: argparse.ArgumentParser, layers: dict[str, _Layer]) -> Iterator[dict[str, _Recorder]]:
    """The parser with each layered value as its option's default (a required option given by a
    layer no longer required); restored afterwards."""
    saved = [(a, a.default, a.required, a.type) for a in settings_actions(parser)]
    recorders: dict[str, _Recorder] = {}
    try:
        for action in settings_actions(parser):
            layer = layers.get(action.dest)
            if not is_switch(action):
                recorders[action.dest] = _Recorder(action, layer is not None)
                action.type = recorders[action.dest]
            if layer is None:
                continue
            action.required = False
            if not is_list(action):  # a repeatable flag replaces a layered list: filled in afterwards
                action.default = layer.value
        yield recorders
    finally:
        for action, default, required, type_ in saved:
            action.default, action.required, action.type = default, required, type_


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    out: TextIO | None = None,
) -> argparse.Namespace:
    """`parser.parse_args(argv)` with the environment and the --config file layered under the flags
    of the settings-enabled parser argv selects; --print-config prints the settings and exits 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    environ = os.environ if environ is None else environ
    found = _target(parser, argv)
    if found is None:
        return parser.parse_args(argv)
    target, rest = found
    prefix = prefix_of(target)
    assert prefix is not None
    config_path = _config_path(rest, prefix, environ)
    layers = read_layers(target, prefix, config_path, environ)
    with _layered(target, layers) as recorders:
        args = parser.parse_args(argv)
        given_path = getattr(args, CONFIG_DEST, None)
        if given_path is not None and given_path != config_path:
            target.error("--config: write the option in full (--config FILE)")
        for action in settings_actions(target):
            layer = layers.get(action.dest)
            recorder = recorders.get(action.dest)
            if layer is not None and is_list(action) and not (recorder and recorder.given):
                setattr(args, action.dest, list(layer.value))
        if getattr(args, PRINT_DEST, False):
            (out or sys.stdout).write(render_toml(target, args, layers, recorders))
            raise SystemExit(0)
    return args


# ---- TOML out -------------------------------------------------------------------------------------


def toml_string(text: str) -> str:
    """A TOML basic string."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def toml_value(value: Any) -> str | None:
    """A TOML literal for a setting's value (None: it has none, e.g. an unset option)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list | tuple):
        items = [toml_value(v) for v in value]
        return "[" + ", ".join(i for i in items if i is not None) + "]"
    return toml_string(str(value))


def setting_value(action: argparse.Action, value: Any, raws: list[str] | None) -> Any:
    """What --print-config writes for an option: its value when it is a TOML scalar, else the
    strings that produced it (so the file reads back through the same validator)."""
    if is_switch(action):
        return bool(value)
    if is_list(action):
        if raws:
            return [_plain(v, r) for v, r in zip(value, raws, strict=False)] if value else raws
        return [_plain(v, None) for v in (value or [])]
    if value is None or (isinstance(value, list | tuple | dict) and not value):
        return None
    return _plain(value, raws[-1] if raws else None)


def _plain(value: Any, raw: str | None) -> Any:
    if isinstance(value, bool | int | float | str):
        return value
    if raw is not None:
        return raw
    if isinstance(value, list | tuple):
        return ",".join(map(str, value))
    if isinstance(value, dict):  # KEY=VALUE[,...] flags (e.g. --dispatch-shed-after) parse back
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def render_toml(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    layers: Mapping[str, _Layer] | None = None,
    recorders: Mapping[str, _Recorder] | None = None,
) -> str:
    """The effective settings as a TOML file `--config` reads back (unset options as comments)."""
    layers = layers or {}
    recorders = recorders or {}
    lines = [
        f"# Effective settings of `{parser.prog}` (--print-config): flag > environment > file > default."
    ]
    for action in settings_actions(parser):
        recorder = recorders.get(action.dest)
        layer = layers.get(action.dest)
        raws: list[str] | None = None
        if recorder is not None and recorder.given:
            raws = recorder.given
        elif layer is not None and not is_switch(action):
            raws = list(layer.raw) if is_list(action) else [layer.raw]
        text = toml_value(setting_value(action, getattr(args, action.dest, None), raws))
        if text is None:
            lines.append(f"# {action.dest} = (not set)")
        else:
            lines.append(f"{action.dest} = {text}")
    return "\n".join(lines) + "\n"


def default_text(action: argparse.Action) -> str:
    """An option's default as the reference documentation shows it."""
    if action.required:
        return "(required)"
    text = toml_value(setting_value(action, action.default, None))
    return "(not set)" if text is None else text


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """An option's help with its %(...)s expanded, as --help shows it (one line)."""
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    params: dict[str, Any] = dict(vars(action), prog=parser.prog)
    if action.choices is not None:
        params["choices"] = ", ".join(map(str, action.choices))
    return " ".join((action.help % params).split())

"""Settings from flags, environment and a TOML file (meshkit.settings) on every serve command:
precedence flag > env > file > default, errors naming their source, --print-config round trips."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from globaldiscovery import cli as discovery_cli
from globaldiscovery.config import DiscoveryConfig
from globalrouter import cli as router_cli
from globalrouter import serve_cli
from globalrouter.config import RouterConfig
from meshkit import settings
from meshkit.cli import int_at_least, positive_seconds, url_list
from mocker import cli as mocker_cli
from poolrelay import cli as relay_cli
from tests.support import REPO

# ---- the mechanism, on a parser of its own --------------------------------------------------------


def toy() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="toy")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--count", type=int_at_least(1), default=3)
    p.add_argument("--wait", type=positive_seconds, default=1.5)
    p.add_argument("--name", required=True)
    p.add_argument("--mode", choices=["a", "b"], default="a")
    p.add_argument("--fast", action="store_true")
    p.add_argument("--item", action="append", default=[])
    p.add_argument("--urls", type=url_list, default=[])
    settings.enable(p, "TOY")
    sub.add_parser("other").add_argument("--count", type=int, default=0)
    return top


def parse(argv: list[str], env: dict[str, str] | None = None, parser=None) -> argparse.Namespace:
    return settings.parse_args(parser or toy(), argv, environ=env or {})


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    return str(path)


def error_of(capsys, argv: list[str], env: dict[str, str] | None = None, parser=None) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse(argv, env, parser)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = write(tmp_path, "count = 5\nwait = 2.5\nname = 'from-file'\n")
    args = parse(["serve", "--config", path])
    assert (args.count, args.wait, args.name, args.mode) == (5, 2.5, "from-file", "a")
    args = parse(["serve", "--config", path], {"TOY_COUNT": "6"})
    assert (args.count, args.wait) == (6, 2.5)
    args = parse(["serve", "--config", path, "--count", "7"], {"TOY_COUNT": "6"})
    assert (args.count, args.wait) == (7, 2.5)
    # The file may also come from <PREFIX>_CONFIG; --config wins over it.
    assert parse(["serve"], {"TOY_CONFIG": path}).name == "from-file"
    other = write(tmp_path / "..", "name = 'other'\n")
    assert parse(["serve", f"--config={other}"], {"TOY_CONFIG": path}).name == "other"


def test_a_required_option_may_come_from_env_or_file(tmp_path, capsys):
    assert parse(["serve"], {"TOY_NAME": "n"}).name == "n"
    assert "--name" in error_of(capsys, ["serve"])


def test_switches_and_repeatable_options(tmp_path):
    env = {"TOY_NAME": "n", "TOY_FAST": "yes", "TOY_ITEM": '["a", "b=c,d"]'}
    args = parse(["serve"], env)
    assert args.fast is True and args.item == ["a", "b=c,d"]
    assert parse(["serve"], {**env, "TOY_ITEM": "one"}).item == ["one"]
    # Flags replace a layered list, they do not add to it.
    assert parse(["serve", "--item", "x"], env).item == ["x"]
    assert parse(["serve"], {**env, "TOY_FAST": "0"}).fast is False
    path = write(
        tmp_path, "name = 'n'\nfast = true\nitem = ['p', 'q']\nurls = ['http://h:1', 'http://g:2']\n"
    )
    args = parse(["serve", "--config", path])
    assert args.fast is True and args.item == ["p", "q"] and args.urls == ["http://h:1", "http://g:2"]


def test_other_subcommands_take_flags_only():
    assert parse(["other"], {"TOY_COUNT": "x", "TOY_NOPE": "1"}).count == 0


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"TOY_COUNT": "0"}, "environment variable TOY_COUNT: must be at least 1, got 0"),
        ({"TOY_COUNT": "many"}, "environment variable TOY_COUNT: expected a whole number, got 'many'"),
        ({"TOY_WAIT": "-1"}, "environment variable TOY_WAIT: must be > 0 seconds"),
        ({"TOY_MODE": "c"}, "environment variable TOY_MODE: invalid choice: 'c'"),
        ({"TOY_FAST": "maybe"}, "environment variable TOY_FAST: expected true or false"),
        ({"TOY_URLS": "ftp://x:1"}, "environment variable TOY_URLS: frontend 'ftp://x:1'"),
        ({"TOY_ITEM": "[1, [2]]"}, "environment variable TOY_ITEM: expected strings or numbers"),
        (
            {"TOY_COUNTT": "4"},
            "environment variable TOY_COUNTT: not a setting of toy serve (did you mean 'TOY_COUNT'?)",
        ),
    ],
)
def test_a_bad_environment_value_names_the_variable(capsys, env, named):
    assert named in error_of(capsys, ["serve", "--name", "n"], env)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("count = 0", "key 'count': must be at least 1, got 0"),
        ("count = 'lots'", "key 'count': expected a whole number, got 'lots'"),
        ("wait = true", "key 'wait': expected a string or a number, got bool True"),
        ("fast = 'yes'", "key 'fast': expected true or false, got 'yes'"),
        ("mode = 'c'", "key 'mode': invalid choice: 'c'"),
        ("stall-timeout = 1", "unknown key 'stall-timeout'"),
        ("cuont = 1", "unknown key 'cuont' (did you mean 'count'?)"),
        ("[count]\nx = 1", "key 'count': expected a value, got a table"),
        ("count = = 1", "not valid TOML"),
    ],
)
def test_a_bad_file_names_the_file_and_key(tmp_path, capsys, text, named):
    path = write(tmp_path, text + "\n")
    err = error_of(capsys, ["serve", "--name", "n", "--config", path])
    assert f"--config {path}: {named}" in err


def test_a_missing_file_is_named(tmp_path, capsys):
    err = error_of(capsys, ["serve", "--name", "n", "--config", str(tmp_path / "absent.toml")])
    assert "absent.toml: cannot read it" in err


def test_print_config_round_trips(tmp_path):
    out = io.StringIO()
    argv = [
        "serve",
        "--name",
        'a "quoted"\tname',
        "--count",
        "9",
        "--fast",
        "--item",
        "x=1",
        "--urls",
        "http://h:1,http://g:2",
    ]
    with pytest.raises(SystemExit) as exit_:
        settings.parse_args(toy(), [*argv, "--print-config"], environ={"TOY_WAIT": "0.25"}, out=out)
    assert exit_.value.code == 0
    path = write(tmp_path, out.getvalue())
    again = parse(["serve", "--config", path])
    first = parse(argv, {"TOY_WAIT": "0.25"})
    assert vars(again) | {"config": None} == vars(first)


# ---- each serve command -----------------------------------------------------------------------------

# (binary's parser, env prefix, required flags, a setting as (flag, dest, file value, env value, flag value))
Binary = tuple[Callable[[], argparse.ArgumentParser], str, list[str], tuple[str, str, str, str, str]]
BINARIES: dict[str, Binary] = {
    "globalrouter": (
        router_cli.build_parser,
        "GLOBALROUTER",
        ["--discovery", "127.0.0.1:1"],
        ("--max-generate-streams", "max_generate_streams", "11", "12", "13"),
    ),
    "poolrelay": (
        relay_cli.build_parser,
        "POOLRELAY",
        [
            "--discovery",
            "127.0.0.1:1",
            "--pool",
            "127.0.0.1:2",
            "--routing-pool",
            "p",
            "--routing-pool-region",
            "r",
        ],
        ("--report-interval", "report_interval", "2.5", "3.5", "4.5"),
    ),
    "globaldiscovery": (
        lambda: discovery_cli._parser()[0],
        "GLOBALDISCOVERY",
        [],
        ("--stop-grace", "stop_grace", "2.5", "3.5", "4.5"),
    ),
    "mocker": (
        mocker_cli.build_parser,
        "MOCKER",
        ["--listen", "127.0.0.1:0", "--pool-id", "p", "--model", "m"],
        ("--kv-subscriber-queue", "kv_subscriber_queue", "21", "22", "23"),
    ),
}


@pytest.mark.parametrize("name", BINARIES)
def test_each_serve_command_layers_flag_env_file_default(name, tmp_path):
    build, prefix, required, (flag, dest, in_file, in_env, in_flag) = BINARIES[name]
    default = build().parse_args(["serve", *required]).__dict__[dest]
    path = write(tmp_path, f"{dest} = {in_file}\n")
    env = {f"{prefix}_{dest.upper()}": in_env}
    got = [
        getattr(settings.parse_args(build(), ["serve", *required, *extra], environ=e), dest)
        for extra, e in [
            ([], {}),
            (["--config", path], {}),
            (["--config", path], env),
            (["--config", path, flag, in_flag], env),
        ]
    ]
    kind = type(default)
    assert got == [default, kind(in_file), kind(in_env), kind(in_flag)]


@pytest.mark.parametrize("name", BINARIES)
def test_each_serve_command_refuses_bad_env_and_file_values(name, tmp_path, capsys):
    build, prefix, required, (_flag, dest, *_values) = BINARIES[name]
    with pytest.raises(SystemExit):
        settings.parse_args(build(), ["serve", *required], environ={f"{prefix}_{dest.upper()}": "-1x"})
    assert f"environment variable {prefix}_{dest.upper()}: " in capsys.readouterr().err
    path = write(tmp_path, "no_such_setting = 1\n")
    with pytest.raises(SystemExit):
        settings.parse_args(build(), ["serve", *required, "--config", path], environ={})
    assert f"--config {path}: unknown key 'no_such_setting'" in capsys.readouterr().err


@pytest.mark.parametrize("name", BINARIES)
def test_each_serve_command_print_config_round_trips(name, tmp_path):
    build, _prefix, required, (flag, dest, _f, _e, in_flag) = BINARIES[name]
    argv = ["serve", *required, flag, in_flag, "--trust-domain", "example.org", "--insecure"]
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_:
        settings.parse_args(build(), [*argv, "--print-config"], environ={}, out=out)
    assert exit_.value.code == 0
    path = write(tmp_path, out.getvalue())
    again = vars(settings.parse_args(build(), ["serve", "--config", path], environ={}))
    first = vars(settings.parse_args(build(), argv, environ={}))
    assert again.pop("config") == path and first.pop("config") is None
    for parsed in (again, first):
        parsed.pop("func", None)  # the subcommand's function: not a setting
    assert again == first
    assert again[dest] == type(first[dest])(in_flag)


def test_router_settings_reach_the_router_config(tmp_path):
    path = write(tmp_path, "kv_max_age = 7.5\nopenai_read_timeout = 60\nhttp_max_connections = 99\n")
    env = {"GLOBALROUTER_LINK_BACKOFF_MAX": "4", "GLOBALROUTER_MAX_GENERATE_STREAMS": "17"}
    argv = ["serve", "--discovery", "127.0.0.1:1", "--config", path, "--http-body-timeout", "3"]
    args = settings.parse_args(router_cli.build_parser(), argv, environ=env)
    args.security = RouterConfig().security  # what cli.main adds after parsing
    config = serve_cli.router_config(args)
    assert config.freshness.kv_max_age == 7.5 and config.openai_link.read_timeout == 60.0
    assert config.http.max_connections == 99 and config.http.body_timeout == 3.0
    assert config.link_backoff_max == 4.0 and config.max_generate_streams == 17


def test_flag_defaults_are_the_dataclass_defaults():
    """One set of defaults: a command given only its required flags builds the dataclass's own defaults."""
    args = router_cli.build_parser().parse_args(["serve", "--discovery", "127.0.0.1:1"])
    args.security = RouterConfig().security
    built = serve_cli.router_config(args)
    assert built == dataclasses.replace(RouterConfig(), listen=built.listen, discovery="127.0.0.1:1")
    parser, serve, _pools = discovery_cli._parser()
    assert discovery_cli.discovery_config(serve, parser.parse_args(["serve"])) == DiscoveryConfig()
    _args, pool, faults = mocker_cli.parse_serve(
        ["serve", "--listen", "127.0.0.1:0", "--pool-id", "p", "--model", "m"]
    )
    assert pool == dataclasses.replace(mocker_cli._DEFAULTS, pool_id="p", models=("m",))
    assert faults == mocker_cli.Faults()


@pytest.mark.parametrize("binary", ["globalrouter", "poolrelay", "globaldiscovery", "mocker"])
def test_the_commands_read_their_environment(binary, tmp_path):
    """The console entry points themselves: --print-config from the environment exits 0, a bad value exits 2."""
    _build, prefix, required, (_flag, dest, _f, in_env, _fl) = BINARIES[binary]
    module = {
        "globalrouter": "globalrouter.cli",
        "poolrelay": "poolrelay.cli",
        "globaldiscovery": "globaldiscovery.cli",
        "mocker": "mocker.cli",
    }[binary]
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefix + "_")}
    env["PYTHONPATH"] = str(REPO)
    code = f"import sys, {module} as m; sys.exit(m.main())"
    ok = subprocess.run(
        [sys.executable, "-c", code, "serve", *required, "--print-config"],
        env={**env, f"{prefix}_{dest.upper()}": in_env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert f"\n{dest} = " in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-c", code, "serve", *required],
        env={**env, f"{prefix}_{dest.upper()}": "nonsense"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and f"environment variable {prefix}_{dest.upper()}: " in bad.stderr


def test_class_maps_round_trip_through_print_config(tmp_path):
    """CLASS=VALUE[,...] settings (--dispatch-shed-after, --dispatch-reserve) print as their flag
    syntax, and when empty as unset: --print-config's file reads back to the same settings."""
    maps = ["--dispatch-shed-after", "0=2.5,3=10", "--dispatch-reserve", "0=2"]
    for extra in ([], maps):
        argv = ["serve", "--discovery", "127.0.0.1:1", "--insecure", *extra]
        out = io.StringIO()
        with pytest.raises(SystemExit):
            settings.parse_args(router_cli.build_parser(), [*argv, "--print-config"], environ={}, out=out)
        path = write(tmp_path, out.getvalue())
        again = vars(settings.parse_args(router_cli.build_parser(), ["serve", "--config", path], environ={}))
        first = vars(settings.parse_args(router_cli.build_parser(), argv, environ={}))
        for key in ("dispatch_shed_after", "dispatch_reserve"):
            assert again[key] == first[key]
    assert first["dispatch_shed_after"] == {0: 2.5, 3: 10.0} and first["dispatch_reserve"] == {0: 2}

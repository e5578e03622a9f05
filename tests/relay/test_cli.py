"""Start-up flag checks of `poolrelay serve`: exit code 2 and a message naming what is wrong."""

from __future__ import annotations

import subprocess

import pytest

from meshlaunch import command
from poolrelay.cli import main

BASE = ["serve", "--pool", "127.0.0.1:1", "--discovery", "127.0.0.1:2", "--routing-pool", "p"]


def run(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert isinstance(exc.value.code, int)
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "bad",
    [
        "ftp://fe:80",
        "http://fe:99999",
        "fe:8000",
        "http://user:pw@fe:80",
        "http://fe:80?q=1",
        "http://fe:80/path",
    ],
)
def test_bad_frontend_is_refused_naming_it(capsys, bad):
    code, err = run(
        capsys, [*BASE, "--routing-pool-region", "r", "--routing-pool-frontends", f"http://ok:1,{bad}"]
    )
    assert code == 2
    assert repr(bad) in err and "--routing-pool-frontends" in err


def test_bad_global_frontend_is_refused_naming_it(capsys):
    code, err = run(
        capsys,
        [
            *BASE,
            "--routing-pool-region",
            "r",
            "--routing-pool-frontends",
            "http://ok:1",
            "--global-frontends",
            "gopher://x:1",
        ],
    )
    assert code == 2 and "'gopher://x:1'" in err


def test_routing_pool_requires_region(capsys):
    code, err = run(capsys, [*BASE, "--routing-pool-frontends", "http://ok:1"])
    assert code == 2 and "--routing-pool requires --routing-pool-region" in err


def test_real_process_exits_2_with_the_message(tmp_path):
    out = subprocess.run(
        [command("poolrelay"), *BASE, "--routing-pool-region", "r", "--routing-pool-frontends", "tcp://x:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "'tcp://x:1'" in out.stderr

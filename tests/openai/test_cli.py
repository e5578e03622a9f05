"""`globalrouter serve` HTTP-front flags: a bad --tokenizer or --http-listen stops the start with a clear message."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.support import command, free_port

pytestmark = pytest.mark.timeout(60)


def serve(*flags: str) -> subprocess.CompletedProcess:
    args = [
        command("globalrouter"),
        "serve",
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--discovery",
        "127.0.0.1:1",
    ]
    return subprocess.run([*args, *flags], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokenizer", "no-equals-sign"], "expected MODEL=DIR"),
        (["--tokenizer", "m=/nonexistent"], "has no tokenizer.json"),
        (["--http-listen", "nonsense"], "HOST:PORT"),
        (["--http-write-timeout", "0"], "--http-write-timeout"),
        (["--http-header-timeout", "0"], "--http-header-timeout"),
        (["--http-max-body-bytes", "10"], "--http-max-body-bytes"),
    ],
)
def test_bad_flags_exit_2_naming_them(flags, message):
    done = serve(*flags)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_unloadable_tokenizer_exits_1_naming_the_model(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    done = serve("--tokenizer", f"m={tmp_path}")
    assert done.returncode == 1
    assert "--tokenizer m=" in done.stderr and "is not a tokenizer" in done.stderr


def test_http_port_in_use_exits_1():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve("--http-listen", f"127.0.0.1:{port}")
    assert done.returncode == 1
    assert "--http-listen" in done.stderr

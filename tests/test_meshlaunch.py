"""meshlaunch names what failed: a process that dies at start, a wait that times out; and it always cleans up."""

from __future__ import annotations

import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest

from meshlaunch import (
    LaunchError,
    LaunchTimeout,
    Mesh,
    ProcessDied,
    command,
    free_port,
    process_group,
    wait_healthy,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (exited, or a zombie nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_a_process_that_dies_at_start_is_named_with_its_exit_code_and_log_tail(tmp_path: Path) -> None:
    with process_group(tmp_path, dump_logs_on_error=False) as group:
        proc = group.start("pool-x", python("import sys; print('bad flag --frob'); sys.exit(3)"))
        with pytest.raises(ProcessDied) as err:
            wait_healthy(f"127.0.0.1:{free_port()}", timeout=30, proc=proc)
    text = str(err.value)
    assert "pool-x exited with code 3" in text
    assert "bad flag --frob" in text


def test_a_health_wait_that_times_out_names_the_process_and_address(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    with process_group(tmp_path, dump_logs_on_error=False) as group:
        proc = group.start(
            "router", python("import time; print('still booting', flush=True); time.sleep(60)")
        )
        with pytest.raises(LaunchTimeout) as err:
            wait_healthy(address, timeout=0.5, proc=proc)
    assert isinstance(err.value, TimeoutError)
    assert f"router at {address} not healthy within 0.5s" in str(err.value)


def test_wait_until_returns_the_value_or_names_the_condition() -> None:
    assert wait_until(lambda: 42, timeout=1) == 42
    with pytest.raises(LaunchTimeout, match=r"pools listed not reached within 0\.1s"):
        wait_until(lambda: False, timeout=0.1, message="pools listed")


def test_a_missing_program_or_console_script_is_a_launch_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="no-such-script-xyz"):
        command("no-such-script-xyz")
    with process_group(tmp_path, dump_logs_on_error=False) as group, pytest.raises(LaunchError) as err:
        group.start("ghost", [str(tmp_path / "no-such-binary")])
    assert "cannot start ghost" in str(err.value)


def test_cleanup_stops_every_process_and_its_children_even_those_ignoring_sigterm(tmp_path: Path) -> None:
    stubborn = """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(child.pid, flush=True)
        time.sleep(60)
    """
    with pytest.raises(RuntimeError, match="the test body failed"):
        with process_group(tmp_path, dump_logs_on_error=False, stop_grace=0.5) as group:
            polite = group.start("polite", python("import time; time.sleep(60)"))
            rude = group.start("rude", python(stubborn))
            child_pid = int(wait_until(lambda: rude.output().strip(), timeout=30, message="child started"))
            raise RuntimeError("the test body failed")
    for pid in (polite.pid, rude.pid, child_pid):
        wait_until(partial(gone, pid), timeout=10, message=f"pid {pid} gone")


def test_a_failed_block_prints_every_log_tail_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ProcessDied), process_group(tmp_path) as group:
        proc = group.start("discovery", python("print('cannot bind 127.0.0.1:1'); raise SystemExit(2)"))
        wait_healthy(f"127.0.0.1:{free_port()}", timeout=30, proc=proc)
    err = capsys.readouterr().err
    assert "--- discovery" in err and "cannot bind 127.0.0.1:1" in err


def test_a_relay_or_router_without_discovery_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with process_group(tmp_path, dump_logs_on_error=False) as group:
        mesh = Mesh(group)
        with pytest.raises(LaunchError, match="start discovery before a global frontend"):
            mesh.start_router()
        with pytest.raises(LaunchError, match="pool p1: start discovery"):
            mesh.start_pool("p1")
        assert group.procs == []

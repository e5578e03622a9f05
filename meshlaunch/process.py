"""Real service processes on 127.0.0.1: free ports, start, wait until healthy, stop whatever happened."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshkit.channels import sync_channel

T = TypeVar("T")

# How much of a process's log an error message carries: enough to show a traceback.
LOG_TAIL_CHARS = 3000
# Seconds a process gets between SIGTERM and SIGKILL when a group is cleaned up.
STOP_GRACE = 5.0


class LaunchError(RuntimeError):
    """A process of the mesh could not be started, did not become ready, or died."""


class ProcessDied(LaunchError):
    """A process exited while it was expected to be serving."""


class LaunchTimeout(LaunchError, TimeoutError):
    """A wait (health, a condition) did not end within its bound."""


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PORT_CHOICE = random.SystemRandom()
_handed_out: set[int] = set()


def _below_ephemeral() -> tuple[int, int]:
    """The ports below the kernel's ephemeral range (the range it gives outgoing connections)."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(1024, low - 16384), low - 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the ephemeral range.

    A port from bind(("127.0.0.1", 0)) comes from the range the kernel also gives every outgoing
    connection, so between this check and the server's own bind any client socket on the machine
    could take it ("Address already in use"). Ports below that range are never handed to outgoing
    connections; a random pick (not handed out before by this process) keeps parallel runs apart.
    """
    low, high = _below_ephemeral()
    if len(_handed_out) > (high - low) // 2:
        _handed_out.clear()  # bounded: a long run reuses ports its first servers are long done with
    for _ in range(256):
        port = _PORT_CHOICE.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        picked: int = s.getsockname()[1]
        return picked


def command(name: str) -> str:
    """The path of an installed console script (globaldiscovery, poolrelay, globalrouter, mocker).

    The one next to this interpreter comes first, so a virtualenv's scripts are used even when the
    virtualenv is not activated; then the PATH.
    """
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise LaunchError(
            f"console script {name!r} is not installed next to {sys.executable} nor on the PATH "
            "(install the project: pip install .)"
        )
    return found


def _tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"


class Proc:
    """One started service process in its own session; its output goes to a log file."""

    def __init__(
        self, args: list[str], log_path: Path, env: dict[str, str] | None = None, name: str | None = None
    ) -> None:
        self.args = args
        self.name = name or Path(args[0]).name
        self.log_path = log_path
        self._stopped = False
        self._log: IO[bytes] = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            # A new session: a Ctrl-C meant for the launcher does not reach the services, and the
            # whole process group can be killed at cleanup.
            self.popen = subprocess.Popen(
                args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )
        except OSError as exc:
            self._log.close()
            raise LaunchError(f"cannot start {self.name} ({' '.join(args)}): {exc}") from exc

    def __repr__(self) -> str:
        return f"Proc({self.name!r}, pid={self.pid}, returncode={self.popen.returncode})"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Sends `sig` to the process (not its group) if it still runs."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, sig)

    def kill9(self) -> None:
        """SIGKILL: the process dies without any cleanup (a crash)."""
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; the exit code. Kills it and raises LaunchTimeout after `timeout` seconds."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self.kill9()
            raise LaunchTimeout(
                f"{self.name} did not exit within {timeout:g}s of SIGTERM; killed\n{self.output_tail()}"
            ) from exc

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Ends the process and its group if it still runs (SIGTERM, SIGKILL after `grace`); once."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.alive():
                self._signal_group(signal.SIGTERM)
                try:
                    self.popen.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    self._signal_group(signal.SIGKILL)
                    self.popen.wait(timeout=grace)
                # Anything it left behind in its group goes too. Only right after reaping it: a
                # group id long gone could name someone else's group by now.
                self._signal_group(signal.SIGKILL)
        finally:
            self._log.close()

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def output(self) -> str:
        """Everything the process printed so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def output_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        if not self._log.closed:
            self._log.flush()
        return _tail(self.log_path, chars)

    def check_alive(self) -> None:
        """Raises ProcessDied, with the exit code and the tail of the log, if the process has exited."""
        if not self.alive():
            raise ProcessDied(
                f"{self.name} exited with code {self.popen.returncode} "
                f"(log {self.log_path}):\n{self.output_tail()}"
            )


# Groups not yet stopped: stopped at interpreter exit too, so no service outlives its launcher.
_LIVE_GROUPS: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()


class ProcessGroup:
    """Starts processes and stops every one of them at the end, whatever happened."""

    def __init__(self, log_dir: Path, stop_grace: float = STOP_GRACE) -> None:
        self.log_dir = Path(log_dir)
        self.stop_grace = stop_grace
        self.procs: list[Proc] = []
        _LIVE_GROUPS.add(self)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        """Starts `args`; its log is `<log_dir>/<name>-<n>.log`. LaunchError if it cannot start."""
        proc = Proc(args, self.log_dir / f"{name}-{len(self.procs)}.log", env, name=name)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        """Stops every process, newest first; one that resists does not keep the others running."""
        errors: list[str] = []
        for proc in reversed(self.procs):
            try:
                proc.stop(self.stop_grace)
            except Exception as exc:
                errors.append(f"{proc.name}: {exc!r}")
        _LIVE_GROUPS.discard(self)
        if errors:
            raise LaunchError("could not stop: " + "; ".join(errors))

    def dump_logs(self, chars: int = 4000) -> str:
        """The tail of every process's log, each under a header naming it."""
        return "\n".join(
            f"--- {p.name} {' '.join(p.args[1:4])} (exit {p.popen.returncode})\n{p.output_tail(chars)}"
            for p in self.procs
        )


@atexit.register
def _stop_live_groups() -> None:
    for group in list(_LIVE_GROUPS):
        with contextlib.suppress(Exception):
            group.stop_all()


@contextlib.contextmanager
def process_group(
    log_dir: Path, dump_logs_on_error: bool = True, stop_grace: float = STOP_GRACE
) -> Iterator[ProcessGroup]:
    """A ProcessGroup whose processes are stopped when the block ends; on an error their logs go to stderr."""
    group = ProcessGroup(log_dir, stop_grace)
    try:
        yield group
    except BaseException:
        if dump_logs_on_error:
            print(group.dump_logs(), file=sys.stderr)
        raise
    finally:
        group.stop_all()


def wait_healthy(address: str, timeout: float = 30.0, proc: Proc | None = None) -> None:
    """Waits until `address` answers grpc.health.v1 Check with SERVING.

    ProcessDied at once if `proc` exits meanwhile; LaunchTimeout after `timeout` seconds. Both name
    the address and carry the tail of the process's log.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    with sync_channel(address) as channel:  # TLS when this process dials TLS (a secure mesh)
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None:
                proc.check_alive()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.05)
    who = f"{proc.name} at {address}" if proc is not None else address
    log = f"\n{proc.output_tail()}" if proc is not None else ""
    raise LaunchTimeout(f"{who} not healthy within {timeout:g}s (last error: {last}){log}")


def wait_until(
    predicate: Callable[[], T], timeout: float, interval: float = 0.05, message: str = "condition"
) -> T:
    """Polls `predicate` until it returns a truthy value (returned); LaunchTimeout after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise LaunchTimeout(f"{message} not reached within {timeout:g}s")
        time.sleep(interval)

"""Helpers for end-to-end tests: free ports, real processes with hard timeouts, health waits, cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(name: str) -> str:
    """The path of a console script installed in this venv (globaldiscovery, poolrelay, ...)."""
    path = BIN / name
    return str(path) if path.exists() else name


class Proc:
    """A started service process; its output goes to a log file that tests can read."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def kill9(self) -> None:
        """SIGKILL: the process dies without any cleanup (a crash)."""
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; returns the exit code (kills after `timeout`)."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise

    def stop(self) -> None:
        """Ends the process whatever its state (used in cleanup)."""
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)
        self._log.close()

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")


class ProcessGroup:
    """Starts processes for one test and stops every one of them at the end, whatever happened."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[Proc] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, self.tmp_path / f"{name}-{len(self.procs)}.log", env)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def dump_logs(self) -> str:
        return "\n".join(f"--- {p.args[0]} {p.args[1:4]}\n{p.output()[-4000:]}" for p in self.procs)


@contextlib.contextmanager
def process_group(tmp_path: Path) -> Iterator[ProcessGroup]:
    group = ProcessGroup(tmp_path)
    try:
        yield group
    except BaseException:
        print(group.dump_logs(), file=sys.stderr)
        raise
    finally:
        group.stop_all()


def wait_healthy(address: str, timeout: float = 15.0, proc: Proc | None = None) -> None:
    """Waits until `address` answers grpc.health.v1 Check with SERVING, or fails with the process log."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise AssertionError(
                    f"process exited early ({proc.popen.returncode}):\n{proc.output()[-3000:]}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.05)
    log = proc.output()[-3000:] if proc else ""
    raise AssertionError(f"{address} not healthy within {timeout}s (last error: {last})\n{log}")


def wait_until(predicate, timeout: float, interval: float = 0.05, message: str = "condition"):
    """Polls `predicate` until it returns a truthy value (returned) or fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} not reached within {timeout}s")
        time.sleep(interval)

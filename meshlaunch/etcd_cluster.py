"""A real etcd cluster on 127.0.0.1 for tests and the chaos suite: N members on free ports, each
one killable and restartable on its own data, the whole cluster restartable."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from meshlaunch.process import LaunchError, LaunchTimeout, Proc, ProcessGroup, free_port

ETCD = "/usr/bin/etcd"
# Raft timing for one machine: a leader is elected within about a second of losing one.
HEARTBEAT_MS = 100
ELECTION_MS = 1000
START_TIMEOUT = 30.0


def etcd_binary() -> str:
    """The etcd executable (the Debian package's, else the PATH's); LaunchError when there is none."""
    if Path(ETCD).exists():
        return ETCD
    found = shutil.which("etcd")
    if found is None:
        raise LaunchError("etcd is not installed (make setup installs it)")
    return found


@dataclass
class Member:
    """One etcd member: its name, ports, data directory and (while it runs) its process."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    proc: Proc | None = None

    @property
    def endpoint(self) -> str:
        """HOST:PORT of its client API."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def healthy(self) -> bool:
        """Whether the member answers /health with true (it is part of a cluster with a leader)."""
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1.0) as reply:
                return bool(json.loads(reply.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False


class EtcdCluster:
    """`size` etcd members started by `group` (which stops them whatever happens)."""

    def __init__(self, group: ProcessGroup, size: int = 3, data_root: Path | None = None) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member (got {size})")
        self.group = group
        self._own_root = data_root is None
        self.data_root = data_root or Path(tempfile.mkdtemp(prefix="etcd-cluster-"))
        self.members = [
            Member(f"etcd{i}", free_port(), free_port(), self.data_root / f"etcd{i}") for i in range(size)
        ]

    @property
    def endpoints(self) -> list[str]:
        """Every member's client HOST:PORT."""
        return [m.endpoint for m in self.members]

    @property
    def endpoints_flag(self) -> str:
        """The members' client addresses as `--etcd-endpoints` takes them."""
        return ",".join(self.endpoints)

    def _args(self, member: Member) -> list[str]:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        client = f"http://{member.endpoint}"
        return [
            etcd_binary(),
            "--name",
            member.name,
            "--data-dir",
            str(member.data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            member.peer_url,
            "--initial-advertise-peer-urls",
            member.peer_url,
            "--initial-cluster",
            initial,
            "--initial-cluster-token",
            f"meshlaunch-{self.members[0].client_port}",
            "--initial-cluster-state",
            "new",
            "--heartbeat-interval",
            str(HEARTBEAT_MS),
            "--election-timeout",
            str(ELECTION_MS),
            "--log-level",
            "error",
        ]

    def start(self, timeout: float = START_TIMEOUT) -> EtcdCluster:
        """Starts every member (all at once: they elect a leader together); waits until all are healthy."""
        for member in self.members:
            self._start_member(member)
        self.wait_healthy(timeout=timeout)
        return self

    def _start_member(self, member: Member) -> None:
        # A member restarted on its data directory rejoins with what it has; the initial-cluster
        # flags only matter the first time.
        member.proc = self.group.start(member.name, self._args(member))

    def kill9(self, index: int) -> Member:
        """Kills member `index` with SIGKILL (a crash); returns it."""
        member = self.members[index]
        if member.proc is not None:
            member.proc.kill9()
        return member

    def restart(self, index: int, timeout: float = START_TIMEOUT) -> Member:
        """Starts member `index` again on its data directory and waits until it is healthy."""
        member = self.members[index]
        if member.proc is not None and member.proc.alive():
            raise LaunchError(f"{member.name} still runs; kill it before restarting it")
        self._start_member(member)
        self.wait_healthy([index], timeout=timeout)
        return member

    def kill_all(self) -> None:
        """Kills every member (a whole-cluster outage); their data stays."""
        for index in range(len(self.members)):
            self.kill9(index)

    def restart_all(self, timeout: float = START_TIMEOUT) -> None:
        """Starts every killed member again (together, so they can elect a leader) and waits."""
        for member in self.members:
            if member.proc is None or not member.proc.alive():
                self._start_member(member)
        self.wait_healthy(timeout=timeout)

    def wait_healthy(self, indexes: list[int] | None = None, timeout: float = START_TIMEOUT) -> None:
        """Until the given members (default: all) report healthy; ProcessDied-like LaunchError if one exits."""
        members = [self.members[i] for i in (indexes if indexes is not None else range(len(self.members)))]
        deadline = time.monotonic() + timeout
        while True:
            for member in members:
                if member.proc is not None:
                    member.proc.check_alive()
            if all(m.healthy() for m in members):
                return
            if time.monotonic() > deadline:
                names = [m.name for m in members if not m.healthy()]
                raise LaunchTimeout(f"etcd members {names} not healthy within {timeout:g} s")
            time.sleep(0.1)

    def leader(self) -> int | None:
        """The index of the member that leads now (None when it cannot be told)."""
        for index, member in enumerate(self.members):
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(
                        f"http://{member.endpoint}/v3/maintenance/status", data=b"{}", method="POST"
                    ),
                    timeout=1.0,
                ) as reply:
                    status = json.loads(reply.read())
            except (OSError, urllib.error.URLError, ValueError):
                continue
            if status.get("leader") == status.get("header", {}).get("member_id"):
                return index
        return None

    def remove_data(self) -> None:
        """Deletes the data directories this cluster made (after its processes stopped)."""
        if self._own_root:
            shutil.rmtree(self.data_root, ignore_errors=True)

"""Helpers shared by the discovery tests."""

from __future__ import annotations

import subprocess

from globaldiscovery.records import PoolRegistration
from meshlaunch import command, free_port, wait_healthy


def reg(pool="p1", relay="r1", inc=1, model="m", region="eu", frontends=("http://f1:80",), **kw):
    """A PoolRegistration of `pool` by `relay` (defaults for every field a test does not care about)."""
    return PoolRegistration(
        pool_id=pool,
        model=model,
        region=region,
        frontends=tuple(frontends),
        relay_id=relay,
        incarnation=inc,
        **kw,
    )


def start_discovery(procs, *extra: str, address: str | None = None):
    """Starts `globaldiscovery serve` (heartbeat 0.5 s, lease 1.5 s unless `extra` overrides) on
    `address` (a free port when None); (proc, address)."""
    address = address or f"127.0.0.1:{free_port()}"
    proc = procs.start(
        "globaldiscovery",
        [
            command("globaldiscovery"),
            "serve",
            "--listen",
            address,
            "--heartbeat-interval",
            "0.5",
            "--lease-duration",
            "1.5",
            *extra,
        ],
    )
    wait_healthy(address, timeout=30, proc=proc)
    return proc, address


def run_pools(address: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """Runs `globaldiscovery pools --discovery address *extra` to the end, output captured."""
    return subprocess.run(
        [command("globaldiscovery"), "pools", "--discovery", address, *extra],
        capture_output=True,
        text=True,
        timeout=30,
    )

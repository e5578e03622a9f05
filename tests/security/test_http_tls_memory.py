"""Memory of the HTTPS front under connections that never start their TLS handshake: a real router
process, its RSS read from /proc before, during and after a burst of idle TCP connections."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest

from meshlaunch import free_port, process_group, wait_until
from meshlaunch.mesh import router_argv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

IDLE = 1000  # below the front's cap of 1024 connections: each one is accepted and its handshake begun


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_idle_tls_connections_cost_little_and_the_memory_is_given_back(pki, tmp_path):
    with process_group(tmp_path) as group:
        router, http = f"127.0.0.1:{free_port()}", free_port()
        argv = router_argv(
            router,
            f"127.0.0.1:{free_port()}",  # no discovery: only the HTTP front is exercised
            *("--http-listen", f"127.0.0.1:{http}", "--http-header-timeout", "60"),
        )
        proc = group.start("router", [*argv, *pki.flags("frontend")])
        context = pki.client_context("client")

        def health() -> int:
            url = f"https://127.0.0.1:{http}/health"
            with urllib.request.urlopen(url, context=context, timeout=10) as reply:
                return reply.status

        def alive() -> bool:
            # Without discovery the frontend never turns ready (gRPC health stays NOT_SERVING): only
            # its HTTP front is exercised here, so wait for that to answer.
            proc.check_alive()
            try:
                return health() == 200
            except OSError:
                return False

        wait_until(alive, 30, message="the HTTPS front answers /health")

        for _ in range(20):  # warm: the first requests load code and fill caches
            assert health() == 200
        before = rss_mb(proc.pid)
        idle = [socket.create_connection(("127.0.0.1", http), timeout=10) for _ in range(IDLE)]
        try:
            # Connections are accepted in order: once a later one is served, every idle one was
            # accepted and holds its TLS state.
            assert health() == 200
            during = rss_mb(proc.pid)
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 30
        after = rss_mb(proc.pid)
        while after > before * 1.10 and time.monotonic() < deadline:
            time.sleep(0.5)
            after = rss_mb(proc.pid)
        print(
            f"RSS before {before:.1f} MB, with {IDLE} idle connections {during:.1f} MB, after {after:.1f} MB"
        )
        # asyncio's own TLS listener took ~300 KB per connection (256 KiB of it a read buffer) and kept it.
        assert during - before < IDLE * 120 / 1024, (before, during)
        assert after <= before * 1.10, (before, during, after)
        assert health() == 200

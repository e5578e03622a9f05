"""A real etcd for tests: the etcd on the PATH, on free ports with a temporary data directory, always stopped.

Without etcd the etcd tests are skipped, except when the CI environment variable is set: there a
missing etcd fails the run, so the etcd store can never go untested unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from meshlaunch import free_port


def etcd_binary() -> str | None:
    """The etcd executable on the PATH (None when there is none)."""
    return shutil.which("etcd")


def require_etcd() -> str:
    """The etcd executable; skips the test without one, or fails it when CI is set."""
    binary = etcd_binary()
    if binary is None:
        message = "etcd is not on the PATH (scripts/ensure_etcd.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI is set, so the etcd tests may not be skipped", pytrace=False)
        pytest.skip(message)
    return binary


@contextlib.contextmanager
def running_etcd() -> Iterator[str]:
    """Starts etcd and yields its client HOST:PORT; stops it and removes its data at the end."""
    binary = require_etcd()
    data = Path(tempfile.mkdtemp(prefix="etcd-test-"))
    client_port, peer_port = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    log = open(data / "etcd.log", "wb")
    proc = subprocess.Popen(
        [
            binary,
            "--name",
            "test",
            "--data-dir",
            str(data / "data"),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"test={peer_url}",
            "--log-level",
            "error",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        address = f"127.0.0.1:{client_port}"
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"etcd exited: {(data / 'etcd.log').read_text()[-2000:]}")
            with grpc.insecure_channel(address) as channel:
                try:
                    grpc.channel_ready_future(channel).result(timeout=0.5)
                    break
                except grpc.FutureTimeoutError:
                    pass
            if time.monotonic() > deadline:
                raise AssertionError("etcd did not start within 30 s")
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        shutil.rmtree(data, ignore_errors=True)


async def wipe_discovery_keys(endpoint: str) -> None:
    """Deletes every discovery key in etcd, so no test sees another's records (any order works)."""
    import aetcd

    from globaldiscovery.store.etcd import PREFIX

    host, _, port = endpoint.rpartition(":")
    client = aetcd.Client(host=host, port=int(port))
    await client.connect()
    try:
        await client.delete_prefix(PREFIX)
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def etcd_replicas(endpoint: str, count: int, *, heartbeat_interval: float, lease_duration: float):
    """`count` started EtcdStores sharing `endpoint` (the discovery keys wiped first); closed at the end."""
    from globaldiscovery.store.etcd import EtcdStore
    from meshkit.clock import SystemClock

    await wipe_discovery_keys(endpoint)
    stores = [
        EtcdStore(
            SystemClock(),
            endpoint=endpoint,
            heartbeat_interval=heartbeat_interval,
            lease_duration=lease_duration,
        )
        for _ in range(count)
    ]
    for store in stores:
        await store.start()
    try:
        yield stores
    finally:
        for store in stores:
            await store.close()


async def pause(store) -> None:
    """Stops an EtcdStore following etcd (as if its etcd member were slow); resume() goes on."""
    assert store._follower is not None
    store._follower.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await store._follower
    if store._watch is not None:
        await store._watch.cancel()


def resume(store) -> None:
    """Starts a paused EtcdStore following etcd again, from the last change it applied."""
    store._follower = asyncio.create_task(store._follow_forever())

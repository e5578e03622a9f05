"""A real etcd for tests: /usr/bin/etcd on free ports with a temporary data directory, always stopped."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from tests.support import free_port

ETCD = "/usr/bin/etcd"


def etcd_available() -> bool:
    return Path(ETCD).exists()


@contextlib.contextmanager
def running_etcd() -> Iterator[str]:
    """Starts etcd and yields its client HOST:PORT; stops it and removes its data at the end."""
    data = Path(tempfile.mkdtemp(prefix="etcd-test-"))
    client_port, peer_port = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    log = open(data / "etcd.log", "wb")
    proc = subprocess.Popen(
        [
            ETCD,
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

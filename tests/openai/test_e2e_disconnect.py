"""End to end, real processes: an HTTP client that disconnects from a non-streaming request stops
its pool's work within a second (the mocker's output counter stands still), where before the pool
generated up to max_tokens for nobody."""

from __future__ import annotations

import json
import socket
import time

import grpc
import pytest

from mocker.v1 import admin_pb2, admin_pb2_grpc
from tests.router.mesh import MODEL, Mesh
from tests.support import free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

MAX_TOKENS = 2000  # 40 s at the mocker's 50 tokens/s


def tokens_generated(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stats = admin_pb2_grpc.MockerAdminServiceStub(ch).GetPoolStats(
            admin_pb2.GetPoolStatsRequest(), timeout=5
        )
    return stats.tokens_generated


def test_a_client_that_leaves_a_non_streaming_request_stops_the_pool(procs):
    mesh = Mesh(procs)
    mesh.start_discovery()
    pool = mesh.start_pool("pool-a", "eu", "--speedup", "1")  # 50 tokens/s
    http = f"127.0.0.1:{free_port()}"
    router = mesh.start_router("--http-listen", http)
    mesh.wait_routable(router, mesh.pools)
    body = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": MAX_TOKENS}).encode()
    host, port = http.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: tokens_generated(pool.address) >= 20, 15, message="the pool generates")
    sock.close()  # the client leaves
    time.sleep(1.0)
    after_a_second = tokens_generated(pool.address)
    time.sleep(1.0)  # 50 more tokens if the pool still ran the request
    assert tokens_generated(pool.address) == after_a_second, "the pool still generates for nobody"
    assert after_a_second < MAX_TOKENS
    assert router.metric("globalrouter_requests_total", model=MODEL, outcome="CANCELLED") == 1

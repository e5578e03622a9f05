"""A client that leaves stops the pool's work for it, on both fronts: a non-streaming HTTP request,
a request still waiting for its first token (queued at the pool) and a gRPC stream are cancelled
at the pool within a second of the disconnect (the pool's load falls back), not run to max_tokens."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.timeout(60)

SLOW = "s"  # a model only the slow pool serves (the byte tokenizer)
MAX_TOKENS = 2000  # 40 s at 50 tokens/s: far longer than the test
BOUND_S = 1.0


async def _slow_pool(front):
    # One request runs at a time; the next waits in the pool's queue (admitted, no first token).
    return await front.add_pool(
        "slow", model=SLOW, vocab_size=128, speedup=1.0, workers=1, max_running_per_worker=1
    )


async def _until(condition, limit: float, what: str) -> float:
    """Seconds until `condition()` holds; fails naming `what` after `limit` seconds."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > limit:
            pytest.fail(f"{what}: not within {limit} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def _open_http(port: int, *, stream: bool, request_id: str) -> socket.socket:
    """Sends one /v1/completions request on a raw socket and returns it unread."""
    body = json.dumps(
        {"model": SLOW, "prompt": "hello there", "max_tokens": MAX_TOKENS, "stream": stream}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        + f"x-request-id: {request_id}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


async def test_a_non_streaming_http_client_that_leaves_stops_the_pool(front):
    pool = await _slow_pool(front)
    sock = await _open_http(front.router.http.port, stream=False, request_id="leaves-1")
    await _until(lambda: pool.load().requests_running == 1, 10, "the pool runs the request")
    await asyncio.sleep(0.3)  # it is generating
    sock.close()
    took = await _until(lambda: not pool.tickets, 5, "the pool's load falls back to zero")
    assert took <= BOUND_S, f"the pool kept generating {took:.2f} s for nobody"
    metrics = front.router.metrics
    assert metrics.requests.labels(SLOW, "CANCELLED")._value.get() == 1


async def test_an_http_client_that_leaves_while_queued_at_the_pool_frees_its_place(front):
    pool = await _slow_pool(front)
    port = front.router.http.port
    running = await _open_http(port, stream=True, request_id="runs-1")
    await _until(lambda: pool.load().requests_running == 1, 10, "the first request runs")
    for stream in (False, True):
        queued = await _open_http(port, stream=stream, request_id=f"queued-{stream}")
        await _until(lambda: pool.load().requests_waiting == 1, 10, "the next request waits in the queue")
        queued.close()
        took = await _until(
            lambda: pool.load().requests_waiting == 0, 5, "the queued request leaves the pool"
        )
        assert took <= BOUND_S, f"the queued request stayed {took:.2f} s (stream={stream})"
        assert pool.load().requests_running == 1
    running.close()
    took = await _until(lambda: not pool.tickets, 5, "the streaming request ends at the pool")
    assert took <= BOUND_S


async def test_a_grpc_client_that_cancels_stops_the_pool_running_or_queued(front):
    pool = await _slow_pool(front)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front.router.port}") as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)

        def generate():
            return stub.Generate(
                router_pb2.GenerateRequest(
                    model=SLOW, prompt=router_pb2.Prompt(text="hello there"), max_tokens=MAX_TOKENS
                )
            )

        running = generate()
        await running.read()  # streaming: its first tokens came
        queued = generate()
        await _until(lambda: pool.load().requests_waiting == 1, 10, "the next request waits in the queue")
        queued.cancel()
        took = await _until(
            lambda: pool.load().requests_waiting == 0, 5, "the queued request leaves the pool"
        )
        assert took <= BOUND_S, f"the queued request stayed {took:.2f} s"
        running.cancel()
        took = await _until(lambda: not pool.tickets, 5, "the running request ends at the pool")
        assert took <= BOUND_S, f"the pool kept generating {took:.2f} s for nobody"

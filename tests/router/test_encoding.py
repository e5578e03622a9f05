"""Prompt encoding runs off the event loop, in a bounded pool: a long prompt does not stall other
requests, and a full encoder refuses at once (RESOURCE_EXHAUSTED LIMIT_EXCEEDED / HTTP 429)."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import grpc
import pytest

from globalrouter.config import RouterConfig
from globalrouter.encoding import Encoder, EncoderBusy
from globalrouter.http_api.config import HttpConfig
from globalrouter.server import create_server
from globalrouter.tokenizer import HfTokenizer
from globalrouter.tokenizer_train import train_tokenizer
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.errors import Reason, reason_of

pytestmark = pytest.mark.timeout(60)

MODEL = "m"
SLOW_ENCODE_S = 0.6


async def test_a_full_encoder_refuses_naming_its_bound_and_takes_jobs_again_once_free():
    encoder = Encoder(threads=1, queue=1)
    gate = threading.Event()
    running = encoder.run(gate.wait, 10)  # holds the one thread
    task1 = asyncio.ensure_future(running)
    task2 = asyncio.ensure_future(encoder.run(lambda: "waited"))  # waits for the thread
    await asyncio.sleep(0)
    assert encoder.jobs == 2
    with pytest.raises(EncoderBusy) as refused:
        await encoder.run(lambda: "refused")
    status = refused.value.status()
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "1 threads busy and 1 prompts waiting" in str(refused.value)
    assert "--tokenizer-queue" in str(refused.value)
    gate.set()
    assert await task1 is True and await task2 == "waited"
    assert encoder.jobs == 0
    assert await encoder.run(lambda: "again") == "again"
    encoder.close()


async def test_a_job_whose_caller_left_still_counts_until_its_thread_is_done():
    encoder = Encoder(threads=1, queue=0)
    gate = threading.Event()
    task = asyncio.ensure_future(encoder.run(gate.wait, 10))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(EncoderBusy):  # the thread still works on it: the bound is on work
        await encoder.run(lambda: None)
    gate.set()
    for _ in range(100):
        if encoder.jobs == 0:
            break
        await asyncio.sleep(0.01)
    assert await encoder.run(lambda: "free") == "free"
    encoder.close()


def test_encoder_bounds_are_checked():
    with pytest.raises(ValueError, match="threads"):
        Encoder(threads=0)
    with pytest.raises(ValueError, match="queue"):
        Encoder(queue=-1)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=300)


@pytest.fixture
def slow_encode(monkeypatch):
    """Every HfTokenizer.encode takes SLOW_ENCODE_S (sleeping, as the Rust tokenizer does without
    the GIL) or, once `gate` is cleared, waits for it."""
    gate = threading.Event()
    gate.set()
    original = HfTokenizer.encode

    def encode(self, text, *, add_special_tokens):
        time.sleep(SLOW_ENCODE_S)
        gate.wait(20)
        return original(self, text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(HfTokenizer, "encode", encode)
    return gate


async def _router(config: RouterConfig):
    router = create_server(config)
    await router.handle.server.start()
    router.start_background()
    return router


async def _stop(router) -> None:
    await router.leave()
    await router.close()
    await router.handle.server.stop(0)


class LagProbe:
    """The event loop's worst lateness: a task that sleeps 10 ms at a time and records how late it wakes."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            self.worst = max(self.worst, time.perf_counter() - before - 0.01)

    async def stop(self) -> float:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task
        return self.worst


def _post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request(
            "POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"}
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


async def test_the_loop_stays_responsive_while_long_prompts_are_encoded(tokenizer_dir, slow_encode):
    # Default config (the same test runs against a tree that predates the encoder settings).
    router = await _router(
        RouterConfig(
            listen="127.0.0.1:0",
            tokenizers=((MODEL, str(tokenizer_dir)),),
            http=HttpConfig(listen="127.0.0.1:0"),
        )
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            await asyncio.sleep(0.2)  # the HTTP front is up
            probe = LagProbe()
            call = stub.Generate(
                router_pb2.GenerateRequest(
                    model=MODEL, prompt=router_pb2.Prompt(text="a short prompt"), max_tokens=4
                )
            )
            with pytest.raises(
                grpc.aio.AioRpcError
            ) as grpc_err:  # no pool serves it: NOT_FOUND after encoding
                async for _ in call:
                    pass
            grpc_lag = await probe.stop()
            probe = LagProbe()
            status, body = await asyncio.to_thread(
                _post, router.http.port, {"model": MODEL, "prompt": "a short prompt", "max_tokens": 4}
            )
            http_lag = await probe.stop()
    finally:
        await _stop(router)
    assert grpc_err.value.code() == grpc.StatusCode.NOT_FOUND
    assert status == 404, body
    # Encoding on the loop would have held it the whole SLOW_ENCODE_S.
    assert grpc_lag < SLOW_ENCODE_S / 3, f"gRPC: the loop stood still {grpc_lag * 1e3:.0f} ms"
    assert http_lag < SLOW_ENCODE_S / 3, f"HTTP: the loop stood still {http_lag * 1e3:.0f} ms"


async def test_a_full_encoder_is_resource_exhausted_over_grpc_and_429_over_http(tokenizer_dir, slow_encode):
    router = await _router(
        RouterConfig(
            listen="127.0.0.1:0",
            tokenizers=((MODEL, str(tokenizer_dir)),),
            tokenizer_threads=1,
            tokenizer_queue=0,
            http=HttpConfig(listen="127.0.0.1:0"),
        )
    )
    slow_encode.clear()  # the first prompt holds the one thread
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            await asyncio.sleep(0.2)
            holder = stub.Generate(
                router_pb2.GenerateRequest(model=MODEL, prompt=router_pb2.Prompt(text="holds"), max_tokens=4)
            )
            held = asyncio.ensure_future(holder.initial_metadata())
            await asyncio.sleep(0.3)  # its encoding started
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Route(
                    router_pb2.RouteRequest(model=MODEL, prompt=router_pb2.Prompt(text="one more"))
                )
            status, body = await asyncio.to_thread(
                _post, router.http.port, {"model": MODEL, "prompt": "one more", "max_tokens": 4}
            )
            slow_encode.set()
            await held
            holder.cancel()
    finally:
        await _stop(router)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason_of(refused.value) == Reason.LIMIT_EXCEEDED
    assert "--tokenizer-threads" in (refused.value.details() or "")
    assert status == 429
    assert body["error"]["code"] == "LIMIT_EXCEEDED" and body["error"]["type"] == "rate_limit_error"
    assert "prompt encoder is full" in body["error"]["message"]

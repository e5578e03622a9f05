"""In-process test doubles: a pool frontend with scripted behaviour and a relay telemetry stream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc

from globaldiscovery.v1 import discovery_pb2
from globalrouter.config import RouterConfig
from globalrouter.server import Router, create_server
from globalrouter.v1 import pool_frontend_pb2, pool_frontend_pb2_grpc, router_pb2, router_pb2_grpc
from meshkit.errors import Reason, abort_with_reason
from meshkit.server import create_server as create_grpc_server
from mocker.tokens import continue_sequence
from poolrelay.v1 import telemetry_pb2, telemetry_pb2_grpc

PoolResponse = pool_frontend_pb2.PoolFrontendServiceGenerateResponse


@dataclass
class PoolBehaviour:
    """What the fake pool does with the next requests."""

    refuse: grpc.StatusCode | None = None
    refuse_message: str = "queue full"
    refuse_reason: Reason | None = None
    """The ErrorInfo reason of the refusal (None: the refusal carries no ErrorInfo)."""
    fail_after_tokens: int = 0
    """When > 0, every admitted stream ends with UNAVAILABLE after this many tokens."""
    fail_reason: Reason | None = None
    """The ErrorInfo reason of that mid-stream failure (e.g. DRAIN_HANDED_BACK)."""
    cached_blocks: int = 0
    requests: list[pool_frontend_pb2.PoolFrontendServiceGenerateRequest] = field(default_factory=list)


class FakePool(pool_frontend_pb2_grpc.PoolFrontendServiceServicer):
    """A pool frontend whose tokens are the mocker's deterministic continuation."""

    def __init__(self) -> None:
        self.behaviour = PoolBehaviour()

    async def Generate(self, request, context):
        b = self.behaviour
        b.requests.append(request)
        if b.refuse is not None:
            await _abort(context, b.refuse, b.refuse_reason, b.refuse_message)
        yield PoolResponse(
            admission=pool_frontend_pb2.PoolAdmission(
                worker_id="w0", cached_blocks=b.cached_blocks, prompt_blocks=len(request.token_ids) // 16
            )
        )
        tokens = continue_sequence(list(request.token_ids), request.max_tokens)
        for i, token in enumerate(tokens):
            if b.fail_after_tokens and i >= b.fail_after_tokens:
                await _abort(context, grpc.StatusCode.UNAVAILABLE, b.fail_reason, "worker lost")
            yield PoolResponse(tokens=pool_frontend_pb2.PoolTokens(token_ids=[token]))
            await asyncio.sleep(0)
        yield PoolResponse(
            finish=pool_frontend_pb2.PoolFinish(
                reason=pool_frontend_pb2.POOL_FINISH_REASON_LENGTH, tokens_generated=len(tokens)
            )
        )


async def _abort(context, code: grpc.StatusCode, reason: Reason | None, message: str) -> None:
    if reason is None:
        await context.abort(code, message)
    else:
        await abort_with_reason(context, code, reason, message)


async def eventually(predicate, within: float = 10.0) -> None:
    """Polls `predicate` on the event loop until it is true; fails after `within` seconds.

    10 s by default, as the relay tests' wait_for: each wait crosses real gRPC, which a loaded
    2-core machine can hold up for seconds.
    """
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def start_fake_pool(servicer=None) -> tuple[FakePool, grpc.aio.Server, str]:
    """A started fake pool (a FakePool, or the PoolFrontendService `servicer` given) and its URL."""
    fake = servicer if servicer is not None else FakePool()

    def register(server):
        pool_frontend_pb2_grpc.add_PoolFrontendServiceServicer_to_server(fake, server)
        return [pool_frontend_pb2.DESCRIPTOR.services_by_name["PoolFrontendService"].full_name]

    handle = create_grpc_server("127.0.0.1:0", register)
    await handle.server.start()
    return fake, handle.server, f"http://127.0.0.1:{handle.port}"


def pool_msg(pool_id: str, url: str | list[str], model: str = "m", **kw) -> discovery_pb2.Pool:
    """A directory entry as WatchPools would send it."""
    urls = [url] if isinstance(url, str) else url
    return discovery_pb2.Pool(
        pool_id=pool_id, model=model, region=kw.pop("region", "r1"), frontends=urls, **kw
    )


async def start_router(**config) -> tuple[Router, router_pb2_grpc.RouterServiceAsyncStub, grpc.aio.Channel]:
    """A started in-process global frontend with no discovery (tests fill its directory)."""
    router = create_server(RouterConfig(listen="127.0.0.1:0", **config))
    await router.handle.server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    return router, router_pb2_grpc.RouterServiceStub(channel), channel


def gen_request(tokens: list[int], max_tokens: int, model: str = "m") -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        model=model,
        prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
        max_tokens=max_tokens,
    )


async def collect(
    stub: router_pb2_grpc.RouterServiceAsyncStub, request, metadata=()
) -> tuple[list[int], router_pb2.GenerateSummary]:
    """Runs Generate (with `metadata`); checks offsets are continuous; returns (tokens, summary)."""
    tokens: list[int] = []
    summary = None
    async for msg in stub.Generate(request, timeout=20, metadata=metadata):
        if msg.WhichOneof("payload") == "tokens":
            assert msg.tokens.offset == len(tokens)
            tokens.extend(msg.tokens.token_ids)
        else:
            summary = msg.summary
    assert summary is not None
    return tokens, summary


class FakeRelay:
    """One relay telemetry stream into a router, driven message by message."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = telemetry_pb2_grpc.TelemetryServiceStub(self._channel)
        self._queue: asyncio.Queue = asyncio.Queue()
        self.call: grpc.aio.StreamStreamCall[Any, Any] | None = None

    async def _requests(self):
        while True:
            msg = await self._queue.get()
            if msg is None:
                return
            yield msg

    async def open(
        self, pool_id: str, relay_id: str = "relay-1", incarnation: int = 1, block_size: int = 16, **kw
    ):
        """Sends a hello; returns the first answer (hello_ack) or raises the stream's error."""
        self.call = self._stub.PublishPoolTelemetry(self._requests())
        hello = telemetry_pb2.TelemetryHello(
            pool_id=pool_id,
            relay_id=relay_id,
            incarnation=incarnation,
            protocol_version=kw.pop("protocol_version", 1),
            block_size=block_size,
            hash_scheme=kw.pop("hash_scheme", telemetry_pb2.HASH_SCHEME_XXH3_64_CHAINED_U32LE),
            **kw,
        )
        await self.send(hello=hello)
        return await self.call.read()

    async def send(self, **payload) -> None:
        await self._queue.put(telemetry_pb2.PublishPoolTelemetryRequest(**payload))

    async def send_batch(self, *messages: telemetry_pb2.PublishPoolTelemetryRequest) -> None:
        """Sends `messages` as one TelemetryBatch."""
        await self.send(batch=telemetry_pb2.TelemetryBatch(messages=messages))

    async def read(self, within: float = 5.0):
        return await asyncio.wait_for(self.call.read(), within)

    async def close(self) -> None:
        await self._queue.put(None)
        if self.call is not None:
            self.call.cancel()
        await self._channel.close()

"""Fixtures for mocker tests: a real in-process aio server around a simulated pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from globalrouter.v1 import pool_frontend_pb2 as pf
from globalrouter.v1 import pool_frontend_pb2_grpc as pf_grpc
from meshkit.clock import SystemClock
from mocker.config import Faults, PoolConfig
from mocker.pool import Pool
from mocker.server import build_server
from mocker.v1 import admin_pb2_grpc
from poolrelay.v1 import pool_events_pb2_grpc


@dataclass
class Served:
    """A pool served on 127.0.0.1 with stubs for its three services."""

    pool: Pool
    channel: grpc.aio.Channel
    frontend: pf_grpc.PoolFrontendServiceAsyncStub
    events: pool_events_pb2_grpc.PoolEventsServiceStub
    admin: admin_pb2_grpc.MockerAdminServiceStub
    exits: list[int] = field(default_factory=list)

    async def generate(self, tokens: list[int], max_tokens: int, model: str = "m", request_id: str = "r"):
        """Runs one Generate to its end: (admission, tokens, finish)."""
        call = self.frontend.Generate(
            pf.PoolFrontendServiceGenerateRequest(
                request_id=request_id, model=model, token_ids=tokens, max_tokens=max_tokens
            )
        )
        out: list[int] = []
        admission, finish = None, None
        async for msg in call:
            kind = msg.WhichOneof("payload")
            if kind == "admission":
                admission = msg.admission
            elif kind == "tokens":
                out.extend(msg.tokens.token_ids)
            else:
                finish = msg.finish
        return admission, out, finish


@pytest.fixture
async def serve_pool():
    """Factory: `await serve_pool(**PoolConfig overrides, faults=Faults())` → Served."""
    started: list[tuple[grpc.aio.Server, grpc.aio.Channel]] = []

    async def make(faults: Faults | None = None, **overrides) -> Served:
        settings: dict[str, Any] = dict(pool_id="p", models=("m", "cold"), not_ready=("cold",), speedup=100.0)
        settings.update(overrides)
        pool = Pool(PoolConfig(**settings), SystemClock(), faults)
        exits: list[int] = []
        handle = build_server("127.0.0.1:0", pool, exit_process=exits.append)
        await handle.server.start()
        await handle.set_serving(True)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
        started.append((handle.server, channel))
        return Served(
            pool=pool,
            channel=channel,
            frontend=pf_grpc.PoolFrontendServiceStub(channel),
            events=pool_events_pb2_grpc.PoolEventsServiceStub(channel),
            admin=admin_pb2_grpc.MockerAdminServiceStub(channel),
            exits=exits,
        )

    yield make
    for server, channel in started:
        await channel.close()
        await server.stop(0)

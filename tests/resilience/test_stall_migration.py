"""A pool that hangs (admitted, then silent) against an in-process global frontend: mid-stream it is
failed for the request and the request migrates; before its first token it counts as a refusal."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from globalrouter.stall import StallPolicy
from globalrouter.v1 import pool_frontend_pb2, pool_frontend_pb2_grpc
from meshkit.errors import Reason, reason_of
from meshkit.server import create_server as create_grpc_server
from mocker.tokens import continue_sequence
from tests.router.fakes import FakePool, collect, gen_request, pool_msg, start_router

pytestmark = pytest.mark.timeout(30)
PROMPT = list(range(300, 364))
STALL = StallPolicy(stall_timeout=0.5, first_token_timeout=0.5, prefill_factor=0.0)
PoolResponse = pool_frontend_pb2.PoolFrontendServiceGenerateResponse


class HangingPool(FakePool):
    """Admits, sends `hang_after` tokens, then says nothing until the caller gives up."""

    def __init__(self, hang_after: int | None) -> None:
        super().__init__()
        self.hang_after = hang_after
        """Tokens sent before the hang; None: it hangs before even admitting."""
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):
        self.behaviour.requests.append(request)
        if self.hang_after is None:
            try:
                await asyncio.Event().wait()
            finally:
                self.cancelled.set()
        yield PoolResponse(admission=pool_frontend_pb2.PoolAdmission(worker_id="w0", prompt_blocks=4))
        for token in continue_sequence(list(request.token_ids), self.hang_after or 0):
            yield PoolResponse(tokens=pool_frontend_pb2.PoolTokens(token_ids=[token]))
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.set()
        yield PoolResponse()  # never reached


@pytest.fixture
async def make_mesh():
    made = []

    async def make(hang_after: int | None, healthy: int = 1):
        router, stub, channel = await start_router(migration_limit=2, admission_tries=3, stall=STALL)
        hanging = HangingPool(hang_after)
        servers = []
        for name, servicer in [("hung", hanging), *[(f"ok{i}", FakePool()) for i in range(healthy)]]:

            def register(server, servicer=servicer):
                pool_frontend_pb2_grpc.add_PoolFrontendServiceServicer_to_server(servicer, server)
                return []

            handle = create_grpc_server("127.0.0.1:0", register)
            await handle.server.start()
            servers.append(handle.server)
            router.core.table.apply_listed(pool_msg(name, f"http://127.0.0.1:{handle.port}"))
        made.append((router, channel, servers))
        # The hung pool ranks first: it has the fewest requests pending at this frontend.
        for other in router.core.table.pools.values():
            if other.pool_id != "hung":
                other.record_sent(10_000, 100)
        return router, stub, hanging

    yield make
    for router, channel, servers in made:
        await channel.close()
        await router.handle.server.stop(0)
        for server in servers:
            await server.stop(0)


async def test_a_pool_that_hangs_mid_stream_is_failed_and_the_request_migrates(make_mesh):
    router, stub, hanging = await make_mesh(hang_after=5)
    started = time.monotonic()
    tokens, summary = await collect(stub, gen_request(PROMPT, 20))
    took = time.monotonic() - started
    assert tokens == continue_sequence(PROMPT, 20), "nothing lost or repeated"
    assert list(summary.pools) == ["hung", "ok0"] and summary.migrations == 1
    assert took < STALL.stall_timeout + 3.0, f"migrated after {took:.1f} s"
    await asyncio.wait_for(hanging.cancelled.wait(), 5)  # the hung stream was given up on
    assert router.core.table.pools["hung"].link_backoff_until > 0, "a hung pool's link backs off"


async def test_a_pool_that_sends_no_first_token_counts_as_a_refusal(make_mesh):
    router, stub, _ = await make_mesh(hang_after=0)
    tokens, summary = await collect(stub, gen_request(PROMPT, 8))
    assert tokens == continue_sequence(PROMPT, 8)
    assert list(summary.refused_by) == ["hung"] and list(summary.pools) == ["ok0"]
    assert summary.migrations == 0, "a refusal, not a migration"
    assert router.metrics.refusals.labels("hung", "DEADLINE_EXCEEDED")._value.get() == 1


async def test_a_pool_that_does_not_even_admit_counts_as_a_refusal(make_mesh):
    router, stub, hanging = await make_mesh(hang_after=None)
    tokens, summary = await collect(stub, gen_request(PROMPT, 8))
    assert tokens == continue_sequence(PROMPT, 8)
    assert list(summary.refused_by) == ["hung"] and list(summary.pools) == ["ok0"]
    assert summary.migrations == 0
    await asyncio.wait_for(hanging.cancelled.wait(), 5)
    assert router.core.table.pools["hung"].link_backoff_until > 0


async def test_no_first_token_anywhere_ends_with_a_clear_reason(make_mesh):
    _, stub, _ = await make_mesh(hang_after=0, healthy=0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, gen_request(PROMPT, 8))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason_of(info.value) == Reason.POOL_STALLED
    assert "no first token" in info.value.details()

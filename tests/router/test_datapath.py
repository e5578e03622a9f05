"""The data path's shortcuts keep its semantics: the summary follows the pool's finish at once, metric children are cached."""

from __future__ import annotations

import asyncio

import pytest

from globalrouter.metrics import RouterMetrics
from globalrouter.v1 import pool_frontend_pb2, pool_frontend_pb2_grpc, router_pb2
from tests.router.fakes import gen_request, pool_msg, start_fake_pool, start_router

pytestmark = pytest.mark.timeout(30)
PROMPT = list(range(200, 248))
Response = pool_frontend_pb2.PoolFrontendServiceGenerateResponse


class LingeringPool(pool_frontend_pb2_grpc.PoolFrontendServiceServicer):
    """Streams its tokens in uneven chunks, then its finish, then keeps the stream open until cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):
        yield Response(admission=pool_frontend_pb2.PoolAdmission(worker_id="w0", prompt_blocks=3))
        tokens = [1000 + i for i in range(request.max_tokens)]
        for chunk in (tokens[:1], tokens[1:4], tokens[4:]):
            yield Response(tokens=pool_frontend_pb2.PoolTokens(token_ids=chunk))
        yield Response(
            finish=pool_frontend_pb2.PoolFinish(
                reason=pool_frontend_pb2.POOL_FINISH_REASON_STOP, tokens_generated=len(tokens)
            )
        )
        try:
            await asyncio.Event().wait()  # a pool slow to end its call after the finish
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_summary_follows_the_pools_finish_without_waiting_for_its_call_to_end():
    pool = LingeringPool()
    _, server, url = await start_fake_pool(pool)
    router, stub, channel = await start_router()
    try:
        router.core.table.apply_listed(pool_msg("p1", url))
        messages = [m async for m in stub.Generate(gen_request(PROMPT, 10), timeout=5)]
        chunks = [m.tokens for m in messages if m.WhichOneof("payload") == "tokens"]
        assert [(c.offset, list(c.token_ids)) for c in chunks] == [
            (0, [1000]),
            (1, [1001, 1002, 1003]),
            (4, [1004 + i for i in range(6)]),
        ]
        summary = messages[-1].summary
        assert messages[-1].WhichOneof("payload") == "summary"
        assert summary.finish_reason == router_pb2.FINISH_REASON_STOP
        assert summary.tokens_generated == 10 and list(summary.pools) == ["p1"]
        # The frontend let go of the pool's call once it had the finish.
        await asyncio.wait_for(pool.cancelled.wait(), 5)
    finally:
        await channel.close()
        await router.handle.server.stop(0)
        await server.stop(0)


def test_labelled_is_the_metric_child_looked_up_once():
    metrics = RouterMetrics()
    child = metrics.labelled(metrics.decisions, "p1")
    assert child is metrics.labelled(metrics.decisions, "p1")
    assert child is metrics.decisions.labels("p1")
    child.inc()
    metrics.labelled(metrics.refusals, "p1", "RESOURCE_EXHAUSTED").inc(2)
    assert metrics.registry.get_sample_value("globalrouter_decisions_total", {"pool": "p1"}) == 1
    assert (
        metrics.registry.get_sample_value(
            "globalrouter_refusals_total", {"pool": "p1", "code": "RESOURCE_EXHAUSTED"}
        )
        == 2
    )

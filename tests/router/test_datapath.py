"""The data path's shortcuts keep its semantics: the summary follows the pool's finish at once, metric children are cached."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
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


class CombiningPool(pool_frontend_pb2_grpc.PoolFrontendServiceServicer):
    """Sends combined messages: the admission carries the first token, the last tokens carry the
    finish. While `failures` (shared between pools) holds a count above 0, a stream fails
    (UNAVAILABLE) after `fail_after` tokens instead, counting it down."""

    def __init__(self, pool_id: str, fail_after: int = 0, failures: list[int] | None = None) -> None:
        self.pool_id = pool_id
        self.fail_after = fail_after
        self.failures = failures if failures is not None else [0]
        self.requests: list[pool_frontend_pb2.PoolFrontendServiceGenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        base = 1000 + 100 * len(request.token_ids)  # the continuation depends on the sequence so far
        tokens = [base + i for i in range(request.max_tokens)]
        yield Response(
            admission=pool_frontend_pb2.PoolAdmission(
                worker_id="w0", prompt_blocks=3, tokens=pool_frontend_pb2.PoolTokens(token_ids=tokens[:1])
            )
        )
        if self.failures[0] > 0:
            self.failures[0] -= 1
            yield Response(tokens=pool_frontend_pb2.PoolTokens(token_ids=tokens[1 : self.fail_after]))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost")
        yield Response(tokens=pool_frontend_pb2.PoolTokens(token_ids=tokens[1:4]))
        finish = pool_frontend_pb2.PoolFinish(
            reason=pool_frontend_pb2.POOL_FINISH_REASON_STOP, tokens_generated=len(tokens)
        )
        yield Response(tokens=pool_frontend_pb2.PoolTokens(token_ids=tokens[4:], finish=finish))
        await asyncio.Event().wait()  # the finish is in hand: the frontend must not wait for the end


def combined_request(max_tokens: int, combine: bool) -> router_pb2.GenerateRequest:
    request = gen_request(PROMPT, max_tokens)
    request.combine_messages = combine
    return request


@contextlib.asynccontextmanager
async def routed(*servicers):
    """A router whose directory lists one started fake pool per servicer (p1, p2, ...); its stub."""
    servers = []
    router, stub, channel = await start_router()
    try:
        for i, servicer in enumerate(servicers, start=1):
            _, server, url = await start_fake_pool(servicer)
            servers.append(server)
            router.core.table.apply_listed(pool_msg(f"p{i}", url))
        yield stub
    finally:
        await channel.close()
        await router.handle.server.stop(0)
        for server in servers:
            await server.stop(0)


@pytest.mark.parametrize("combine", [True, False])
async def test_a_pools_combined_messages_reach_the_client_once_each_in_the_form_it_asked_for(combine):
    pool = CombiningPool("p1")
    async with routed(pool) as stub:
        messages = [m async for m in stub.Generate(combined_request(10, combine), timeout=5)]
    assert pool.requests[0].combine_messages  # the frontend reads the combined form
    chunks = [m.tokens for m in messages if m.WhichOneof("payload") == "tokens"]
    base = 1000 + 100 * len(PROMPT)
    assert [(c.offset, list(c.token_ids)) for c in chunks] == [
        (0, [base]),
        (1, [base + 1, base + 2, base + 3]),
        (4, [base + 4 + i for i in range(6)]),
    ]
    assert not any(c.HasField("summary") for c in chunks[:-1])
    if combine:
        assert len(messages) == 3 and chunks[-1].HasField("summary")
        summary = chunks[-1].summary
    else:
        # A client that did not ask gets the summary as its own last message, as before.
        assert len(messages) == 4 and not chunks[-1].HasField("summary")
        assert messages[-1].WhichOneof("payload") == "summary"
        summary = messages[-1].summary
    assert summary.finish_reason == router_pb2.FINISH_REASON_STOP
    assert summary.tokens_generated == 10 and list(summary.pools) == ["p1"]
    assert summary.prompt_blocks == 3 and summary.migrations == 0


async def test_a_pool_with_separate_messages_still_ends_a_combining_clients_stream_with_a_summary():
    async with routed(LingeringPool()) as stub:
        messages = [m async for m in stub.Generate(combined_request(10, True), timeout=5)]
    assert [m.WhichOneof("payload") for m in messages] == ["tokens"] * 3 + ["summary"]
    assert messages[-1].summary.tokens_generated == 10


async def test_a_stream_that_began_inside_the_admission_migrates_with_prompt_and_tokens_so_far():
    failures = [1]  # whichever pool takes the request first fails it after 3 tokens
    pools = [CombiningPool(p, fail_after=3, failures=failures) for p in ("p1", "p2")]
    async with routed(*pools) as stub:
        messages = [m async for m in stub.Generate(combined_request(10, True), timeout=5)]
    chunks = [m.tokens for m in messages]
    tokens = [t for c in chunks for t in c.token_ids]
    assert [c.offset for c in chunks] == [
        sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))
    ]
    first, second = sorted(pools, key=lambda p: len(p.requests[0].token_ids))
    resumed = second.requests[0]
    # Three tokens came from the failed pool; the next pool got the prompt plus exactly those.
    assert list(resumed.token_ids) == PROMPT + tokens[:3] and resumed.max_tokens == 7
    assert len(tokens) == 10 and chunks[-1].summary.migrations == 1
    assert list(chunks[-1].summary.pools) == [first.pool_id, second.pool_id]


async def test_a_combining_client_gets_the_request_id_in_the_trailers_instead_of_a_header():
    async with routed(CombiningPool("p1")) as stub:
        request = combined_request(10, True)
        request.request_id = "combined-1"
        call = stub.Generate(request, timeout=5)
        messages = [m async for m in call]
        assert messages[-1].tokens.summary.request_id == "combined-1"
        assert "x-request-id" not in dict(await call.initial_metadata())
        assert dict(await call.trailing_metadata())["x-request-id"] == "combined-1"
        # An error names the request too (here: no pool serves the model).
        request.model = "other"
        failed = stub.Generate(request, timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [m async for m in failed]
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert dict(err.value.trailing_metadata())["x-request-id"] == "combined-1"
        # A client that did not ask keeps its header.
        plain = stub.Generate(combined_request(10, False), timeout=5)
        _ = [m async for m in plain]
        assert dict(await plain.initial_metadata())["x-request-id"]

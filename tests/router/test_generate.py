"""Generate, Route and ListPools against in-process fake pools: admission, errors, migration, metrics."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from globalrouter.v1 import router_pb2
from meshkit.blocks import block_hashes
from meshkit.errors import Reason, reason_of
from meshkit.validation import bad_request_fields
from mocker.tokens import continue_sequence
from poolrelay.v1 import pool_events_pb2, telemetry_pb2
from tests.router.fakes import (
    FakeRelay,
    collect,
    eventually,
    gen_request,
    pool_msg,
    start_fake_pool,
    start_router,
)

pytestmark = pytest.mark.timeout(30)
PROMPT = list(range(100, 164))


@pytest.fixture
async def mesh():
    """A router and three fake pools p1..p3 (listed, model m); p1 ranks first (fewest pending)."""
    router, stub, channel = await start_router(migration_limit=2, admission_tries=3)
    pools, servers = {}, []
    for name in ("p1", "p2", "p3"):
        fake, server, url = await start_fake_pool()
        pools[name] = fake
        servers.append(server)
        router.core.table.apply_listed(pool_msg(name, url))
    yield router, stub, pools
    await channel.close()
    await router.handle.server.stop(0)
    for server in servers:
        await server.stop(0)


def order(router) -> list[str]:
    return [c.pool_id for c in router.core.decide("m", PROMPT, 8).candidates]


async def test_generate_streams_the_pool_tokens_with_a_summary(mesh):
    router, stub, pools = mesh
    first = order(router)[0]
    pools[first].behaviour.cached_blocks = 3
    tokens, summary = await collect(stub, gen_request(PROMPT, 20))
    assert tokens == continue_sequence(PROMPT, 20)
    assert list(summary.pools) == [first]
    assert summary.finish_reason == router_pb2.FINISH_REASON_LENGTH
    assert (summary.cached_blocks, summary.prompt_blocks, summary.migrations) == (3, 4, 0)
    assert summary.tokens_generated == 20 and summary.request_id


async def test_refusing_pool_hands_over_to_the_next(mesh):
    router, stub, pools = mesh
    ranked = order(router)
    pools[ranked[0]].behaviour.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
    pools[ranked[1]].behaviour.refuse = grpc.StatusCode.UNAVAILABLE
    pools[ranked[1]].behaviour.refuse_reason = Reason.POOL_DRAINING
    pools[ranked[1]].behaviour.refuse_message = "the pool is not taking requests"
    tokens, summary = await collect(stub, gen_request(PROMPT, 5))
    assert tokens == continue_sequence(PROMPT, 5)
    assert list(summary.refused_by) == ranked[:2]
    assert list(summary.pools) == [ranked[2]]
    assert router.metrics.refusals.labels(ranked[0], "RESOURCE_EXHAUSTED")._value.get() == 1
    assert router.core.table.pools[ranked[1]].link_backoff_until == 0.0  # a refusal is no link failure


async def test_refusal_is_decided_on_the_reason_not_the_message(mesh):
    """UNAVAILABLE saying 'draining' in words but carrying no POOL_DRAINING reason is a link failure."""
    router, stub, pools = mesh
    ranked = order(router)
    pools[ranked[0]].behaviour.refuse = grpc.StatusCode.UNAVAILABLE
    pools[ranked[0]].behaviour.refuse_message = "pool is draining"
    _tokens, summary = await collect(stub, gen_request(PROMPT, 5))
    assert not summary.refused_by and list(summary.pools) == [ranked[1]]
    assert router.core.table.pools[ranked[0]].link_backoff_until > router.clock.monotonic()


async def test_all_refuse_is_resource_exhausted(mesh):
    _router, stub, pools = mesh
    for fake in pools.values():
        fake.behaviour.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, gen_request(PROMPT, 5))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason_of(err.value) == Reason.ALL_POOLS_REFUSED
    assert all(name in err.value.details() for name in pools)


async def test_unknown_model_is_not_found(mesh):
    _router, stub, _pools = mesh
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, gen_request(PROMPT, 5, model="other"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert reason_of(err.value) == Reason.NO_POOL_FOR_MODEL
    assert "'other'" in err.value.details()


async def test_nothing_eligible_is_unavailable_naming_each_reason(mesh):
    router, stub, _pools = mesh
    table = router.core.table
    table.pools["p1"].directory_draining = True
    table.pools["p2"].frontends = ()
    table.pools["p3"].models_ready = {"m": False}
    table.pools["p3"].state_at = router.clock.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, gen_request(PROMPT, 5))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert reason_of(err.value) == Reason.NO_ELIGIBLE_POOL
    details = err.value.details()
    assert "p1: draining" in details and "p2: no frontend" in details and "p3: not ready" in details


async def test_mid_stream_failure_migrates_without_loss_or_repeat(mesh):
    router, stub, pools = mesh
    first = order(router)[0]
    pools[first].behaviour.fail_after_tokens = 7
    tokens, summary = await collect(stub, gen_request(PROMPT, 30))
    assert tokens == continue_sequence(PROMPT, 30)
    assert summary.migrations == 1 and summary.pools[0] == first and len(summary.pools) == 2
    second = summary.pools[1]
    assert list(pools[second].behaviour.requests[-1].token_ids) == PROMPT + tokens[:7]
    assert pools[second].behaviour.requests[-1].max_tokens == 23
    assert router.metrics.migrations.labels(first)._value.get() == 1
    assert router.core.table.pools[first].link_backoff_until > router.clock.monotonic()


async def test_a_stream_handed_back_at_drain_migrates_without_backing_off_the_pool(mesh):
    router, stub, pools = mesh
    first = order(router)[0]
    pools[first].behaviour.fail_after_tokens = 4
    pools[first].behaviour.fail_reason = Reason.DRAIN_HANDED_BACK
    tokens, summary = await collect(stub, gen_request(PROMPT, 12))
    assert tokens == continue_sequence(PROMPT, 12)
    assert summary.migrations == 1 and summary.pools[0] == first
    assert router.core.table.pools[first].link_backoff_until == 0.0


async def test_migration_limit_ends_with_unavailable_and_its_reason(mesh):
    router, stub, pools = mesh
    for fake in pools.values():
        fake.behaviour.fail_after_tokens = 2
    got: list[int] = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for msg in stub.Generate(gen_request(PROMPT, 30), timeout=20):
            got.extend(msg.tokens.token_ids)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert reason_of(err.value) == Reason.MIGRATION_LIMIT_REACHED
    assert "migration limit (2)" in err.value.details()
    assert got == continue_sequence(PROMPT, 6)  # three pools, two tokens each, nothing repeated
    trailers = dict(await _trailers(err))
    assert trailers["x-migrations"] == "2"
    assert _error_info(err.value).metadata["tokens_sent"] == "6"  # the client continues from there
    assert router.metrics.migration_aborts._value.get() == 1


async def _trailers(err):
    return err.value.trailing_metadata() or ()


def _error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    info = error_details_pb2.ErrorInfo()
    [detail] = rpc_status.from_call(error).details  # type: ignore[arg-type]  # an aio error is a Call too
    assert detail.Unpack(info)
    return info


async def test_bad_requests_name_the_field(mesh):
    _router, stub, _pools = mesh
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, router_pb2.GenerateRequest(model="", max_tokens=0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(bad_request_fields(err.value)) == {"model", "prompt", "max_tokens"}


async def test_route_shows_cost_terms_and_filter_reasons(mesh):
    router, stub, _pools = mesh
    relay = FakeRelay(f"127.0.0.1:{router.port}")
    await relay.open("p2")
    await relay.send(
        kv_snapshot=telemetry_pb2.KvSnapshot(snapshot_id=1, last=True, block_hashes=block_hashes(PROMPT, 16))
    )
    await relay.send(load=telemetry_pb2.LoadReport(load=pool_events_pb2.PoolLoad(max_running_requests=4)))
    router.core.table.pools["p3"].directory_draining = True
    await eventually(lambda: router.core.table.pools["p2"].kv_sources and router.core.table.pools["p2"].load)
    reply = await stub.Route(
        router_pb2.RouteRequest(model="m", prompt=router_pb2.Prompt(token_ids={"ids": PROMPT}))
    )
    assert [c.pool_id for c in reply.candidates] == ["p2", "p1"]  # cached prefix and known load first
    best = reply.candidates[0]
    assert (best.rank, best.cached_blocks, best.prompt_blocks, best.load_known) == (1, 4, 4, True)
    assert best.total_cost == pytest.approx(best.prefill_cost + best.load_cost + best.pending_cost)
    assert [(f.pool_id, f.reason) for f in reply.filtered] == [("p3", router_pb2.FILTER_REASON_DRAINING)]
    # ListPools shows the live signals next to the directory.
    page = await stub.ListPools(router_pb2.ListPoolsRequest(page_size=2))
    assert [p.pool_id for p in page.pools] == ["p1", "p2"] and page.next_page_token
    p2 = page.pools[1]
    assert p2.indexed_blocks == 4 and p2.telemetry_streams == 1 and p2.kv_freshness.fresh and p2.listed
    rest = await stub.ListPools(router_pb2.ListPoolsRequest(page_size=2, page_token=page.next_page_token))
    assert [p.pool_id for p in rest.pools] == ["p3"] and rest.pools[0].draining and not rest.next_page_token
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListPools(router_pb2.ListPoolsRequest(model="x", page_token=page.next_page_token))
    assert bad_request_fields(err.value) == ["page_token"]
    await relay.close()


async def test_route_lists_at_most_max_candidates_the_best_ranked(mesh):
    router, stub, _pools = mesh
    router.core.table.pools["p3"].directory_draining = True

    def route(**kw):
        return stub.Route(
            router_pb2.RouteRequest(model="m", prompt=router_pb2.Prompt(token_ids={"ids": PROMPT}), **kw)
        )

    everything = await route()
    assert len(everything.candidates) == everything.candidates_total == 2  # 0: all, as before
    one = await route(max_candidates=1)
    # The same decision, its best candidate only; the total says how many were eligible.
    assert list(one.candidates) == [everything.candidates[0]] and one.candidates_total == 2
    assert one.filtered == everything.filtered and one.prompt_blocks == everything.prompt_blocks
    assert await route(max_candidates=5) == everything


async def test_a_pools_frontends_share_its_load_round_robin():
    router, stub, channel = await start_router()
    fakes, servers, urls = [], [], []
    for _ in range(2):
        fake, server, url = await start_fake_pool()
        fakes.append(fake)
        servers.append(server)
        urls.append(url)
    router.core.table.apply_listed(pool_msg("p1", urls))
    try:
        for i in range(6):
            await collect(stub, gen_request([*PROMPT, i], 2))
        assert [len(f.behaviour.requests) for f in fakes] == [3, 3]
    finally:
        await channel.close()
        await router.handle.server.stop(0)
        for server in servers:
            await server.stop(0)


async def test_an_unreachable_pool_is_skipped_and_backs_off(mesh):
    router, stub, _pools = mesh
    dead = order(router)[0]
    router.core.table.pools[dead].frontends = ("http://127.0.0.1:1",)  # nothing listens there
    tokens, summary = await collect(stub, gen_request(PROMPT, 3))
    assert summary.pools[0] != dead and not summary.refused_by  # unreachable is not a refusal
    assert tokens == continue_sequence(PROMPT, 3)
    reply = await stub.Route(
        router_pb2.RouteRequest(model="m", prompt=router_pb2.Prompt(token_ids={"ids": PROMPT}))
    )
    assert dead not in [c.pool_id for c in reply.candidates]
    assert [(f.pool_id, f.reason) for f in reply.filtered] == [(dead, router_pb2.FILTER_REASON_LINK_BACKOFF)]
    assert "back-off" in reply.filtered[0].detail


async def test_trailing_metadata_names_the_pools_and_migrations(mesh):
    router, stub, pools = mesh
    first = order(router)[0]
    pools[first].behaviour.fail_after_tokens = 2
    call = stub.Generate(gen_request(PROMPT, 6), timeout=20)
    async for _msg in call:
        pass
    trailers = dict(await call.trailing_metadata())
    assert trailers["x-migrations"] == "1"
    assert trailers["x-pools"].split(",")[0] == first and len(trailers["x-pools"].split(",")) == 2


@pytest.mark.parametrize("method", ["Generate", "Route"])
async def test_invalid_utf8_in_a_text_prompt_is_invalid_argument_naming_the_field(mesh, method):
    """proto3 strings must be UTF-8: the frontend says which field is not, instead of UNKNOWN."""
    router, _stub, _pools = mesh
    request_type = router_pb2.GenerateRequest if method == "Generate" else router_pb2.RouteRequest
    raw = request_type(model="m", prompt=router_pb2.Prompt(text="AAAA"), max_tokens=3).SerializeToString()
    raw = raw.replace(b"AAAA", b"\xff\xfeA\xc3")  # not UTF-8, same length
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        path = f"/globalrouter.v1.RouterService/{method}"
        if method == "Generate":
            call = channel.unary_stream(path, request_serializer=bytes, response_deserializer=bytes)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call(raw, timeout=5):
                    pass
        else:
            unary = channel.unary_unary(path, request_serializer=bytes, response_deserializer=bytes)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await unary(raw, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["prompt.text"]


async def test_each_generated_request_observes_its_time_to_first_token_once(mesh):
    router, stub, _pools = mesh
    ttft = router.metrics.time_to_first_token
    before = ttft._sum.get(), sum(b.get() for b in ttft._buckets)
    await collect(stub, gen_request(PROMPT, 20))
    await collect(stub, gen_request(PROMPT, 5))
    assert sum(b.get() for b in ttft._buckets) - before[1] == 2  # once per request, not per chunk
    assert ttft._sum.get() > before[0]

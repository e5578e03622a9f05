"""Late binding in the live frontend's request path (globalrouter.dispatch_live): a request waits
for a pool that can start it, its chosen pool comes first in the decision it gets, a shed
request ends RESOURCE_EXHAUSTED with its reason and a retry hint, a request whose caller leaves
is taken out of the queue; and end to end on real processes, `serve --dispatch late` serves."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from globalrouter.dispatch import DispatchConfig
from globalrouter.dispatch_live import LateBinder
from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import LoadSignal, PoolCapacityHint, PoolState
from globalrouter.routing import RoutingCore
from globalrouter.selection import Selector
from globalrouter.tenancy import TenantRefusal
from meshkit.clock import FakeClock
from meshkit.errors import Reason
from meshlaunch import Mesh, generate_cli, process_group

NOW = 100.0


def core_with(*pools: tuple[str, int]) -> RoutingCore:
    clock = FakeClock(start=NOW)
    table = PoolTable()
    for pool_id, backlog in pools:
        p = PoolState(
            pool_id=pool_id,
            listed=True,
            model="m",
            region="r",
            frontends=("http://127.0.0.1:1",),
            capacity=PoolCapacityHint(prefill_tokens_per_second=1000),
            block_size=16,
        )
        p.record_load(LoadSignal(prefill_tokens_in_flight=backlog), NOW)
        table.pools[pool_id] = p
    return RoutingCore(table, KvIndex(), Selector(), clock, RouterMetrics())


async def test_waits_for_a_pool_then_gets_it_first_in_its_decision():
    core = core_with(("a", 3000), ("b", 2000))  # 3 s and 2 s of work
    binder = LateBinder(core, DispatchConfig(start_within_seconds=0.0))
    task = asyncio.create_task(binder.decide("m", list(range(32)), 0))
    await asyncio.sleep(0.1)
    assert not task.done() and binder.queue.queued() == 1
    assert isinstance(core.clock, FakeClock)
    core.clock.set(NOW + 2.0)  # "b" has served its work
    decision = await asyncio.wait_for(task, 5)
    assert decision.candidates[0].pool_id == "b"
    assert [c.pool_id for c in decision.candidates] == ["b", "a"]
    # the queue leaves the send to GenerateRun's record_sent (no double count)
    assert core.table.pools["b"].pending_requests == 0
    await binder.close()


async def test_a_shed_request_ends_resource_exhausted_with_reason_and_retry_hint():
    core = core_with(("a", 100_000))
    binder = LateBinder(core, DispatchConfig(start_within_seconds=0.0, max_queued=1))
    first = asyncio.create_task(binder.decide("m", list(range(32)), 0))
    await asyncio.sleep(0.05)
    with pytest.raises(TenantRefusal) as caught:
        await binder.decide("m", list(range(32)), 0)
    exc = caught.value
    assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.reason == Reason.QUEUE_FULL
    assert exc.metadata["shed_reason"] == "QUEUE_FULL"
    assert dict(exc.headers)["retry-after"] == exc.metadata["retry_after_seconds"]
    # the caller of the first one leaves: it is taken out of the queue
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert binder.queue.queued() == 0
    await binder.close()


async def test_a_model_nobody_serves_comes_back_as_a_decision_at_once():
    core = core_with(("a", 0))
    binder = LateBinder(core, DispatchConfig())
    decision = await binder.decide("other", [1, 2, 3], 0)
    assert not decision.model_served and not decision.candidates


@pytest.mark.e2e
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("placement", "extra"),
    [
        ("rank", ()),
        ("match", ()),
        ("rank", ("--wait-slo", "2", "--dispatch-order", "deadline", "--dispatch-slo-feedback")),
    ],
)
def test_a_frontend_with_late_binding_serves_and_keeps_a_prefix_on_its_holder(tmp_path, placement, extra):
    prefix = [(11 * i + 5) % 30_000 for i in range(256)]
    with process_group(tmp_path) as group:
        m = Mesh(group)
        m.start_discovery()
        m.start_pool("pool-a", "eu", "--workers", "2", "--speedup", "10")
        m.start_pool("pool-b", "eu", "--workers", "2", "--speedup", "10")
        router = m.start_router(
            "--dispatch", "late", "--dispatch-max-queued", "64", "--dispatch-placement", placement, *extra
        )
        m.wait_routable(router, m.pools)
        first = generate_cli(router, [*prefix, 1, 2, 3], 4)
        assert len(first["tokens"]) == 4
        outs = [generate_cli(router, [*prefix, 1, 2, 3, k], 4) for k in range(3)]
        assert all(len(o["tokens"]) == 4 for o in outs)


# Pacing on the live request path: a paced class's request waits for its bucket and then gets its
# pool, while a higher class's request is decided at once.
async def test_a_paced_request_waits_for_its_bucket_and_a_higher_class_does_not():
    core = core_with(("a", 0), ("b", 0))
    clock = core.clock
    assert isinstance(clock, FakeClock)
    config = DispatchConfig(
        start_within_seconds=1e6, pace_tokens_per_second={0: 100.0}, pace_burst_seconds=0.0
    )
    binder = LateBinder(core, config)
    try:
        # 32 prompt + 68 output tokens: the first puts class 0 1 s in debt
        first = await asyncio.wait_for(binder.decide("m", list(range(32)), 68, priority=0), 5)
        assert first.candidates
        held = asyncio.create_task(binder.decide("m", list(range(32, 64)), 68, priority=0))
        await asyncio.sleep(0.1)
        assert not held.done() and binder.queue.queued() == 1
        high = await asyncio.wait_for(binder.decide("m", list(range(64, 96)), 68, priority=1), 5)
        assert high.candidates and not held.done()
        clock.set(NOW + 0.5)
        await asyncio.sleep(0.1)
        assert not held.done()
        clock.set(NOW + 1.0)  # out of debt: the binder's wake-up finds it
        decision = await asyncio.wait_for(held, 5)
        assert decision.candidates and binder.queue.queued() == 0
    finally:
        await binder.close()


# The SLO's deadline order and feedback run on the live request path as in the simulator (the
# same DispatchQueue): a decision is one observation of the feedback.
async def test_the_live_path_runs_the_deadline_order_and_the_slo_feedback():
    core = core_with(("a", 0), ("b", 0))
    binder = LateBinder(core, DispatchConfig.for_wait_slo(1.0, "rank", "deadline", feedback=True))
    try:
        decision = await asyncio.wait_for(binder.decide("m", list(range(32)), 8), 5)
        assert decision.candidates
        feedback = binder.queue.feedback
        # started at once on an idle pool: a wait of 0, under the target, so the scale rises
        assert feedback is not None and feedback.observations == 1 and feedback.scale > 1.0
        assert binder.queue.config.late_after_seconds == 1.0
    finally:
        await binder.close()

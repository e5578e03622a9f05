"""Pacing on the live frontend's request path (globalrouter.dispatch_live.LateBinder over a fake
clock): a paced class's request waits for its bucket and then gets its pool, while a higher
class's request is decided at once."""

from __future__ import annotations

import asyncio

from globalrouter.dispatch import DispatchConfig
from globalrouter.dispatch_live import LateBinder
from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import LoadSignal, PoolCapacityHint, PoolState
from globalrouter.routing import RoutingCore
from globalrouter.selection import Selector
from meshkit.clock import FakeClock

NOW = 100.0


def idle_core() -> tuple[RoutingCore, FakeClock]:
    clock = FakeClock(start=NOW)
    table = PoolTable()
    for pool_id in ("a", "b"):
        p = PoolState(
            pool_id=pool_id,
            listed=True,
            model="m",
            region="r",
            frontends=("http://127.0.0.1:1",),
            capacity=PoolCapacityHint(prefill_tokens_per_second=1_000_000),
            block_size=16,
        )
        p.record_load(LoadSignal(), NOW)
        table.pools[pool_id] = p
    return RoutingCore(table, KvIndex(), Selector(), clock, RouterMetrics()), clock


async def test_a_paced_request_waits_for_its_bucket_and_a_higher_class_does_not():
    core, clock = idle_core()
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

"""The in-memory store's expiry task on a FakeClock: it wakes at the next deadline, not on a poll."""

from __future__ import annotations

import asyncio

from globaldiscovery.records import EventKind, Removal
from globaldiscovery.store import MemoryStore
from meshkit.clock import FakeClock
from tests.discovery.helpers import reg

LEASE = 3.0


async def next_event(watcher):
    return await asyncio.wait_for(watcher.next(), 5)


async def test_expiry_task_removes_at_the_deadline_and_tells_watchers_once():
    clock = FakeClock(start=0.0)
    store = MemoryStore(clock, heartbeat_interval=1.0, lease_duration=LEASE)
    await store.start()
    try:
        watcher = await store.watch(model="", region="")
        assert (await next_event(watcher)).kind is EventKind.SNAPSHOT_DONE
        await store.register_pool(reg("a"))
        await clock.advance(1.0)
        await store.register_pool(reg("b"))
        assert (await next_event(watcher)).kind is EventKind.ADDED
        assert (await next_event(watcher)).kind is EventKind.ADDED
        removed_at: list[tuple[str, float]] = []

        async def collect():
            while len(removed_at) < 2:
                event = await watcher.next()
                assert event.kind is EventKind.REMOVED and event.reason is Removal.LEASE_EXPIRED
                removed_at.append((event.pool.pool_id, clock.monotonic()))

        collector = asyncio.create_task(collect())
        await clock.advance(LEASE - 1.0 - 1e-3)  # just before a's deadline (t = 3.0)
        assert removed_at == []
        await clock.advance(1e-3)
        assert removed_at == [("a", LEASE)]  # at the deadline exactly: the task slept until then
        await clock.advance(1.0)
        await asyncio.wait_for(collector, 5)
        assert removed_at == [("a", LEASE), ("b", LEASE + 1.0)]
        pools, more, complete = await store.list_pools(model="", region="", after=None, limit=10)
        assert pools == [] and not more and complete
        await clock.advance(10 * LEASE)
        assert watcher.pending() == 0
    finally:
        await store.close()


async def test_renewed_pool_stays_while_another_expires():
    clock = FakeClock(start=0.0)
    store = MemoryStore(clock, heartbeat_interval=1.0, lease_duration=LEASE)
    await store.start()
    try:
        await store.register_pool(reg("kept"))
        await store.register_pool(reg("lapsed"))
        for _ in range(12):  # four leases' worth of heartbeats
            await clock.advance(1.0)
            await store.register_pool(reg("kept"))
        pools, _, _ = await store.list_pools(model="", region="", after=None, limit=10)
        assert [p.pool_id for p in pools] == ["kept"]
    finally:
        await store.close()


async def test_close_ends_watchers():
    clock = FakeClock(start=0.0)
    store = MemoryStore(clock, heartbeat_interval=1.0, lease_duration=LEASE)
    await store.start()
    watcher = await store.watch(model="", region="")
    await store.close()
    assert await next_event(watcher) is None

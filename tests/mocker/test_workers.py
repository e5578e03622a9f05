"""Worker caches (LRU, numbered KV events), the pool's worker choice and the timing model."""

from __future__ import annotations

import pytest

from meshkit.blocks import block_hashes
from mocker.workers import KvCache, KvEvent, TimingModel, Worker, choose_worker


def test_lru_evicts_least_recently_used_and_refresh_moves_to_end():
    cache = KvCache(3)
    assert cache.insert([1, 2, 3]) == ([1, 2, 3], [])
    assert cache.insert([1]) == ([], [])  # refresh: 1 becomes most recent
    assert cache.blocks() == [2, 3, 1]
    assert cache.insert([4]) == ([4], [2])
    assert cache.blocks() == [3, 1, 4]
    assert cache.insert([5, 6]) == ([5, 6], [3, 1])
    assert cache.blocks() == [4, 5, 6]


def test_insert_longer_than_capacity_keeps_the_prefix_and_reports_net_changes():
    cache = KvCache(2)
    cache.insert([9])
    stored, removed = cache.insert([1, 2, 3, 4])
    assert cache.blocks() == [1, 2]
    assert (stored, removed) == ([1, 2], [9])


def test_cached_prefix_stops_at_first_miss():
    cache = KvCache(10)
    cache.insert([1, 2, 3])
    assert cache.cached_prefix([1, 2, 3, 4]) == 3
    assert cache.cached_prefix([1, 7, 3]) == 1
    assert cache.cached_prefix([7, 1, 2]) == 0


def test_kv_events_are_numbered_per_worker_without_gaps():
    events: list[KvEvent] = []
    w = Worker("w", capacity_blocks=2, max_running=1, on_event=events.append)
    assert w.store([1, 2]) == KvEvent("w", 1, (1, 2), ())
    assert w.store([1, 2]) is None  # nothing changed: no event, no number used
    assert w.store([3]) == KvEvent("w", 2, (3,), (1,))
    assert [e.event_id for e in events] == [1, 2]
    assert w.snapshot() == (2, [2, 3])


def test_replaying_events_on_a_snapshot_reproduces_the_cache():
    w = Worker("w", capacity_blocks=5, max_running=1)
    w.store([1, 2, 3])
    event_id, blocks = w.snapshot()
    held = set(blocks)
    events: list[KvEvent] = []
    w._on_event = events.append
    for prompt in ([1, 4, 5], [6, 7, 8], [1, 2]):
        w.store(prompt)
    for e in events:
        assert e.event_id == event_id + 1
        event_id = e.event_id
        held |= set(e.stored)
        held -= set(e.removed)
    assert held == set(w.cache.blocks())


def _prompt(seed: int, blocks: int, bs: int = 4) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * bs)]


def test_choice_prefers_the_worker_with_the_longest_cached_prefix():
    a, b = Worker("a", 100, 2), Worker("b", 100, 2)
    hashes = block_hashes(_prompt(1, 4), 4)
    b.cache.insert(hashes[:3])
    a.cache.insert(hashes[:1])
    assert choose_worker([a, b], hashes) == (b, 3)


def test_choice_breaks_ties_by_load_then_id():
    a, b = Worker("a", 100, 2), Worker("b", 100, 2)
    hashes = block_hashes(_prompt(1, 2), 4)
    assert choose_worker([b, a], hashes) == (a, 0)
    a.running = 1
    assert choose_worker([a, b], hashes) == (b, 0)


def test_choice_avoids_a_full_worker_even_with_cache():
    a, b = Worker("a", 100, 1), Worker("b", 100, 1)
    hashes = block_hashes(_prompt(1, 2), 4)
    a.cache.insert(hashes)
    a.running = 1
    assert choose_worker([a, b], hashes) == (b, 0)
    b.running = 1  # everyone full: the cache decides again
    assert choose_worker([a, b], hashes) == (a, 2)


def test_timing_model_prefill_grows_with_uncached_tokens_and_speedup_divides():
    slow = TimingModel(prefill_tokens_per_second=1000, decode_tokens_per_second=50)
    fast = TimingModel(prefill_tokens_per_second=1000, decode_tokens_per_second=50, speedup=4)
    assert slow.prefill_seconds(500) == pytest.approx(0.5)
    assert slow.prefill_seconds(1000) == pytest.approx(1.0)
    assert fast.prefill_seconds(1000) == pytest.approx(0.25)
    assert slow.token_interval() == pytest.approx(0.02)
    assert fast.token_interval() == pytest.approx(0.005)


async def test_slots_are_first_come_first_served():
    import asyncio

    w = Worker("w", 10, max_running=1)
    await w.acquire()
    order: list[str] = []

    async def take(name: str) -> None:
        await w.acquire()
        order.append(name)

    t1 = asyncio.create_task(take("first"))
    t2 = asyncio.create_task(take("second"))
    await asyncio.sleep(0)
    assert w.waiting == 2 and order == []
    w.release()
    await asyncio.sleep(0)
    assert order == ["first"] and w.running == 1
    w.release()
    await asyncio.gather(t1, t2)
    assert order == ["first", "second"]
    w.release()
    assert w.running == 0

"""Recently sent prompts count as cached at their pool until its KV events arrive (routed_prefixes)."""

from __future__ import annotations

import pytest

from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import LoadSignal, PoolCapacityHint, PoolState
from globalrouter.routed_prefixes import PER_FIRST_BLOCK, RoutedPrefixes, common_prefix
from globalrouter.routing import RoutingCore
from globalrouter.selection import Selector
from globalrouter.simulate import SimConfig, simulate
from globalrouter.trace import TraceRequest
from meshkit.blocks import block_hashes
from meshkit.clock import FakeClock
from tests.support import count_routing_hashes

NOW = 100.0


def test_common_prefix_of_chained_hashes():
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 9, 9]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([7], [1]) == 0
    assert common_prefix([], [1]) == 0
    for k in range(0, 50):
        a = list(range(50))
        b = a[:k] + [-1] * (50 - k)
        assert common_prefix(a, b) == k


def test_a_sent_prompt_counts_at_its_pool_for_the_ttl_only():
    routed = RoutedPrefixes(ttl=5.0)
    routed.record("a", [1, 2, 3, 4], NOW)
    routed.record("b", [1, 2], NOW + 1)
    assert routed.holds(1) and not routed.holds(2)
    assert routed.overlaps([1, 2, 3, 9], NOW + 2) == {"a": 3, "b": 2}
    assert routed.overlaps([5, 2, 3], NOW + 2) == {}
    assert routed.overlaps([1, 2, 3, 4], NOW + 5) == {"b": 2}  # a's record expired
    routed.record("c", [8], NOW + 10)  # expiry happens as records come
    assert not routed.holds(1) and len(routed) == 1


def test_records_are_bounded_in_blocks_and_per_first_block_and_pool():
    routed = RoutedPrefixes(ttl=60.0, max_blocks=6)
    for k in range(5):
        routed.record("a", [100 + k, 1], NOW)  # 2 blocks each
    assert (len(routed), routed.blocks) == (3, 6)
    assert not routed.holds(100) and not routed.holds(101) and routed.holds(104)
    per = RoutedPrefixes(ttl=60.0)
    for k in range(PER_FIRST_BLOCK + 3):
        per.record("a", list(range(1, 3 + k)), NOW + k)  # ever longer prompts of one prefix
    per.record("a", [1, 2], NOW + 20)  # a short one does not push the longest out
    assert per.overlaps(list(range(1, 40)), NOW + 21) == {"a": PER_FIRST_BLOCK + 4}
    assert len(per) == PER_FIRST_BLOCK
    # every record forgotten early is let go of once the records ahead of it expire
    per.record("b", [9], NOW + 200)
    assert (len(per), per.blocks) == (1, 1)
    assert not per.holds(1)


def test_a_shared_prefix_sent_many_times_keeps_the_work_per_record_small():
    routed = RoutedPrefixes(ttl=5.0)
    system = list(range(1, 65))
    for k in range(20_000):  # one system prompt, 20,000 requests over 200 s, 4 pools
        routed.record(f"p{k % 4}", [*system, 10_000 + k], NOW + k * 0.01)
    assert len(routed) <= 4 * PER_FIRST_BLOCK
    assert routed.blocks <= 4 * PER_FIRST_BLOCK * 65
    assert len(routed._order) <= 5.0 / 0.01 + 1  # dead records wait at most the TTL


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="ttl must be positive"):
        RoutedPrefixes(ttl=0)
    with pytest.raises(ValueError, match="max_blocks"):
        RoutedPrefixes(max_blocks=0)


def _pool(name: str) -> PoolState:
    pool = PoolState(
        pool_id=name,
        listed=True,
        model="m",
        frontends=("http://h:1",),
        block_size=16,
        capacity=PoolCapacityHint(prefill_tokens_per_second=10_000),
    )
    pool.kv_at, pool.kv_sources = NOW, {f"{name}/r/1"}
    pool.record_load(LoadSignal(), NOW)
    return pool


@pytest.mark.parametrize("ttl", [0.0, 10.0])
def test_the_next_request_of_a_prefix_follows_the_first_before_the_pools_kv_events(ttl):
    table = PoolTable()
    index = KvIndex()
    pools = [_pool(f"p{i}") for i in range(4)]
    for pool in pools:
        index.apply_snapshot(next(iter(pool.kv_sources)), ())
        table.pools[pool.pool_id] = pool
    clock = FakeClock(start=NOW)
    core = RoutingCore(table, index, Selector(), clock, RouterMetrics())
    if ttl:
        core.routed = RoutedPrefixes(ttl)
    prompt = list(range(1600))  # 100 blocks
    first = core.decide("m", prompt, 16)
    sent_to = next(p for p in pools if p.pool_id == first.candidates[0].pool_id)
    core.record_routed(sent_to, first, prompt, "")
    # the pool where it went is busier now than the others (its own pending work), and its KV
    # events have not come: only the record says it holds the prefix
    sent_to.record_sent(len(prompt), 16)
    follow = [*prompt, *range(5000, 5160)]
    cached = core.overlaps(pools, follow, NOW + 1)
    second = core.selector.select(pools, "m", len(follow), 16, cached, NOW + 1, affinity_key=2)
    if ttl:
        assert cached[sent_to.pool_id] == 100
        assert second.candidates[0].pool_id == sent_to.pool_id
    else:
        assert dict(cached) == {}
        assert second.candidates[0].pool_id != sent_to.pool_id
    assert block_hashes(prompt, 16)[:1] == block_hashes(follow, 16)[:1]


def test_the_simulator_with_late_kv_events_recovers_the_hits_of_a_burst():
    # one long prefix, four requests 0.1 s apart; the pools' KV events come every 5 s
    trace = [TraceRequest(0.1 * k, 20 * 512, 4, (*range(20), 100 + k)) for k in range(4)]
    off = simulate(trace, SimConfig(pools=4, rate=200_000, kv_interval=5.0), "default")
    on = simulate(trace, SimConfig(pools=4, rate=200_000, kv_interval=5.0, routed_prefix_ttl=10.0), "default")
    assert off.hit_rate == 0  # nobody is known to hold the prefix: the followers spread
    assert on.hit_rate == pytest.approx(3 * 20 / (4 * 21))  # the three followers hit the prefix
    dynamo = simulate(
        trace, SimConfig(pools=4, rate=200_000, kv_interval=5.0, routed_prefix_ttl=10.0), "dynamo"
    )
    assert (
        dynamo.hit_rate
        == simulate(trace, SimConfig(pools=4, rate=200_000, kv_interval=5.0), "dynamo").hit_rate
    )


def test_a_prompt_the_decision_hashed_is_not_hashed_again_when_recorded(monkeypatch):
    table, index, pools = PoolTable(), KvIndex(), [_pool("p0"), _pool("p1")]
    for pool in pools:
        index.apply_snapshot(next(iter(pool.kv_sources)), ())
        table.pools[pool.pool_id] = pool
    core = RoutingCore(table, index, Selector(), FakeClock(start=NOW), RouterMetrics())
    core.routed = RoutedPrefixes(10.0)
    prompt = list(range(320))
    core.record_routed(pools[0], core.decide("m", prompt, 4), prompt)  # nobody held it: hashed here
    calls = count_routing_hashes(monkeypatch)
    decision = core.decide("m", prompt, 4)  # the record holds its first block: the whole prompt hashed once
    assert decision.prompt_hashes is not None and decision.prompt_hashes[16] == block_hashes(prompt, 16)
    assert calls.count(320) == 1  # the whole prompt once (and its first block for the look and the tie-break)
    before = len(calls)
    core.record_routed(pools[1], decision, prompt)
    assert len(calls) == before  # none at the record
    assert core.routed.overlaps(block_hashes(prompt, 16), NOW) == {"p0": 20, "p1": 20}

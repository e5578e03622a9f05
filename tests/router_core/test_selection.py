"""Selection: each filter reason, and the ranking rules (cache, load, unknown load, pending,
pools of different capacity)."""

from __future__ import annotations

from globalrouter.kv_index import KvIndex
from globalrouter.pool_state import FreshnessLimits, LoadSignal, PoolCapacityHint, PoolState
from globalrouter.selection import FilterReason, SelectionConfig, Selector, pool_overlaps

NOW = 100.0
MODEL = "m"


IDLE = LoadSignal()


def pool(pool_id: str, *, rate: int = 10_000, load: LoadSignal | None = IDLE, **kw) -> PoolState:
    p = PoolState(
        pool_id=pool_id,
        listed=True,
        model=MODEL,
        region="r1",
        frontends=("http://127.0.0.1:1",),
        capacity=PoolCapacityHint(prefill_tokens_per_second=rate),
        block_size=16,
        kv_at=NOW,
        kv_sources={f"{pool_id}/relay"},
    )
    if load is not None:
        p.record_load(load, NOW)
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def order(decision) -> list[str]:
    return [c.pool_id for c in decision.candidates]


def test_each_filter_reason():
    pools = [
        pool("a", model="other"),
        pool("b", models_ready={MODEL: False}, state_at=NOW),
        pool("c", directory_draining=True),
        pool("d", telemetry_draining=True),
        pool("e", frontends=()),
        pool("f", link_backoff_until=NOW + 2.5),
        pool("g"),
        pool("h", listed=False),  # not listed: neither candidate nor filtered
    ]
    d = Selector().select(pools, MODEL, 64, 16, {}, NOW)
    assert order(d) == ["g"]
    got = {f.pool_id: f.reason for f in d.filtered}
    assert got == {
        "a": FilterReason.OTHER_MODEL,
        "b": FilterReason.NOT_READY,
        "c": FilterReason.DRAINING,
        "d": FilterReason.DRAINING,
        "e": FilterReason.NO_FRONTEND,
        "f": FilterReason.LINK_BACKOFF,
    }
    assert [f.pool_id for f in d.filtered] == sorted(got)
    assert "2.5s" in next(f.detail for f in d.filtered if f.pool_id == "f")
    assert d.model_served and d.prompt_blocks == 4


def test_stale_readiness_counts_as_ready_and_expired_backoff_is_eligible():
    p = pool("a", models_ready={MODEL: False}, state_at=NOW - 1000, link_backoff_until=NOW - 1)
    assert order(Selector().select([p], MODEL, 64, 16, {}, NOW)) == ["a"]


def test_model_served_only_by_listed_pools():
    d = Selector().select([pool("a", model="x"), pool("b", listed=False)], MODEL, 64, 16, {}, NOW)
    assert not d.model_served and d.candidates == []
    d = Selector().select([pool("a", directory_draining=True)], MODEL, 64, 16, {}, NOW)
    assert d.model_served and d.candidates == []


def test_cached_prefix_wins_when_loads_are_equal():
    pools = [pool("a"), pool("b"), pool("c")]
    d = Selector().select(pools, MODEL, 160, 16, {"b": 8, "c": 2}, NOW)
    assert order(d) == ["b", "c", "a"]
    best = d.candidates[0]
    assert best.cached_blocks == 8 and best.prompt_blocks == 10 and best.uncached_tokens == 32
    assert best.prefill_cost < d.candidates[1].prefill_cost


def test_load_beats_a_small_cache_advantage():
    busy = LoadSignal(prefill_tokens_in_flight=50_000, requests_running=4)
    pools = [pool("a", load=busy), pool("b")]
    d = Selector().select(pools, MODEL, 1600, 16, {"a": 10}, NOW)  # a caches 160 of 1600 tokens
    assert order(d) == ["b", "a"]
    assert d.candidates[1].load_cost > 0 and d.candidates[0].load_cost == 0


def test_unknown_load_ranks_behind_known_load():
    busy = LoadSignal(prefill_tokens_in_flight=10_000_000)
    missing = pool("a", load=None)
    stale = pool("b")
    stale.load_at = NOW - 10 * FreshnessLimits().load_max_age
    d = Selector().select([missing, stale, pool("c", load=busy)], MODEL, 1600, 16, {"a": 100, "b": 50}, NOW)
    assert order(d) == ["c", "a", "b"]  # the busy known pool first; unknown ones not excluded
    assert [c.load_known for c in d.candidates] == [True, False, False]
    assert d.candidates[1].load_cost == 0.0


def test_pending_spreads_a_burst():
    pools = [pool("a"), pool("b"), pool("c")]
    sel = Selector()
    chosen = []
    for _ in range(6):
        d = sel.select(pools, MODEL, 1600, 16, {"a": 2}, NOW)
        best = d.candidates[0]
        chosen.append(best.pool_id)
        next(p for p in pools if p.pool_id == best.pool_id).record_sent(best.uncached_tokens, 16)
    assert chosen[0] == "a"
    assert set(chosen) == {"a", "b", "c"}
    assert max(chosen.count(x) for x in "abc") <= 3
    # a load report resets pending
    pools[0].record_load(LoadSignal(), NOW)
    assert sel.select(pools, MODEL, 1600, 16, {"a": 2}, NOW).candidates[0].pool_id == "a"


def test_pools_of_different_capacity():
    # Same queued work: the pool that serves it four times faster is the better choice.
    load = LoadSignal(prefill_tokens_in_flight=40_000)
    pools = [pool("small", rate=5_000, load=load), pool("big", rate=20_000, load=load)]
    d = Selector(SelectionConfig(hotspot_seconds=0)).select(pools, MODEL, 1600, 16, {}, NOW)
    assert order(d) == ["big", "small"]
    assert d.candidates[1].load_cost == 4 * d.candidates[0].load_cost
    assert order(Selector().select(pools, MODEL, 1600, 16, {}, NOW)) == ["big", "small"]
    # Without a stated rate, max running requests scales the throughput.
    a = pool("slots8", rate=0, capacity=PoolCapacityHint(max_running_requests=8), load=load)
    b = pool("slots2", rate=0, capacity=PoolCapacityHint(max_running_requests=2), load=load)
    assert order(Selector().select([b, a], MODEL, 1600, 16, {}, NOW)) == ["slots8", "slots2"]


def test_weights_come_from_the_config():
    busy = LoadSignal(prefill_tokens_in_flight=3_000)
    pools = [pool("a", load=busy), pool("b")]
    cached = {"a": 100}  # a holds the whole prompt
    plain = SelectionConfig(prefill_weight=1.0, hotspot_seconds=0)
    assert order(Selector(plain).select(pools, MODEL, 1600, 16, cached, NOW)) == ["b", "a"]
    heavy = Selector(SelectionConfig(prefill_weight=4.0, hotspot_seconds=0))
    assert order(heavy.select(pools, MODEL, 1600, 16, cached, NOW)) == ["a", "b"]
    d = heavy.select(pools, MODEL, 1600, 16, cached, NOW)
    assert d.candidates[1].prefill_cost == 4.0 * 1600 / 10_000


def test_hotspot_penalty_sheds_a_long_queue_despite_a_large_cache_advantage():
    # a holds the whole 16,000-token prompt (1.6 s of prefill saved) but queues 3 s of work
    # while the others queue 1 s: linear costs keep piling onto a, the hotspot term does not.
    pools = [
        pool("a", load=LoadSignal(prefill_tokens_in_flight=30_000)),
        pool("b", load=LoadSignal(prefill_tokens_in_flight=10_000)),
        pool("c", load=LoadSignal(prefill_tokens_in_flight=10_000)),
    ]
    cached = {"a": 1000}
    linear = Selector(SelectionConfig(prefill_weight=1.5, hotspot_seconds=0))
    assert order(linear.select(pools, MODEL, 16_000, 16, cached, NOW))[0] == "a"
    cfg = SelectionConfig(prefill_weight=1.5, hotspot_seconds=1.0, hotspot_request_share=0.5)
    d = Selector(cfg).select(pools, MODEL, 16_000, 16, cached, NOW)
    assert order(d)[-1] == "a"
    # the mean queue is 5/3 s; a's excess 4/3 s adds (4/3)^2 / (1 + 0.5 T + 5/3) s to its 3 s
    # queue, T = (16,000 + 4 x 16) / 10,000 s being the request's own service time
    t = (16_000 + 4 * 16) / 10_000
    assert abs(d.candidates[-1].load_cost - (3.0 + (4 / 3) ** 2 / (1 + 0.5 * t + 5 / 3))) < 1e-9
    assert d.candidates[0].load_cost == 1.0  # below the mean: unchanged


def test_hotspot_sheds_short_requests_before_long_ones():
    # a queues 1.5 s, b and c 0.5 s (mean 5/6 s). Both requests save about 1.1 s of prefill at
    # a, more than a's extra 1 s of queue, so linear costs keep both there. The hotspot term is
    # scaled by the request's own service time: the short one (1.1 s) is shed, the long one
    # (4 s, whose prefill dwarfs the excess) stays.
    pools = [
        pool("a", load=LoadSignal(prefill_tokens_in_flight=15_000)),
        pool("b", load=LoadSignal(prefill_tokens_in_flight=5_000)),
        pool("c", load=LoadSignal(prefill_tokens_in_flight=5_000)),
    ]
    short = (11_000, {"a": 687})  # 10,992 of 11,000 tokens cached at a
    long = (40_000, {"a": 700})  # 11,200 of 40,000 tokens cached at a
    linear = Selector(SelectionConfig(prefill_weight=1.0, hotspot_seconds=0))
    for tokens, cached in (short, long):
        assert order(linear.select(pools, MODEL, tokens, 16, cached, NOW))[0] == "a"
    sel = Selector(SelectionConfig(prefill_weight=1.0, hotspot_seconds=0.25, hotspot_request_share=1.0))
    assert order(sel.select(pools, MODEL, long[0], 16, long[1], NOW))[0] == "a"
    assert order(sel.select(pools, MODEL, short[0], 16, short[1], NOW))[0] != "a"


def test_reported_work_drains_at_the_pool_throughput_since_the_report():
    # a reported 2 s of work 1.5 s ago; b reported nothing. a holds most of the prompt.
    a = pool("a", load=LoadSignal(prefill_tokens_in_flight=20_000))
    a.load_at = NOW - 1.5
    b = pool("b")
    b.load_at = NOW - 1.5
    a.record_sent(1_000, 0)  # pending work is never drained (when it arrived is unknown)
    d = Selector(SelectionConfig(hotspot_seconds=0)).select([a, b], MODEL, 8_000, 16, {"a": 400}, NOW)
    got = {c.pool_id: c for c in d.candidates}
    assert abs(got["a"].load_cost - 0.5) < 1e-9 and abs(got["a"].pending_cost - 0.1) < 1e-9
    assert order(d) == ["a", "b"]  # the holder has nearly caught up: its follower stays
    # a report older than the work it lists counts as served, never negative
    a.load_at = NOW - 2.9
    assert Selector().select([a], MODEL, 8_000, 16, {}, NOW).candidates[0].load_cost == 0.0
    # without draining, the stale report overstates the queue and sends the follower away
    stale = Selector(SelectionConfig(drain_reports=False, hotspot_seconds=0))
    a.load_at = NOW - 1.5
    assert order(stale.select([a, b], MODEL, 8_000, 16, {"a": 300}, NOW)) == ["b", "a"]
    assert order(
        Selector(SelectionConfig(hotspot_seconds=0)).select([a, b], MODEL, 8_000, 16, {"a": 300}, NOW)
    ) == [
        "a",
        "b",
    ]


def test_a_follower_stays_with_a_mildly_busier_holder():
    # the holder queues 0.3 s more than the others; the follower saves 1 s of prefill there
    pools = [pool("a", load=LoadSignal(prefill_tokens_in_flight=5_000))] + [
        pool(x, load=LoadSignal(prefill_tokens_in_flight=2_000)) for x in "bcdefgh"
    ]
    d = Selector().select(pools, MODEL, 12_000, 100, {"a": 625}, NOW)
    assert order(d)[0] == "a"


def test_equal_costs_tie_by_prefix_rendezvous_hash():
    pools = [pool(f"p{k}") for k in range(8)]
    sel = Selector()
    firsts = {
        sel.select(pools, MODEL, 1600, 16, {}, NOW, affinity_key=key).candidates[0].pool_id
        for key in range(64)
    }
    assert len(firsts) >= 6  # new prefixes spread over the pools
    again = [
        sel.select(pools, MODEL, 1600, 16, {}, NOW, affinity_key=7).candidates[0].pool_id for _ in range(3)
    ]
    assert len(set(again)) == 1  # the same prefix ties the same way


def test_pool_overlaps_takes_max_over_sources_and_ignores_stale_kv():
    idx = KvIndex()
    idx.apply_snapshot("a/r1", [1, 2])
    idx.apply_snapshot("a/r2", [1, 2, 3])
    idx.apply_snapshot("b/r1", [1, 2, 3])
    a = pool("a", kv_sources={"a/r1", "a/r2"})
    b = pool("b", kv_sources={"b/r1"}, kv_at=NOW - 1000)
    c = pool("c", kv_sources=set())
    limits = FreshnessLimits()
    assert pool_overlaps(idx, [a, b, c], [1, 2, 3, 4], NOW, limits) == {"a": 3, "b": 0, "c": 0}


def test_filter_reason_names_match_the_proto_enum():
    from globalrouter.v1 import router_pb2

    for reason in FilterReason:
        assert router_pb2.FilterReason.Value(f"FILTER_REASON_{reason.name}") == reason.value


def test_fast_ranked_pool_constructor_matches_the_dataclass():
    from globalrouter.selection import RankedPool, _new_ranked

    values = ("p", 1.5, 0.25, 0.75, 0.5, 3, 10, False, "r", 100)
    assert _new_ranked(*values) == RankedPool(*values)
    assert repr(_new_ranked(*values)) == repr(RankedPool(*values))


def test_an_adapter_request_goes_only_to_pools_serving_the_adapter():
    pools = [
        pool("a", adapters={MODEL: frozenset({"sql"})}),
        pool("b", adapters={MODEL: frozenset({"chat"})}),
        pool("c"),  # no readiness report naming adapters: not known to serve it
        pool("d", model="other", adapters={"other": frozenset({"sql"})}),
    ]
    d = Selector().select(pools, MODEL, 64, 16, {}, NOW, adapter="sql")
    assert order(d) == ["a"] and d.model_served
    got = {f.pool_id: (f.reason, f.detail) for f in d.filtered}
    assert got["b"] == (
        FilterReason.ADAPTER_NOT_SERVED,
        "does not serve adapter 'sql' of 'm' (it lists chat)",
    )
    assert got["c"] == (
        FilterReason.ADAPTER_NOT_SERVED,
        "does not serve adapter 'sql' of 'm' (it lists none)",
    )
    assert got["d"][0] is FilterReason.OTHER_MODEL
    # The base model's requests go anywhere; an adapter no pool serves is not served at all.
    assert {c.pool_id for c in Selector().select(pools, MODEL, 64, 16, {}, NOW).candidates} == {"a", "b", "c"}
    none = Selector().select(pools, MODEL, 64, 16, {}, NOW, adapter="nope")
    assert not none.model_served and none.candidates == []

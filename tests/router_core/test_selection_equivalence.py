"""The vectorised selection (PoolColumns, Ranking, PoolOverlaps) against the per-pool Python rule it
replaced (tests/router_core/selection_reference.py): the same decisions on many random fleets.

Equality is exact (RankedPool's floats compare with ==): the vectorised code does the same float
operations in the same order, and the hotspot mean is Python's sum, as in the rule.
"""

from __future__ import annotations

import copy
import gc
import random
from typing import Any

import numpy as np
import pytest

from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import KvSummary, _Probe, mix
from globalrouter.pool_state import (
    BLOCKED,
    COLUMNS,
    FLAGS,
    KV_AT,
    LISTED,
    LOAD_AT,
    LOAD_DECODE,
    LOAD_PREFILL,
    LOAD_PRESENT,
    NOT_READY,
    PEND_DECODE,
    PEND_PREFILL,
    SLOTS,
    STATE_AT,
    FreshnessLimits,
    LoadSignal,
    PoolCapacityHint,
    PoolState,
)
from globalrouter.selection import Decision, PoolOverlaps, Ranking, SelectionConfig, Selector, pool_overlaps
from globalrouter.wait_slo import WaitSlo
from tests.router_core.selection_reference import ReferenceSelector, reference_pool_overlaps

NOW = 1000.0
MODELS = ("m", "m", "m", "n")
REGIONS = ("r1", "r2", "r3")


def random_pool(rng: random.Random, k: int) -> PoolState:
    """A pool with every signal random: unknown, stale or fresh, filtered for any reason or not."""
    p = PoolState(pool_id=f"p{k:03d}")
    p.listed = rng.random() < 0.92
    p.model = rng.choice(MODELS)
    p.region = rng.choice(REGIONS)
    p.frontends = () if rng.random() < 0.05 else ("http://h:1",)
    p.directory_draining = rng.random() < 0.04
    p.telemetry_draining = rng.random() < 0.04
    p.capacity = PoolCapacityHint(
        max_running_requests=rng.choice((0, 0, 8, 32)),
        prefill_tokens_per_second=rng.choice((0, 0, 5_000, 12_000, 40_000)),
    )
    p.block_size = rng.choice((16, 16, 16, 32, 0))
    p.models_ready = rng.choice(({}, {}, {p.model: True}, {p.model: False}, {"other": True}))
    p.state_at = rng.choice((None, NOW - rng.uniform(0, 60)))
    if rng.random() < 0.3:
        p.adapters = {p.model: frozenset(rng.sample(("a1", "a2", "a3"), rng.randint(0, 2)))}
    if rng.random() < 0.85:
        p.record_load(
            LoadSignal(
                requests_running=rng.randint(0, 9),
                prefill_tokens_in_flight=rng.choice((0, 0, rng.randint(1, 200_000))),
                decode_tokens_in_flight=rng.choice((0, rng.randint(1, 50_000))),
                max_running_requests=rng.choice((0, 16, 64)),
            ),
            NOW - rng.choice((0.0, rng.uniform(0, 5))),
        )
    for _ in range(rng.choice((0, 0, 1, 3))):
        p.record_sent(rng.randint(0, 20_000), rng.randint(0, 500))
    p.link_backoff_until = rng.choice((0.0, 0.0, NOW + rng.uniform(-5, 5)))
    p.kv_at = rng.choice((None, NOW - rng.uniform(0, 40), NOW))
    p.kv_sources = {f"p{k:03d}/relay-{r}" for r in range(rng.randint(0, 2))}
    return p


def twin(rng: random.Random, p: PoolState, k: int) -> PoolState:
    """A pool whose signals equal `p`'s (its costs tie with p's: the tie-break decides)."""
    q = copy.copy(p)
    q.pool_id = f"p{k:03d}"
    q.kv_sources = {s.replace(p.pool_id, q.pool_id) for s in p.kv_sources}
    return q


def random_fleet(rng: random.Random) -> list[PoolState]:
    n = rng.choice((0, 1, 2, 5, 12, 40, 90))
    if rng.random() < 0.2:  # idle identical pools: everything ties
        base = PoolState(
            pool_id="p000",
            listed=True,
            model="m",
            region="r1",
            frontends=("http://h:1",),
            block_size=16,
            kv_at=NOW,
        )
        base.record_load(LoadSignal(), NOW)
        return [base, *(twin(rng, base, k) for k in range(1, n + 1))]
    pools: list[PoolState] = []
    for k in range(n):
        if pools and rng.random() < 0.15:
            pools.append(twin(rng, rng.choice(pools), k))
        else:
            pools.append(random_pool(rng, k))
    return pools


def random_config(rng: random.Random) -> SelectionConfig:
    return SelectionConfig(
        freshness=rng.choice((FreshnessLimits(), FreshnessLimits(load_max_age=1.0, state_max_age=10.0))),
        prefill_weight=rng.choice((1.0, 1.3, 2.0)),
        load_weight=rng.choice((1.0, 0.7)),
        drain_reports=rng.random() < 0.7,
        pending_weight=rng.choice((1.0, 1.5)),
        decode_weight=rng.choice((4.0, 1.0)),
        hotspot_seconds=rng.choice((0.25, 0.25, 0.0, 1.0)),
        hotspot_request_share=rng.choice((0.6, 0.0)),
        wait_slo=rng.choice((None, None, WaitSlo(target_seconds=rng.choice((0.5, 2.0))))),
    )


def same(new: Decision, old: Decision) -> None:
    assert isinstance(new.candidates, Ranking)
    assert list(new.candidates) == list(old.candidates)
    assert new.filtered == old.filtered
    assert new.prompt_blocks == old.prompt_blocks
    assert new.model_served == old.model_served
    for c in new.candidates:  # plain Python values, as the rule built them
        assert type(c.total_cost) is float and type(c.cached_blocks) is int and type(c.load_known) is bool


@pytest.mark.parametrize("seed", range(60))
def test_select_matches_the_per_pool_rule(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(12):
        pools = random_fleet(rng)
        config = random_config(rng)
        new, old = Selector(config), ReferenceSelector(config)
        for _ in range(6):
            prompt = rng.choice((0, 5, 16, 100, 1600, 16_000))
            max_tokens = rng.choice((0, 16, 300))
            cached = {p.pool_id: rng.randint(0, prompt // 8 + 3) for p in pools if rng.random() < 0.6}
            if pools and rng.random() < 0.3:  # a pool ranked only by cache: equal costs otherwise
                cached[rng.choice(pools).pool_id] = 10**6
            regions = rng.choice((None, None, frozenset({"r1", "r2"}), frozenset(), frozenset({"r3", "x"})))
            adapter = rng.choice(("", "", "", "a1", "zz"))
            model = rng.choice(("m", "m", "n", "absent"))
            now = NOW + rng.choice((0.0, 0.5, 3.0))
            observe = rng.random() < 0.8
            key = rng.getrandbits(64)
            args = (model, prompt, max_tokens, cached, now)
            kw: dict[str, Any] = dict(affinity_key=key, observe=observe, regions=regions, adapter=adapter)
            same(new.select(pools, *args, **kw), old.select(pools, *args, **kw))
            if new.wait_price is not None:
                assert old.wait_price is not None
                assert new.wait_price.excess_weight == old.wait_price.excess_weight
                assert new.wait_price.observations == old.wait_price.observations
            # the pools passed as any iterable, and the cached blocks as PoolOverlaps
            ov = PoolOverlaps(
                pools,
                np.array([p.row for p in pools], np.int64),
                np.array([cached.get(p.pool_id, 0) for p in pools], np.int64),
            )
            kw["observe"] = False
            same(
                new.select(iter(pools), model, prompt, max_tokens, ov, now, **kw),
                old.select(pools, *args, **kw),
            )


def test_ties_are_broken_by_the_rendezvous_hash_like_the_rule() -> None:
    rng = random.Random(7)
    base = PoolState(
        pool_id="q0", listed=True, model="m", region="r", frontends=("h",), block_size=16, kv_at=NOW
    )
    pools = [base, *(twin(rng, base, k) for k in range(1, 300))]
    for key in range(20):
        new = Selector().select(pools, "m", 1000, 10, {}, NOW, affinity_key=key)
        old = ReferenceSelector().select(pools, "m", 1000, 10, {}, NOW, affinity_key=key)
        same(new, old)
    firsts = {
        Selector().select(pools, "m", 1000, 10, {}, NOW, affinity_key=k).candidates[0].pool_id
        for k in range(50)
    }
    assert len(firsts) > 20  # spread, not the listing order


def test_ranking_reads_like_a_list_and_builds_lazily() -> None:
    pools = [
        PoolState(pool_id=f"x{k}", listed=True, model="m", frontends=("h",), block_size=16, kv_at=NOW)
        for k in range(5)
    ]
    ranking = Selector().select(pools, "m", 160, 1, {"x3": 10}, NOW).candidates
    assert isinstance(ranking, Ranking)
    assert ranking[0].pool_id == "x3" and ranking[-1] is ranking[len(ranking) - 1]
    assert ranking._built.count(None) == 3  # only what was read
    assert [c.pool_id for c in ranking[1:3]] == [c.pool_id for c in list(ranking)[1:3]]
    assert ranking == list(ranking) and len(ranking) == 5 and ranking[0] is next(iter(ranking))
    with pytest.raises(IndexError):
        ranking[5]
    assert Selector().select([], "m", 160, 1, {}, NOW).candidates == []


def test_columns_follow_every_write_and_rows_are_reused() -> None:
    c = COLUMNS
    p = PoolState(pool_id="c1", listed=True, model="m", kv_at=5.0, frontends=("h",))
    row = p.row
    assert c.ids[row] == "c1" and c.i[FLAGS, row] == LISTED and c.f[KV_AT, row] == 5.0
    assert np.isnan(c.f[LOAD_AT, row]) and np.isnan(c.f[STATE_AT, row])
    p.record_load(
        LoadSignal(prefill_tokens_in_flight=7, decode_tokens_in_flight=3, max_running_requests=4), 9.0
    )
    p.record_sent(11, 2)
    assert c.f[[LOAD_PREFILL, LOAD_DECODE, LOAD_AT, PEND_PREFILL, PEND_DECODE, SLOTS], row].tolist() == [
        7,
        3,
        9,
        11,
        2,
        4,
    ]
    assert c.i[FLAGS, row] & LOAD_PRESENT
    p.capacity = PoolCapacityHint(max_running_requests=6)  # the stated slots before the report's
    assert c.f[SLOTS, row] == 6
    p.models_ready = {"m": False}
    assert c.i[FLAGS, row] & NOT_READY
    p.models_ready = {"m": True}
    assert not c.i[FLAGS, row] & NOT_READY
    p.model = "z"  # Ready is the pool's own model's
    assert c.i[FLAGS, row] & NOT_READY
    p.telemetry_draining = True
    assert c.i[FLAGS, row] & BLOCKED
    p.telemetry_draining = False
    assert not c.i[FLAGS, row] & BLOCKED
    p.frontends = ()
    assert c.i[FLAGS, row] & BLOCKED
    q = copy.copy(p)
    q_row = q.row
    assert q_row != row and c.ids[q_row] == "c1"
    q.listed = False
    assert c.i[FLAGS, row] & LISTED and not c.i[FLAGS, q_row] & LISTED
    p.row = 12345  # owned by the store
    assert p.row == row
    del p, q
    gc.collect()
    # Both rows went back to the store (the collection may free other tests' pools too, so
    # which freed row the next pool takes depends on what ran before: any of them, reset).
    freed = set(c._free)
    assert {row, q_row} <= freed
    r = PoolState(pool_id="c2")  # takes a freed row
    assert r.row in freed and c.ids[r.row] == "c2" and c.i[FLAGS, r.row] == BLOCKED


def test_throughput_is_the_rate_select_uses() -> None:
    rng = random.Random(5)
    pools = [random_pool(rng, k) for k in range(200)]
    selector = Selector(SelectionConfig(tokens_per_second_per_slot=900.0, default_tokens_per_second=7000.0))
    rates = selector._rates(COLUMNS.f[:, [p.row for p in pools]])
    assert rates.tolist() == [selector.throughput(p) for p in pools]


def summary_fleet(
    rng: random.Random, n: int, prompt: list[int]
) -> tuple[KvSummary, KvIndex, list[PoolState]]:
    summary, exact = KvSummary(), KvIndex()
    pools = []
    for k in range(n):
        held = prompt[: rng.choice((0, 1, 3, len(prompt) // 2, len(prompt)))]
        own = [rng.getrandbits(64) for _ in range(rng.randint(0, 30))]
        sources = [f"s{k:02d}/relay-{r}" for r in range(rng.randint(0, 2))]
        for s in sources:
            summary.apply_snapshot(s, own + held)
            exact.apply_snapshot(s, own + held)
        p = PoolState(pool_id=f"s{k:02d}", listed=True, model="m", kv_sources=set(sources))
        p.kv_at = rng.choice((None, NOW, NOW - 100.0))
        pools.append(p)
    return summary, exact, pools


@pytest.mark.parametrize("seed", range(20))
def test_pool_overlaps_match_the_per_source_rule(seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.getrandbits(64) for _ in range(40)]
    summary, exact, pools = summary_fleet(rng, rng.randint(1, 30), prompt)
    limits = FreshnessLimits()
    for index in (summary, exact):
        for hashes in (prompt, prompt[:7], [rng.getrandbits(64), *prompt[1:]], []):
            got = pool_overlaps(index, pools, hashes, NOW, limits)
            assert dict(got) == reference_pool_overlaps(index, pools, hashes, NOW, limits)  # type: ignore[arg-type]


def test_pool_overlaps_see_sources_change_in_place() -> None:
    """The telemetry ingest adds and discards kv_sources in place: the cached table of a pool
    (PoolColumns.kv_table) follows."""
    summary = KvSummary()
    prompt = [11, 22, 33]
    summary.apply_snapshot("a/relay-0", prompt)
    pool = PoolState(pool_id="a", listed=True, model="m", kv_at=NOW)
    limits = FreshnessLimits()
    assert pool_overlaps(summary, [pool], prompt, NOW, limits)["a"] == 0  # no source yet
    pool.kv_sources.add("a/relay-0")
    assert pool_overlaps(summary, [pool], prompt, NOW, limits)["a"] == 3
    pool.kv_sources.discard("a/relay-0")
    assert pool_overlaps(summary, [pool], prompt, NOW, limits)["a"] == 0
    pool.kv_sources |= {"a/relay-0"}
    assert pool_overlaps(summary, [pool], prompt, NOW, limits)["a"] == 3
    other = KvSummary()  # another summary: looked up again
    other.apply_snapshot("a/relay-0", prompt[:1])
    assert pool_overlaps(other, [pool], prompt, NOW, limits)["a"] == 1
    assert pool_overlaps(summary, [pool], prompt, NOW, limits)["a"] == 3


def test_prefix_lengths_with_one_and_several_table_sizes() -> None:
    """The benchmark's fleet shape (pools of one size: one probe group), plus a pool of another."""
    rng = np.random.default_rng(3)
    summary = KvSummary()
    prompt = rng.integers(0, 2**64 - 1, 64, dtype=np.uint64)
    for k in range(40):
        held = 64 >> (k % 8)
        own = np.concatenate((rng.integers(0, 2**64 - 1, 300 - held, dtype=np.uint64), prompt[:held]))
        summary.apply_snapshot(f"f{k}/relay-0", own)
    # one pool of another size: the probe groups pools by size
    other = np.concatenate((rng.integers(0, 2**64 - 1, 5000, dtype=np.uint64), prompt))
    summary.apply_snapshot("f40/relay-0", other)
    lengths = summary.pool_lengths(prompt.tolist())
    assert lengths is not None and summary.pool_lengths([12345]) is None
    for k in range(41):
        p = summary.table_of(f"f{k}/relay-0")
        want = 64 if k == 40 else 64 >> (k % 8)
        assert lengths[p] == want


@pytest.mark.parametrize("seed", range(8))
def test_prefix_search_by_size_matches_the_per_element_probe(seed: int) -> None:
    """_Probe's shared-size paths (the search's gathers, verify's pool x block grid) against
    probing every (pool, block) on its own, on pools with holes in their prefixes."""
    rng = np.random.default_rng(seed)
    summary = KvSummary()
    prompt = rng.integers(0, 2**64 - 1, 200, dtype=np.uint64)
    sizes = (1000,) if seed % 2 else (1000, 1000, 3000)
    for k in range(60):
        held = prompt[: rng.integers(0, 201)]
        holes = rng.random(held.size) < rng.choice((0.0, 0.01, 0.2))
        own = rng.integers(0, 2**64 - 1, 300, dtype=np.uint64)
        summary.expect_pool(f"h{k}", sizes[k % len(sizes)])  # tables of one size (or of two)
        summary.apply_snapshot(f"h{k}/relay-0", np.concatenate((own, held[~holes])))
    for n in (200, 37, 1):
        hashes = prompt[:n].tolist()
        pools, lengths = summary._prefix_lengths(hashes)
        h = mix(np.array(hashes, np.uint64))
        lo = np.ones(pools.size, np.int64)
        for i, p in enumerate(pools.tolist()):  # the search's bound, one pool at a time
            a, b = 1, n
            while a < b:
                mid = (a + b + 1) >> 1
                ok = summary._held(np.array([p]), h[mid - 1 : mid])[0]
                a, b = (mid, b) if ok else (a, mid - 1)
            lo[i] = a
        slow = _Probe(summary, pools, h)
        slow._flat = None  # every probe on its own
        assert lengths.tolist() == summary._verify(pools, lo, h, slow).tolist()


def test_names_past_the_code_bound_are_decided_by_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Model and region codes are bounded (MAX_CODES): pools whose names got none are filtered
    and ranked exactly as the rule says."""
    monkeypatch.setattr("globalrouter.pool_state.MAX_CODES", len(COLUMNS._codes))
    rng = random.Random(11)
    pools = [random_pool(rng, k) for k in range(30)]
    for k, p in enumerate(pools[:10]):
        p.model = f"late-model-{k % 2}"
        p.region = f"late-region-{k}"
    assert all(COLUMNS.i[0, p.row] == -2 for p in pools[:10])
    for model in ("late-model-0", "m", "never"):
        for regions in (None, frozenset({"late-region-2", "r1"})):
            new = Selector().select(pools, model, 1600, 10, {}, NOW, regions=regions)
            same(new, ReferenceSelector().select(pools, model, 1600, 10, {}, NOW, regions=regions))

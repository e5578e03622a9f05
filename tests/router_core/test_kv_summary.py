"""KvSummary: per-pool fingerprint tables (insert, remove, snapshots, sources of one pool), the
longest-prefix search with holes, doubling, the false-positive rate, and agreement with KvIndex."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from globalrouter.cli import main
from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import MAX_LOST, MIN_BUCKETS, KvSummary, default_pool_of, mix
from globalrouter.simulate import SimConfig, simulate
from globalrouter.trace import SyntheticTraceSpec, synthetic_trace, write_trace


def _keys(n: int, seed: int = 0) -> list[int]:
    return [int(k) for k in np.random.default_rng(seed).integers(0, 2**64, n, dtype=np.uint64)]


def test_snapshot_delta_and_counts():
    s = KvSummary()
    keys = _keys(3000)
    s.apply_snapshot("a/r0", keys[:1000])
    s.apply_snapshot("b/r0", keys[:10])
    assert s.block_count("a/r0") == 1000 and s.block_count("b/r0") == 10
    assert s.pool_block_count("a") == 1000 and s.block_count("nobody/r") == 0
    s.apply_delta("a/r0", keys[1000:1500], keys[:100])
    # The table doubled (1,400 blocks in a table sized for 1,000); every block stored has its
    # entry, even one sharing a row and a fingerprint with a held block.
    held = s.block_count("a/r0")
    assert held == 1400 and s.stats().doublings == 1 and s.stats().dropped_blocks == 0
    assert all(s.pool_holds("a", k) for k in keys[100:1500])
    assert not s.pool_holds("a", keys[0]) and not s.pool_holds("a", keys[99])
    # removing an absent block changes nothing (a store is a 0->1 transition: a relay never
    # repeats one, and a repeat would add an entry)
    s.apply_delta("a/r0", (), keys[:100])
    assert s.block_count("a/r0") == held
    # a delta that removes then re-stores a block leaves it held
    s.apply_delta("a/r0", [keys[5]], [keys[5]])
    assert s.pool_holds("a", keys[5]) and s.block_count("a/r0") == held + 1
    # a snapshot replaces the whole set
    s.apply_snapshot("a/r0", keys[2000:2100])
    assert s.block_count("a/r0") == 100 and not s.pool_holds("a", keys[1200])
    assert s.total_blocks() == 110
    assert s.sources() == ["a/r0", "b/r0"] and s.pools() == ["a", "b"]


def test_prefix_overlaps_per_source_like_the_exact_index():
    keys = _keys(2000, 1)
    s, x = KvSummary(), KvIndex()
    for index in (s, x):
        index.apply_snapshot("p1/r", keys[:1000])
        index.apply_snapshot("p2/r", keys[:300])
        index.apply_snapshot("p3/r", keys[1000:])
    assert s.prefix_overlaps(keys[:1000]) == x.prefix_overlaps(keys[:1000]) == {"p1/r": 1000, "p2/r": 300}
    assert s.prefix_overlaps(keys[:1]) == {"p1/r": 1, "p2/r": 1}
    assert s.prefix_overlaps(keys[1000:1005]) == {"p3/r": 5}
    assert s.prefix_overlaps([]) == {} and s.prefix_overlaps(_keys(5, 9)) == {}
    assert s.holds(keys[0]) and not s.holds(_keys(1, 9)[0])
    assert s.pool_prefixes(keys[:500]) == {"p1": 500, "p2": 300}


def test_holes_the_binary_search_would_miss_are_found_by_the_check():
    keys = _keys(1000, 2)
    s = KvSummary()
    s.apply_snapshot("front/r", keys[1:])  # first block evicted (an LRU evicts it first)
    s.apply_snapshot("middle/r", keys[:400] + keys[401:])  # a hole at 400, the rest held
    s.apply_snapshot("full/r", keys)
    assert s.prefix_overlaps(keys) == {"middle/r": 400, "full/r": 1000}


def test_unchecked_pools_are_never_credited_more_than_the_checked_ones():
    keys = _keys(1000, 3)
    s = KvSummary(verify_top=1)
    s.apply_snapshot("holey/r", keys[:10] + keys[11:])  # the search says 1000, truly 10
    s.apply_snapshot("good/r", keys[:600])
    s.apply_snapshot("other/r", keys[:300] + keys[301:500])  # the search says 500, truly 300
    got = s.pool_prefixes(keys)
    # holey checked first (bound 1000 -> 10), then good (600): one checked pool now reaches
    # every unchecked bound (other's 500), so other keeps its bound, below good's 600
    assert got["holey"] == 10 and got["good"] == 600
    assert got["other"] == 500 <= got["good"]
    s.verify_top = 3
    assert s.pool_prefixes(keys) == {"holey": 10, "good": 600, "other": 300}


def test_sources_of_one_pool_share_its_set():
    keys = _keys(100, 4)
    s = KvSummary()
    s.apply_snapshot("p/r0/1#1", keys[:50])
    s.apply_snapshot("p/r1/1#2", keys[:50])  # the same pool-level set from the other replica
    assert s.block_count("p/r0/1#1") == s.block_count("p/r1/1#2") == 50
    s.apply_delta("p/r0/1#1", keys[50:60], [])  # r1 fed last: r0's delta is skipped
    s.apply_delta("p/r1/1#2", keys[50:55], [])
    assert s.pool_block_count("p") == 55
    assert s.stats().skipped_deltas == 10
    assert s.prefix_overlaps(keys[:70]) == {"p/r0/1#1": 55, "p/r1/1#2": 55}
    s.drop_source("p/r1/1#2")  # the feeder leaves: the set stays, r0 feeds it now
    assert s.pool_block_count("p") == 55 and s.prefix_overlaps(keys[:70]) == {"p/r0/1#1": 55}
    s.apply_delta("p/r0/1#1", keys[55:60], [])
    assert s.pool_block_count("p") == 60
    s.drop_source("p/r0/1#1")  # the last source leaves: the set goes
    assert s.pool_block_count("p") == 0 and s.prefix_overlaps(keys) == {} and s.sources() == []
    s.drop_source("p/r0/1#1")  # unknown now: nothing to do


def test_tables_double_and_keep_every_block():
    keys = _keys(3000, 5)
    s = KvSummary()
    s.apply_snapshot("p/r", [])  # the smallest table: 64 rows of 2 slots (5 doublings: 4,096)
    for at in range(0, len(keys), 100):
        s.apply_delta("p/r", keys[at : at + 100], [])
    stats = s.stats()
    assert stats.doublings == 5 and stats.dropped_blocks == 0 and int(s._lost[0]) == 5
    assert s.block_count("p/r") == len(keys)
    assert s.prefix_overlaps(keys) == {"p/r": len(keys)}
    # a snapshot rebuilds at full precision, sized for it
    s.apply_snapshot("p/r", keys)
    assert int(s._lost[0]) == 0 and s.block_count("p/r") == len(keys)
    assert s.table_bytes() <= 2.7 * len(keys)


def test_past_max_lost_doublings_blocks_are_dropped_and_counted():
    keys = _keys(20_000, 5)
    s = KvSummary()
    s.apply_snapshot("p/r", [])
    for at in range(0, len(keys), 500):
        s.apply_delta("p/r", keys[at : at + 500], [])
    stats = s.stats()
    assert stats.doublings == MAX_LOST and stats.dropped_blocks > 0
    assert stats.entries + stats.dropped_blocks <= len(keys)


def test_expect_sizes_the_table_so_deltas_do_not_double_it():
    keys = _keys(10_000, 6)
    s = KvSummary()
    s.expect("p/r", 10_000)
    for at in range(0, len(keys), 100):
        s.apply_delta("p/r", keys[at : at + 100], [])
    assert s.stats().doublings == 0 and s.block_count("p/r") == 10_000
    assert s.table_bytes() / 10_000 < 3


def test_false_positive_rate_is_within_the_design_bound():
    held, other = _keys(200_000, 7), _keys(200_000, 8)
    s = KvSummary()
    s.apply_snapshot("p/r", held)
    assert all(s.pool_holds("p", k) for k in held[:2000])
    pools = np.zeros(len(other), np.int64)
    rate = float(s._held(pools, mix(np.array(other, np.uint64))).mean())
    # two rows of 2 slots at a load of at most 0.75, 15-bit fingerprints: 4 * 0.75 / 2^15
    assert rate <= 4 * 0.75 / 2**15
    assert s.table_bytes() / len(held) < 2.7


def test_arena_compaction_keeps_every_pool():
    keys = _keys(5000, 10)
    s = KvSummary()
    for round_ in range(6):
        for k in range(10):
            s.apply_snapshot(f"p{k}/r", keys[: 500 * (k % 5 + 1) - round_])
        for k in range(0, 10, 2):
            s.drop_source(f"p{k}/r")
    assert s.pools() == [f"p{k}" for k in range(1, 10, 2)]
    assert s.pool_prefixes(keys) == {f"p{k}": 500 * (k % 5 + 1) - 5 for k in range(1, 10, 2)}
    assert s.memory_bytes() <= 4 * s.table_bytes()


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="does not name its pool"):
        default_pool_of("lonely")
    with pytest.raises(ValueError, match="verify_top"):
        KvSummary(verify_top=0)
    with pytest.raises(ValueError, match="expected blocks"):
        KvSummary().expect("p/r", -1)
    assert default_pool_of("pool-1/relay-a/3#7") == "pool-1" and default_pool_of("p/r") == "p"


UNIVERSE = list(range(48))
"""Block hashes of the property test: no two share a fingerprint in a row pair of the 64-bucket
tables they live in (checked below), so the summary must answer exactly what KvIndex does."""


def test_universe_has_no_fingerprint_collision():
    s = KvSummary()
    s.apply_snapshot("p/r", UNIVERSE)
    assert int(s._nb[0]) == MIN_BUCKETS
    b1, b2, v = s._locate(0, mix(np.array(UNIVERSE, np.uint64)))
    seen: set[tuple[int, int]] = set()
    for a, b, f in zip(b1.tolist(), b2.tolist(), v.tolist(), strict=True):
        for pair in ((a, f), (b, f)):
            assert pair not in seen
        seen.update(((a, f), (b, f)))


_ops = st.lists(
    st.tuples(
        st.sampled_from(["snapshot", "delta", "drop"]),
        st.integers(0, 2),
        st.lists(st.sampled_from(UNIVERSE), max_size=30),
        st.lists(st.sampled_from(UNIVERSE), max_size=30),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(_ops, st.lists(st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=40), min_size=1, max_size=5))
def test_matches_the_exact_index_one_source_per_pool(ops, prompts):
    s, x = KvSummary(), KvIndex()
    held: dict[str, set[int]] = {}
    for op, pool, a, b in ops:
        source = f"pool{pool}/relay"
        # A delta is 0<->1 transitions (what a relay sends, numbered): removals of held blocks,
        # then stores of blocks not held after them.
        have = held.setdefault(source, set())
        removed = sorted(set(b) & have)
        stored = sorted(set(a) - (have - set(removed)))
        for index in (s, x):
            if op == "snapshot":
                index.apply_snapshot(source, a)
            elif op == "delta":
                index.apply_delta(source, stored, removed)
            else:
                index.drop_source(source)
        if op == "snapshot":
            held[source] = set(a)
        elif op == "delta":
            held[source] = (have - set(removed)) | set(stored)
        else:
            held[source] = set()
    for pool in range(3):
        assert s.block_count(f"pool{pool}/relay") == x.block_count(f"pool{pool}/relay")
    for prompt in prompts:
        assert s.prefix_overlaps(prompt) == x.prefix_overlaps(prompt)
        assert s.holds(prompt[0]) == x.holds(prompt[0])


def test_simulator_runs_on_either_kv_state(tmp_path, capsys):
    trace = synthetic_trace(SyntheticTraceSpec(requests=300, seed=3))
    exact = simulate(trace, SimConfig(pools=4, capacity_blocks=200))
    summary = simulate(trace, SimConfig(pools=4, capacity_blocks=200, kv_state="summary"))
    # 4 pools, every one checked block by block: the two see the same prefixes (no false
    # positive among these few blocks is likely, and a few would move the figure by little)
    assert summary.share_of_ideal == pytest.approx(exact.share_of_ideal, abs=0.01)
    with pytest.raises(ValueError, match="kv_state"):
        simulate(trace, SimConfig(kv_state="bloom"))
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    assert main(["simulate", "--trace", str(path), "--pools", "4", "--kv-state", "summary", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 300

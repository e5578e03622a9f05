"""KvIndex: one-pass prefix overlaps across sources, snapshots, deltas, dropping a source."""

from __future__ import annotations

import random

from globalrouter.kv_index import KvIndex


class CountingList(list):
    """A prompt that counts how often its items are read (to prove one pass)."""

    reads = 0

    def __getitem__(self, i):
        CountingList.reads += 1
        return super().__getitem__(i)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


def test_overlaps_several_sources():
    idx = KvIndex()
    idx.apply_snapshot("a", [1, 2, 3, 4])
    idx.apply_snapshot("b", [1, 2])
    idx.apply_snapshot("c", [9])
    idx.apply_snapshot("d", [2, 3, 4])  # holds later blocks but not the first: no prefix
    assert idx.prefix_overlaps([1, 2, 3, 5]) == {"a": 3, "b": 2}
    assert idx.prefix_overlaps([1, 2, 3, 4]) == {"a": 4, "b": 2}
    assert idx.prefix_overlaps([9, 1]) == {"c": 1}
    assert idx.prefix_overlaps([7]) == {}
    assert idx.prefix_overlaps([]) == {}
    assert idx.block_count("a") == 4 and idx.block_count("zzz") == 0


def test_one_pass_over_the_prompt_whatever_the_number_of_sources():
    idx = KvIndex()
    prompt = list(range(100))
    for s in range(40):
        idx.apply_snapshot(f"s{s}", prompt[: s + 1])
    counted = CountingList(prompt)
    CountingList.reads = 0
    out = idx.prefix_overlaps(counted)
    assert out == {f"s{s}": s + 1 for s in range(40)}
    # the prompt is read once (its first block, then one conversion), not once per source
    assert CountingList.reads <= len(prompt) + 1


def test_deltas_and_snapshot_replacement():
    idx = KvIndex()
    idx.apply_snapshot("a", [1, 2, 3])
    idx.apply_delta("a", stored=[4], removed=[2])
    assert idx.prefix_overlaps([1, 2, 3, 4]) == {"a": 1}
    assert idx.block_count("a") == 3
    idx.apply_delta("a", stored=[2], removed=[2])  # removed first, then stored: held
    assert idx.prefix_overlaps([1, 2, 3, 4]) == {"a": 4}
    idx.apply_delta("a", stored=[], removed=[99])  # removing an unknown block is harmless
    idx.apply_snapshot("a", [7, 8])  # a new snapshot replaces the set
    assert idx.prefix_overlaps([1, 2]) == {}
    assert idx.prefix_overlaps([7, 8]) == {"a": 2}
    assert idx.block_count("a") == 2
    assert idx.total_blocks() == 2


def test_drop_source_clears_only_its_state_and_bits_are_reused():
    idx = KvIndex()
    idx.apply_snapshot("pool-a/relay-1", [1, 2, 3])
    idx.apply_snapshot("pool-a/relay-2", [1, 2])
    idx.apply_snapshot("pool-b/relay-1", [1])
    idx.drop_source("pool-a/relay-1")
    assert idx.prefix_overlaps([1, 2, 3]) == {"pool-a/relay-2": 2, "pool-b/relay-1": 1}
    assert idx.block_count("pool-a/relay-1") == 0
    idx.drop_source("never-seen")
    idx.apply_snapshot("pool-c/relay-1", [1, 2, 3])  # takes the freed bit
    assert idx.prefix_overlaps([1, 2, 3]) == {
        "pool-a/relay-2": 2,
        "pool-b/relay-1": 1,
        "pool-c/relay-1": 3,
    }
    assert idx.sources() == ["pool-a/relay-2", "pool-b/relay-1", "pool-c/relay-1"]
    for s in idx.sources():
        idx.drop_source(s)
    assert idx.total_blocks() == 0


def reference_overlaps(sets: dict[str, set[int]], prompt: list[int]) -> dict[str, int]:
    out = {}
    for source, blocks in sets.items():
        n = 0
        while n < len(prompt) and prompt[n] in blocks:
            n += 1
        if n:
            out[source] = n
    return out


def test_matches_a_set_per_source_through_growth_tombstones_and_many_sources():
    # Random snapshots, deltas and drops over 70 sources (two mask words), with keys small and
    # large (the empty-slot key 2^64-1 included), enough blocks to rebuild the table several
    # times, and prompts longer than the first vectorised step: every answer must equal a plain
    # set-per-source model's.
    rng = random.Random(7)
    universe = [rng.randrange(1 << 64) for _ in range(3000)] + list(range(500)) + [(1 << 64) - 1]
    idx = KvIndex()
    sets: dict[str, set[int]] = {}
    chains = [rng.sample(universe, 300) for _ in range(6)]
    for step in range(1500):
        source = f"s{rng.randrange(70)}"
        op = rng.random()
        if op < 0.05:
            blocks = set(rng.sample(universe, rng.randrange(0, 400)))
            idx.apply_snapshot(source, list(blocks))
            sets[source] = blocks
        elif op < 0.08:
            idx.drop_source(source)
            sets.pop(source, None)
        else:
            held = sets.setdefault(source, set())
            if source not in idx.sources():
                idx.apply_snapshot(source, [])
            chain = rng.choice(chains)
            stored = chain[: rng.randrange(1, 300)] if rng.random() < 0.5 else rng.sample(universe, 20)
            removed = rng.sample(sorted(held), min(len(held), rng.randrange(0, 30))) if held else []
            idx.apply_delta(source, stored, removed)
            held.difference_update(removed)
            held.update(stored)
        if step % 50 == 0:
            for chain in chains:
                assert idx.prefix_overlaps(chain) == reference_overlaps(sets, chain)
            assert idx.total_blocks() == len(set().union(*sets.values()))
            for s, blocks in sets.items():
                assert idx.block_count(s) == len(blocks)
                assert all(idx.holds(h) for h in list(blocks)[:20])
    assert idx.memory_bytes() > 0


def test_a_block_no_source_holds_any_more_is_reused_not_leaked():
    # Churn: the same source stores and evicts fresh blocks; tombstones are reused or rebuilt
    # away, so the table does not grow with the number of blocks ever seen.
    idx = KvIndex()
    idx.apply_snapshot("a", [])
    next_id = 0
    for _ in range(200):
        fresh = list(range(next_id, next_id + 500))
        idx.apply_delta("a", stored=fresh, removed=list(range(next_id - 500, next_id)) if next_id else [])
        next_id += 500
    assert idx.block_count("a") == 500 and idx.total_blocks() == 500
    assert idx.memory_bytes() <= 16 * 4096
    assert idx.prefix_overlaps(list(range(next_id - 500, next_id))) == {"a": 500}


def test_a_large_snapshot_takes_the_scatter_path_and_stays_exact():
    # 100,000 blocks in one snapshot resolve slot collisions by scattering (no sort); a second
    # source's snapshot over half of them, then a replacement, must keep every count exact.
    idx = KvIndex()
    rng = random.Random(3)
    blocks = [rng.getrandbits(64) for _ in range(100_000)]
    idx.apply_snapshot("a", blocks)
    idx.apply_snapshot("b", blocks[:50_000])
    assert idx.block_count("a") == 100_000 and idx.total_blocks() == 100_000
    assert idx.prefix_overlaps(blocks[:3000]) == {"a": 3000, "b": 3000}
    assert idx.prefix_overlaps(blocks[49_000:52_000]) == {"a": 3000, "b": 1000}
    idx.apply_snapshot("a", blocks[:10])
    assert idx.total_blocks() == 50_000 and idx.block_count("b") == 50_000
    assert idx.prefix_overlaps(blocks[:20]) == {"a": 10, "b": 20}
    assert all(idx.holds(h) for h in blocks[:50_000:997]) and not idx.holds(blocks[60_000])


def test_sources_arriving_in_a_storm_widen_the_masks_a_few_times_not_once_per_64(monkeypatch):
    """Each widening copies the whole mask table on the serving loop (hundreds of ms at 1,000
    pools): 2,000 sources (1,000 pools x 2 relays) may cause a handful, not one per 64 sources."""
    index = KvIndex()
    widenings: list[int] = []
    widen = KvIndex._widen

    def counted(self, words):
        widenings.append(words)
        widen(self, words)

    monkeypatch.setattr(KvIndex, "_widen", counted)
    for i in range(2000):
        index.apply_snapshot(f"p{i // 2}/r{i % 2}", [i, 10_000_000 + i % 7])
    assert len(widenings) <= 10, widenings
    # (Widened ahead a step at a time as numbers approach the width, so few or none are forced.)
    assert index._words <= 48  # at most half as wide again as the 32 words needed
    for i in (0, 1, 1999):
        assert index.prefix_overlaps([i]) == {f"p{i // 2}/r{i % 2}": 1}
    assert index.block_count("p999/r1") == 2


def test_bit_counts_of_sparse_and_dense_rows_agree_with_a_plain_count():
    """_bit_counts takes a sparse path (non-zero words only) or the dense histogram: both count
    bit j of the little-endian words, for every j."""
    import numpy as np

    from globalrouter.kv_index import _bit_counts

    rng = np.random.default_rng(3)
    for words, per_row, zero_share in ((32, 1, 0.3), (32, 6, 0.0), (1, 1, 0.0), (4, 40, 0.5), (3, 0, 1.0)):
        rows = np.zeros((500, words), np.uint64)
        for _ in range(per_row):
            src = rng.integers(0, 64 * words, 500)
            rows[np.arange(500), src // 64] |= np.left_shift(np.uint64(1), (src % 64).astype(np.uint64))
        rows[rng.random(500) < zero_share] = 0
        want = [sum(int(rows[i, j // 64]) >> (j % 64) & 1 for i in range(500)) for j in range(64 * words)]
        assert _bit_counts(rows).tolist() == want

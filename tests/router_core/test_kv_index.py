"""KvIndex: one-pass prefix overlaps across sources, snapshots, deltas, dropping a source."""

from __future__ import annotations

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
    assert CountingList.reads <= len(prompt)  # at most one read per block, not one per source
    CountingList.reads = 0
    idx.prefix_overlaps(counted)
    assert CountingList.reads <= 41  # stops once no source holds the prefix


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

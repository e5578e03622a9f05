"""KvSummary's arena: snapshot storms and churn reuse given-up regions, never copying every table."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest

from globalrouter.kv_summary import KvSummary

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the mapped arena is Linux's")


def _keys(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def test_a_snapshot_storm_and_churn_never_copy_the_arena(monkeypatch):
    """Pools arriving in a storm, then re-sending snapshots of other sizes, leaving and coming
    back (regions given up all the time), then deltas that double a table: no call copies every
    table (the old arena grew by a quarter with a copy of all of them, and compacted with
    another: seconds on the serving loop at 1,000 pools x 1,000,000 blocks), and every pool's
    answers stay right."""

    def no_copy(self, rows):
        raise AssertionError("the arena was copied")

    monkeypatch.setattr(KvSummary, "_compact", no_copy)
    rng = random.Random(3)
    keys = _keys(6000, 1)
    s = KvSummary()
    held: dict[str, list[int]] = {}
    source: dict[str, str] = {}  # pool -> its current source (the ingest renames it per snapshot)
    for round_ in range(5):
        for k in range(60):
            pool = f"p{k}"
            if round_ and rng.random() < 0.2:
                if pool in source:
                    s.drop_source(source.pop(pool))
                held.pop(pool, None)
                continue
            n = rng.randrange(50, 3000)
            start = rng.randrange(0, 3000)
            blocks = keys[start : start + n]
            if rng.random() < 0.5:  # the live ingest's stepped path, under a new source key
                new = f"{pool}/r/{round_}#{k}"
                s.begin_snapshot(new, len(blocks), pool)
                for at in range(0, len(blocks), 700):
                    s.add_blocks(new, np.array(blocks[at : at + 700], np.uint64))
                s.commit_snapshot(new)
                if pool in source:
                    s.drop_source(source[pool])  # the stream's previous source leaves
                source[pool] = new
            else:
                if pool in source and source[pool] != f"{pool}/r":
                    s.drop_source(source[pool])
                s.apply_snapshot(f"{pool}/r", blocks)
                source[pool] = f"{pool}/r"
            held[pool] = blocks
    # Deltas that overfill one pool's table: it doubles (into a region of its own).
    grow = next(iter(held))
    extra = _keys(5000, 2)
    s.apply_delta(source[grow], extra, [])
    held[grow] = held[grow] + extra
    assert s.stats().doublings >= 1
    for pool, blocks in held.items():
        assert s.pool_block_count(pool) >= 0.99 * len(set(blocks)), pool
        assert s.pool_prefixes(blocks[:40]).get(pool, 0) >= 39, pool
    assert sorted(s.pools()) == sorted(held)
    # Given-up regions are reused or returned: the arena is a small multiple of the live tables.
    assert s.memory_bytes() <= 3 * s.table_bytes()

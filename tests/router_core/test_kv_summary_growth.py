"""KvSummary's table growth a slice at a time: no write pays for a whole table, answers unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from globalrouter import kv_summary
from globalrouter.kv_summary import MAX_LOAD, SLOTS, KvSummary, mix


def _keys(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2**63, n, dtype=np.uint64)


class _Placed:
    """The largest batch one call puts into tables (_bulk and _place), per call of the caller."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        bulk, place = KvSummary._bulk, KvSummary._place

        def counting_bulk(s, p, b1, *rest, **kw):
            self.sizes.append(int(b1.size))
            return bulk(s, p, b1, *rest, **kw)

        def counting_place(s, p, *rest):
            self.sizes.append(int(p.size))
            return place(s, p, *rest)

        monkeypatch.setattr(KvSummary, "_bulk", counting_bulk)
        monkeypatch.setattr(KvSummary, "_place", counting_place)


def _growing(s: KvSummary) -> bool:
    """Whether a growth is in progress (read without `growing`, so the base code fails on what
    it does, not on a missing name)."""
    return bool(getattr(s, "_shadow", None) or getattr(s, "_fresh", None))


def _full_table(blocks: int) -> tuple[KvSummary, np.ndarray, int]:
    """A pool whose table holds `blocks` blocks just under the growth threshold."""
    s = KvSummary()
    hashes = _keys(blocks, 1)
    s.apply_snapshot("g/r", hashes)
    p = s._pool_ids["g"]
    room = int(MAX_LOAD * SLOTS * int(s._nb[p])) - blocks
    extra = _keys(room, 2)
    s.apply_delta("g/r", extra.tolist(), ())
    s.block_count("g/r")  # folded
    assert not _growing(s)
    return s, np.concatenate((hashes, extra)), p


def test_deltas_that_overfill_a_table_grow_it_a_slice_per_write(monkeypatch):
    """A 200,000-block table past its load: the write that starts the growth and every write
    after it move at most GROW_ROWS + GROW_PACE x its blocks old rows (the base code rebuilt the
    whole table inside that write: 196 ms at 1,000,000 blocks); reads answer from both tables
    throughout, and the growth ends after a bounded number of writes."""
    s, held, p = _full_table(200_000)
    nb = int(s._nb[p])
    placed = _Placed(monkeypatch)
    writes = 0
    doubled = False
    fresh = _keys(50_000, 3)
    at = 0
    slice_rows = getattr(kv_summary, "GROW_ROWS", 4096) + getattr(kv_summary, "GROW_PACE", 4) * 64
    bound = 2 * slice_rows + 64  # entries: 2 a row at most, and the write's own
    while writes == 0 or _growing(s):
        batch = fresh[at : at + 64]
        at += 64
        placed.sizes.clear()
        s.apply_delta("g/r", batch.tolist(), ())
        s.block_count("g/r")  # a read folds it (the write's work)
        writes += 1
        assert max(placed.sizes) <= bound, (writes, max(placed.sizes))
        if writes == 1:
            assert _growing(s)
        doubled = doubled or int(s._nb[p]) == 2 * nb
        if writes % 25 == 1:  # reads during the growth: every block held
            live = np.concatenate((held, fresh[:at]))
            assert s._held(np.full(live.size, p), mix(live)).all()
            assert s.pool_prefixes(live[:3].tolist()) == {"g": 3}
        assert writes < nb // slice_rows + 3
    live = np.concatenate((held, fresh[:at]))
    assert s.block_count("g/r") == live.size
    assert s._held(np.full(live.size, p), mix(live)).all()
    assert doubled and int(s._nb[p]) == 2 * nb
    assert s.stats().doublings == 1 and s.stats().dropped_blocks == 0
    assert not s._shadow and not s._cursor and not s._fresh


def test_grow_step_moves_a_growth_on_in_bounded_slices(monkeypatch):
    """Without writes, grow_step (the ingest's steps) ends a growth, about `rows` rows a call."""
    s, held, p = _full_table(50_000)
    s.apply_delta("g/r", _keys(10, 4).tolist(), ())
    s.block_count("g/r")
    assert s.growing()
    placed = _Placed(monkeypatch)
    calls = 0
    while s.grow_step(1000):
        calls += 1
        assert max(placed.sizes) <= 2 * 1000 + 1
        placed.sizes.clear()
    assert calls >= 10 and not s.growing()
    assert s._held(np.full(held.size, p), mix(held)).all()


class _AtOnce(KvSummary):
    """The same rules with every growth finished inside the write that starts it (the base
    code's doubling): the reference for the answers."""

    __slots__ = ()

    def _start_growth(self, p: int) -> None:
        self._begin_growth(p)
        self._grow(p, 0)


@pytest.mark.parametrize("seed", range(8))
def test_answers_during_growths_match_growing_at_once(seed, monkeypatch):
    """Randomized: tiny tables (a growth spans many writes) take snapshots (whole or stepped),
    deltas storing and removing blocks, drops, reads and grow steps of random sizes, next to a
    twin that grows at once, against a set per pool: every block a pool holds is held, the counts
    are the model's, and every probe the stepped one answers 'held' the twin does too (an entry
    not moved yet keeps its full fingerprint, so the stepped answers can only be fewer false
    positives), with the same prefix lengths for the pools' own blocks."""
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 16))
    monkeypatch.setattr(kv_summary, "GROW_ROWS", rows)  # tables of 64 to 1,024 rows: many writes
    monkeypatch.setattr(kv_summary, "GROW_PACE", int(rng.integers(0, 2)))
    monkeypatch.setattr(kv_summary, "ZERO_ROWS", int(rng.integers(1, 64)))  # zeroing spans writes too
    checked_growing = 0
    a, b = KvSummary(), _AtOnce()
    universe = _keys(30_000, seed + 10)
    model: dict[str, set[int]] = {}
    for step in range(400):
        pool = f"p{int(rng.integers(0, 4))}"
        source = f"{pool}/r"
        op = rng.random()
        if op < 0.05 or pool not in model:
            n = int(rng.integers(0, 300))
            blocks = rng.choice(universe, n, replace=False)
            for s in (a, b):
                s.apply_snapshot(source, blocks)
            model[pool] = set(blocks.tolist())
        elif op < 0.75:
            have = sorted(model[pool])
            gone = rng.choice(have, int(rng.integers(0, min(len(have), 40) + 1)), replace=False).tolist()
            new = [
                k for k in rng.choice(universe, int(rng.integers(0, 120))).tolist() if k not in model[pool]
            ]
            new = list(dict.fromkeys(new))
            for s in (a, b):
                s.apply_delta(source, new, gone)
            model[pool] -= set(gone)
            model[pool] |= set(new)
        elif op < 0.8:
            for s in (a, b):
                s.drop_source(source)
            del model[pool]
        else:
            a.grow_step(int(rng.integers(1, 3 * rows)))
        if step % 20 == 0 or step == 399:
            checked_growing += a.growing()
            for name, members in model.items():
                assert a.pool_block_count(name) == len(members) == b.pool_block_count(name)
                if members:
                    live = np.fromiter(members, np.uint64, len(members))
                    q = a._pool_ids[name]
                    assert a._held(np.full(live.size, q), mix(live)).all()
                    first = sorted(members)[:5]
                    assert a.pool_prefixes(first) == b.pool_prefixes(first)
            probes = mix(universe)
            for name in model:
                qa, qb = a._pool_ids[name], b._pool_ids[name]
                ha = a._held(np.full(probes.size, qa), probes)
                hb = b._held(np.full(probes.size, qb), probes)
                assert not (ha & ~hb).any()
    assert a.stats().doublings > 0 and checked_growing > 0  # reads ran during growths
    while a.grow_step(0):
        pass
    assert not a.growing()

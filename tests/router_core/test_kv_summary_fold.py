"""KvSummary's fold of steady deltas: its placement of entries whose two rows are full looks one step
ahead (a resident of those rows moves to its other row) instead of walking blind, so a fold takes
a few settle rounds, not dozens; the tables answer exactly as a blind walk's do."""

from __future__ import annotations

import numpy as np
import pytest

from bench.bench_fold import churn, load_pools
from globalrouter import kv_summary
from globalrouter.kv_summary import KvSummary, mix

pytestmark = pytest.mark.timeout(120)


class BlindWalk(KvSummary):
    """The placement without look-ahead: every entry whose rows are full evicts blindly."""

    def _look_ahead(self, p, ga, va, gb, vb, full, left):
        return np.zeros(0, np.int64)


def _churn(s: KvSummary, pools: int, blocks: int, rounds: int, per: int) -> list[np.ndarray]:
    """Every pool's snapshot of `blocks` blocks, then `rounds` deltas a pool of `per` new blocks
    stored and its oldest `per` removed (a constant load of 0.75, as a relay's steady state);
    returns each pool's blocks now."""
    rings = load_pools(s, pools, blocks, seed=7)
    churn(s, rings, rounds, per)
    s.stats()  # folds what is logged
    return rings


def _answers(s: KvSummary, pools: int, probes: np.ndarray) -> np.ndarray:
    h = mix(probes)
    return np.stack([s._held(np.full(h.size, s._pool_ids[f"p{i}"], np.int64), h) for i in range(pools)])


def test_a_steady_fold_takes_few_settle_rounds_and_keeps_every_block():
    s = KvSummary()
    pools, blocks, rounds, per = 100, 4000, 8, 100
    rings = _churn(s, pools, blocks, rounds, per)
    folds = rounds * pools * per * 2 // kv_summary.PENDING
    # A blind walk took about 45 vector rounds a fold of 8,192 logged blocks; with one step of
    # look-ahead about 20, and with the last 32 entries walked one at a time about 4.
    assert s.settle_rounds <= 10 * folds, (s.settle_rounds, folds)
    stats = s.stats()
    assert stats.dropped_blocks == 0 and stats.entries == pools * blocks
    for i in range(pools):
        h = mix(rings[i])
        assert s._held(np.full(h.size, s._pool_ids[f"p{i}"], np.int64), h).all(), i


def test_look_ahead_answers_like_the_blind_walk():
    # Where an entry lands never changes an answer (a probe reads both rows), so the tables of the
    # two placements answer the same for held blocks, removed ones and never-seen ones alike.
    pools, blocks, rounds, per = 40, 3000, 6, 120
    ahead, blind = KvSummary(), BlindWalk()
    rings = _churn(ahead, pools, blocks, rounds, per)
    rings_blind = _churn(blind, pools, blocks, rounds, per)
    assert all(np.array_equal(a, b) for a, b in zip(rings, rings_blind, strict=True))
    assert ahead.settle_rounds < blind.settle_rounds
    gone = (np.arange(1, rounds * pools * per + 1, dtype=np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
    unseen = np.random.default_rng(99).integers(2**63, 2**64 - 1, 20_000, dtype=np.uint64)
    probes = np.concatenate((np.concatenate(rings[:5]), gone[:20_000], unseen))
    assert np.array_equal(_answers(ahead, pools, probes), _answers(blind, pools, probes))
    assert ahead.stats().entries == blind.stats().entries == pools * blocks

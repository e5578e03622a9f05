"""KvSummary's fold of steady deltas in-process: the CPU of each fold (one turn of the serving loop).

Every pool gets a snapshot of `--blocks` random blocks, then `--rounds` rounds of one delta a pool
(`--per` new blocks stored, its oldest `--per` removed: a constant load, as a relay's steady
state at 200 block events/s a pool with one write a second), through `apply_delta`, which folds
when the log holds PENDING blocks. Prints the CPU time of each fold (mean, p50, p99, max), the
CPU of the whole ingest and the settle rounds a fold.

    .venv/bin/python -m bench.bench_fold [--pools 1000] [--blocks 10000] [--per 100] [--rounds 10]
        [--pending 4096]

Compare two codes interleaved: `PYTHONPATH=OLD python -m bench.bench_fold` and the same with this
tree, alternately (CPU time per fold, so the load of the machine weighs less than on wall time).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from globalrouter import kv_summary
from globalrouter.kv_summary import KvSummary


class _Timed(KvSummary):
    """A KvSummary that records the CPU time of every fold that folds something."""

    def __init__(self) -> None:
        super().__init__()
        self.folds: list[float] = []

    def _fold(self) -> None:
        if not self._log_keys:
            return
        t = time.process_time()
        super()._fold()
        self.folds.append(time.process_time() - t)


def load_pools(s: KvSummary, pools: int, blocks: int, seed: int) -> list[np.ndarray]:
    """Gives pools p0..p{pools-1} (source `p{i}/r0`) a snapshot of `blocks` random blocks each;
    returns each pool's blocks (churn's rings)."""
    rng = np.random.default_rng(seed)
    rings = []
    for i in range(pools):
        ring = rng.integers(1, 2**63, blocks, dtype=np.uint64)
        s.apply_snapshot(f"p{i}/r0", ring)
        rings.append(ring)
    return rings


def churn(s: KvSummary, rings: list[np.ndarray], rounds: int, per: int) -> None:
    """`rounds` rounds of one delta a pool: `per` new blocks stored and its oldest `per` removed
    (a constant load, as a relay's steady state); `rings` follow what each pool holds."""
    fresh = 1
    for r in range(rounds):
        for i, ring in enumerate(rings):
            at = (np.arange(per) + r * per) % ring.size
            new = np.arange(fresh, fresh + per, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            fresh += per
            old = ring[at].copy()
            ring[at] = new
            s.apply_delta(f"p{i}/r0", new.tolist(), old.tolist())


def run(pools: int, blocks: int, per: int, rounds: int) -> dict[str, float]:
    """The figures of one run (milliseconds a fold; seconds of the whole ingest)."""
    s = _Timed()
    rings = load_pools(s, pools, blocks, seed=1)
    s.folds.clear()
    settle0 = getattr(s, "settle_rounds", 0)
    t0 = time.process_time()
    churn(s, rings, rounds, per)
    total = time.process_time() - t0
    ms = np.array(s.folds) * 1000
    return {
        "folds": float(ms.size),
        "mean_ms": float(ms.mean()),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "ingest_s": total,
        "settle_rounds_per_fold": (getattr(s, "settle_rounds", 0) - settle0) / max(1, ms.size),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pools", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=10_000, help="blocks per pool")
    p.add_argument("--per", type=int, default=100, help="blocks stored (and removed) per delta")
    p.add_argument("--rounds", type=int, default=10, help="deltas per pool")
    p.add_argument("--pending", type=int, default=0, help="logged blocks that trigger a fold (0: the code's)")
    a = p.parse_args()
    for name, value in (
        ("--pools", a.pools),
        ("--blocks", a.blocks),
        ("--per", a.per),
        ("--rounds", a.rounds),
    ):
        if value < 1:
            p.error(f"{name} must be at least 1, got {value}")
    if a.pending < 0:
        p.error(f"--pending must be >= 0, got {a.pending}")
    if a.pending:
        kv_summary.PENDING = a.pending
    r = run(a.pools, a.blocks, a.per, a.rounds)
    print(
        f"PENDING {kv_summary.PENDING}: {r['folds']:.0f} folds, CPU a fold mean {r['mean_ms']:.2f} p50 "
        f"{r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} max {r['max_ms']:.2f} ms; ingest {r['ingest_s']:.2f} s CPU; "
        f"{r['settle_rounds_per_fold']:.1f} settle rounds a fold"
    )


if __name__ == "__main__":
    main()

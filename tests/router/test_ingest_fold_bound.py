"""Steady deltas under the per-pool summary are folded into the tables in small batches: a fold is
one turn of the serving loop, and at 65,536 logged blocks a fold took 78 ms at 1,000 pools (at 8,192
about 6 ms, at 4,096 about 3)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from globalrouter import kv_summary
from globalrouter.kv_summary import KvSummary
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import TelemetryIngest, TelemetryServicer
from meshkit.clock import FakeClock
from tests.router.test_telemetry_budgets import chunk, delta, hello

pytestmark = pytest.mark.timeout(60)
FOLD_LIMIT = 4096
"""The most logged delta blocks a steady stream of small deltas may leave for one fold."""


class FoldSizes(KvSummary):
    """A KvSummary that records how many logged blocks each fold took."""

    def __init__(self) -> None:
        super().__init__()
        self.folded: list[int] = []

    def _fold(self) -> None:
        if self._log_keys:
            self.folded.append(len(self._log_keys))
        super()._fold()


def test_steady_deltas_are_folded_in_small_batches():
    table, summary = PoolTable(), FoldSizes()
    ingest = TelemetryIngest(table, summary, FakeClock(), RouterMetrics())
    pools, per_delta = 50, 40  # 200 events/s a pool in deltas every 0.2 s
    streams = []
    for i in range(pools):
        s = ingest.open(hello(pool=f"p{i}"))
        ingest.receive(s, chunk(range(i << 32 | 1, i << 32 | 1001), last=True))
        streams.append(s)
    rng = np.random.default_rng(3)
    for seq in range(2, 2 + 80):  # 80,000 stored blocks without a read in between
        for i, s in enumerate(streams):
            stored = (rng.integers(1 << 20, 1 << 30, per_delta // 2) | i << 32).tolist()
            ingest.receive(s, delta(seq, stored=stored))
    assert summary.folded, "deltas were never folded"
    assert max(summary.folded) <= FOLD_LIMIT + per_delta, max(summary.folded)
    assert kv_summary.PENDING <= FOLD_LIMIT


async def test_a_paced_fold_opens_a_slice_and_never_runs_inside_a_message():
    """Through the servicer's pacer the summary folds at the start of a loop turn's slice, not
    inside the delta that filled its log: folded there, a fold (3-5 ms at 1,000 pools) came on top
    of the slice that delta ended."""
    table, summary = PoolTable(), FoldSizes()
    ingest = TelemetryIngest(table, summary, FakeClock(), RouterMetrics())
    servicer = TelemetryServicer(ingest, "frontend-test")
    inside = [False]
    folded_inside: list[bool] = []
    original_fold = summary._fold

    def fold() -> None:
        if summary._log_keys:
            folded_inside.append(inside[0])
        original_fold()

    summary._fold = fold  # type: ignore[method-assign]
    apply = servicer.pacer._apply

    def applying(stream, msg):
        inside[0] = True
        try:
            return apply(stream, msg)
        finally:
            inside[0] = False

    servicer.pacer._apply = applying
    pools, per_delta = 50, 40
    streams = []
    for i in range(pools):
        s = ingest.open(hello(pool=f"p{i}"))
        ingest.receive(s, chunk(range(i << 32 | 1, i << 32 | 1001), last=True))
        streams.append(s)
    rng = np.random.default_rng(3)
    for seq in range(2, 2 + 40):  # 40,000 stored blocks, every stream's delta in one loop turn
        await asyncio.gather(
            *(
                servicer.pacer.submit(
                    s, delta(seq, stored=(rng.integers(1 << 20, 1 << 30, per_delta) | i << 32).tolist())
                )
                for i, s in enumerate(streams)
            )
        )
    assert folded_inside and not any(folded_inside), folded_inside.count(True)
    assert servicer.pacer.works >= 5
    assert max(summary.folded) <= kv_summary.PENDING + per_delta, max(summary.folded)

"""Index work steps are sized by the loop thread's CPU time, so preemption does not shrink them."""

from __future__ import annotations

import numpy as np

from globalrouter import telemetry_ingest
from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import MIN_STEP, TelemetryIngest
from meshkit.clock import FakeClock
from poolrelay.v1 import telemetry_pb2 as tm
from tests.router.test_telemetry_budgets import hello


def test_a_preempted_process_keeps_its_step_size(monkeypatch):
    """On a loaded machine the process loses the CPU mid-step: each step's wall time looks long
    (here: one second) though its work was small. The step size follows the thread's CPU time, so
    it grows to step_blocks as on an idle machine; sized by the wall time it fell to MIN_STEP and a
    snapshot storm was applied 256 blocks per loop iteration."""
    wall = [0.0]

    def preempted() -> float:
        wall[0] += 1.0  # a second passes between any two readings
        return wall[0]

    monkeypatch.setattr(telemetry_ingest.time, "perf_counter", preempted)
    monkeypatch.setattr(telemetry_ingest.time, "monotonic", preempted)
    ingest = TelemetryIngest(PoolTable(), KvIndex(), FakeClock(), RouterMetrics(), step_blocks=8192)
    stream = ingest.open(hello())
    hashes = np.arange(1, 200_001, dtype=np.uint64).tolist()
    msg = tm.PublishPoolTelemetryRequest(
        kv_snapshot=tm.KvSnapshot(snapshot_id=1, sequence=1, chunk_index=0, last=True, block_hashes=hashes)
    )
    ingest.receive(stream, msg)
    steps = 0
    while ingest.step():
        steps += 1
        assert steps < 1000
    assert ingest._step_size > MIN_STEP
    assert steps < 200_000 // MIN_STEP // 2, steps


def test_a_summary_snapshot_s_last_placements_are_steps_of_their_own(monkeypatch):
    """With --kv-state summary, the entries a snapshot's build steps left waiting are placed by
    later steps (KvSummary.settle_build, about a step's budget each) before the swap, so the step
    that commits places none of them: the base code's commit ran all of _bulk's passes over them
    in one step, the longest of a 1,000,000-block snapshot's (5-9 ms on this host)."""
    from globalrouter.kv_summary import KvSummary

    summary = KvSummary()
    ingest = TelemetryIngest(PoolTable(), summary, FakeClock(), RouterMetrics(), step_blocks=8192)
    stream = ingest.open(hello())
    hashes = np.random.default_rng(3).integers(1, 2**63, 600_000, dtype=np.uint64)
    for i, at in enumerate(range(0, hashes.size, 16_384)):
        chunk = hashes[at : at + 16_384].tolist()
        last = at + 16_384 >= hashes.size
        ingest.receive(
            stream,
            tm.PublishPoolTelemetryRequest(
                kv_snapshot=tm.KvSnapshot(
                    snapshot_id=1, sequence=1, chunk_index=i, last=last, block_hashes=chunk
                )
            ),
        )
    committed: list[int] = []
    commit = KvSummary.commit_snapshot

    def watched(self, source):
        build = self._staged[source][0]
        waiting = self._waiting.get(build)
        committed.append(0 if waiting is None else int(waiting[0].size))
        return commit(self, source)

    monkeypatch.setattr(KvSummary, "commit_snapshot", watched)
    settled: list[int] = []
    settle = getattr(KvSummary, "settle_build", lambda self, source, budget: 0)  # the base code has none

    def watched_settle(self, source, budget):
        settled.append(budget)
        return settle(self, source, budget)

    monkeypatch.setattr(KvSummary, "settle_build", watched_settle, raising=False)
    steps = 0
    while ingest.step():
        steps += 1
        assert steps < 10_000
    assert committed == [0]
    assert settled and all(0 < b <= 8192 for b in settled)
    assert summary.pool_block_count("p") == hashes.size
    assert all(summary.pool_holds("p", int(h)) for h in hashes[::10_007])

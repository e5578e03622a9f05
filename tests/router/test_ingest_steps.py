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
    stream = ingest.open(
        tm.TelemetryHello(
            pool_id="p",
            relay_id="a",
            incarnation=1,
            protocol_version=1,
            block_size=16,
            hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
        )
    )
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

"""bench_restart_ingest runs a small storm end to end: every pool gets its set, built once."""

from __future__ import annotations

import pytest

from bench.bench_restart_ingest import run

pytestmark = pytest.mark.timeout(60)


def test_a_small_storm_builds_every_pools_set_once():
    out = run(pools=3, blocks=20_000, relays=2, step_blocks=8192, seed=5)
    assert out["ready_pools"] == 3 and out["adopted"] == 3  # the second relay's snapshot joins
    assert out["steps_s"] > 0 and out["receive_s"] >= 0

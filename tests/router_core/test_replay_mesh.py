"""Replay through a real mesh (discovery, two mocker pools with relays, a global frontend)."""

from __future__ import annotations

import json
import subprocess

import pytest

from globalrouter.trace import TraceRequest, write_trace
from meshlaunch import MODEL, Mesh, command


@pytest.mark.timeout(120)
def test_replay_through_the_live_mesh_reuses_prefixes(procs, tmp_path):
    # four 8-block prefixes (4,096 tokens each), each asked ten times in rotation
    prefixes = [tuple(range(100 * p, 100 * p + 8)) for p in range(4)]
    trace = [TraceRequest(0.1 * i, 4096, 4, prefixes[i % 4]) for i in range(40)]
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace)
    mesh = Mesh(procs)
    mesh.start_discovery()
    for pool_id in ("pool-a", "pool-b"):
        mesh.start_pool(pool_id, "r1", "--workers", "1", "--speedup", "20")
    router = mesh.start_router()
    mesh.wait_routable(router, ["pool-a", "pool-b"])
    argv = ["replay", "--trace", str(path), "--router", router.address, "--model", MODEL, "--json"]
    out = subprocess.run(
        [command("globalrouter"), *argv],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["requests"] == 40 and result["ok"] == 40 and result["errors"] == {}
    assert result["ideal_hit_rate"] == pytest.approx(36 / 40)
    # every repeat finds its prefix where the frontend sent the first one (allow a few misses
    # for telemetry that had not arrived yet on a slow machine)
    assert result["share_of_ideal"] >= 0.75, result
    assert result["ttft_p50"] > 0 and result["ttft_p99"] >= result["ttft_p50"]
    assert sum(result["requests_per_pool"].values()) == 40

"""A restart's snapshot storm through TelemetryIngest in-process (no gRPC): CPU per stage.

`--pools` pools with `--relays` relay streams each send their whole snapshot (`--blocks` random
block hashes, in the relay's 16,384-hash chunks, the replicas' chunks interleaved as after a
restart), as serialized requests parsed here, into the per-pool summary (`--kv-state summary`'s
KvSummary) through TelemetryIngest's stepped builds (the serving loop's worker: `step` until no
work is left, a few steps after each pool's chunks). Reported in this thread's CPU time: parsing
the requests (gRPC's share, done before the ingest sees them), `receive` of the chunks, and the
build steps; per (pool, block) for the steps. The figure is the frontend's storm work without
gRPC, the steady deltas or the machine's other load (bench_scale's restart has those).

    .venv/bin/python -m bench.bench_restart_ingest [--pools 50] [--blocks 100000] [--relays 2]

Run it with PYTHONPATH set to another tree (a `git archive main`) to measure that code the same way.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from globalrouter.kv_summary import KvSummary
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import PROTOCOL_VERSION, TelemetryIngest
from meshkit.clock import FakeClock
from poolrelay.v1 import telemetry_pb2 as tm

CHUNK = 16_384
"""Hashes per snapshot chunk (the relay's default)."""
STEPS_PER_POOL = 3
"""Worker steps run after each pool's chunks (the loop interleaves steps with messages)."""


def hello(pool: str, relay: str) -> tm.TelemetryHello:
    return tm.TelemetryHello(
        pool_id=pool,
        relay_id=relay,
        incarnation=1,
        protocol_version=PROTOCOL_VERSION,
        block_size=16,
        hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
    )


def run(pools: int, blocks: int, relays: int, step_blocks: int, seed: int) -> dict[str, float]:
    """The storm's CPU by stage (seconds), and the pools whose set was in at the end."""
    rng = np.random.default_rng(seed)
    table = PoolTable()
    ingest = TelemetryIngest(table, KvSummary(), FakeClock(), RouterMetrics(), step_blocks=step_blocks)
    streams = [[ingest.open(hello(f"pool-{i}", f"r{k}")) for k in range(relays)] for i in range(pools)]
    chunks = -(-blocks // CHUNK)
    parse = receive = steps = 0.0
    for i in range(pools):
        hashes = rng.integers(1, 2**63, blocks, dtype=np.uint64)
        wires = [
            tm.PublishPoolTelemetryRequest(
                kv_snapshot=tm.KvSnapshot(
                    snapshot_id=1,
                    sequence=1,
                    chunk_index=c,
                    last=c == chunks - 1,
                    block_hashes=hashes[c * CHUNK : (c + 1) * CHUNK].tolist(),
                )
            ).SerializeToString()
            for c in range(chunks)
        ]
        for wire in wires:  # the replicas' chunks interleaved
            for stream in streams[i]:
                t0 = time.thread_time()
                msg = tm.PublishPoolTelemetryRequest.FromString(wire)
                t1 = time.thread_time()
                ingest.receive(stream, msg)
                t2 = time.thread_time()
                parse += t1 - t0
                receive += t2 - t1
        t0 = time.thread_time()
        for _ in range(STEPS_PER_POOL):
            ingest.step()
        steps += time.thread_time() - t0
    t0 = time.thread_time()
    while ingest.step():
        pass
    steps += time.thread_time() - t0
    ready = sum(1 for i in range(pools) if table.pools[f"pool-{i}"].kv_sources)
    return {
        "parse_s": parse,
        "receive_s": receive,
        "steps_s": steps,
        "steps_ns_per_pool_block": steps / pools / blocks * 1e9,
        "ready_pools": ready,
        "adopted": ingest.snapshots_adopted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pools", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks per pool's snapshot")
    ap.add_argument("--relays", type=int, default=2, help="relay streams per pool")
    ap.add_argument("--step-blocks", type=int, default=8192, help="the frontend's --snapshot-step-blocks")
    ap.add_argument("--repeat", type=int, default=3, help="runs; the best is reported")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    for name, value in (
        ("--pools", a.pools),
        ("--blocks", a.blocks),
        ("--relays", a.relays),
        ("--repeat", a.repeat),
    ):
        if value < 1:
            ap.error(f"{name} must be at least 1 (got {value})")
    best = min(
        (run(a.pools, a.blocks, a.relays, a.step_blocks, a.seed) for _ in range(a.repeat)),
        key=lambda r: r["steps_s"],
    )
    print(
        f"{a.pools} pools x {a.blocks:,} blocks x {a.relays} relays (best of {a.repeat}): parse "
        f"{best['parse_s']:.3f} s, receive {best['receive_s']:.3f} s, build steps {best['steps_s']:.3f} s "
        f"({best['steps_ns_per_pool_block']:.0f} ns a pool-block); {best['ready_pools']}/{a.pools} pools "
        f"with a set, {best['adopted']} snapshots adopted"
    )


if __name__ == "__main__":
    main()

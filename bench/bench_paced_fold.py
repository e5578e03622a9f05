"""The serving loop's turns under the summary's steady deltas, in-process: where the fold lands in them.

Run: `python -m bench.bench_paced_fold [--pools 1000] [--blocks 10000] [--rounds 20] [--per-turn 20]`.
A TelemetryServicer over KvSummary (as `--kv-state summary`), one relay stream a pool with a
snapshot of `--blocks` blocks; then `--rounds` rounds in which every stream's delta (100 stored,
100 removed: a second of 200 block events/s a pool) goes through the servicer's pacer,
`--per-turn` streams' messages arriving each loop iteration (as gRPC's reads complete a few at a
time). A probe task on the same loop records the wall time between its wake-ups (one loop turn
with everything else in it). Prints the turns' p50 / p99 / max, how many took over 5 and 10 ms,
and the thread CPU a message (the folds included). Run it with PYTHONPATH=an older tree to
compare (interleaved, CPU-time and turn figures on a loaded machine move between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import time

import numpy as np

from globalrouter import kv_summary, telemetry_ingest
from globalrouter.kv_summary import KvSummary
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import TelemetryIngest, TelemetryServicer
from meshkit.clock import SystemClock
from poolrelay.v1 import telemetry_pb2 as tm


def hello(pool: str) -> tm.TelemetryHello:
    return tm.TelemetryHello(
        pool_id=pool,
        relay_id="relay-0",
        incarnation=1,
        protocol_version=1,
        block_size=16,
        hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
    )


async def run(pools: int, blocks: int, rounds: int, per_turn: int, slice_seconds: float = 0.0) -> None:
    ingest = TelemetryIngest(PoolTable(), KvSummary(), SystemClock(), RouterMetrics(), step_blocks=0)
    servicer = TelemetryServicer(
        ingest, "bench", max_streams=2 * pools, slice_seconds=slice_seconds or telemetry_ingest.SLICE_SECONDS
    )
    rng = np.random.default_rng(7)
    streams, held = [], []
    for k in range(pools):
        s = ingest.open(hello(f"pool-{k:04d}"))
        own = rng.integers(1, 2**63, blocks, dtype=np.uint64)
        ingest.receive(
            s,
            tm.PublishPoolTelemetryRequest(
                kv_snapshot=tm.KvSnapshot(snapshot_id=1, last=True, block_hashes=own.tolist())
            ),
        )
        streams.append(s)
        held.append(list(own.tolist()))
    turns: list[float] = []
    done = False

    async def probe() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            turns.append(now - last)
            last = now

    messages = []
    for r in range(rounds):
        for k in range(pools):
            new = rng.integers(1, 2**63, 100, dtype=np.uint64).tolist()
            old, held[k] = held[k][:100], held[k][100:] + new
            messages.append(
                (
                    streams[k],
                    tm.PublishPoolTelemetryRequest(
                        kv_delta=tm.KvDelta(sequence=1 + r, stored=new, removed=old)
                    ),
                )
            )
    # As the frontend once ready: what is alive frozen (here the messages to come too, so that the
    # collector's passes over them do not pass for the ingest's), generation 1 a tenth as often.
    gc.collect()
    gc.freeze()
    young, _, oldest = gc.get_threshold()
    gc.set_threshold(young, 100, oldest)
    watcher = asyncio.ensure_future(probe())
    await asyncio.sleep(0)
    cpu0 = time.thread_time()
    pending: list[asyncio.Future] = []
    for i in range(0, len(messages), per_turn):
        pending.extend(
            asyncio.ensure_future(servicer.pacer.submit(s, m)) for s, m in messages[i : i + per_turn]
        )
        await asyncio.sleep(0)  # the next loop turn: the next reads complete
        if len(pending) > 4 * per_turn:
            done_now = [f for f in pending if f.done()]
            pending = [f for f in pending if not f.done()]
            for f in done_now:
                f.result()
    await asyncio.gather(*pending)
    cpu = time.thread_time() - cpu0
    done = True
    await watcher
    t = np.array(turns[1:]) * 1000
    print(
        f"{pools} pools x {blocks:,} blocks, {len(messages):,} deltas of 200 blocks, {per_turn} a turn: "
        f"loop turns p50 / p99 / max {np.percentile(t, 50):.2f} / {np.percentile(t, 99):.2f} / {t.max():.2f} ms, "
        f"over 5 ms {int((t > 5).sum())}, over 10 ms {int((t > 10).sum())} of {t.size}; "
        f"CPU {cpu:.2f} s, {cpu / len(messages) * 1e6:.1f} us a message; "
        f"pacer works {getattr(servicer.pacer, 'works', 'n/a')}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pools", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--per-turn", type=int, default=20)
    p.add_argument("--pending", type=int, default=0, help="kv_summary.PENDING for this run (0: the code's)")
    p.add_argument("--slice", type=float, default=0.0, help="the pacer's slice, seconds (0: the code's)")
    a = p.parse_args()
    if a.pending:
        kv_summary.PENDING = a.pending
    if min(a.pools, a.blocks, a.rounds, a.per_turn) <= 0 or a.blocks < 200:
        p.error("--pools, --rounds and --per-turn must be > 0, --blocks >= 200")
    logging.disable(logging.CRITICAL)  # no per-stream log lines in the measurement
    asyncio.run(run(a.pools, a.blocks, a.rounds, a.per_turn, a.slice))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-message CPU of the telemetry servicer's Python path and its loop turns (no gRPC transport):
`python -m bench.bench_ingest_loop [DELTAS [BATCH ...]] [--no-pacer]`. 2,000 fake streams, each a
2,000-block snapshot, then DELTAS deltas (5 stored + 5 removed) with repeated readiness, drain and
heartbeat reports; every stream always has its next message ready (a saturated loop). A probe task
records each loop turn. Each BATCH (default 1) is a run of its own in this process: the messages
after the snapshot go BATCH at a time in one TelemetryBatch (1: one message per read, unbatched).
`--no-pacer`: the pacer's slice is made endless, so every message is applied when read."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import grpc
import numpy as np

from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import TelemetryIngest, TelemetryServicer
from meshkit.clock import SystemClock
from meshkit.timeconv import timestamp
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import telemetry_pb2 as tm

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
STREAMS, BLOCKS, DELTAS = 2000, 2000, int(ARGS[0]) if ARGS else 30
BATCHES = [int(a) for a in ARGS[1:]] or [1]
PACER = "--no-pacer" not in sys.argv
rng = np.random.default_rng(1)
shared = rng.integers(1, 2**63, 20_000, dtype=np.uint64)


class Ctx:
    def __init__(self, i, batch: int = 1):
        pool, relay = divmod(i, 2)
        own = rng.integers(1, 2**63, BLOCKS // 2, dtype=np.uint64)
        blocks = np.concatenate([shared[(pool * 7) % 10_000 :][: BLOCKS // 2], own])
        self.msgs = [
            tm.PublishPoolTelemetryRequest(
                hello=tm.TelemetryHello(
                    pool_id=f"p{pool}",
                    relay_id=f"r{relay}",
                    incarnation=1,
                    protocol_version=1,
                    block_size=16,
                    hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
                )
            )
        ]
        self.msgs.append(
            tm.PublishPoolTelemetryRequest(
                kv_snapshot=tm.KvSnapshot(
                    snapshot_id=1, sequence=1, chunk_index=0, last=True, block_hashes=blocks.tolist()
                )
            )
        )
        seq = 2
        ready = tm.PublishPoolTelemetryRequest(
            readiness=tm.ReadinessReport(models=[pe.ModelStatus(model="m", state=pe.MODEL_STATE_READY)])
        )
        drain = tm.PublishPoolTelemetryRequest(
            drain=tm.DrainReport(drain=pe.DrainStatus(state=pe.DRAIN_STATE_ACTIVE))
        )
        for d in range(DELTAS):
            st = rng.integers(1, 2**63, 5, dtype=np.uint64).tolist()
            self.msgs.append(
                tm.PublishPoolTelemetryRequest(
                    kv_delta=tm.KvDelta(sequence=seq, stored=st, removed=blocks[d * 5 : (d + 1) * 5].tolist())
                )
            )
            seq += 1
            if d % 5 == 0:
                self.msgs += [
                    ready,
                    drain,
                    tm.PublishPoolTelemetryRequest(
                        heartbeat=tm.TelemetryHeartbeat(send_time=timestamp(time.time()))
                    ),
                ]
        if batch > 1:
            head, rest = self.msgs[:2], self.msgs[2:]
            self.msgs = head + [
                tm.PublishPoolTelemetryRequest(batch=tm.TelemetryBatch(messages=rest[k : k + batch]))
                for k in range(0, len(rest), batch)
            ]
        self.i = 0

    async def read(self):
        await asyncio.sleep(0)
        if self.i >= len(self.msgs):
            return grpc.aio.EOF
        m = self.msgs[self.i]
        self.i += 1
        return m

    async def write(self, m):
        pass

    async def abort(self, *a, **k):
        raise AssertionError(a)


def _inner(m):
    return m.batch.messages if m.WhichOneof("payload") == "batch" else [m]


async def main(batch: int):
    global rng
    rng = np.random.default_rng(2)  # the same streams for every BATCH
    ingest = TelemetryIngest(PoolTable(), KvIndex(), SystemClock(), RouterMetrics(), step_blocks=8192)
    sv = TelemetryServicer(ingest, "f", max_streams=4096, slice_seconds=0.004 if PACER else 1e9)
    ctxs = [Ctx(i, batch) for i in range(STREAMS)]
    reads = sum(len(c.msgs) for c in ctxs)
    msgs = sum(len(_inner(m)) for c in ctxs for m in c.msgs)
    events = sum(
        len(i.kv_delta.stored) + len(i.kv_delta.removed) for c in ctxs for m in c.msgs for i in _inner(m)
    )
    # the longest loop turn, seen from a probe task
    gaps = []

    async def probe():
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    p = asyncio.ensure_future(probe())
    c0, t0 = time.thread_time(), time.perf_counter()
    await asyncio.gather(*(sv.PublishPoolTelemetry(None, c) for c in ctxs))  # type: ignore[arg-type]
    while ingest.has_work():  # noqa: ASYNC110 (the index worker, polled)
        await asyncio.sleep(0.01)
    c1, t1 = time.thread_time(), time.perf_counter()
    p.cancel()
    gaps.sort()
    print(
        f"batch {batch}{'' if PACER else ', no pacer'}: {msgs} messages in {reads} reads ({events} delta events) "
        f"in {c1 - c0:.2f} s CPU ({t1 - t0:.2f} s wall): {(c1 - c0) / msgs * 1e6:.1f} us a message, "
        f"{(c1 - c0) / reads * 1e6:.1f} us a read, {(c1 - c0) / events * 1e6:.2f} us a delta event; "
        f"loop turn p50 {gaps[len(gaps) // 2] * 1e3:.2f} ms, "
        f"p99 {gaps[int(len(gaps) * 0.99)] * 1e3:.1f} ms, max {gaps[-1] * 1e3:.1f} ms",
        flush=True,
    )


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    for b in BATCHES:
        asyncio.run(main(b))

"""What the cyclic gc's young collections walk in a frontend-like process (no gRPC transport):
`python -m bench.bench_gc_young [--streams 2000] [--blocks 2000] [--seconds 20] [--threshold N]`.

A TelemetryServicer over the summary KV state (as `--kv-state summary`) gets `--streams` fake
relay streams (two per pool: a hello and a snapshot each), then steady traffic: every stream sends,
as a relay with `--telemetry-batch-interval 1` does, a TelemetryBatch a read holding five deltas
(20 stored + 20 removed blocks each) and the readiness, drain and heartbeat reports. Every read
deserializes its message from bytes (as gRPC does), so messages die as they do in the frontend.
After the snapshots everything alive is frozen (the frontend's refreeze does it after a full
collection). Then, for `--seconds`, every collection is timed (gc.callbacks) and, at the start of
every 8th generation-1 collection (not timed), the objects of generations 0 and 1 are counted by
type, with the references their traversal visits (len(gc.get_referents)): a young collection's
cost is about these objects and references.

Measured (BENCHMARKS.md, "Loop lag at 1,000 pools"): the ingest's own per-message path leaves
almost nothing alive past a young collection (2 young collections in 15 s at 2,000 streams and
~16,000 deltas/s): what generation-1 collections walk in the frontend is gRPC's, see
bench/gc_sample."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import time
from collections import Counter
from typing import Any

import grpc
import numpy as np

from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import KvSummary
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import TelemetryIngest, TelemetryServicer
from meshkit.clock import SystemClock
from meshkit.logs import configure_logging
from meshkit.timeconv import timestamp
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import telemetry_pb2 as tm

Req = tm.PublishPoolTelemetryRequest
PER_DELTA = 20


class Ctx:
    """A fake call context: `read` returns the stream's next message, deserialized anew."""

    def __init__(self, i: int, blocks: int, rng: np.random.Generator, stop: list[bool]) -> None:
        pool, relay = divmod(i, 2)
        self.rng = rng
        self.stop = stop
        own = rng.integers(1, 2**63, blocks, dtype=np.uint64)
        # The relay's set, as a ring (a numpy array: a list here would be a young container of
        # `blocks` references, walked by every young collection, which the frontend has not).
        self.blocks = own.copy()
        self.pos = 0
        self.head = [
            Req(
                hello=tm.TelemetryHello(
                    pool_id=f"p{pool}",
                    relay_id=f"r{relay}",
                    incarnation=1,
                    protocol_version=1,
                    block_size=16,
                    hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
                )
            ).SerializeToString(),
            Req(
                kv_snapshot=tm.KvSnapshot(
                    snapshot_id=1, sequence=1, chunk_index=0, last=True, block_hashes=own.tolist()
                )
            ).SerializeToString(),
        ]
        self.seq = 2
        self.i = 0

    def _batch(self) -> bytes:
        msgs = []
        for _ in range(5):
            fresh = self.rng.integers(1, 2**63, PER_DELTA, dtype=np.uint64)
            at = slice(self.pos, self.pos + PER_DELTA)
            stored, removed = fresh.tolist(), self.blocks[at].tolist()
            self.blocks[at] = fresh
            self.pos = (self.pos + PER_DELTA) % (len(self.blocks) - PER_DELTA + 1)
            msgs.append(Req(kv_delta=tm.KvDelta(sequence=self.seq, stored=stored, removed=removed)))
            self.seq += 1
        msgs += [
            Req(readiness=tm.ReadinessReport(models=[pe.ModelStatus(model="m", state=pe.MODEL_STATE_READY)])),
            Req(drain=tm.DrainReport(drain=pe.DrainStatus(state=pe.DRAIN_STATE_ACTIVE))),
            Req(heartbeat=tm.TelemetryHeartbeat(send_time=timestamp(time.time()))),
        ]
        return Req(batch=tm.TelemetryBatch(messages=msgs)).SerializeToString()

    async def read(self) -> Any:
        await asyncio.sleep(0)
        if self.i < len(self.head):
            self.i += 1
            return Req.FromString(self.head[self.i - 1])
        if self.stop[0]:
            return grpc.aio.EOF
        return Req.FromString(self._batch())

    async def write(self, m: Any) -> None:
        pass

    async def abort(self, *a: Any, **k: Any) -> None:
        raise AssertionError(a)


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] if xs else 0.0


async def main(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(1)
    index: Any = KvIndex() if args.exact else KvSummary()
    ingest = TelemetryIngest(PoolTable(), index, SystemClock(), RouterMetrics(), step_blocks=8192)
    sv = TelemetryServicer(ingest, "f", max_streams=8192, slice_seconds=0.004)
    stop = [False]
    ctxs = [Ctx(i, args.blocks, rng, stop) for i in range(args.streams)]
    calls = [asyncio.ensure_future(sv.PublishPoolTelemetry(None, c)) for c in ctxs]  # type: ignore[arg-type]
    while min(c.i for c in ctxs) < 2 or ingest.has_work():  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    gc.collect()
    gc.freeze()
    if args.threshold:
        gc.set_threshold(args.threshold, *gc.get_threshold()[1:])
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    seen = Counter[str]()
    refs = Counter[str]()
    samples = [0]
    young = [0]
    start = [0.0, -1.0]

    def cb(phase: str, info: dict[str, Any]) -> None:
        gen = info["generation"]
        if phase == "start":
            start[1] = -1.0
            if gen == 1:
                young[0] += 1
                if young[0] % 8 == 0:
                    samples[0] += 1
                    for g in (0, 1):
                        for o in gc.get_objects(generation=g):
                            name = type(o).__qualname__
                            seen[name] += 1
                            refs[name] += len(gc.get_referents(o))
                    return
            start[1] = gen
            start[0] = time.perf_counter()
        elif start[1] == gen:
            pauses[gen].append(time.perf_counter() - start[0])

    msgs0 = sum(c.seq for c in ctxs)
    cpu0, t0 = time.process_time(), time.perf_counter()
    gc.callbacks.append(cb)
    await asyncio.sleep(args.seconds)
    gc.callbacks.remove(cb)
    cpu1, t1 = time.process_time(), time.perf_counter()
    deltas = sum(c.seq for c in ctxs) - msgs0
    stop[0] = True
    await asyncio.gather(*calls, return_exceptions=True)
    print(
        f"{args.streams} streams, {'exact' if args.exact else 'summary'}, threshold {gc.get_threshold()}: "
        f"{deltas} deltas in {t1 - t0:.1f} s ({cpu1 - cpu0:.1f} s CPU), frozen {gc.get_freeze_count()}"
    )
    for g, xs in pauses.items():
        if xs:
            print(
                f"  gen {g}: {len(xs)} collections ({len(xs) / (t1 - t0):.1f}/s), p50 {_pct(xs, 0.5) * 1e3:.2f} ms, "
                f"p99 {_pct(xs, 0.99) * 1e3:.2f} ms, max {max(xs) * 1e3:.2f} ms, sum {sum(xs):.2f} s"
            )
    n = max(1, samples[0])
    print(
        f"  at the start of a gen-1 collection (mean of {samples[0]}): objects in gen 0+1, references visited"
    )
    for name, count in seen.most_common(args.top):
        print(f"    {name:40s} {count / n:10.0f} {refs[name] / n:12.0f}")
    print(f"    {'all':40s} {sum(seen.values()) / n:10.0f} {sum(refs.values()) / n:12.0f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--threshold", type=int, default=0)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--exact", action="store_true", help="the exact KvIndex instead of the summary")
    logging.disable(logging.CRITICAL)
    configure_logging("bench-gc-young", "warning")
    asyncio.run(main(p.parse_args()))

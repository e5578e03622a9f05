"""Benchmark of the relay's KV path: pool-side events → pool_blocks → publisher → frontend streams.

Measures, in one run: the raw pool_blocks rate (no gRPC, the baseline); KV events per second
through the relay's TelemetryHub to 1 and to 16 in-process receivers on loopback (and the ratio to
the baseline); bytes on the wire per block event (serialized message sizes); and the time to build
and send a snapshot of 1,000,000 blocks to one receiver. Writes bench/results/bench_relay.md.

Run: .venv/bin/python bench/bench_relay.py [--events N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import sys
import time
from pathlib import Path

import grpc

from bench.measure import write_result
from meshkit.clock import SystemClock
from meshkit.logs import configure_logging
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.telemetry_publisher import TelemetryConfig, TelemetryHub
from poolrelay.v1 import telemetry_pb2 as tm
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc

ROOT = Path(__file__).resolve().parent.parent

WORKERS = 4
BLOCKS_PER_EVENT = 4  # a KV event stores 4 blocks and evicts 4 (a short prompt on a full cache)
SHARED = 0.25  # fraction of stored blocks another worker already holds (no pool-level transition)
PACE = 10_000  # events/s for the paced run
REPEATS = 3  # rate measurements report the best of this many runs


class CountingReceiver(tm_grpc.TelemetryServiceServicer):
    """A frontend's telemetry endpoint that only counts: sequence reached, bytes, snapshots."""

    def __init__(self) -> None:
        self.sequence = -1
        self.snapshot_blocks = 0
        self.snapshots_done = 0
        self.bytes = 0
        self.delta_bytes = 0
        self.delta_blocks = 0
        self.changed = asyncio.Event()

    async def PublishPoolTelemetry(self, request_iterator, context):
        yield tm.PublishPoolTelemetryResponse(hello_ack=tm.TelemetryHelloAck(frontend_id="bench"))
        async for req in request_iterator:
            size = req.ByteSize()
            self.bytes += size
            kind = req.WhichOneof("payload")
            if kind == "kv_delta":
                self.sequence = req.kv_delta.sequence
                self.delta_bytes += size
                self.delta_blocks += len(req.kv_delta.stored) + len(req.kv_delta.removed)
            elif kind == "kv_snapshot":
                self.snapshot_blocks += len(req.kv_snapshot.block_hashes)
                if req.kv_snapshot.last:
                    self.sequence = req.kv_snapshot.sequence
                    self.snapshots_done += 1
            self.changed.set()


def make_events(n: int, seed: int = 1) -> list[tuple[str, list[int], list[int]]]:
    """n worker events: each stores BLOCKS_PER_EVENT blocks and removes as many it held (FIFO)."""
    rng = random.Random(seed)
    held: dict[str, list[int]] = {f"w{i}": [] for i in range(WORKERS)}
    recent: list[int] = []
    events = []
    next_block = 1
    for _ in range(n):
        w = f"w{rng.randrange(WORKERS)}"
        stored = []
        for _ in range(BLOCKS_PER_EVENT):
            if recent and rng.random() < SHARED:
                stored.append(rng.choice(recent))
            else:
                stored.append(next_block * 0x9E3779B97F4A7C15 % (1 << 64))
                next_block += 1
        removed = held[w][:BLOCKS_PER_EVENT] if len(held[w]) > 256 else []
        held[w] = held[w][len(removed) :] + [h for h in stored if h not in held[w]]
        recent = (recent + stored)[-512:]
        events.append((w, stored, removed))
    return events


def baseline(events, batch: int) -> float:
    """Raw pool_blocks events/s: apply every event, take a delta every `batch` events."""
    blocks = PoolBlocks()
    start = time.perf_counter()
    for i, (w, stored, removed) in enumerate(events, 1):
        blocks.apply_event(w, stored, removed)
        if i % batch == 0:
            blocks.take_delta()
    blocks.take_delta()
    return len(events) / (time.perf_counter() - start)


async def start_receivers(n: int):
    servers, receivers, urls = [], [], []
    for _ in range(n):
        recv = CountingReceiver()
        server = grpc.aio.server()
        tm_grpc.add_TelemetryServiceServicer_to_server(recv, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        receivers.append(recv)
        urls.append(f"http://127.0.0.1:{port}")
    return servers, receivers, urls


async def wait_all(receivers, sequence: int, snapshots: int = 0, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while any(r.sequence < sequence or r.snapshots_done < snapshots for r in receivers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"receivers did not reach sequence {sequence} within {limit}s")
        await asyncio.sleep(0.002)


async def through_relay(events, fanout: int, pace: float = 0.0) -> dict:
    """Events/s from pool-side events through pool_blocks + the hub to `fanout` receivers.

    With `pace` > 0, events are fed at that many per second (a realistic delta size) instead of
    as fast as possible (which coalesces far more per 5 ms delta).
    """
    servers, receivers, urls = await start_receivers(fanout)
    blocks = PoolBlocks()
    config = TelemetryConfig(
        pool_id="bench", relay_id="bench", incarnation=1, region="local", report_interval=60
    )
    hub = TelemetryHub(config, blocks, SystemClock())
    hub.set_frontends(static=urls)
    try:
        await wait_all(receivers, 0, snapshots=1)
        start = time.perf_counter()
        for i, (w, stored, removed) in enumerate(events, 1):
            blocks.apply_event(w, stored, removed)
            hub.blocks_changed()
            if pace and i % 50 == 0:
                await asyncio.sleep(max(0.0, start + i / pace - time.perf_counter()))
            elif i % 64 == 0:
                await asyncio.sleep(0)  # the pool stream's reader yields between messages
        hub.flush()
        await wait_all(receivers, blocks.sequence)
        elapsed = time.perf_counter() - start
        dropped = sum(p.messages_dropped for p in hub.publishers.values())
        r0 = receivers[0]
        return {
            "rate": len(events) / elapsed,
            "deltas": hub.deltas_published,
            "delta_bytes": r0.delta_bytes,
            "delta_blocks": r0.delta_blocks,
            "dropped": dropped,
        }
    finally:
        await hub.close()
        for s in servers:
            await s.stop(0)


async def snapshot_time(n_blocks: int) -> tuple[float, float, int]:
    """(build seconds, send seconds, bytes) for a snapshot of n_blocks to one receiver."""
    servers, receivers, urls = await start_receivers(1)
    blocks = PoolBlocks()
    hashes = [(i + 1) * 0x9E3779B97F4A7C15 % (1 << 64) for i in range(n_blocks)]
    t0 = time.perf_counter()
    blocks.apply_snapshot("w0", hashes)
    blocks.take_delta()
    build = time.perf_counter() - t0
    config = TelemetryConfig(
        pool_id="bench", relay_id="bench", incarnation=1, region="local", report_interval=60
    )
    hub = TelemetryHub(config, blocks, SystemClock())
    try:
        t1 = time.perf_counter()
        hub.set_frontends(static=urls)  # a new stream starts with a full snapshot
        await wait_all(receivers, blocks.sequence, snapshots=1)
        send = time.perf_counter() - t1
        assert receivers[0].snapshot_blocks == n_blocks
        return build, send, receivers[0].bytes
    finally:
        await hub.close()
        for s in servers:
            await s.stop(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000, help="KV events per measurement")
    parser.add_argument("--snapshot-blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    configure_logging("bench", "warning")
    events = make_events(args.events)
    cmd = ".venv/bin/python bench/bench_relay.py" + (
        f" --events {args.events}" if args.events != 100_000 else ""
    )

    # Best of REPEATS: the machine is shared, and the best run is the one least disturbed.
    base = max(baseline(events, batch=64) for _ in range(REPEATS))
    print(f"baseline pool_blocks (no gRPC): {base:,.0f} events/s")
    one = max((asyncio.run(through_relay(events, 1)) for _ in range(REPEATS)), key=lambda r: r["rate"])
    print(f"through relay to 1 frontend: {one['rate']:,.0f} events/s ({one['rate'] / base:.2f}x baseline)")
    sixteen = max((asyncio.run(through_relay(events, 16)) for _ in range(REPEATS)), key=lambda r: r["rate"])
    print(
        f"through relay to 16 frontends: {sixteen['rate']:,.0f} events/s ({sixteen['rate'] / base:.2f}x baseline, "
        f"{sixteen['rate'] / one['rate']:.2f}x one frontend)"
    )
    per_block = one["delta_bytes"] / max(1, one["delta_blocks"])
    per_event = one["delta_bytes"] / len(events)
    print(
        f"wire: {one['deltas']} deltas, {one['delta_bytes']:,} bytes for {one['delta_blocks']:,} block transitions "
        f"= {per_block:.2f} bytes per block event, {per_event:.2f} bytes per KV event"
    )
    paced_n = min(len(events), 20_000)
    paced = asyncio.run(through_relay(events[:paced_n], 1, pace=PACE))
    paced_block = paced["delta_bytes"] / max(1, paced["delta_blocks"])
    paced_event = paced["delta_bytes"] / paced_n
    print(
        f"paced at {PACE:,} events/s to 1 frontend: {paced['deltas']} deltas, {paced_block:.2f} bytes per block "
        f"event, {paced_event:.2f} bytes per KV event"
    )
    build, send, snap_bytes = asyncio.run(snapshot_time(args.snapshot_blocks))
    print(
        f"snapshot of {args.snapshot_blocks:,} blocks: build {build:.3f} s, send to one receiver {send:.3f} s, "
        f"{snap_bytes / args.snapshot_blocks:.2f} bytes per block"
    )

    md = f"""## poolrelay: KV event path and snapshots

Command: `{cmd}` (from the repository root; part of `make bench`).
Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, shared with
other work (figures move between runs; compare ratios). Workload: {len(events):,} worker KV events
over {WORKERS} workers, each storing {BLOCKS_PER_EVENT} blocks ({SHARED:.0%} already held by another
worker) and evicting {BLOCKS_PER_EVENT} once a worker holds 256; transitions coalesced for 5 ms
per delta; rates are the best of {REPEATS} runs. Receivers are in-process gRPC servers on loopback (same process, same cores).

| measurement | result |
|---|---|
| baseline: raw pool_blocks (no gRPC), events/s | {base:,.0f} |
| through relay to 1 frontend stream, events/s | {one["rate"]:,.0f} ({one["rate"] / base:.2f}x baseline) |
| through relay to 16 frontend streams, events/s | {sixteen["rate"]:,.0f} ({sixteen["rate"] / base:.2f}x baseline, {sixteen["rate"] / one["rate"]:.2f}x one stream) |
| deltas sent per stream (1 frontend) | {one["deltas"]:,} |
| deltas dropped (queue overflow), 1 / 16 frontends | {one["dropped"]} / {sixteen["dropped"]} |
| bytes on the wire per block event (serialized KvDelta), unpaced | {per_block:.2f} |
| bytes on the wire per KV event, unpaced (much coalesced) | {per_event:.2f} |
| paced at {PACE:,} events/s ({paced_n:,} events): deltas sent | {paced["deltas"]:,} |
| paced: bytes per block event | {paced_block:.2f} |
| paced: bytes per KV event | {paced_event:.2f} |
| snapshot of {args.snapshot_blocks:,} blocks: build pool set | {build:.3f} s |
| snapshot of {args.snapshot_blocks:,} blocks: send to one receiver (hello → last chunk received) | {send:.3f} s |
| snapshot bytes per block | {snap_bytes / args.snapshot_blocks:.2f} |
"""
    write_result("bench_relay.md", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

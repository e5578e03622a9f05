"""Frontend CPU per telemetry message through real gRPC, batched against not, in one run:
`python -m bench.bench_batch_ingest [--streams 400] [--seconds 15] [--rounds 2] [--no-pacer]`.

A TelemetryServicer (the frontend's, exact KvIndex) serves in a process of its own; this process
opens `--streams` relay streams to it (a channel each, hello and a 2,000-block snapshot), then every
stream writes `--seconds` of a simulated relay's traffic at 200 block events/s (a delta of 20 stored
and 20 removed blocks every 0.2 s, and the load, readiness, drain and heartbeat reports once a
second) as fast as the server reads it, and half-closes. The server's CPU seconds (utime + stime of
its process) from the first message to the last stream's end, divided by the messages, the gRPC
messages and the block events, for each way of writing them:

- `unbatched`: one gRPC message per message (relays before batches, or an old frontend);
- `batched`: as a relay sends to a frontend that accepts batches when it keeps up: the four
  reports of a second in one TelemetryBatch, each delta alone (what bench/scale_sim.py sends);
- `all`: a second's nine messages in one batch (a relay whose stream is backed up).

Each mode gets a fresh server; the modes alternate `--rounds` times. The machine is shared, so
compare modes within a run."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from meshkit.timeconv import timestamp
from poolrelay.telemetry_publisher import PUBLISH_METHOD, batch_wire
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import telemetry_pb2 as tm

Req = tm.PublishPoolTelemetryRequest
MODES = ("unbatched", "batched", "all")
SNAPSHOT_BLOCKS = 2000
PER_DELTA = 20  # stored and as many removed: 40 block events a delta, 5 deltas a second = 200/s
MARKER = Req(kv_delta=tm.KvDelta(sequence=1 << 60)).SerializeToString()


def _hash(i: int, blocks: list[int]) -> list[int]:
    """Well-spread 64-bit hashes of stream i's block numbers (splitmix64), as chained hashes are."""
    x = np.array(blocks, dtype=np.uint64) + np.uint64(i << 40)
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))).tolist()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the server process -----------------------------------------------------------------------
async def serve(port_file: str, pacer: bool) -> None:
    from globalrouter.kv_index import KvIndex
    from globalrouter.metrics import RouterMetrics
    from globalrouter.pool_directory import PoolTable
    from globalrouter.telemetry_ingest import SLICE_SECONDS, TelemetryIngest, TelemetryServicer
    from meshkit.clock import SystemClock
    from meshkit.logs import configure_logging
    from meshkit.server import create_server

    configure_logging("bench-batch-ingest", "warning")
    ingest = TelemetryIngest(PoolTable(), KvIndex(), SystemClock(), RouterMetrics(), step_blocks=8192)
    servicer = TelemetryServicer(
        ingest, "bench", max_streams=8192, slice_seconds=SLICE_SECONDS if pacer else 1e9
    )

    def register(server: grpc.aio.Server) -> list[str]:
        servicer.add_to_server(server)  # as the frontend registers it (messages sized as received)
        return [tm.DESCRIPTOR.services_by_name["TelemetryService"].full_name]

    # The mesh's own server (its options and interceptors), as the frontend serves telemetry.
    handle = create_server("127.0.0.1:0", register)
    await handle.server.start()
    Path(port_file).write_text(str(handle.port))  # noqa: ASYNC240 (once, before any stream)
    await handle.server.wait_for_termination()


# ---- the relays -------------------------------------------------------------------------------
def stream_messages(i: int, seconds: int, mode: str) -> tuple[list[bytes], int, int]:
    """(what stream i writes after its snapshot, messages in it, block events in it)."""
    rng = np.random.default_rng(i)
    reports = [
        Req(load=tm.LoadReport(load=pe.PoolLoad(requests_running=i % 7, max_running_requests=64))),
        Req(readiness=tm.ReadinessReport(models=[pe.ModelStatus(model="m", state=pe.MODEL_STATE_READY)])),
        Req(drain=tm.DrainReport(drain=pe.DrainStatus(state=pe.DRAIN_STATE_ACTIVE))),
        Req(heartbeat=tm.TelemetryHeartbeat(send_time=timestamp(time.time()))),
    ]
    report_bytes = [r.SerializeToString() for r in reports]
    held = list(range(1, SNAPSHOT_BLOCKS + 1))
    nxt = SNAPSHOT_BLOCKS + 1
    sequence = 1
    out: list[bytes] = []
    messages = events = 0
    for _ in range(seconds):
        second = list(report_bytes)
        for _ in range(5):
            sequence += 1
            stored = list(range(nxt, nxt + PER_DELTA))
            nxt += PER_DELTA
            gone = [held.pop(int(rng.integers(len(held)))) for _ in range(PER_DELTA)]
            held.extend(stored)
            delta = tm.KvDelta(sequence=sequence, stored=_hash(i, stored), removed=_hash(i, gone))
            second.append(Req(kv_delta=delta).SerializeToString())
            events += 2 * PER_DELTA
        messages += len(second)
        if mode == "unbatched":
            out += second
        elif mode == "batched":
            out += [batch_wire(second[:4]), *second[4:]]
        else:
            out.append(batch_wire(second))
    return out, messages, events


def opening(i: int) -> list[bytes]:
    hello = Req(
        hello=tm.TelemetryHello(
            pool_id=f"p{i // 2}",
            relay_id=f"r{i % 2}",
            incarnation=1,
            protocol_version=1,
            block_size=16,
            hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
        )
    )
    blocks = _hash(i, list(range(1, SNAPSHOT_BLOCKS + 1)))
    snap = Req(
        kv_snapshot=tm.KvSnapshot(snapshot_id=1, sequence=1, chunk_index=0, last=True, block_hashes=blocks)
    )
    return [hello.SerializeToString(), snap.SerializeToString()]


async def one_mode(args, mode: str, workdir: Path) -> dict[str, float]:
    port_file = workdir / f"port-{mode}"
    port_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "bench.bench_batch_ingest", "--serve", str(port_file)]
    if not args.pacer:
        argv.append("--no-pacer")
    proc = await asyncio.create_subprocess_exec(*argv)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline and proc.returncode is None, "the server did not start"
            await asyncio.sleep(0.05)
        target = f"127.0.0.1:{port_file.read_text()}"
        plans = [stream_messages(i, args.seconds, mode) for i in range(args.streams)]
        channels = [grpc.aio.insecure_channel(target) for _ in range(args.streams)]
        calls: list[Any] = [
            ch.stream_stream(
                PUBLISH_METHOD,
                request_serializer=None,
                response_deserializer=tm.PublishPoolTelemetryResponse.FromString,
            )()
            for ch in channels
        ]
        for i, call in enumerate(calls):
            for data in opening(i):
                await call.write(data)
        for call in calls:
            ack = await asyncio.wait_for(call.read(), 60)
            assert ack.HasField("hello_ack") and ack.hello_ack.accepts_batches, ack
        await asyncio.sleep(2.0)  # the snapshots applied (index work), the loop idle
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()

        async def send(call, msgs: list[bytes]) -> None:
            for data in msgs:
                await call.write(data)
            # A delta out of sequence: its SnapshotRequest says the server has applied all before it
            # (the streams' ends, and the index work they queue, are not measured).
            await call.write(MARKER)
            answer = await call.read()
            assert answer.HasField("snapshot_request"), answer

        await asyncio.wait_for(
            asyncio.gather(*(send(c, p[0]) for c, p in zip(calls, plans, strict=True))), 600
        )
        c1, t1 = cpu_seconds(proc.pid), time.monotonic()
        for call in calls:
            await call.done_writing()
        for ch in channels:
            await ch.close()
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
    writes = sum(len(p[0]) for p in plans)
    messages = sum(p[1] for p in plans)
    events = sum(p[2] for p in plans)
    cpu = c1 - c0
    return {
        "cpu_s": cpu,
        "wall_s": t1 - t0,
        "messages": messages,
        "writes": writes,
        "events": events,
        "us_per_message": cpu / messages * 1e6,
        "us_per_write": cpu / writes * 1e6,
        "us_per_event": cpu / events * 1e6,
    }


async def main(args) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    print(
        f"{args.streams} streams x {args.seconds} s of relay traffic (200 block events/s, 4 reports/s each)"
        f"{'' if args.pacer else ', pacer off'}; server CPU while it reads them, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes}
    for _ in range(args.rounds):
        for mode in args.modes:
            r = await one_mode(args, mode, workdir)
            results[mode].append(r)
            print(
                f"  {mode:9s}: {r['messages']} messages in {r['writes']} gRPC messages, {r['events']} block events: "
                f"{r['cpu_s']:.2f} s CPU ({r['wall_s']:.1f} s wall) = {r['us_per_message']:.1f} us a message, "
                f"{r['us_per_write']:.1f} us a gRPC message, {r['us_per_event']:.2f} us a block event "
                f"(load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    base = results.get("unbatched")
    if base:
        b = sum(r["cpu_s"] for r in base) / sum(r["messages"] for r in base)
        for mode in args.modes:
            if mode != "unbatched":
                m = sum(r["cpu_s"] for r in results[mode]) / sum(r["messages"] for r in results[mode])
                print(f"CPU per message, {mode} / unbatched: {m / b:.2f}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=400)
    p.add_argument("--seconds", type=int, default=15, help="seconds of relay traffic each stream writes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--no-pacer", dest="pacer", action="store_false", help="the pacer's slice made endless")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    if set(a.modes) - set(MODES) or a.streams <= 0 or a.seconds <= 0 or a.rounds <= 0:
        p.error(f"--modes takes {', '.join(MODES)}; --streams, --seconds and --rounds must be > 0")
    return a


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    args = parse()
    if args.serve:
        asyncio.run(serve(args.serve, args.pacer))
    else:
        asyncio.run(main(args))

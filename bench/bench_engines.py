"""Benchmark of engine pools: KV event ingestion from a real ZMQ socket, and TTFT through the mesh.

Measures, in one run: (1) vLLM KV event batches (encoded exactly as vLLM encodes them) applied by
the relay's engine feed in-process (decode + mesh-block rebuild + pool block set: the baseline)
and the same batches read from a real ZMQ PUB socket on loopback (the ratio to the baseline);
(2) when the engines' virtualenv exists (`make test-engines` makes it), time to first token of a
streamed completion through the global frontend next to calling the vLLM server directly, the two
interleaved in the same run. Writes bench/results/bench_engines.md.

Run: .venv/bin/python bench/bench_engines.py [--batches N] [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import zmq
import zmq.asyncio

from bench.measure import write_result
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.logs import configure_logging
from meshlaunch import free_port
from meshlaunch.vllm_wire import KVCacheEvent, encode, removed, stored
from poolrelay.engine.config import EngineWorker
from poolrelay.engine.feed import WorkerFeed, ZmqWorkerTransport
from poolrelay.engine.translate import WorkerBlocks
from poolrelay.pool_blocks import PoolBlocks

ROOT = Path(__file__).resolve().parent.parent

ENGINE_BLOCK = 32
BLOCKS_PER_EVENT = 4
REPEATS = 3


def workload(n: int) -> list[bytes]:
    """n batches: each stores 4 new engine blocks chained on the last and evicts the 4 stored 64 batches ago."""
    out = []
    parent = None
    names: list[bytes] = []
    for i in range(n):
        new = [f"b{i}-{k}".encode() for k in range(BLOCKS_PER_EVENT)]
        tokens = [(i * 131 + t) % 2048 for t in range(BLOCKS_PER_EVENT * ENGINE_BLOCK)]
        events: list[KVCacheEvent] = [stored(new, parent, tokens, ENGINE_BLOCK)]
        names.append(new)  # type: ignore[arg-type]
        if i >= 64:
            events.append(removed(names[i - 64]))
        # Chains of 16 batches, then a fresh root: prompts of 64 engine blocks.
        parent = None if i % 16 == 15 else new[-1]
        out.append(encode(*events, ts=float(i)))
    return out


def feed() -> tuple[WorkerFeed, PoolBlocks]:
    pool = PoolBlocks()
    worker = EngineWorker("w0", "http://127.0.0.1:1", "tcp://127.0.0.1:1")
    f = WorkerFeed(worker, WorkerBlocks(16), lambda w, t: pool.apply_event(w, t.stored, t.removed, t.cleared))
    return f, pool


def in_process(batches: list[bytes]) -> float:
    f, _ = feed()

    async def go():
        started = time.perf_counter()
        for seq, payload in enumerate(batches):
            await f.on_message(seq, payload)
        return time.perf_counter() - started

    elapsed = asyncio.run(go())
    assert f.counts.batches == len(batches) and f.counts.resets == 0
    return len(batches) / elapsed


def over_zmq(batches: list[bytes]) -> float:
    """Batches published on a PUB socket (another thread) and read by the relay's transport."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    ready = threading.Event()
    marks: dict[str, float] = {}

    def publish():
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind(endpoint)
        ready.wait(10)
        time.sleep(0.5)  # ZMQ's slow joiner: the subscription must reach the publisher first
        marks["start"] = time.perf_counter()
        for seq, payload in enumerate(batches):
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        time.sleep(1.0)
        pub.close(linger=1000)
        ctx.term()

    async def go():
        pool = PoolBlocks()
        done = asyncio.Event()
        applied = 0

        def apply(worker, t):
            nonlocal applied
            pool.apply_event(worker, t.stored, t.removed, t.cleared)
            applied += 1
            if applied == len(batches):
                marks["end"] = time.perf_counter()
                done.set()

        worker = EngineWorker("w0", "http://127.0.0.1:1", endpoint)
        f = WorkerFeed(worker, WorkerBlocks(16), apply)
        ctx = zmq.asyncio.Context()
        task = asyncio.create_task(ZmqWorkerTransport(ctx, worker, 1.0).run(f))
        ready.set()
        await asyncio.wait_for(done.wait(), 300)
        # From the first send to the last batch applied: sending and reading overlap.
        elapsed = marks["end"] - marks["start"]
        task.cancel()
        ctx.destroy(linger=0)
        assert f.counts.resets == 0, "the subscriber missed batches"
        return elapsed

    thread = threading.Thread(target=publish)
    thread.start()
    elapsed = asyncio.run(go())
    thread.join()
    return len(batches) / elapsed


# --- TTFT through the global frontend vs directly --------------------------------------------


def ttft_direct(url: str, prompt: list[int]) -> float:
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
    ).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if line.startswith(b"data: {") and b'"token_ids":[' in line.replace(b" ", b""):
                first = time.perf_counter() - started
                resp.read()
                return first
    raise AssertionError("no token")


def ttft_mesh(stub, prompt: list[int]) -> float:
    req = router_pb2.GenerateRequest(
        model="tiny", prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=prompt)), max_tokens=2
    )
    started = time.perf_counter()
    first = None
    for msg in stub.Generate(req, timeout=120):
        if first is None and msg.HasField("tokens"):
            first = time.perf_counter() - started
    assert first is not None
    return first


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def ttft(python: str, requests: int) -> dict[str, list[float]]:
    from meshlaunch import Mesh, ProcessGroup, command, wait_until
    from meshlaunch.vllm_engine import Engine

    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    model_dir = tmp / "model"
    import subprocess

    subprocess.run(
        [python, str(ROOT / "scripts/engines/make_model.py"), str(model_dir)], check=True, capture_output=True
    )
    group = ProcessGroup(tmp)
    try:
        engine = Engine("pool-a", free_port(), free_port(), free_port())
        engine.proc = group.start("vllm", engine.args(python, model_dir), env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        mesh = Mesh(group)
        mesh.start_discovery()
        router = mesh.start_router()
        worker = (
            f"url={engine.url},events=tcp://127.0.0.1:{engine.events},replay=tcp://127.0.0.1:{engine.replay}"
        )
        group.start(
            "relay",
            [command("poolrelay"), "serve", "--engine", "vllm", "--engine-worker", worker, "--engine-block-size",
             "32", "--discovery", mesh.discovery, "--routing-pool", "pool-a", "--routing-pool-region", "local",
             "--report-interval", "0.2"],
        )  # fmt: skip
        wait_until(engine.healthy, 900, interval=1.0, message="vLLM healthy")
        mesh.wait_routable(router, ["pool-a"], timeout=120)
        out: dict[str, list[float]] = {"direct": [], "mesh": []}
        with grpc.insecure_channel(router.address) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            for i in range(requests + 5):
                prompt = [
                    (i * 7919 + k * 31) % 2000 + 3 for k in range(128)
                ]  # no shared prefix: a full prefill
                d = ttft_direct(engine.url, prompt)
                m = ttft_mesh(stub, [(t + 1) % 2000 + 3 for t in prompt])
                if i >= 5:  # the first requests warm both paths
                    out["direct"].append(d)
                    out["mesh"].append(m)
        return out
    finally:
        group.stop_all()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()
    configure_logging("bench", "error")
    cmd = "python bench/bench_engines.py" + "".join(
        f" --{k} {v}" for k, v in (("batches", args.batches), ("requests", args.requests))
    )
    batches = workload(args.batches)
    events = sum(2 if i >= 64 else 1 for i in range(args.batches))
    base = max(in_process(batches) for _ in range(REPEATS))
    zmq_rate = max(over_zmq(batches) for _ in range(REPEATS))
    print(f"in-process: {base:,.0f} batches/s ({base * events / len(batches):,.0f} events/s)")
    print(f"over ZMQ:   {zmq_rate:,.0f} batches/s ({zmq_rate * events / len(batches):,.0f} events/s)")
    rows = [
        f"| baseline: in-process feed (decode + rebuild + pool set), batches/s | {base:,.0f} |",
        f"| baseline: KV events/s | {base * events / len(batches):,.0f} |",
        f"| from a ZMQ PUB socket on loopback, batches/s | {zmq_rate:,.0f} ({zmq_rate / base:.2f}x baseline) |",
        f"| from a ZMQ PUB socket, KV events/s | {zmq_rate * events / len(batches):,.0f} |",
    ]
    python = os.environ.get("ENGINES_PYTHON") or str(ROOT / ".venv-engines" / "bin" / "python")
    ttft_note = ""
    if Path(python).exists():
        t = ttft(python, args.requests)
        for name in ("direct", "mesh"):
            v = t[name]
            print(
                f"TTFT {name}: p50 {pct(v, 0.5) * 1000:.1f} ms, p99 {pct(v, 0.99) * 1000:.1f} ms (n={len(v)})"
            )
        d50, d99 = pct(t["direct"], 0.5), pct(t["direct"], 0.99)
        m50, m99 = pct(t["mesh"], 0.5), pct(t["mesh"], 0.99)
        rows += [
            f"| TTFT calling vLLM directly (streamed /v1/completions), p50 / p99 | {d50 * 1000:.1f} / {d99 * 1000:.1f} ms |",
            f"| TTFT through the global frontend (gRPC Generate → relay-registered vLLM pool), p50 / p99 | "
            f"{m50 * 1000:.1f} / {m99 * 1000:.1f} ms ({m50 / d50:.2f}x / {m99 / d99:.2f}x direct) |",
            f"| TTFT: added by the mesh at p50 | {(m50 - d50) * 1000:.1f} ms |",
        ]
        ttft_note = (
            f" TTFT: {len(t['direct'])} requests each way, interleaved, 128-token prompts with no shared prefix, "
            "one CPU vLLM server (tiny random Llama, block size 32) behind discovery, a relay and one global frontend."
        )
    else:
        ttft_note = f" TTFT not measured: no engines virtualenv at {python} (run `make test-engines` first)."
        print(ttft_note.strip())
    md = f"""## Engine pools: KV event ingestion and TTFT through the mesh

Command: `{cmd}` (from the repository root; part of `make bench`).
Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, shared with
other work (figures move between runs; compare ratios). Ingestion: {args.batches:,} vLLM KV event
batches ({events:,} events: each stores {BLOCKS_PER_EVENT} engine blocks of {ENGINE_BLOCK} tokens chained
on the last, and from the 65th on evicts the blocks stored 64 batches earlier), msgpack-encoded
exactly as vLLM encodes them; best of {REPEATS} runs; the ZMQ publisher is a thread of the same process.{ttft_note}

| measurement | result |
|---|---|
{chr(10).join(rows)}
"""
    write_result("bench_engines.md", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

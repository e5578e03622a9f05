"""Benchmark of the global frontend: added latency against calling the pool directly, and throughput.

One real mesh on 127.0.0.1 (discovery, one mocker pool with a high speed-up and its relay, one
global frontend). In the same run and interleaved, so both see the same machine noise:
- TTFT (time from the call to the first token message) direct to the pool's PoolFrontendService
  vs through the global frontend's Generate: p50/p99 and the ratio;
- requests per second with 16-token outputs, a closed loop of concurrent clients, direct vs
  through the frontend (bounded by time and request count).
Writes bench/results/bench_frontend.md.

Run: .venv/bin/python bench/bench_frontend.py [--ttft-requests N] [--seconds S] [--concurrency C]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from globalrouter.v1 import pool_frontend_pb2, pool_frontend_pb2_grpc, router_pb2, router_pb2_grpc
from meshlaunch import MODEL, Mesh, process_group

ROOT = Path(__file__).resolve().parent.parent

RESULT = ROOT / "bench" / "results" / "bench_frontend.md"
OUTPUT_TOKENS = 16


def prompt(i: int) -> list[int]:
    """A 128-token prompt; distinct per request so no run is a pure cache hit."""
    return [(i * 7919 + k * 31) % 30_000 for k in range(128)]


class Target:
    """Issues one streaming request and returns (ttft seconds, tokens)."""

    def __init__(self, name: str, channel: grpc.aio.Channel, via_router: bool) -> None:
        self.name = name
        self.via_router = via_router
        if via_router:
            self._stub = router_pb2_grpc.RouterServiceStub(channel)
        else:
            self._pool = pool_frontend_pb2_grpc.PoolFrontendServiceStub(channel)

    async def one(self, i: int, max_tokens: int) -> tuple[float, int]:
        tokens = prompt(i)
        started = time.perf_counter()
        ttft = None
        call: grpc.aio.UnaryStreamCall[Any, Any]
        count = 0
        if self.via_router:
            call = self._stub.Generate(
                router_pb2.GenerateRequest(
                    model=MODEL,
                    prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
                    max_tokens=max_tokens,
                ),
                timeout=30,
            )
        else:
            call = self._pool.Generate(
                pool_frontend_pb2.PoolFrontendServiceGenerateRequest(
                    request_id=f"bench-{i}", model=MODEL, token_ids=tokens, max_tokens=max_tokens
                ),
                timeout=30,
            )
        async for msg in call:
            if msg.WhichOneof("payload") == "tokens":
                if ttft is None:
                    ttft = time.perf_counter() - started
                count += len(msg.tokens.token_ids)
        return ttft or float("nan"), count


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def ttft_run(direct: Target, routed: Target, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "router": []}
    for i in range(20):  # warm-up: channels, caches, code paths
        await direct.one(10_000_000 + i, 1)
        await routed.one(20_000_000 + i, 1)
    for i in range(n):
        for target in (direct, routed) if i % 2 else (routed, direct):
            ttft, _ = await target.one(i * 2 + (target is routed), 1)
            out["router" if target is routed else "direct"].append(ttft)
    return out


async def throughput_run(
    target: Target, seconds: float, concurrency: int, max_requests: int
) -> tuple[float, int]:
    done = 0
    deadline = time.perf_counter() + seconds
    counter = iter(range(max_requests))

    async def worker() -> None:
        nonlocal done
        for i in counter:
            if time.perf_counter() >= deadline:
                return
            _, n = await target.one(30_000_000 + i, OUTPUT_TOKENS)
            assert n == OUTPUT_TOKENS
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return done / elapsed, done


async def measure(pool_address: str, router_address: str, args) -> dict:
    async with grpc.aio.insecure_channel(pool_address) as pc, grpc.aio.insecure_channel(router_address) as rc:
        direct, routed = Target("direct", pc, False), Target("router", rc, True)
        ttft = await ttft_run(direct, routed, args.ttft_requests)
        rps: dict[str, tuple[float, int]] = {}
        for target in (direct, routed, direct, routed):  # twice each, alternating; keep the better
            rate, n = await throughput_run(target, args.seconds, args.concurrency, 100_000)
            rps[target.name] = max(rps.get(target.name, (0.0, 0)), (rate, n))
        return {"ttft": ttft, "rps": rps}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ttft-requests", type=int, default=300, help="requests per side for TTFT")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per throughput run")
    parser.add_argument(
        "--concurrency", type=int, default=16, help="concurrent clients in the throughput loop"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-frontend-") as tmp, process_group(Path(tmp)) as group:
        mesh = Mesh(group)
        mesh.start_discovery()
        pool = mesh.start_pool(
            "bench-pool",
            "local",
            "--workers",
            "4",
            "--speedup",
            "1000",
            "--max-queue",
            "256",
            "--max-running-per-worker",
            "16",
        )
        router = mesh.start_router("--log-level", "warning")
        mesh.wait_routable(router, mesh.pools)
        result = asyncio.run(measure(pool.address, router.address, args))
    d, r = result["ttft"]["direct"], result["ttft"]["router"]
    d50, d99, r50, r99 = pct(d, 50), pct(d, 99), pct(r, 50), pct(r, 99)
    (drps, dn), (rrps, rn) = result["rps"]["direct"], result["rps"]["router"]
    lines = [
        f"TTFT direct to the pool:   p50 {d50 * 1e3:.2f} ms  p99 {d99 * 1e3:.2f} ms  ({len(d)} requests)",
        f"TTFT through the frontend: p50 {r50 * 1e3:.2f} ms  p99 {r99 * 1e3:.2f} ms  ({len(r)} requests)",
        f"added latency p50 {(r50 - d50) * 1e3:.2f} ms; ratio router/direct p50 {r50 / d50:.2f}x, p99 {r99 / d99:.2f}x",
        f"throughput, {OUTPUT_TOKENS}-token outputs, {args.concurrency} concurrent clients: direct {drps:.0f} req/s "
        f"({dn} requests), through the frontend {rrps:.0f} req/s ({rn} requests), ratio {rrps / drps:.2f}",
    ]
    for line in lines:
        print(line)
    cmd = (
        f".venv/bin/python bench/bench_frontend.py --ttft-requests {args.ttft_requests} --seconds {args.seconds:g} "
        f"--concurrency {args.concurrency}"
    )
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(
        "## Global frontend: added latency and throughput (`bench_frontend`)\n\n"
        f"Command: `{cmd}` on {platform.machine()} with {os.cpu_count()} cores (shared; the client, the mocker,\n"
        "its relay, discovery and the frontend all run on this machine). One mocker pool (4 workers,\n"
        "speed-up 1000) with its relay, one global frontend; the direct baseline calls the pool's\n"
        "PoolFrontendService.Generate, measured in the same run, interleaved.\n\n"
        "| measure | direct to the pool | through the global frontend | ratio |\n|---|---|---|---|\n"
        f"| TTFT p50 | {d50 * 1e3:.2f} ms | {r50 * 1e3:.2f} ms | {r50 / d50:.2f}x |\n"
        f"| TTFT p99 | {d99 * 1e3:.2f} ms | {r99 * 1e3:.2f} ms | {r99 / d99:.2f}x |\n"
        f"| requests/s ({OUTPUT_TOKENS}-token outputs, {args.concurrency} clients) | {drps:.0f} | {rrps:.0f} | "
        f"{rrps / drps:.2f} |\n\n"
        f"Added latency at p50: {(r50 - d50) * 1e3:.2f} ms (one more gRPC hop, the routing decision and a\n"
        "second stream). The throughput figure is what one frontend process sustains on this shared\n"
        "machine while the load generator competes with it for the same cores.\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

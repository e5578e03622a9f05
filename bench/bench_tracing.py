"""Benchmark of tracing's cost per request on the frontend's request path, on and off in the same run.

In-process: a global frontend's RequestPath (decide, admit over real gRPC to an in-process pool,
stream 16 tokens, count) driven directly, with tracing off and with tracing on (sample ratio 1,
exporting over OTLP/gRPC to a receiver in another process, the collector's TraceService), in
alternating rounds so both see the same machine noise. Reported: wall time per request (median
over requests) and this process's CPU time per request (the exporter's thread included: it runs in
the frontend's process too, and the on rounds' CPU includes flushing their spans). Also the cost
of the off path's checks alone (a microbench of what every request runs when tracing is off).
Writes bench/results/bench_tracing.md.

Run: .venv/bin/python -m bench.bench_tracing [--requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

from bench.measure import RESULTS
from globaldiscovery.v1 import discovery_pb2
from globalrouter.config import RouterConfig
from globalrouter.request_path import RequestPath
from globalrouter.server import create_server
from globalrouter.v1 import pool_frontend_pb2 as pf
from globalrouter.v1 import pool_frontend_pb2_grpc as pf_grpc
from meshkit import tracing
from meshkit.server import create_server as create_grpc_server
from meshkit.tracing import TracingConfig

ROOT = Path(__file__).resolve().parent.parent
RESULT = RESULTS / "bench_tracing.md"
OUTPUT_TOKENS = 16
RECEIVER = (
    "import sys, time\n"
    "from tests.tracing.otlp_receiver import OtlpReceiver\n"
    "r = OtlpReceiver()\n"
    "print(r.endpoint, flush=True)\n"
    "sys.stdin.read()\n"
    "print(len(r.spans()), flush=True)\n"
)


class QuickPool(pf_grpc.PoolFrontendServiceServicer):
    """A pool that admits at once and sends its 16 tokens with the finish in one message."""

    async def Generate(self, request, context):
        n = request.max_tokens
        tokens = pf.PoolTokens(
            token_ids=list(range(1, n + 1)),
            finish=pf.PoolFinish(reason=pf.POOL_FINISH_REASON_LENGTH, tokens_generated=n),
        )
        yield pf.PoolFrontendServiceGenerateResponse(
            admission=pf.PoolAdmission(
                worker_id="w0", prompt_blocks=len(request.token_ids) // 16, tokens=tokens
            )
        )


def prompt(i: int) -> list[int]:
    return [i % 30_000, i // 30_000] + [(i * 7919 + k * 31) % 30_000 for k in range(2, 128)]


async def one(path: RequestPath, i: int) -> float:
    started = time.perf_counter()
    run = await path.start(request_id=f"b{i}", model="m", prompt=prompt(i), max_tokens=OUTPUT_TOKENS)
    got = 0
    async with run as outputs:
        async for out in outputs:
            got += len(out.token_ids)
    assert got == OUTPUT_TOKENS
    return time.perf_counter() - started


MODES = {"off": None, "on": 1.0, "sampled out": 0.0}
"""Mode -> sample ratio (None: tracing off). Sampled out: tracing on at ratio 0, what most requests
pay under a low ratio (non-recording spans, the unsampled context still sent to the pool)."""


async def run_round(
    path: RequestPath, start: int, n: int, endpoint: str | None, ratio: float = 1.0
) -> tuple[list[float], float]:
    """(wall seconds per request, CPU seconds of the whole round)."""
    cpu = time.process_time()
    if endpoint:
        tracing.setup("bench", TracingConfig(otlp_endpoint=endpoint, sample_ratio=ratio))
    walls = [await one(path, start + i) for i in range(n)]
    if endpoint:
        tracing.shutdown()  # its spans go out: their export is part of the cost
    return walls, time.process_time() - cpu


def off_checks_ns() -> float:
    """What a request runs of tracing when it is off: the fronts' and the path's checks."""
    trace = None

    def per_request() -> None:
        if tracing.enabled():
            pass
        if trace is not None:  # GenerateRun: admission, stream, (migration)
            pass
        if trace is not None:
            pass
        tracing.outgoing_metadata()  # the pool call's metadata

    n = 200_000
    return min(timeit.repeat(per_request, number=n, repeat=5)) / n * 1e9


async def main_async(args, endpoint: str) -> tuple[dict[str, float], dict[str, float]]:
    def register(server):
        pf_grpc.add_PoolFrontendServiceServicer_to_server(QuickPool(), server)
        return [pf.DESCRIPTOR.services_by_name["PoolFrontendService"].full_name]

    pool = create_grpc_server("127.0.0.1:0", register)
    await pool.server.start()
    config = RouterConfig(listen="127.0.0.1:0")
    router = create_server(config)
    router.core.table.apply_listed(
        discovery_pb2.Pool(pool_id="p1", model="m", region="r1", frontends=[f"http://127.0.0.1:{pool.port}"])
    )
    path = RequestPath.of(router.core, router.links, config)  # what both fronts call
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    cpus: dict[str, float] = dict.fromkeys(MODES, 0.0)
    try:
        await run_round(path, 0, 200, None)  # warm-up: channels, code paths
        await run_round(path, 0, 200, endpoint)
        for r in range(args.rounds):
            modes = list(MODES)
            for mode in modes[r % 3 :] + modes[: r % 3]:  # the order rotates every round
                ratio = MODES[mode]
                w, c = await run_round(
                    path,
                    (r + 1) * 1_000_000,
                    args.requests,
                    endpoint if ratio is not None else None,
                    ratio or 0.0,
                )
                walls[mode].extend(w)
                cpus[mode] += c
    finally:
        await router.close()
        await router.handle.server.stop(0)
        await pool.server.stop(0)
    n = args.requests * args.rounds
    return {m: statistics.median(walls[m]) * 1e6 for m in walls}, {m: cpus[m] / n * 1e6 for m in cpus}


def report(args, med: dict[str, float], cpu: dict[str, float], exported: str) -> str:
    n = args.requests * args.rounds
    lines = [
        f"Command: `.venv/bin/python -m bench.bench_tracing --requests {args.requests} --rounds {args.rounds}` "
        f"({n} requests per mode, {OUTPUT_TOKENS} output tokens, one in-process pool over gRPC; "
        f"spans received by the OTLP receiver: {exported})",
        "",
        "| tracing | wall µs/request (median) | CPU µs/request |",
        "|---|---:|---:|",
        f"| off | {med['off']:.0f} | {cpu['off']:.0f} |",
        f"| on (ratio 1, OTLP export) | {med['on']:.0f} | {cpu['on']:.0f} |",
        f"| on, sampled out (ratio 0) | {med['sampled out']:.0f} | {cpu['sampled out']:.0f} |",
        *(
            f"| added: {mode} | {med[mode] - med['off']:+.0f} ({(med[mode] / med['off'] - 1) * 100:+.1f} %) "
            f"| {cpu[mode] - cpu['off']:+.0f} ({(cpu[mode] / cpu['off'] - 1) * 100:+.1f} %) |"
            for mode in ("on", "sampled out")
        ),
        "",
        f"Off, the tracing checks a request runs cost {off_checks_ns():.0f} ns in all (microbench; no span "
        "object is made and no opentelemetry module is imported).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="requests per mode and round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert receiver.stdout is not None and receiver.stdin is not None
    endpoint = receiver.stdout.readline().strip()
    try:
        med, cpu = asyncio.run(main_async(args, endpoint))
    finally:
        receiver.stdin.close()
        exported = receiver.stdout.readline().strip()
        receiver.wait(10)
    text = report(args, med, cpu, exported)
    RESULT.write_text("# Tracing: cost per request, on vs off (bench_tracing)\n\n" + text)
    print(text)


if __name__ == "__main__":
    main()

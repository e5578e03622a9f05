"""`globalrouter replay`: replays a trace through a live global frontend and reports routing quality.

Each trace hash id becomes a deterministic block of 512 token ids (equal ids give equal tokens,
so equal prefixes give equal block hashes at any mesh block size dividing 512); a request's
prompt is its blocks cut to `input_length`. Requests go out at their arrival time divided by
the speed-up, at most `concurrency` at once, through the Generate RPC; the figures are those of
`globalrouter simulate` measured on the mesh (hits from each GenerateSummary, converted from the
mesh's block size to the trace's 512-token blocks) plus client-side TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import grpc
import numpy as np

from globalrouter.simulate import (
    DECODE_WORK_PER_TOKEN,
    ideal_hit_rate,
    load_trace_for,
    percentile,
)
from globalrouter.trace import TRACE_BLOCK_SIZE, TraceRequest
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.blocks import DEFAULT_BLOCK_SIZE
from meshkit.channels import aio_channel
from meshkit.cli import host_port, int_at_least, positive_number

VOCAB = 50_000
"""Token ids of the replayed blocks are drawn below this."""
UNLIMITED_BLOCKS = 1 << 62


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One replay run."""

    router: str
    """HOST:PORT of the global frontend."""
    model: str = "demo-model"
    """The model every request asks for."""
    speedup: float = 1.0
    """Arrival times are divided by this."""
    concurrency: int = 64
    """Requests in flight at most (later ones wait, and their lag is reported)."""
    mesh_block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV block in the mesh (GenerateSummary counts blocks of this size)."""
    max_output_tokens: int = 0
    """Caps each request's max_tokens (0: the trace's output_length)."""
    ideal_capacity_blocks: int = 0
    """Trace blocks of the ideal single cache (0: unlimited)."""
    timeout: float = 300.0
    """Seconds per request."""
    outcomes_path: str = ""
    """Writes one JSON line per request (index, pools, cached_blocks, ttft, ...) here, if set."""
    explain: bool = False
    """Asks Route (the dry run) right before each Generate and keeps its ranking in the outcome,
    to see what the frontend believed when it chose (costs one more decision per request)."""


@dataclass(slots=True)
class Outcome:
    """What one replayed request came back with."""

    index: int
    code: str = "OK"
    ttft: float | None = None
    latency: float = 0.0
    lag: float = 0.0
    cached_blocks: int = 0
    prompt_blocks: int = 0
    pools: list[str] = field(default_factory=list)
    migrations: int = 0
    tokens: int = 0
    ranking: list[tuple[str, int, float, float, float, float]] = field(default_factory=list)
    """With `explain`: (pool, cached blocks, total, prefill, load, pending cost) best first."""


@dataclass(slots=True)
class ReplayResult:
    """The figures of a replay (the JSON `replay --json` prints)."""

    requests: int
    ok: int
    errors: dict[str, int]
    hit_rate: float
    """Hit trace blocks (mesh cached tokens // 512) / prompt trace blocks, over OK requests."""
    mesh_hit_rate: float
    """Sum of cached_blocks / sum of prompt_blocks as the mesh reported them."""
    ideal_hit_rate: float
    share_of_ideal: float
    ttft_p50: float
    ttft_p99: float
    latency_p50: float
    latency_p99: float
    imbalance: float
    """max / mean estimated work per pool (uncached prompt tokens + 4 x output tokens)."""
    requests_per_pool: dict[str, int]
    migrations: int
    lag_p99: float
    """How late requests started against the schedule (concurrency limit or a slow client)."""
    duration: float


@lru_cache(maxsize=16_384)
def block_tokens(hash_id: int) -> tuple[int, ...]:
    """The deterministic 512 token ids a trace hash id stands for."""
    rng = np.random.default_rng(hash_id)
    return tuple(rng.integers(0, VOCAB, TRACE_BLOCK_SIZE, dtype=np.uint32).tolist())


def prompt_tokens(request: TraceRequest) -> list[int]:
    """The request's prompt: its blocks' tokens, cut to input_length."""
    out: list[int] = []
    for h in request.hash_ids:
        out.extend(block_tokens(h))
    return out[: request.input_length]


def generate_request(config: ReplayConfig, index: int, request: TraceRequest) -> router_pb2.GenerateRequest:
    """The Generate call a trace request becomes (its prompt tokens, its output capped)."""
    max_tokens = max(1, request.output_length)
    if config.max_output_tokens:
        max_tokens = min(max_tokens, config.max_output_tokens)
    return router_pb2.GenerateRequest(
        model=config.model,
        prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=prompt_tokens(request))),
        max_tokens=max_tokens,
        request_id=f"replay-{index}",
    )


async def _one(
    stub: router_pb2_grpc.RouterServiceAsyncStub,
    config: ReplayConfig,
    index: int,
    msg: router_pb2.GenerateRequest,
    scheduled: float,
) -> Outcome:
    out = Outcome(index=index)
    started = time.monotonic()
    out.lag = max(0.0, started - scheduled)
    try:
        if config.explain:
            route = await stub.Route(
                router_pb2.RouteRequest(model=msg.model, prompt=msg.prompt, max_tokens=msg.max_tokens),
                timeout=config.timeout,
            )
            out.ranking = [
                (c.pool_id, c.cached_blocks, c.total_cost, c.prefill_cost, c.load_cost, c.pending_cost)
                for c in route.candidates
            ]
        async for response in stub.Generate(msg, timeout=config.timeout):
            if response.WhichOneof("payload") == "tokens":
                if out.ttft is None and response.tokens.token_ids:
                    out.ttft = time.monotonic() - started
                out.tokens += len(response.tokens.token_ids)
            else:
                s = response.summary
                out.cached_blocks = s.cached_blocks
                out.prompt_blocks = s.prompt_blocks
                out.pools = list(s.pools)
                out.migrations = s.migrations
    except grpc.aio.AioRpcError as exc:
        out.code = exc.code().name
    out.latency = time.monotonic() - started
    return out


async def replay(trace: Sequence[TraceRequest], config: ReplayConfig) -> ReplayResult:
    """Replays `trace` (already cut to the limit) through the frontend at `config.router`."""
    limiter = asyncio.Semaphore(config.concurrency)
    outcomes: list[Outcome] = []
    # Built before the clock starts: building a long prompt's tokens and message takes
    # milliseconds, and doing it on schedule made the client fall seconds behind a fast replay
    # (bursts the trace does not have).
    messages = [generate_request(config, i, r) for i, r in enumerate(trace)]
    started = time.monotonic()
    base = trace[0].arrival if trace else 0.0
    async with aio_channel(config.router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)

        async def run(i: int, r: TraceRequest, scheduled: float) -> None:
            try:
                outcomes.append(await _one(stub, config, i, messages[i], scheduled))
            finally:
                limiter.release()

        tasks = []
        for i, r in enumerate(trace):
            scheduled = started + (r.arrival - base) / config.speedup
            delay = scheduled - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await limiter.acquire()
            tasks.append(asyncio.create_task(run(i, r, scheduled)))
        await asyncio.gather(*tasks)
    if config.outcomes_path:
        await asyncio.to_thread(write_outcomes, config.outcomes_path, outcomes)
    return summarize(trace, outcomes, config, time.monotonic() - started)


def write_outcomes(path: str, outcomes: Sequence[Outcome]) -> None:
    """One JSON object per request, in trace order (for comparing placements with the simulator)."""
    with open(path, "w", encoding="utf-8") as f:
        for o in sorted(outcomes, key=lambda o: o.index):
            f.write(json.dumps(asdict(o)) + "\n")


def summarize(
    trace: Sequence[TraceRequest], outcomes: Sequence[Outcome], config: ReplayConfig, duration: float
) -> ReplayResult:
    """Figures from the per-request outcomes."""
    ok = [o for o in outcomes if o.code == "OK"]
    hit = blocks = mesh_cached = mesh_prompt = 0
    work: Counter[str] = Counter()
    per_pool: Counter[str] = Counter()
    for o in ok:
        r = trace[o.index]
        cached_tokens = min(o.cached_blocks * config.mesh_block_size, r.input_length)
        hit += cached_tokens // TRACE_BLOCK_SIZE
        blocks += len(r.hash_ids)
        mesh_cached += o.cached_blocks
        mesh_prompt += o.prompt_blocks
        if o.pools:
            per_pool[o.pools[0]] += 1
            work[o.pools[0]] += r.input_length - cached_tokens + DECODE_WORK_PER_TOKEN * o.tokens
    hit_rate = hit / blocks if blocks else 0.0
    served = [trace[o.index] for o in sorted(ok, key=lambda o: o.index)]
    ideal = ideal_hit_rate(served, config.ideal_capacity_blocks or UNLIMITED_BLOCKS)
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    latencies = [o.latency for o in ok]
    mean_work = sum(work.values()) / len(work) if work else 0.0
    return ReplayResult(
        requests=len(outcomes),
        ok=len(ok),
        errors=dict(Counter(o.code for o in outcomes if o.code != "OK")),
        hit_rate=hit_rate,
        mesh_hit_rate=mesh_cached / mesh_prompt if mesh_prompt else 0.0,
        ideal_hit_rate=ideal,
        share_of_ideal=hit_rate / ideal if ideal else 1.0,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        latency_p50=percentile(latencies, 50),
        latency_p99=percentile(latencies, 99),
        imbalance=max(work.values()) / mean_work if mean_work else 1.0,
        requests_per_pool=dict(sorted(per_pool.items())),
        migrations=sum(o.migrations for o in ok),
        lag_p99=percentile([o.lag for o in outcomes], 99),
        duration=duration,
    )


# ---- command line ------------------------------------------------------------------------------
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay a trace through a live global frontend and report routing quality and TTFT",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", required=True, help="JSONL trace (Mooncake format)")
    p.add_argument("--router", required=True, type=host_port, help="HOST:PORT of a global frontend")
    p.add_argument("--speedup", type=positive_number, default=1.0, help="divide arrival times by this")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="only the first N requests")
    p.add_argument("--model", default="demo-model", help="model to ask for (default demo-model)")
    p.add_argument("--concurrency", type=int_at_least(1), default=64, help="requests in flight at most")
    p.add_argument(
        "--mesh-block-size",
        type=int_at_least(1),
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV block in the mesh (default {DEFAULT_BLOCK_SIZE})",
    )
    p.add_argument(
        "--max-output-tokens",
        type=int_at_least(1),
        default=0,
        help="cap each request's output (default: trace's)",
    )
    p.add_argument(
        "--ideal-capacity-blocks",
        type=int_at_least(1),
        default=0,
        help="trace blocks of the ideal single cache (default: unlimited)",
    )
    p.add_argument("--timeout", type=positive_number, default=300.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--outcomes", default="", help="write each request's outcome as a JSON line to this file")
    p.add_argument(
        "--explain",
        action="store_true",
        help="dry-run Route before each request and keep its ranking (--outcomes)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    trace = load_trace_for("replay", args.trace, args.limit)
    if trace is None:
        return 2
    config = ReplayConfig(
        router=args.router,
        model=args.model,
        speedup=args.speedup,
        concurrency=args.concurrency,
        mesh_block_size=args.mesh_block_size,
        max_output_tokens=args.max_output_tokens,
        ideal_capacity_blocks=args.ideal_capacity_blocks,
        timeout=args.timeout,
        outcomes_path=args.outcomes,
        explain=args.explain,
    )
    result = asyncio.run(replay(trace, config))
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        for key, value in asdict(result).items():
            print(f"{key:<16} {value:.4f}" if isinstance(value, float) else f"{key:<16} {value}")
    return 0 if result.ok else 1

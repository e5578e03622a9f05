"""Helpers shared by benchmarks: percentiles, interleaved TTFT runs, closed-loop throughput, a fast
mocker pool's flags, synthetic pools for the routing core, writing a result file."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Protocol

from globalrouter.pool_state import LoadSignal, PoolCapacityHint, PoolState

RESULTS = Path(__file__).resolve().parent / "results"
# A mocker pool quick and wide enough that the frontend under test, not the pool, bounds a benchmark.
FAST_POOL = ("--workers", "4", "--speedup", "1000", "--max-queue", "256", "--max-running-per-worker", "16")


class Target(Protocol):
    """One way of sending a request: returns (seconds to the first token, output tokens)."""

    name: str

    async def one(self, i: int, max_tokens: int) -> tuple[float, int]: ...


def pct(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def ttft_interleaved(a: Target, b: Target, n: int, warmup: int = 20) -> dict[str, list[float]]:
    """TTFT of `n` one-token requests per target, alternating which goes first, after a warm-up
    (channels, caches, code paths), so both see the same machine noise."""
    out: dict[str, list[float]] = {a.name: [], b.name: []}
    for i in range(warmup):
        await a.one(10_000_000 + i, 1)
        await b.one(20_000_000 + i, 1)
    for i in range(n):
        for target in (a, b) if i % 2 else (b, a):
            ttft, _ = await target.one(i * 2 + (target is b), 1)
            out[target.name].append(ttft)
    return out


async def closed_loop(
    target: Target, seconds: float, concurrency: int, max_requests: int, output_tokens: int
) -> tuple[float, int]:
    """Requests per second of `concurrency` clients each sending the next request when the last
    ends, bounded by `seconds` and `max_requests`; every reply must hold `output_tokens` tokens."""
    done = 0
    deadline = time.perf_counter() + seconds
    counter = iter(range(max_requests))

    async def worker() -> None:
        nonlocal done
        for i in counter:
            if time.perf_counter() >= deadline:
                return
            _, n = await target.one(30_000_000 + i, output_tokens)
            assert n == output_tokens, n
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - started), done


def synthetic_pool(k: int, block_size: int = 16) -> PoolState:
    """Listed pool `pool-k` of the routing-core benchmarks: KV from one relay (`pool-k/relay-0`),
    capacity and load both growing with k so that no two pools tie."""
    return PoolState(
        pool_id=f"pool-{k:02d}",
        listed=True,
        model="m",
        region="r",
        frontends=("http://127.0.0.1:1",),
        capacity=PoolCapacityHint(prefill_tokens_per_second=10_000 + 100 * k),
        block_size=block_size,
        kv_at=0.0,
        kv_sources={f"pool-{k:02d}/relay-0"},
        load=LoadSignal(prefill_tokens_in_flight=1000 * k, requests_running=k),
        load_at=0.0,
    )


def write_result(name: str, text: str) -> Path:
    """Writes bench/results/`name` (making the directory) and says so; its path."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(text)
    print(f"wrote bench/results/{name}")
    return path

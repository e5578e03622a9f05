"""The frontend's wait estimate from a mocker pool's load report against the wait requests really had.

One process, a fake clock in trace seconds, no network: POOLS mocker `Pool`s (one worker, 16
slots, a cache of CAPACITY trace blocks, prefilling R trace tokens per trace second, as
bench_replay starts them) serve the first N trace requests (outputs capped) at their arrival
times, each sent to the pool the simulator's default policy with `--wait-slo dynamo` placed it on
(as the live frontend would, roughly). At each arrival, before the request is admitted, the pool's
load report gives the estimate the frontend computes from a fresh report: (prefill_tokens_in_flight
+ decode_weight x decode_tokens_in_flight) / R. The real wait is the request's start (its prefill
beginning) minus its arrival. Printed: the ratio estimate / real over the requests that waited
(real > 0.05 s), per term, for the report as `Pool.load()` makes it and for the report that
counted a prefill in progress whole until it ended (the mocker's before issue 20's fix).

Run: .venv/bin/python bench/bench_wait_estimate.py [--trace FILE] [--requests N] [--rate R]
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

import numpy as np

from globalrouter.replay import prompt_tokens
from globalrouter.selection import SelectionConfig
from globalrouter.simulate import SimConfig, simulate
from globalrouter.trace import TRACE_BLOCK_SIZE, TraceRequest, load_trace
from globalrouter.wait_slo import WaitSlo
from meshkit.blocks import DEFAULT_BLOCK_SIZE
from meshkit.cli import int_at_least, positive_number
from meshkit.clock import FakeClock
from mocker.config import PoolConfig
from mocker.pool import Pool, Ticket

MOCKER_WORKER_RATE = 20_000.0
"""Prompt tokens per second one mocker worker prefills before its speed-up."""
TRACE_BLOCKS = TRACE_BLOCK_SIZE // DEFAULT_BLOCK_SIZE
BUSY = 0.05
"""A request that waited more than this (trace seconds) counts in the ratios."""


@dataclass(slots=True)
class Sample:
    arrival: float
    prefill: float
    """Seconds of the reported prefill (Pool.load())."""
    prefill_whole: float
    """Seconds of the prefill counted whole until it ends (the report before the fix)."""
    decode: float
    """Seconds of the weighted decode term."""
    start: float = -1.0


class _Timing:
    """The pool's timing model, noting when each request's prefill begins (its start)."""

    def __init__(self, inner, clock: FakeClock, starts: dict[asyncio.Task, Sample]) -> None:
        self.inner, self.clock, self.starts = inner, clock, starts

    def prefill_seconds(self, tokens: int) -> float:
        task = asyncio.current_task()
        sample = self.starts.get(task) if task is not None else None
        if sample is not None and sample.start < 0:
            sample.start = self.clock.monotonic()
        return self.inner.prefill_seconds(tokens)

    def token_interval(self) -> float:
        return self.inner.token_interval()


async def replay(trace: list[TraceRequest], places: list[int], args: argparse.Namespace) -> list[Sample]:
    clock = FakeClock(start=0.0)
    starts: dict[asyncio.Task, Sample] = {}
    pools = []
    for k in range(args.pools):
        pool = Pool(
            PoolConfig(
                pool_id=f"pool-{k}",
                models=("m",),
                workers=1,
                worker_capacity_blocks=args.capacity * TRACE_BLOCKS,
                speedup=args.rate / MOCKER_WORKER_RATE,
                max_queue=512,
                max_running_per_worker=16,
            ),
            clock,
        )
        pool.timing = _Timing(pool.timing, clock, starts)  # type: ignore[assignment]
        pools.append(pool)

    async def serve(pool: Pool, ticket: Ticket) -> None:
        async for _ in pool.run(ticket):
            pass

    samples: list[Sample] = []
    tasks = []
    for i, r in enumerate(trace):
        await clock.advance(r.arrival - clock.monotonic())
        pool = pools[places[i]]
        load = pool.load()
        whole = sum(t.prefill_pending for t in pool.tickets)
        sample = Sample(
            r.arrival,
            load.prefill_tokens_in_flight / args.rate,
            whole / args.rate,
            args.decode_weight * load.decode_tokens_in_flight / args.rate,
        )
        samples.append(sample)
        ticket = pool.admit(f"r{i}", "m", prompt_tokens(r), r.output_length)
        task = asyncio.ensure_future(serve(pool, ticket))
        ticket.task = task
        starts[task] = sample
        tasks.append(task)
        await clock.settle()
    while not all(t.done() for t in tasks):
        await clock.advance(0.05)
    return samples


def describe(name: str, estimate: np.ndarray, real: np.ndarray) -> str:
    busy = real > BUSY
    ratio = estimate[busy] / real[busy]
    q = np.percentile(ratio, [10, 50, 90, 99])
    return (
        f"{name}: estimate/real over {busy.sum()} requests that waited: p10 {q[0]:.2f} median {q[1]:.2f}"
        f" p90 {q[2]:.2f} p99 {q[3]:.2f}; estimate p50/p90/p99 {np.percentile(estimate, 50):.3f}/"
        f"{np.percentile(estimate, 90):.3f}/{np.percentile(estimate, 99):.3f} s;"
        f" estimate over 1.2 s: {(estimate > 1.2).sum()} requests"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="/work/shared/traces/mooncake_conversation_first_half.jsonl")
    p.add_argument("--requests", type=int_at_least(1), default=1000)
    p.add_argument("--pools", type=int_at_least(1), default=4)
    p.add_argument("--capacity", type=int_at_least(1), default=4000, help="trace blocks per pool")
    p.add_argument("--rate", type=positive_number, default=14_000.0, help="R, trace tokens per second")
    p.add_argument("--max-output-tokens", type=int_at_least(1), default=16)
    p.add_argument("--decode-weight", type=positive_number, default=SelectionConfig().decode_weight)
    args = p.parse_args()
    trace = [
        TraceRequest(
            r.arrival, r.input_length, min(max(1, r.output_length), args.max_output_tokens), r.hash_ids
        )
        for r in load_trace(args.trace, args.requests)
    ]
    sim = SimConfig(
        pools=args.pools, capacity_blocks=args.capacity, rate=args.rate, load_interval=0.8, timeline=True
    )
    slo = simulate(trace, sim, "dynamo").wait_p99
    placed = simulate(trace, sim, "default", SelectionConfig(wait_slo=WaitSlo(slo)))
    samples = asyncio.run(replay(trace, [k for _, k, _ in placed.placements], args))
    real = np.array([s.start - s.arrival for s in samples])
    prefill = np.array([s.prefill for s in samples])
    whole = np.array([s.prefill_whole for s in samples])
    decode = np.array([s.decode for s in samples])
    print(
        f"{len(samples)} requests, placements of the simulated default policy --wait-slo {slo:.3f}; real wait"
        f" p50/p90/p99 {np.percentile(real, 50):.3f}/{np.percentile(real, 90):.3f}/{np.percentile(real, 99):.3f}"
        " trace s"
    )
    print(describe("report now (prefill left)", prefill + decode, real))
    print(describe("report before (prefill whole until it ends)", whole + decode, real))
    busy = real > BUSY
    print(
        f"terms, median over the requests that waited: prefill left/real {np.median(prefill[busy] / real[busy]):.3f},"
        f" decode/real {np.median(decode[busy] / real[busy]):.3f};"
        f" decode share of the summed estimate {decode.sum() / (prefill + decode).sum():.3f}"
    )


if __name__ == "__main__":
    main()

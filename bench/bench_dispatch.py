"""Late binding (`globalrouter.dispatch`) in the simulator, against dynamo and the default in the
same run, and the cost of the dispatch queue on a decision when pools are idle.

Grid: the conversation trace (first half) at R = 6,000 (bench_conversation's load), 8,000 and
12,000 work tokens/s per pool; the synthetic trace at bench_quality's R = 8,000 ... 50,000; 8
pools x 4,000 blocks. Per load: dynamo, the default (early binding), the default under
`--wait-slo T` with T = dynamo's p99 of the same run (early binding), and the same with late
binding (`DispatchConfig.for_wait_slo(T)`) and without an SLO (late, default selection). Wait =
arrival to start, the frontend's queue included. Then SLO tracking: targets of 0.85, 1 and 1.2 x
dynamo's p99 on the conversation trace, early vs late, p99 / target, and at 0.85 and 1.2 x at every
load of the grid, late binding in queue order vs the deadline order. Then a microbench: one
decision on 8 idle pools through `DispatchQueue.enqueue` (its fast path) vs a direct
`Selector.select`, same run, same overlaps.

    .venv/bin/python bench/bench_dispatch.py [--conversation FILE] [--synthetic FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from globalrouter.budgets import BudgetExceeded, MemoryStore, TenantBudgets
from globalrouter.dispatch import DispatchConfig, DispatchQueue, DispatchRequest
from globalrouter.policy import Policy, parse
from globalrouter.pool_state import LoadSignal, PoolCapacityHint, PoolState
from globalrouter.selection import SelectionConfig, Selector
from globalrouter.simulate import SimBudgets, SimConfig, SimResult, simulate
from globalrouter.trace import TraceRequest, load_trace
from globalrouter.wait_slo import WaitSlo
from meshkit.clock import FakeClock

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TRACES = ROOT.parent / "shared" / "traces"
CONV_RATES = (6_000, 8_000, 12_000)
SYN_RATES = (8_000, 12_000, 16_000, 24_000, 50_000)
SLO_FACTORS = (0.85, 1.0, 1.2)
LATE_NO_SLO = DispatchConfig(max_queue_seconds=3600.0)
"""Late binding with the default selection (no SLO), DispatchConfig's defaults (start within 1 s,
hold 5 s: a good point of a small grid on the conversation trace at R = 6,000)."""


def late_for(
    target: float, placement: str = "rank", order: str = "fifo", feedback: bool = False
) -> DispatchConfig:
    # the simulator never sheds: a deadline beyond any wait the traces produce
    return replace(DispatchConfig.for_wait_slo(target, placement, order, feedback), max_queue_seconds=3600.0)


def case(trace: list[TraceRequest], rate: int) -> tuple[float, dict[str, SimResult]]:
    config = SimConfig(pools=8, capacity_blocks=4000, rate=rate)
    dyn = simulate(trace, config, "dynamo")
    # at light load dynamo's p99 is 0 (nobody waits): a target of at least 10 ms
    target = max(round(dyn.wait_p99, 3), 0.01)
    slo = SelectionConfig(wait_slo=WaitSlo(target))
    return target, {
        "dynamo": dyn,
        "default": simulate(trace, config, "default"),
        "default, late": simulate(trace, config, "default", dispatch=LATE_NO_SLO),
        "slo, early": simulate(trace, config, "default", slo),
        "slo, late": simulate(trace, config, "default", slo, dispatch=late_for(target)),
        "slo, late, match": simulate(trace, config, "default", slo, dispatch=late_for(target, "match")),
        "slo, late, deadline": simulate(
            trace, config, "default", slo, dispatch=late_for(target, "rank", "deadline")
        ),
        "slo, late, deadline, feedback": simulate(
            trace, config, "default", slo, dispatch=late_for(target, "rank", "deadline", feedback=True)
        ),
    }


ROWS = (
    "dynamo",
    "default",
    "default, late",
    "slo, early",
    "slo, late",
    "slo, late, match",
    "slo, late, deadline",
    "slo, late, deadline, feedback",
)


def fmt_case(name: str, rate: int, target: float, c: dict[str, SimResult]) -> str:
    cells = [f"{c[key].share_of_ideal:.4f} / {c[key].wait_p99:.3f}" for key in ROWS]
    return f"| {name} | {rate:,} | {target:.3f} | " + " | ".join(cells) + " |"


FLOOD_COPIES = 4
FLOOD_RATE = 12_000
FLOOD_QUEUE = DispatchConfig(start_within_seconds=0.0, max_queue_seconds=60.0, reserved_pools={0: 1})
"""The queue under the flood: pools take work only when idle, class 0 leaves one pool free for
class 1 and waits at most 60 s."""
FLOOD_SCAVENGER = replace(FLOOD_QUEUE, reserved_pools={0: 7})
"""The same with class 0 taking a pool only while all 8 are idle: pools do not preempt, so this
is what keeps class 1 within 1.2x of its p99 without the flood here (reserving 1, 3, 5 or 6
pools does not; BENCHMARKS.md)."""
FLOOD_WINDOW = replace(FLOOD_QUEUE, reserve_window_seconds=10.0)
"""One pool reserved, and class 0 also leaves free every pool class 1 was given work at in the
last 10 s (the window picked from 5, 10 and 20 s on the first 400 s of the flood trace)."""


def flood_mix(
    conv: list[TraceRequest], syn: list[TraceRequest]
) -> tuple[list[TraceRequest], Callable[[TraceRequest], int]]:
    """The conversation trace with a class-0 flood (FLOOD_COPIES copies of the synthetic trace
    stretched over the conversation's span, disjoint blocks), and each request's class."""
    span = conv[-1].arrival / syn[-1].arrival
    extra = [
        TraceRequest(
            r.arrival * span + c * 0.37,
            r.input_length,
            r.output_length,
            tuple(h + ((c + 1) << 40) for h in r.hash_ids),
        )
        for c in range(FLOOD_COPIES)
        for r in syn
    ]
    high = {id(r) for r in conv}
    mixed = sorted(conv + extra, key=lambda r: r.arrival)

    def prio(r: TraceRequest) -> int:
        return 1 if id(r) in high else 0

    return mixed, prio


def flood(conv: list[TraceRequest], syn: list[TraceRequest]) -> list[tuple[str, SimResult]]:
    """The conversation trace as class 1 with and without a class-0 flood (`flood_mix`), about 3x
    what the pools serve; early binding (no classes) vs late binding with classes."""
    mixed, prio = flood_mix(conv, syn)
    config = SimConfig(pools=8, capacity_blocks=4000, rate=FLOOD_RATE)
    out = []
    for label, trace, dispatch in (
        ("no flood, early", conv, None),
        ("no flood, late", conv, FLOOD_QUEUE),
        ("flood, early", mixed, None),
        ("flood, late", mixed, FLOOD_QUEUE),
        ("flood, late, reserve 7", mixed, FLOOD_SCAVENGER),
        ("flood, late, reserve 1 + 10 s window", mixed, FLOOD_WINDOW),
    ):
        r = simulate(trace, config, "default", dispatch=dispatch, priority=prio)
        out.append((label, r))
        print(f"{label}: p99 by class {r.wait_p99_by_class} shed {r.shed_by_class}", flush=True)
    return out


BUDGET_FACTOR = 10
"""The flood asks for this many times its tenant's tokens-per-minute budget (the issue's goal)."""
FINE_BUCKETS = 100
"""[budget] buckets of the row that counts the budget in finer buckets (the most a policy allows):
each bucket frees a smaller lump of allowance, more often."""
PACE_BURST_SECONDS = 1.0
"""`pace_burst_seconds` of the paced rows (DispatchConfig's default)."""
BUDGET_RESERVES = (0, 1, 2, 3, 4, 5, 6, 7)
"""Pools class 0 leaves free (`reserved_pools={0: n}`) in the search for the smallest reserve
that keeps class 1 within 1.2x of its no-flood p99 once the flood is held to its budget."""


def budget_flood(conv: list[TraceRequest], syn: list[TraceRequest], out: Path) -> int:
    """The flood of `flood` with class 0's tenant given a tokens-per-minute budget of a tenth of
    what it asks for (prompt + output tokens per minute over the trace): the frontend's own
    `TenantBudgets` refuses the rest at arrival (the refused do not come back), and only the
    admitted part competes with class 1. Class-1 wait p99 with and without it, early and late
    binding, without a reserve and with the flood bench's one pool; then the smallest reserve that
    meets 1.2x. Writes `out` (markdown) and prints the rows as they come."""
    started = time.monotonic()
    mixed, prio = flood_mix(conv, syn)
    flood_requests = [r for r in mixed if prio(r) == 0]
    seconds = mixed[-1].arrival - mixed[0].arrival
    asked = sum(r.input_length + r.output_length for r in flood_requests) / seconds * 60
    budget = round(asked / BUDGET_FACTOR)
    policy = parse(
        f'[identity."client/flood"]\npriority = 0\ntokens_per_minute = {budget}\n\n'
        '[identity."client/high"]\npriority = 1\n'
    )
    budgets = SimBudgets(policy, lambda r: "client/high" if prio(r) == 1 else "client/flood")
    admitted = asyncio.run(_admitted(flood_requests, policy))
    asked_tokens = sum(r.input_length + r.output_length for r in flood_requests)
    admitted_tokens = sum(r.input_length + r.output_length for r in admitted)
    # the same volume without the budget's bursts: every k-th flood request, k = asked / admitted tokens
    every = round(asked_tokens / admitted_tokens)
    thinned_ids = {id(r) for r in flood_requests[::every]}
    thinned = [r for r in mixed if prio(r) == 1 or id(r) in thinned_ids]
    print(
        f"budget flood: class 0 asks {asked:,.0f} tokens/min over {seconds:,.0f} s "
        f"({len(flood_requests):,} requests): budget {budget:,} tokens/min",
        flush=True,
    )
    config = SimConfig(pools=8, capacity_blocks=4000, rate=FLOOD_RATE)
    no_reserve = replace(FLOOD_QUEUE, reserved_pools={})
    rows: list[tuple[str, SimResult]] = []

    def run(
        label: str, trace: list[TraceRequest], dispatch: DispatchConfig | None, held: SimBudgets | None = None
    ) -> SimResult:
        with_budget = (held or budgets) if trace is mixed else None
        r = simulate(trace, config, "default", dispatch=dispatch, priority=prio, budgets=with_budget)
        rows.append((label, r))
        print(
            f"{label}: p99 by class {r.wait_p99_by_class} refused {r.refused_by_class} "
            f"shed {r.shed_by_class} ({r.sim_seconds:.0f} s)",
            flush=True,
        )
        return r

    base_early = run("no flood, early", conv, None).wait_p99_by_class[1]
    base_late = run("no flood, late", conv, FLOOD_QUEUE).wait_p99_by_class[1]
    run("flood at 10x budget, early", mixed, None)
    run(f"flood thinned to every {every}th request, no budget, late, no reserve", thinned, no_reserve)
    fine = SimBudgets(replace(policy, budget=replace(policy.budget, buckets=FINE_BUCKETS)), budgets.tenant)
    run(f"flood at 10x budget in {FINE_BUCKETS} buckets, late, no reserve", mixed, no_reserve, fine)
    first = {
        0: run("flood at 10x budget, late, no reserve", mixed, no_reserve),
        1: run("flood at 10x budget, late, reserve 1", mixed, FLOOD_QUEUE),
    }
    # class 0 leaves the queue no faster than its budget's rate: the budget's bursts spread out
    # (reserve 0 and 1, then more until one meets 1.2x)
    pace = {0: budget / 60.0}
    goal = 1.2 * base_late
    paced: dict[int, SimResult] = {}
    for n in BUDGET_RESERVES:
        paced[n] = run(
            f"flood at 10x budget, late, paced at its budget's rate, reserve {n}",
            mixed,
            replace(
                FLOOD_QUEUE,
                reserved_pools={0: n} if n else {},
                pace_tokens_per_second=pace,
                pace_burst_seconds=PACE_BURST_SECONDS,
            ),
        )
        if n >= 1 and paced[n].wait_p99_by_class[1] <= goal:
            break
    smallest = next((n for n, r in first.items() if r.wait_p99_by_class[1] <= goal), None)
    for n in BUDGET_RESERVES if smallest is None else ():
        if n in first:
            continue
        r = run(f"flood at 10x budget, late, reserve {n}", mixed, replace(FLOOD_QUEUE, reserved_pools={0: n}))
        if r.wait_p99_by_class[1] <= goal:
            smallest = n
            break

    def ratio(label: str, r: SimResult) -> str:
        base = base_early if label.endswith("early") else base_late
        return f"{r.wait_p99_by_class.get(1, 0.0) / base:.2f}x"

    def flood_count(label: str) -> int:
        if label.startswith("flood thinned"):
            return len(thinned_ids)
        return len(flood_requests) if label.startswith("flood") else 0

    paced_smallest = next((n for n, r in paced.items() if r.wait_p99_by_class[1] <= goal), None)
    lines = [
        "Command: `.venv/bin/python bench/bench_dispatch.py --budget-flood` "
        f"(ran {time.monotonic() - started:.0f} s; {platform.machine()}, Python {platform.python_version()}).",
        "",
        f"Class 0 (tenant `client/flood`) asks {asked:,.0f} tokens/min (prompt + output, "
        f"{len(flood_requests):,} requests over {seconds:,.0f} s); its budget, `tokens_per_minute = {budget:,}` "
        f"(1/{BUDGET_FACTOR} of that; [budget] defaults: 60 s in 10 buckets), is applied at arrival by "
        "the frontend's `TenantBudgets` over its memory store; a refused request does not come back. "
        f"Admitted: {len(admitted):,} requests, {admitted_tokens / asked_tokens:.3f} of the tokens asked "
        "(small requests fit where large ones do not, so more of the requests). "
        f"*thinned*: every {every}th flood request and no budget, about the admitted volume spread evenly "
        "(the budget admits it in bursts: what each bucket frees goes in the first second of the bucket). "
        f"*in {FINE_BUCKETS} buckets*: the same budget with `[budget] buckets = {FINE_BUCKETS}` (0.6 s buckets). "
        "Class 1 (`client/high`, no budget): the conversation trace. Late binding as in the flood "
        "table above (start only on idle pools, 60 s deadline); *reserve n*: class 0 leaves n pools free. "
        f"*paced at its budget's rate*: `pace_tokens_per_second={{0: {pace[0]:,.0f}}}` (the budget / 60 s, "
        f"`pace_burst_seconds={PACE_BURST_SECONDS:g}`; `serve --dispatch-pace 0={pace[0]:.0f}`): what the budget "
        "admits leaves the frontend's queue no faster than that.",
        "",
        "| run | class 1 wait p99 (s) | vs no flood | class 0 wait p99 (s) | class 0 refused at budget "
        "| class 0 shed in queue | class 0 served | class 1 shed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows:
        served0 = flood_count(label) - r.refused_by_class.get(0, 0) - r.shed_by_class.get(0, 0)
        lines.append(
            f"| {label} | {r.wait_p99_by_class.get(1, 0.0):.3f} | {ratio(label, r)} | "
            + (f"{r.wait_p99_by_class[0]:.3f}" if 0 in r.wait_p99_by_class else "-")
            + f" | {r.refused_by_class.get(0, 0):,} | {r.shed_by_class.get(0, 0):,} | {served0:,} "
            f"| {r.shed_by_class.get(1, 0)} |"
        )
    lines += [
        "",
        "Smallest reserve within 1.2x of the no-flood late p99: "
        + (f"**{smallest} pool(s)**." if smallest is not None else "none of 0-7."),
        "",
        "Paced at the budget's rate (reserve 0 and 1, then more until one meets 1.2x): "
        + ", ".join(
            f"reserve {n} {r.wait_p99_by_class.get(1, 0.0) / base_late:.3f}x" for n, r in paced.items()
        )
        + " of the no-flood late p99; smallest reserve within 1.2x: "
        + (f"**{paced_smallest} pool(s)**." if paced_smallest is not None else "none of 0-7."),
        "",
    ]
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


async def _admitted(requests: list[TraceRequest], policy: Policy) -> list[TraceRequest]:
    """The requests of client/flood its budget admits (the simulator's rule: TenantBudgets over a
    memory store at each arrival), for the figures of the table."""
    clock = FakeClock(start=0.0, wall_offset=0.0)
    budgets = TenantBudgets(MemoryStore(clock), policy.budget, clock)
    entry = policy.entries["client/flood"]
    out = []
    for r in requests:
        clock.set(r.arrival)
        try:
            await budgets.admit("client/flood", entry, r.input_length + r.output_length)
        except BudgetExceeded:
            continue
        out.append(r)
    return out


MICRO_REPEATS = 5


def microbench(n: int = 20_000, placement: str = "rank") -> tuple[float, float]:
    """Mean microseconds of process CPU time of one decision on 8 idle pools: (Selector.select,
    DispatchQueue.enqueue), the best of MICRO_REPEATS interleaved runs of each (CPU time, not wall
    time: on a shared machine the wall clock counts other processes' turns)."""
    now = 100.0
    pools = []
    for k in range(8):
        p = PoolState(
            pool_id=f"pool-{k}",
            listed=True,
            model="m",
            region="r",
            frontends=("http://127.0.0.1:1",),
            capacity=PoolCapacityHint(prefill_tokens_per_second=10_000),
            block_size=16,
            kv_at=now,
        )
        p.record_load(LoadSignal(), now)
        pools.append(p)
    cached = {"pool-3": 4}
    selector = Selector()
    clock = FakeClock(start=now)
    queue: DispatchQueue[int] = DispatchQueue(
        DispatchConfig(placement=placement), clock, selector, lambda: pools, lambda r, t: cached
    )

    tick = iter(range(1, 1 << 30))  # clock seconds, moving forward across the runs

    def direct() -> float:
        t0 = time.process_time()
        for k in range(n):
            t = now + next(tick)
            selector.select(pools, "m", 1000, 100, cached, t, affinity_key=k)
            # as in queued(): the pools report idle again for the next decision
            for p in pools:
                p.record_load(LoadSignal(), t)
        return (time.process_time() - t0) / n * 1e6

    def queued() -> float:
        t0 = time.process_time()
        for k in range(n):
            t = now + next(tick)
            clock.set(t)
            out = queue.enqueue(DispatchRequest(k, "m", 1000, 100, affinity_key=k))
            assert out is not None
            # the pools report idle again for the next decision
            for p in pools:
                p.record_load(LoadSignal(), t)
        return (time.process_time() - t0) / n * 1e6

    # the reset loop costs about the same in both; interleave runs, keep the best of each
    best_direct = best_queued = float("inf")
    for _ in range(MICRO_REPEATS):
        best_direct = min(best_direct, direct())
        best_queued = min(best_queued, queued())
    return best_direct, best_queued


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversation", default=str(TRACES / "mooncake_conversation_first_half.jsonl"))
    parser.add_argument("--synthetic", default=str(TRACES / "mooncake_synthetic_trace.jsonl"))
    parser.add_argument(
        "--budget-flood",
        action="store_true",
        help="only the flood at 10x its tenant's budget (writes bench/results/bench_dispatch_budget_flood.md)",
    )
    args = parser.parse_args()
    started = time.monotonic()
    conv = load_trace(args.conversation)
    syn = load_trace(args.synthetic)
    if args.budget_flood:
        return budget_flood(conv, syn, RESULTS / "bench_dispatch_budget_flood.md")
    rows = []
    cases: list[tuple[str, list[TraceRequest], int, float]] = []
    goals: list[tuple[str, int, float, float, float, float, float]] = []
    match_goals: list[tuple[str, int, float, float, float, float, float]] = []
    deadline_goals: list[tuple[str, int, float, float, float, float, float]] = []
    feedback_goals: list[tuple[str, int, float, float, float, float, float]] = []
    for name, trace, rates, goal in (
        ("conversation", conv, CONV_RATES, 0.95),
        ("synthetic", syn, SYN_RATES, 0.97),
    ):
        for rate in rates:
            target, c = case(trace, rate)
            cases.append((name, trace, rate, target))
            rows.append(fmt_case(name, rate, target, c))
            print(rows[-1], flush=True)
            dyn = c["dynamo"]
            for key, out in (
                ("slo, late", goals),
                ("slo, late, match", match_goals),
                ("slo, late, deadline", deadline_goals),
                ("slo, late, deadline, feedback", feedback_goals),
            ):
                lt = c[key]
                out.append(
                    (name, rate, goal, lt.share_of_ideal, lt.wait_p99, dyn.wait_p99, lt.wait_p99 / target)
                )
    tracking = []
    conv_config = SimConfig(pools=8, capacity_blocks=4000, rate=CONV_RATES[0])
    dyn_p99 = simulate(conv, conv_config, "dynamo").wait_p99
    for f in SLO_FACTORS:
        target = round(f * dyn_p99, 3)
        slo = SelectionConfig(wait_slo=WaitSlo(target))
        early = simulate(conv, conv_config, "default", slo)
        lt = simulate(conv, conv_config, "default", slo, dispatch=late_for(target))
        mt = simulate(conv, conv_config, "default", slo, dispatch=late_for(target, "match"))
        dl = simulate(conv, conv_config, "default", slo, dispatch=late_for(target, "rank", "deadline"))
        fb = simulate(conv, conv_config, "default", slo, dispatch=late_for(target, "rank", "deadline", True))
        tracking.append((f, target, early, lt, mt, dl, fb))
        print(
            f"slo {target}: early {early.wait_p99 / target:.3f}T late {lt.wait_p99 / target:.3f}T "
            f"match {mt.wait_p99 / target:.3f}T deadline {dl.wait_p99 / target:.3f}T",
            flush=True,
        )
    grid_tracking = []
    for name, trace, rate, dyn_target in cases:
        config = SimConfig(pools=8, capacity_blocks=4000, rate=rate)
        cells = []
        for f in (SLO_FACTORS[0], SLO_FACTORS[-1]):
            target = max(round(f * dyn_target, 3), 0.01)
            slo = SelectionConfig(wait_slo=WaitSlo(target))
            for order, feedback in (("fifo", False), ("deadline", False), ("deadline", True)):
                r = simulate(
                    trace, config, "default", slo, dispatch=late_for(target, "rank", order, feedback)
                )
                cells.append(f"{r.share_of_ideal:.4f} / {r.wait_p99 / target:.3f}")
        grid_tracking.append(f"| {name} | {rate:,} | {dyn_target:.3f} | " + " | ".join(cells) + " |")
        print(grid_tracking[-1], flush=True)
    flooded = flood(conv, syn)
    load_before = os.getloadavg()
    direct_us, queued_us = microbench()
    print(f"decision on idle pools: select {direct_us:.1f} us, enqueue {queued_us:.1f} us", flush=True)
    match_direct_us, match_queued_us = microbench(placement="match")
    print(f"match: select {match_direct_us:.1f} us, enqueue {match_queued_us:.1f} us", flush=True)
    load_after = os.getloadavg()

    def met(goals: list[tuple[str, int, float, float, float, float, float]]) -> str:
        ok = [g for g in goals if g[3] >= g[2] and g[4] <= g[5]]
        return (
            f"met at {len(ok)} of {len(goals)} loads** "
            f"({', '.join(f'{n} R = {r:,}' for n, r, *_ in ok) or 'none'}). p99 / T per load: "
            + ", ".join(f"{n[:4]} {r // 1000}k {q:.2f}" for n, r, _, _, _, _, q in goals)
        )

    near = [g for g in match_goals if g[3] >= g[2]]
    lines = [
        "## Late binding: the dispatch queue in the simulator (`bench_dispatch`)",
        "",
        f"Command: `.venv/bin/python bench/bench_dispatch.py` (traces `{Path(args.conversation).name}`, "
        f"{len(conv):,} requests, and `{Path(args.synthetic).name}`, {len(syn):,}; 8 pools x 4,000 blocks); "
        f"machine: {platform.machine()}, Python {platform.python_version()}; ran {time.monotonic() - started:.0f}s.",
        "",
        "Each cell is share_of_ideal / wait p99 (s); wait = arrival to start, the frontend's dispatch queue "
        "included. T = dynamo's p99 in the same run. *slo* = the default under `--wait-slo T`; *early* "
        "commits at arrival (today), *late* holds requests in the dispatch queue "
        "(`DispatchConfig.for_wait_slo(T)`: pools queue up to 0.85 T, a request holds out for its "
        "cached pool while that pool can start it within 1.7 T); *default, late* is late binding "
        "without an SLO (start within 1 s, hold 5 s); *late, match* is late binding with the "
        'pool-driven placement (`--dispatch-placement match`, `DispatchConfig.for_wait_slo(T, "match")`: '
        "free pools go to the queued requests with the longest prefix cached there; pools queue up "
        "to 0.2 T, a request holds out for the pool caching its prompt within 2 T, a pool left free "
        "goes to a held request whose wait costs more than its prefix saves); *late, deadline* is "
        'the rank placement with the deadline order (`--dispatch-order deadline`, `DispatchConfig.for_wait_slo(T, "rank", '
        '"deadline")`: within a class a request queued longer than T goes behind those that can still '
        "start within it, for at most 10 T; pools queue up to 0.2 T, hold 1.7 T); *deadline, feedback* "
        "adds the SLO feedback (`--dispatch-slo-feedback`: the queue depth and the hold scaled up to 64x "
        "while the wait p99 over the last 512 decisions is under T).",
        "",
        "| trace | R | T (s) | dynamo | default | default, late | slo, early | slo, late | slo, late, match "
        "| slo, late, deadline | slo, late, deadline, feedback |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "**Goals (late binding under `--wait-slo T`): share ≥ 0.95 (conversation) / 0.97 (synthetic) "
        f"with p99 ≤ dynamo's: rank placement {met(goals)}; **match placement {met(match_goals)}. "
        f"The match placement reaches the share goal alone at {len(near)} of {len(match_goals)} loads; "
        f"**the deadline order {met(deadline_goals)}; **with the feedback {met(feedback_goals)}.",
        "",
        "SLO tracking on the conversation trace (R = 6,000), p99 / target (deadline: also the "
        "p99.9 and the longest wait, s, against late's):",
        "",
        "| target (x dynamo's p99) | target (s) | early share / p99 / ratio | late share / p99 / ratio "
        "| late, match share / p99 / ratio | late, deadline share / p99 / ratio | deadline p99.9, max "
        "(late's) | deadline, feedback share / p99 / ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {f} | {t:.3f} | {e.share_of_ideal:.4f} / {e.wait_p99:.3f} / {e.wait_p99 / t:.3f} | "
            f"{lt.share_of_ideal:.4f} / {lt.wait_p99:.3f} / {lt.wait_p99 / t:.3f} | "
            f"{mt.share_of_ideal:.4f} / {mt.wait_p99:.3f} / {mt.wait_p99 / t:.3f} | "
            f"{dl.share_of_ideal:.4f} / {dl.wait_p99:.3f} / {dl.wait_p99 / t:.3f} | "
            f"{dl.wait_p999:.2f}, {dl.wait_max:.2f} ({lt.wait_p999:.2f}, {lt.wait_max:.2f}) | "
            f"{fb.share_of_ideal:.4f} / {fb.wait_p99:.3f} / {fb.wait_p99 / t:.3f} |"
            for f, t, e, lt, mt, dl, fb in tracking
        ],
        "",
        "SLO tracking across the grid (rank placement, late binding; share / p99 over target; T = dynamo's "
        "p99 at that load):",
        "",
        "| trace | R | T (s) | 0.85 T, queue order | 0.85 T, deadline | 0.85 T, deadline, feedback "
        "| 1.2 T, queue order | 1.2 T, deadline | 1.2 T, deadline, feedback |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *grid_tracking,
        "",
        f"Priority under a flood (conversation trace as class 1, R = {FLOOD_RATE:,}; class 0: "
        f"{FLOOD_COPIES} copies of the synthetic trace stretched over its span, about 3x what the pools "
        "serve; late binding: pools take work only when idle, class 0 leaves one free pool to class 1 "
        "(`reserved_pools={0: 1}`) and waits at most 60 s, then DEADLINE_EXCEEDED; *reserve 7*: "
        "class 0 takes a pool only while all 8 are idle; *10 s window*: one pool reserved and "
        "class 0 also leaves free the pools class 1 was given work at in the last 10 s, "
        "`reserve_window_seconds=10`):",
        "",
        "| run | class 1 wait p99 (s) | class 0 wait p99 (s) | class 0 shed | class 1 shed |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {label} | {r.wait_p99_by_class.get(1, 0.0):.3f} | "
            + (f"{r.wait_p99_by_class[0]:.3f}" if 0 in r.wait_p99_by_class else "-")
            + f" | {r.shed_by_class.get(0, 0)} | {r.shed_by_class.get(1, 0)} |"
            for label, r in flooded
        ],
        "",
        f"Decision on 8 idle pools (process CPU time, mean of 20,000, best of {MICRO_REPEATS}; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after, {os.cpu_count()} CPUs): "
        f"`Selector.select` {direct_us:.1f} µs, "
        f"`DispatchQueue.enqueue` (empty queue, free pool: ranks and dispatches at once) {queued_us:.1f} µs; "
        f"the queue adds **{(queued_us - direct_us) / 1000:.3f} ms** (goal ≤ 0.2 ms). With the match "
        f"placement (its fast path also finds the pool caching the longest prefix): select "
        f"{match_direct_us:.1f} µs, enqueue {match_queued_us:.1f} µs, "
        f"**{(match_queued_us - match_direct_us) / 1000:.3f} ms** added.",
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_dispatch.md").write_text("\n".join(lines))
    print(f"wrote {RESULTS / 'bench_dispatch.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

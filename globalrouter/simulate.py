"""`globalrouter simulate`: replays a trace against simulated pools through the real selection code.

The pool model (issue 5) is fixed so that results compare across tools: each pool caches blocks
in LRU order up to C blocks; a request's hit is the longest prefix of its `hash_ids` the chosen
pool holds at arrival, after which all its `hash_ids` are inserted as most recently used (in
list order); each pool serves requests first come first served at R work tokens per second; a
request's work is max(0, input_length - 512 * hit) + 4 * output_length; its wait is its start
minus its arrival.

The router side is the real one: the simulated frontend holds `PoolState`s and a `KvIndex`,
fed as relays feed them: block 0<->1 transitions published as batched deltas every
`kv_interval` seconds (the trace's hash ids are the block hashes), load reports every
`load_interval` seconds, and the frontend's own pending bookkeeping in between.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import cast

import numpy as np

from globalrouter import policy as tenant_policy
from globalrouter.budgets import BudgetExceeded, MemoryStore, TenantBudgets
from globalrouter.dispatch import (
    PLACEMENTS,
    DispatchConfig,
    Dispatched,
    DispatchQueue,
    DispatchRequest,
    Outcome,
)
from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import KvSummary
from globalrouter.policies import POLICIES, FrontendView, Policy, make_policy
from globalrouter.pool_state import LoadSignal, PoolCapacityHint, PoolState
from globalrouter.routed_prefixes import RoutedPrefixes
from globalrouter.selection import RANKINGS, SelectionConfig, Selector
from globalrouter.serve_cli import add_dispatch_slo_flags, class_rates
from globalrouter.trace import TRACE_BLOCK_SIZE, TraceError, TraceRequest, load_trace
from globalrouter.wait_slo import WaitSlo
from meshkit.cli import fraction, int_at_least, non_negative_number, positive_number
from meshkit.clock import FakeClock

DECODE_WORK_PER_TOKEN = 4
"""Work tokens per output token in the pool model (fixed by the issue)."""
SIM_MODEL = "sim-model"
KV_STATES = ("exact", "summary")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation run."""

    pools: int = 8
    """Number of identical pools."""
    capacity_blocks: int = 4000
    """KV blocks each pool's LRU holds."""
    rate: float = 12_000.0
    """Work tokens per second each pool serves."""
    load_interval: float = 1.0
    """Seconds between a pool's load reports (a relay reports periodically)."""
    kv_interval: float = 0.1
    """Seconds between a relay's KV delta batches."""
    seed: int = 0
    """Seed of the random policy."""
    timeline: bool = False
    """Record each request's placement (for plots)."""
    kv_state: str = "exact"
    """The frontend's KV state: "exact" (KvIndex) or "summary" (KvSummary, per-pool fingerprints)."""
    routed_prefix_ttl: float = 0.0
    """Trace seconds a prompt the default policy sent counts as cached at its pool before the
    pool's KV events say so (`serve --routed-prefix-ttl`); 0: off."""


@dataclass(slots=True)
class SimResult:
    """The figures of one run (the JSON `simulate --json` prints)."""

    policy: str
    requests: int
    hit_rate: float
    ideal_hit_rate: float
    share_of_ideal: float
    wait_p50: float
    wait_p99: float
    imbalance: float
    wait_mean: float = 0.0
    work_per_pool: list[float] = field(default_factory=list)
    requests_per_pool: list[int] = field(default_factory=list)
    sim_seconds: float = 0.0
    """Wall time the simulation took."""
    placements: list[tuple[float, int, float]] = field(default_factory=list)
    """(arrival, pool index, work tokens) of each request (only with SimConfig.timeline)."""
    shed: int = 0
    """Requests the late-binding queue shed (not in the hit and wait figures)."""
    queue_p99: float = 0.0
    """p99 of the time spent in the frontend's dispatch queue (late binding; part of the wait)."""
    wait_p99_by_class: dict[int, float] = field(default_factory=dict)
    """Priority class -> wait p99 of its requests (only with a `priority` function)."""
    shed_by_class: dict[int, int] = field(default_factory=dict)
    """Priority class -> requests shed (late binding with a `priority` function)."""
    refused: int = 0
    """Requests refused at arrival over their tenant's budget (`budgets`; in no other figure)."""
    refused_by_class: dict[int, int] = field(default_factory=dict)
    """Priority class -> requests refused over budget (with `budgets` and a `priority` function)."""
    wait_p999: float = 0.0
    """The 99.9th percentile of the waits (what the deadline order's late requests pay)."""
    wait_max: float = 0.0


class LruCache:
    """A block LRU of fixed capacity that records its 0<->1 transitions for the relay."""

    __slots__ = ("blocks", "capacity", "removed", "stored")

    def __init__(self, capacity: int) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.stored: list[int] = []
        self.removed: list[int] = []

    def prefix_hit(self, hash_ids: Sequence[int]) -> int:
        """Leading blocks held."""
        blocks = self.blocks
        n = 0
        for h in hash_ids:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, hash_ids: Sequence[int]) -> None:
        """All blocks become most recently used (in list order); evicts the least recent."""
        blocks = self.blocks
        for h in hash_ids:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                self.stored.append(h)
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            self.removed.append(h)

    def take_transitions(self) -> tuple[list[int], list[int]]:
        """The batch since the last call as net 0<->1 transitions, as a relay publishes them
        (poolrelay.pool_blocks): a block stored and evicted within the batch is in neither list,
        nor one evicted and stored again. (A block's events alternate, so its stores minus its
        removals is its net change.) KvSummary counts on it: its tables hold one entry per
        store, so a removal of a block it never had would take another block's entry."""
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        if not stored or not removed:
            return stored, removed
        net: dict[int, int] = {}
        for h in stored:
            net[h] = net.get(h, 0) + 1
        for h in removed:
            net[h] = net.get(h, 0) - 1
        return [h for h, n in net.items() if n > 0], [h for h, n in net.items() if n < 0]


@dataclass(slots=True)
class _Job:
    finish: float
    start: float
    work: float
    output_length: int


class SimPool:
    """One simulated pool: an LRU block cache and an FCFS server at a fixed work rate."""

    __slots__ = ("cache", "free_at", "jobs", "rate", "requests", "work")

    def __init__(self, capacity: int, rate: float) -> None:
        self.cache = LruCache(capacity)
        self.rate = rate
        self.free_at = 0.0
        self.jobs: deque[_Job] = deque()
        self.work = 0.0
        self.requests = 0

    def admit(self, request: TraceRequest, now: float | None = None) -> tuple[int, float, float]:
        """Serves a request sent to the pool at `now` (its arrival when None); returns (hit
        blocks, wait seconds from its arrival, work tokens)."""
        hit = self.cache.prefix_hit(request.hash_ids)
        self.cache.insert(request.hash_ids)
        work = max(0, request.input_length - TRACE_BLOCK_SIZE * hit) + (
            DECODE_WORK_PER_TOKEN * request.output_length
        )
        start = max(request.arrival if now is None else now, self.free_at)
        self.free_at = start + work / self.rate
        self.jobs.append(_Job(self.free_at, start, work, request.output_length))
        self.work += work
        self.requests += 1
        return hit, start - request.arrival, work

    def load(self, now: float) -> LoadSignal:
        """The load report a relay would read at `now`: remaining work split into the prefill
        left and the output tokens left of each unfinished request."""
        jobs = self.jobs
        while jobs and jobs[0].finish <= now:
            jobs.popleft()
        waiting = running = 0
        prefill = decode = 0.0
        for job in jobs:
            if job.start <= now:
                running += 1
                left = (job.finish - now) * self.rate
            else:
                waiting += 1
                left = job.work
            decode_work = DECODE_WORK_PER_TOKEN * job.output_length
            if left > decode_work:
                prefill += left - decode_work
                decode += job.output_length
            else:
                decode += left / DECODE_WORK_PER_TOKEN
        return LoadSignal(
            requests_waiting=waiting,
            requests_running=running,
            prefill_tokens_in_flight=round(prefill),
            decode_tokens_in_flight=round(decode),
            kv_blocks_used=len(self.cache.blocks),
            kv_blocks_total=self.cache.capacity,
            max_running_requests=1,
        )


def ideal_hit_rate(trace: Sequence[TraceRequest], capacity_blocks: int) -> float:
    """Hit rate of one pool holding all the blocks (the same LRU model)."""
    cache = LruCache(capacity_blocks)
    hits = total = 0
    for r in trace:
        hits += cache.prefix_hit(r.hash_ids)
        total += len(r.hash_ids)
        cache.insert(r.hash_ids)
        cache.stored.clear()
        cache.removed.clear()
    return hits / total if total else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile of `values` (0 when there are none)."""
    return float(np.percentile(values, q)) if values else 0.0


def simulate(
    trace: Sequence[TraceRequest],
    config: SimConfig,
    policy_name: str = "default",
    selection: SelectionConfig | None = None,
    omniscient: Callable[[list[SimPool]], Policy] | None = None,
    dispatch: DispatchConfig | None = None,
    priority: Callable[[TraceRequest], int] | None = None,
    budgets: SimBudgets | None = None,
) -> SimResult:
    """Runs one policy over the trace and returns its figures.

    `omniscient`, when given, builds the policy from the simulated pools themselves (their true
    caches and queues): a bound for benches to compare against, never what a frontend sees.
    `dispatch`, when given, runs the default policy with late binding (`globalrouter.dispatch`):
    the frontend holds each request in its dispatch queue until a pool can start it.
    `priority`, when given, is each request's class (late binding dispatches higher first) and
    the result has per-class wait p99s. `budgets`, when given, refuses at arrival each request
    over its tenant's budget, as a frontend's gate does (it is then neither queued nor served)."""
    if dispatch is not None and (policy_name != "default" or omniscient is not None):
        raise ValueError("late binding (dispatch) runs the default policy only")
    started = time.perf_counter()
    selection = selection or SelectionConfig()
    sims = [SimPool(config.capacity_blocks, config.rate) for _ in range(config.pools)]
    policy = (
        omniscient(sims) if omniscient else make_policy(policy_name, selection, config.seed, TRACE_BLOCK_SIZE)
    )
    states = [
        PoolState(
            pool_id=f"pool-{k:02d}",
            listed=True,
            model=SIM_MODEL,
            region="sim",
            frontends=(f"http://pool-{k:02d}.sim:1",),
            capacity=PoolCapacityHint(
                max_running_requests=1,
                kv_cache_blocks=config.capacity_blocks,
                prefill_tokens_per_second=round(config.rate),
            ),
            block_size=TRACE_BLOCK_SIZE,
            kv_sources={f"pool-{k:02d}/relay-0"},
        )
        for k in range(config.pools)
    ]
    if config.kv_state not in KV_STATES:
        raise ValueError(f"kv_state must be one of {KV_STATES}, got {config.kv_state!r}")
    summary = KvSummary() if config.kv_state == "summary" else None
    # The summary answers KvIndex's calls (apply_snapshot, apply_delta, prefix_overlaps, holds).
    index = cast(KvIndex, summary) if summary is not None else KvIndex()
    for k, state in enumerate(states):
        if summary is not None:  # sized from the pool's KV capacity, as a frontend knows it
            summary.expect(f"pool-{k:02d}/relay-0", config.capacity_blocks)
        index.apply_snapshot(f"pool-{k:02d}/relay-0", ())
        state.kv_at = 0.0
    view = FrontendView(
        states,
        index,
        selection,
        RoutedPrefixes(config.routed_prefix_ttl) if config.routed_prefix_ttl > 0 else None,
    )

    next_load = 0.0
    next_kv = 0.0
    hits = blocks = 0
    waits: list[float] = []
    placements: list[tuple[float, int, float]] = []
    late: _LateStats | None = None
    class_waits: dict[int, list[float]] = {}
    gate = _BudgetGate(budgets, priority) if budgets is not None else None
    if dispatch is not None:
        late = _run_late(trace, config, selection, dispatch, sims, states, index, view, priority, gate)
        hits, blocks, waits, placements = late.hits, late.blocks, late.waits, late.placements
    for request in trace if late is None else ():
        now = request.arrival
        if gate is not None and not gate.admits(request):
            continue
        next_kv, next_load = _relay_signals(now, next_kv, next_load, config, sims, states, index)
        choice = policy.choose(view, request, now)
        hit, wait, work = sims[choice.pool].admit(request)
        if config.timeline:
            placements.append((now, choice.pool, work))
        states[choice.pool].record_sent(choice.uncached_tokens, request.output_length)
        hits += hit
        blocks += len(request.hash_ids)
        waits.append(wait)
        if priority is not None:
            class_waits.setdefault(priority(request), []).append(wait)

    if late is not None:
        class_waits = late.class_waits
    work_per_pool = [s.work for s in sims]
    mean_work = sum(work_per_pool) / len(work_per_pool) if work_per_pool else 0.0
    hit_rate = hits / blocks if blocks else 0.0
    dropped = (late.shed_ids if late is not None else set()) | (
        gate.refused_ids if gate is not None else set()
    )
    served = trace if not dropped else [r for r in trace if id(r) not in dropped]
    # the ideal of the requests served (a shed request is in neither figure)
    ideal = ideal_hit_rate(served, config.pools * config.capacity_blocks)
    return SimResult(
        policy=policy_name if late is None else f"{policy_name} (late)",
        requests=len(trace),
        hit_rate=hit_rate,
        ideal_hit_rate=ideal,
        share_of_ideal=hit_rate / ideal if ideal else 1.0,
        wait_p50=percentile(waits, 50),
        wait_p99=percentile(waits, 99),
        imbalance=max(work_per_pool) / mean_work if mean_work else 1.0,
        wait_mean=sum(waits) / len(waits) if waits else 0.0,
        work_per_pool=work_per_pool,
        requests_per_pool=[s.requests for s in sims],
        sim_seconds=time.perf_counter() - started,
        placements=placements,
        shed=late.shed if late is not None else 0,
        queue_p99=percentile(late.queued, 99) if late is not None else 0.0,
        wait_p99_by_class={c: percentile(w, 99) for c, w in sorted(class_waits.items())},
        shed_by_class=dict(sorted(late.shed_by_class.items())) if late is not None else {},
        refused=len(gate.refused_ids) if gate is not None else 0,
        refused_by_class=dict(sorted(gate.refused_by_class.items())) if gate is not None else {},
        wait_p999=percentile(waits, 99.9),
        wait_max=max(waits, default=0.0),
    )


@dataclass(slots=True)
class _LateStats:
    hits: int = 0
    blocks: int = 0
    shed: int = 0
    waits: list[float] = field(default_factory=list)
    queued: list[float] = field(default_factory=list)
    placements: list[tuple[float, int, float]] = field(default_factory=list)
    class_waits: dict[int, list[float]] = field(default_factory=dict)
    shed_by_class: dict[int, int] = field(default_factory=dict)
    shed_ids: set[int] = field(default_factory=set)


def _run_late(
    trace: Sequence[TraceRequest],
    config: SimConfig,
    selection: SelectionConfig,
    dispatch: DispatchConfig,
    sims: list[SimPool],
    states: list[PoolState],
    index: KvIndex,
    view: FrontendView,
    priority: Callable[[TraceRequest], int] | None = None,
    gate: _BudgetGate | None = None,
) -> _LateStats:
    """The simulation with late binding: events are arrivals, the relays' KV batches and load
    reports (while requests are queued) and the queue's own wake-ups; the feeds to the frontend
    are the same as without it."""
    clock = FakeClock(start=0.0)
    queue: DispatchQueue[TraceRequest] = DispatchQueue(
        dispatch,
        clock,
        Selector(selection),
        lambda: states,
        lambda req, now: view.overlaps_routed(req.payload.hash_ids, now),
    )
    index_of = {s.pool_id: k for k, s in enumerate(states)}
    stats = _LateStats()
    next_load = next_kv = 0.0

    def deliver(outcome: Outcome[TraceRequest], now: float) -> None:
        if not isinstance(outcome, Dispatched):
            stats.shed += 1
            stats.shed_ids.add(id(outcome.request.payload))
            c = outcome.request.priority
            stats.shed_by_class[c] = stats.shed_by_class.get(c, 0) + 1
            return
        request = outcome.request.payload
        k = index_of[outcome.pool.pool_id]
        view.record_routed(k, request.hash_ids, now)
        hit, wait, work = sims[k].admit(request, now)
        if config.timeline:
            stats.placements.append((request.arrival, k, work))
        stats.hits += hit
        stats.blocks += len(request.hash_ids)
        stats.waits.append(wait)
        stats.queued.append(outcome.queued_seconds)
        if priority is not None:
            stats.class_waits.setdefault(outcome.request.priority, []).append(wait)

    i, n = 0, len(trace)
    while i < n or queue.queued():
        t = trace[i].arrival if i < n else math.inf
        if queue.queued():
            wake = queue.next_wakeup()
            t = min(t, next_kv, next_load, wake if wake is not None else math.inf)
        clock.set(max(t, clock.monotonic()))
        now = clock.monotonic()
        next_kv, next_load = _relay_signals(now, next_kv, next_load, config, sims, states, index)
        while i < n and trace[i].arrival <= now:
            r = trace[i]
            i += 1
            if gate is not None and not gate.admits(r):
                continue
            outcome = queue.enqueue(
                DispatchRequest(
                    r,
                    SIM_MODEL,
                    r.input_length,
                    r.output_length,
                    r.hash_ids[0] if r.hash_ids else 0,
                    priority=priority(r) if priority is not None else 0,
                )
            )
            if outcome is not None:
                # sent (or refused) before the next arrival is ranked, as a frontend does
                deliver(outcome, now)
        for outcome in queue.poll():
            deliver(outcome, now)
    return stats


def _every_request_unchecked(_request: TraceRequest) -> str:
    return tenant_policy.UNCHECKED_KEY


@dataclass(frozen=True, slots=True)
class SimBudgets:
    """Tenant budgets at arrival, as a frontend's gate (globalrouter.tenancy) applies them: each
    request's tenant gets its policy entry (else `[default]`) and asks for prompt + max_tokens
    (here input_length + output_length, all generated: nothing to give back)."""

    policy: tenant_policy.Policy
    """The policy file's content (its [budget] settings and entries)."""
    tenant: Callable[[TraceRequest], str] = _every_request_unchecked
    """A request's policy key; by default every request is the loopback caller "unchecked"."""


class _BudgetGate:
    """The same `TenantBudgets` a frontend runs, over its memory store, on a clock at each
    arrival (wall time = trace time, so buckets start at 0)."""

    def __init__(self, budgets: SimBudgets, priority: Callable[[TraceRequest], int] | None) -> None:
        self.clock = FakeClock(start=0.0, wall_offset=0.0)
        self.budgets = TenantBudgets(MemoryStore(self.clock), budgets.policy.budget, self.clock)
        self.policy = budgets.policy
        self.tenant = budgets.tenant
        self.priority = priority
        self.refused_ids: set[int] = set()
        self.refused_by_class: dict[int, int] = {}

    def admits(self, request: TraceRequest) -> bool:
        """Whether the request fits its tenant's budget at its arrival (reserving it if so)."""
        self.clock.set(max(request.arrival, self.clock.monotonic()))
        key = self.tenant(request)
        policy = self.policy.entries.get(key, self.policy.default)
        admit = self.budgets.admit(key, policy, request.input_length + request.output_length)
        try:
            # The memory store never suspends, so the coroutine runs to its end in one step.
            admit.send(None)
        except StopIteration:
            return True
        except BudgetExceeded:
            self.refused_ids.add(id(request))
            c = self.priority(request) if self.priority is not None else 0
            self.refused_by_class[c] = self.refused_by_class.get(c, 0) + 1
            return False
        admit.close()
        raise RuntimeError("the budget admission suspended (the simulator runs the memory store only)")


# ---- command line ------------------------------------------------------------------------------


def load_trace_for(command: str, path: str, limit: int | None) -> list[TraceRequest] | None:
    """Loads a trace for a CLI command; None after printing why it cannot (exit code 2)."""
    try:
        return load_trace(path, limit)
    except (OSError, TraceError) as exc:
        print(f"globalrouter {command}: {exc}", file=sys.stderr)
        return None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a trace against simulated pools through the real selection code",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", required=True, help="JSONL trace (Mooncake format)")
    p.add_argument("--pools", type=int_at_least(1), default=8, help="number of pools (default 8)")
    p.add_argument(
        "--pool-capacity-blocks", type=int_at_least(1), default=4000, help="KV blocks per pool (default 4000)"
    )
    p.add_argument(
        "--pool-rate", type=positive_number, default=12_000.0, help="work tokens/s per pool (default 12000)"
    )
    p.add_argument(
        "--policy",
        choices=[*sorted(POLICIES), "all"],
        default="default",
        help="routing policy (default: the project's Selector); 'all' runs every policy",
    )
    p.add_argument(
        "--load-interval", type=positive_number, default=1.0, help="seconds between load reports (default 1)"
    )
    p.add_argument(
        "--kv-interval",
        type=positive_number,
        default=0.1,
        help="seconds between KV delta batches (default 0.1)",
    )
    p.add_argument(
        "--wait-slo",
        type=positive_number,
        default=None,
        metavar="SECONDS",
        help="the default policy ranks under this wait SLO, as `globalrouter serve --wait-slo` does "
        "(default: off)",
    )
    p.add_argument(
        "--wait-slo-quantile", type=fraction, default=0.99, help="quantile of --wait-slo (default 0.99)"
    )
    p.add_argument(
        "--dispatch",
        choices=("early", "late"),
        default="early",
        help="early: the default policy commits each request to a pool at arrival (as today); late: "
        "the frontend holds it in a dispatch queue until a pool can start it (globalrouter.dispatch; "
        "runs the default policy only; with --wait-slo T the queue's settings follow T)",
    )
    p.add_argument(
        "--start-within",
        type=non_negative_number,
        default=None,
        metavar="SECONDS",
        help="late: a pool takes work while its estimated backlog is at most this (default 1, or 0.85 T; "
        "match: 0.2 T)",
    )
    p.add_argument(
        "--affinity-hold",
        type=non_negative_number,
        default=None,
        metavar="SECONDS",
        help="late: a request holds out for its best pool while that pool can start it within this "
        "(default 5, or 1.7 T; match: 2 T)",
    )
    p.add_argument(
        "--dispatch-placement",
        choices=PLACEMENTS,
        default="rank",
        help="late: rank, each queued request in order takes the pool the ranking puts first; match, "
        "pool-driven: free pools go to the queued requests with the longest prefix cached there "
        "(default rank)",
    )
    add_dispatch_slo_flags(p)
    p.add_argument(
        "--dispatch-pace",
        type=class_rates,
        default="",
        metavar="CLASS=TOKENS_PER_S[,...]",
        help="late: requests of priority class CLASS leave the queue at most TOKENS_PER_S tokens per "
        "second, as `globalrouter serve --dispatch-pace` (every request here is class 0) (default: none)",
    )
    p.add_argument(
        "--routed-prefix-ttl",
        type=non_negative_number,
        default=0.0,
        metavar="SECONDS",
        help="the default policy counts a prompt it sent as cached at its pool for SECONDS (trace time) "
        "before the pool's KV events say so, as `globalrouter serve --routed-prefix-ttl` (default: off)",
    )
    p.add_argument(
        "--ranking",
        choices=tuple(RANKINGS),
        default="default",
        help="the default policy's ranking weights, as `globalrouter serve --ranking` (dynamo: the "
        "dynamo policy's cost through the frontend's Selector) (default %(default)s)",
    )
    p.add_argument(
        "--kv-state",
        choices=KV_STATES,
        default="exact",
        help="the frontend's KV state: exact (per-source index) or summary (per-pool fingerprint "
        "tables, lossy; globalrouter/kv_summary.py) (default exact)",
    )
    p.add_argument(
        "--tenant-policy",
        default=None,
        metavar="FILE",
        help="tenant policy (TOML, as `globalrouter serve --policy` reads it): its budgets refuse "
        "requests at arrival; every request is the loopback caller (the policy's "
        "[identity.unchecked], else [default]) (default: no budgets)",
    )
    p.add_argument("--limit", type=int_at_least(1), default=None, help="only the first N requests")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    p.add_argument("--json", action="store_true", help="print one JSON object (a list with --policy all)")
    p.set_defaults(func=run)


def summary(result: SimResult) -> dict:
    """The JSON object of one run (without the placements)."""
    out = asdict(result)
    out.pop("placements")
    return out


def late_dispatch_config(args: argparse.Namespace) -> DispatchConfig:
    """The dispatch queue's settings from the flags (the simulator never sheds: its deadline is
    beyond any wait the traces produce)."""
    placement = args.dispatch_placement
    if args.dispatch_order != "fifo" and not args.wait_slo:
        raise ValueError(f"--dispatch-order {args.dispatch_order} needs --wait-slo (the order's target)")
    if args.dispatch_slo_feedback and not args.wait_slo:
        raise ValueError("--dispatch-slo-feedback needs --wait-slo (the feedback's target)")
    base = (
        DispatchConfig.for_wait_slo(args.wait_slo, placement, args.dispatch_order, args.dispatch_slo_feedback)
        if args.wait_slo
        else DispatchConfig(placement=placement)
    )
    return DispatchConfig(
        placement=placement,
        start_within_seconds=base.start_within_seconds if args.start_within is None else args.start_within,
        affinity_hold_seconds=base.affinity_hold_seconds
        if args.affinity_hold is None
        else args.affinity_hold,
        max_queue_seconds=1e9,
        pace_tokens_per_second=args.dispatch_pace,
        late_after_seconds=base.late_after_seconds,
        slo_feedback=base.slo_feedback,
    )


def run(args: argparse.Namespace) -> int:
    trace = load_trace_for("simulate", args.trace, args.limit)
    if trace is None:
        return 2
    budgets = None
    if args.tenant_policy:
        try:
            budgets = SimBudgets(tenant_policy.load(args.tenant_policy))
        except tenant_policy.PolicyError as exc:
            print(f"globalrouter simulate: {exc}", file=sys.stderr)
            return 2
    config = SimConfig(
        pools=args.pools,
        capacity_blocks=args.pool_capacity_blocks,
        rate=args.pool_rate,
        load_interval=args.load_interval,
        kv_interval=args.kv_interval,
        seed=args.seed,
        kv_state=args.kv_state,
        routed_prefix_ttl=args.routed_prefix_ttl,
    )
    names = list(POLICIES) if args.policy == "all" else [args.policy]
    try:
        selection = SelectionConfig.for_ranking(
            args.ranking,
            wait_slo=WaitSlo(args.wait_slo, quantile=args.wait_slo_quantile) if args.wait_slo else None,
        )
        dispatch = late_dispatch_config(args) if args.dispatch == "late" else None
    except ValueError as exc:
        print(f"globalrouter simulate: {exc}", file=sys.stderr)
        return 2
    if dispatch is not None and args.policy not in ("default", "all"):
        print("globalrouter simulate: --dispatch late runs the default policy only", file=sys.stderr)
        return 2
    if dispatch is not None and args.policy == "default":
        names = []  # only the late run
    results = [simulate(trace, config, name, selection, budgets=budgets) for name in names]
    if dispatch is not None:
        # with --policy all: every policy as today, then the default with late binding
        results.append(simulate(trace, config, "default", selection, dispatch=dispatch, budgets=budgets))
    if args.json:
        out = [summary(r) for r in results]
        print(json.dumps(out if len(out) > 1 else out[0], indent=None))
        return 0
    print(
        f"{'policy':<14} {'requests':>8} {'hit_rate':>8} {'ideal':>7} {'share':>7} "
        f"{'wait_p50':>9} {'wait_p99':>9} {'imbalance':>9}"
    )
    for r in results:
        print(
            f"{r.policy:<14} {r.requests:>8} {r.hit_rate:>8.4f} {r.ideal_hit_rate:>7.4f} "
            f"{r.share_of_ideal:>7.4f} {r.wait_p50:>9.3f} {r.wait_p99:>9.3f} {r.imbalance:>9.3f}"
        )
    return 0


def _relay_signals(
    now: float, next_kv: float, next_load: float, config, sims, states, index
) -> tuple[float, float]:
    """What the simulated relays have sent by `now`: the KV delta batches since the last flush, then
    the last load report at or before `now` (it counts everything sent before it); returns the
    next flush and report times. One copy for early and late binding."""
    if now >= next_kv:
        tick = now - (now - next_kv) % config.kv_interval
        for k, sim in enumerate(sims):
            stored, removed = sim.cache.take_transitions()
            if stored or removed:
                index.apply_delta(f"pool-{k:02d}/relay-0", stored, removed)
            states[k].kv_at = tick
        next_kv = tick + config.kv_interval
    if now >= next_load:
        tick = now - (now - next_load) % config.load_interval
        for k, sim in enumerate(sims):
            states[k].record_load(sim.load(tick), tick)
        next_load = tick + config.load_interval
    return next_kv, next_load

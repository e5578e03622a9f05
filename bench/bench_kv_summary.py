"""KvSummary (per-pool fingerprint tables) at fleet scale, and its routing quality against KvIndex.

Measures, on one KvSummary holding `--pools` pools x `--blocks` blocks (every block of a pool a
distinct random 64-bit hash, plus a shared prompt's first 1000 >> (k mod 8) blocks on pool k),
each pool fed by `--relays` relay sources: memory (the pool tables, the arena, the process's
resident set) per (pool, block); the time to load every pool's snapshot; one 1,000,000-block
snapshot from a list of Python ints (as a telemetry stream hands it over); the decision
(`pool_overlaps` + `Selector.select` over every pool, hashing excluded) for a 1k- and a 16k-token
prompt (62 and 1,000 blocks of 16 tokens), cached and uncached, and the prefix search alone;
the same with 1,000 delta blocks pending (folded by the decision: 5 ms of 200,000 events/s);
the delta ingest rate (32 stored + 32 removed per call, round-robin over the pools, folds
included); the false-positive rate of the tables; and `globalrouter simulate --policy default`
with `--kv-state exact` and `--kv-state summary` on both shared traces.

    .venv/bin/python -m bench.bench_kv_summary [--pools 1000] [--blocks 1000000] [--relays 2]
    .venv/bin/python -m bench.bench_kv_summary --compare --pools 64 --blocks 100000 --relays 2
    .venv/bin/python -m bench.bench_kv_summary --lockstep
    .venv/bin/python -m bench.bench_kv_summary --quality
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np

from bench.measure import synthetic_pool, write_result
from globalrouter import kv_summary
from globalrouter import simulate as simulate_module
from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import KvSummary
from globalrouter.pool_state import PoolState
from globalrouter.selection import Selector, pool_overlaps
from globalrouter.simulate import SimConfig, simulate
from globalrouter.trace import load_trace

PROMPT_BLOCKS = 1000
"""A 16,000-token prompt at 16 tokens per block."""
SHORT_BLOCKS = 62
"""A 1,000-token prompt at 16 tokens per block."""
DECISIONS = 1000
DELTA_CALLS = 20_000
TRACES = Path("/work/shared/traces")
SIM_RUNS = (
    ("", SimConfig()),
    (
        "--pools 32 --pool-capacity-blocks 1000 --pool-rate 3000",
        SimConfig(pools=32, capacity_blocks=1000, rate=3000.0),
    ),
    (
        "--pools 128 --pool-capacity-blocks 250 --pool-rate 750",
        SimConfig(pools=128, capacity_blocks=250, rate=750.0),
    ),
)
"""The simulator's defaults, then the same total KV capacity and work rate split over 32 and 128 pools."""


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def timed(fn: Callable[[], object], n: int) -> tuple[float, float, float, float]:
    """(wall p50, wall p99, CPU p50, CPU p99) in microseconds of n calls (CPU: this thread's; on
    this shared host the wall clock's tail is mostly waiting for a core)."""
    wall, cpu = [], []
    for _ in range(n):
        started, started_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - started_cpu)
        wall.append(time.perf_counter() - started)
    wall.sort()
    cpu.sort()
    p50, p99 = n // 2, int(n * 0.99)
    return wall[p50] * 1e6, wall[p99] * 1e6, cpu[p50] * 1e6, cpu[p99] * 1e6


def fmt(t: tuple[float, float, float, float]) -> str:
    return f"{t[0] / 1000:.2f} / {t[1] / 1000:.2f} ms (CPU {t[2] / 1000:.2f} / {t[3] / 1000:.2f})"


def pool_states(pools: int, relays: int) -> list[PoolState]:
    out = []
    for k in range(pools):
        state = synthetic_pool(k)
        state.kv_sources = {f"pool-{k:02d}/relay-{r}" for r in range(relays)}
        out.append(state)
    return out


def fleet(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, Any]:
    pools, blocks, relays = args.pools, args.blocks, args.relays
    gc.collect()
    rss0 = rss_bytes()
    summary = KvSummary(reserve_blocks=pools * blocks)
    prompt = rng.integers(0, 2**64 - 1, PROMPT_BLOCKS, dtype=np.uint64)
    took = []
    started = time.perf_counter()
    for k in range(pools):
        held = PROMPT_BLOCKS >> (k % 8)
        own = np.concatenate((rng.integers(0, 2**64 - 1, blocks - held, dtype=np.uint64), prompt[:held]))
        t0 = time.thread_time()
        summary.apply_snapshot(f"pool-{k:02d}/relay-0", own)
        took.append(time.thread_time() - t0)
        for r in range(1, relays):  # the other replicas' streams: their deltas are skipped
            summary.apply_delta(f"pool-{k:02d}/relay-{r}", (), ())
        if k % 100 == 99:
            print(f"  {k + 1} pools loaded, {time.perf_counter() - started:.0f} s", flush=True)
    load_s = time.perf_counter() - started
    gc.collect()
    rss1 = rss_bytes()
    stats = summary.stats()
    entries = pools * blocks
    out: dict[str, Any] = {
        "entries": entries,
        "stats": stats,
        "table_per_block": stats.table_bytes / entries,
        "arena_per_block": stats.arena_bytes / entries,
        "rss_per_block": (rss1 - rss0) / entries,
        "rss_growth": rss1 - rss0,
        "load_s": load_s,
        "fleet_snapshot_cpu_p50": sorted(took)[len(took) // 2],
        "fleet_snapshot_cpu_max": max(took),
    }
    states = pool_states(pools, relays)
    selector = Selector()
    limits = selector.config.freshness
    warm = prompt.tolist()
    cold = rng.integers(0, 2**64 - 1, PROMPT_BLOCKS, dtype=np.uint64).tolist()
    assert summary.prefix_overlaps(warm)["pool-00/relay-0"] == PROMPT_BLOCKS

    def decide(p: list[int]) -> None:
        cached = pool_overlaps(cast(KvIndex, summary), states, p, 1.0, limits)
        selector.select(states, "m", 16 * len(p), 100, cached, 1.0, affinity_key=p[0])

    for name, p in (("16k cached", warm), ("16k uncached", cold), ("1k cached", warm[:SHORT_BLOCKS])):
        out[f"decision {name}"] = timed(partial(decide, p), DECISIONS)
        print(f"  decision {name}: {fmt(out[f'decision {name}'])}", flush=True)
    out["search 16k cached"] = timed(lambda: summary.prefix_overlaps(warm), DECISIONS)
    out["search 1k cached"] = timed(lambda: summary.prefix_overlaps(warm[:SHORT_BLOCKS]), DECISIONS)
    # Decisions with 1,000 delta blocks logged before each (5 ms of 200,000 events/s): the
    # decision folds them first. Only the decision is timed.
    fresh = rng.integers(0, 2**64 - 1, (DECISIONS + 1, 16, 32), dtype=np.uint64).tolist()
    wall, cpu = [], []
    for i in range(DECISIONS):
        for j in range(16):
            k = (i * 16 + j) % pools
            summary.apply_delta(f"pool-{k:02d}/relay-0", fresh[i + 1][j], fresh[i][j])
        t0, c0 = time.perf_counter(), time.thread_time()
        decide(warm)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    wall.sort()
    cpu.sort()
    n = DECISIONS
    out["decision 16k cached, 1,000 pending"] = (
        wall[n // 2] * 1e6,
        wall[int(n * 0.99)] * 1e6,
        cpu[n // 2] * 1e6,
        cpu[int(n * 0.99)] * 1e6,
    )
    # Ingest: 32 stored + 32 removed per call, round-robin over pools, folds included.
    batches = rng.integers(0, 2**64 - 1, (DELTA_CALLS + 1, 32), dtype=np.uint64).tolist()
    summary.stats()  # fold what is pending
    c0, t0 = time.thread_time(), time.perf_counter()
    for i in range(DELTA_CALLS):
        summary.apply_delta(f"pool-{i % pools:02d}/relay-0", batches[i + 1], batches[i])
    summary.stats()  # the last fold
    ingest_cpu, ingest_wall = time.thread_time() - c0, time.perf_counter() - t0
    out["ingest_events_per_cpu_s"] = DELTA_CALLS * 64 / ingest_cpu
    out["ingest_events_per_wall_s"] = DELTA_CALLS * 64 / ingest_wall
    # False positives: blocks no pool holds, probed on random pools.
    probe = rng.integers(0, 2**64 - 1, 1_000_000, dtype=np.uint64)
    on = rng.integers(0, pools, probe.size)
    on = on[summary._count[on] > 0]
    out["fp_rate"] = float(summary._held(on, kv_summary.mix(probe[: on.size])).mean())
    return out


def one_snapshot(rng: np.random.Generator, runs: int = 5) -> tuple[float, float, float, float]:
    """A 1,000,000-block snapshot from a list of Python ints replacing a pool's set: (wall p50,
    wall max, CPU p50, CPU max) in seconds over `runs`."""
    summary = KvSummary()
    wall, cpu = [], []
    for _ in range(runs):
        keys = rng.integers(0, 2**64 - 1, 1_000_000, dtype=np.uint64).tolist()
        t0, c0 = time.perf_counter(), time.thread_time()
        summary.apply_snapshot("pool-00/relay-0", keys)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    wall.sort()
    cpu.sort()
    return wall[runs // 2], wall[-1], cpu[runs // 2], cpu[-1]


def quality() -> list[tuple[str, str, float, float, str]]:
    """(trace, extra flags, share_of_ideal exact, summary, prefix searches differing) per run:
    the summary run routes with the summary while an exact index gets the same feed (_Lockstep)."""
    rows = []
    for path in sorted(TRACES.glob("*.jsonl")):
        trace = load_trace(str(path))
        for flags, config in SIM_RUNS:
            exact = simulate(trace, config)
            summary, s = lockstep_run(trace, config)
            kinds = ", ".join(f"{k}: {n}" for k, n in sorted(s.kinds.items())) or "none"
            differing = f"{s.differing:,} of {s.calls:,} ({s.over} / {s.under}; {kinds})"
            rows.append((path.name, flags, exact.share_of_ideal, summary.share_of_ideal, differing))
            print(
                f"  {path.name} {flags or '(defaults)'}: share_of_ideal exact {exact.share_of_ideal:.4f}, "
                f"summary {summary.share_of_ideal:.4f}; searches differing (pools over / under) {differing}",
                flush=True,
            )
    return rows


def quality_table(rows: list[tuple[str, str, float, float, str]]) -> list[str]:
    return [
        "| trace | flags | share_of_ideal exact | summary | summary - exact | prefix searches differing from exact (pools over / under; kinds) |",
        "|---|---|---:|---:|---:|---:|",
        *(
            f"| {t} | {fl or '(defaults: 8 pools x 4,000 blocks)'} | {e:.4f} | {s:.4f} | {s - e:+.4f} | {d} |"
            for t, fl, e, s, d in rows
        ),
    ]


def compare(pools: int, blocks: int, relays: int, rng: np.random.Generator) -> str:
    """The exact index against the summary on one small fleet, same data, same run: memory and
    the 16k- and 1k-token cached decisions (CPU p50 / p99 in µs, interleaved calls). Returns the
    Markdown section."""
    prompt = rng.integers(0, 2**64 - 1, PROMPT_BLOCKS, dtype=np.uint64)
    snaps = [
        np.concatenate(
            (
                rng.integers(0, 2**64 - 1, blocks - (PROMPT_BLOCKS >> (k % 8)), dtype=np.uint64),
                prompt[: PROMPT_BLOCKS >> (k % 8)],
            )
        ).tolist()
        for k in range(pools)
    ]
    exact, summary = KvIndex(), KvSummary()
    for k, own in enumerate(snaps):
        for r in range(relays):
            exact.apply_snapshot(f"pool-{k:02d}/relay-{r}", own)
            if r == 0:
                summary.apply_snapshot(f"pool-{k:02d}/relay-0", own)
            else:
                summary.apply_delta(f"pool-{k:02d}/relay-{r}", (), ())
    del snaps
    states = pool_states(pools, relays)
    selector = Selector()
    limits = selector.config.freshness
    warm = prompt.tolist()
    rows = []
    for label, prompt_blocks in (("16k-token prompt", PROMPT_BLOCKS), ("1k-token prompt", SHORT_BLOCKS)):
        p = warm[:prompt_blocks]
        got: tuple[list[int], list[int]] = ([], [])
        for _ in range(DECISIONS):
            for index, sink in ((exact, got[0]), (summary, got[1])):
                t0 = time.thread_time_ns()
                cached = pool_overlaps(cast(KvIndex, index), states, p, 1.0, limits)
                selector.select(states, "m", 16 * len(p), 100, cached, 1.0, affinity_key=p[0])
                sink.append(time.thread_time_ns() - t0)
        assert pool_overlaps(exact, states, p, 1.0, limits) == pool_overlaps(
            cast(KvIndex, summary), states, p, 1.0, limits
        )
        e, m = (sorted(x) for x in got)
        n = DECISIONS
        rows.append(
            f"| decision, {label} cached, CPU p50 / p99 | {e[n // 2] / 1000:.0f} / {e[int(n * 0.99)] / 1000:.0f} µs "
            f"| {m[n // 2] / 1000:.0f} / {m[int(n * 0.99)] / 1000:.0f} µs |"
        )
        print(rows[-1], flush=True)
    entries = pools * blocks
    head = [
        f"Small fleet, exact index against summary: `.venv/bin/python -m bench.bench_kv_summary --compare "
        f"--pools {pools} --blocks {blocks} --relays {relays}` (same data and run, calls interleaved, CPU "
        "time of this thread; answers checked equal):",
        "",
        "| figure | exact (KvIndex) | summary (KvSummary) |",
        "|---|---:|---:|",
        f"| bytes per (pool, block) | {exact.memory_bytes() / entries:.2f} | {summary.memory_bytes() / entries:.2f} |",
    ]
    return "\n".join(head + rows) + "\n"


class _Lockstep(KvSummary):
    """A KvSummary that also feeds an exact KvIndex the same calls and counts, per prefix
    search, the answers that differ (the simulator routes with the summary's), and per pool
    answer that differs its kind: `kinds` counts "false positive at the first missing block"
    (the summary's table holds every block up to its answer), "unchecked bound" (a binary
    search's bound not checked block by block) and "false negative" (a block the exact index
    holds that the table does not)."""

    __slots__ = ("calls", "differing", "exact", "kinds", "over", "under")

    def __init__(self) -> None:
        super().__init__()
        self.exact = KvIndex()
        self.calls = self.differing = self.over = self.under = 0
        self.kinds: dict[str, int] = {}

    def apply_snapshot(self, source: str, hashes: Iterable[int]) -> None:
        keys = list(hashes)
        super().apply_snapshot(source, keys)
        self.exact.apply_snapshot(source, keys)

    def apply_delta(self, source: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        put, drop = list(stored), list(removed)
        super().apply_delta(source, put, drop)
        self.exact.apply_delta(source, put, drop)

    def pool_lengths(self, block_hashes: Sequence[int]) -> np.ndarray | None:
        # what selection.pool_overlaps reads from a summary: compared through prefix_overlaps
        self.prefix_overlaps(block_hashes)
        return super().pool_lengths(block_hashes)

    def prefix_overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        got, want = super().prefix_overlaps(block_hashes), self.exact.prefix_overlaps(block_hashes)
        self.calls += 1
        if got != want:
            self.differing += 1
            keys = kv_summary.mix(np.array(block_hashes, np.uint64))
            for source in got.keys() | want.keys():
                g, w = got.get(source, 0), want.get(source, 0)
                self.over += g > w
                self.under += g < w
                if g == w:
                    continue
                held = self._held(np.full(keys.size, self._source_pool[source]), keys)
                if g < w:
                    kind = "false negative"
                elif held[:g].all():
                    kind = "false positive at the first missing block"
                else:
                    kind = "unchecked bound"
                self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return got


class _Perturbed(KvIndex):
    """The exact index, but at the given prefix searches one random pool's answer is one block
    longer: how much a handful of different decisions moves the simulation on its own."""

    __slots__ = ("at", "calls", "rng")

    def __init__(self, at: set[int], seed: int) -> None:
        super().__init__()
        self.at, self.calls, self.rng = at, 0, random.Random(seed)

    def prefix_overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        out = super().prefix_overlaps(block_hashes)
        self.calls += 1
        if self.calls in self.at and out:
            source = self.rng.choice(sorted(out))
            out[source] = min(len(block_hashes), out[source] + 1)
        return out


def perturbed(trace_name: str, config: SimConfig, n: int, seed: int) -> float:
    """share_of_ideal of the exact index with n random one-block overestimates (seeded)."""
    trace = load_trace(str(TRACES / trace_name))
    at = set(random.Random(seed).sample(range(1, len(trace) + 1), n))
    saved = simulate_module.KvIndex
    simulate_module.KvIndex = lambda: _Perturbed(at, seed)  # type: ignore[misc,assignment]
    try:
        return simulate(trace, config).share_of_ideal
    finally:
        simulate_module.KvIndex = saved  # type: ignore[misc]


def lockstep_run(trace: Sequence[Any], config: SimConfig) -> tuple[Any, _Lockstep]:
    """The summary simulation with an exact index fed alongside: (its result, the lockstep)."""
    made: list[_Lockstep] = []

    def factory() -> _Lockstep:
        made.append(_Lockstep())
        return made[-1]

    saved = simulate_module.KvSummary
    simulate_module.KvSummary = factory  # type: ignore[misc,assignment]
    try:
        r = simulate(trace, replace(config, kv_state="summary"))
    finally:
        simulate_module.KvSummary = saved  # type: ignore[misc]
    return r, made[0]


def lockstep(trace_name: str, config: SimConfig) -> str:
    """One summary simulation with the exact index fed alongside: how many decisions saw other
    prefixes than the exact index would have given, and in which direction."""
    r, s = lockstep_run(load_trace(str(TRACES / trace_name)), config)
    line = (
        f"{trace_name} {config.pools} pools x {config.capacity_blocks} blocks: share_of_ideal {r.share_of_ideal:.4f}; "
        f"{s.differing} of {s.calls} prefix searches differ from the exact index's (pools over: {s.over}, "
        f"under: {s.under}); the exact index with as many random one-block overestimates (seeds 1, 2, 3): "
        + ", ".join(f"{perturbed(trace_name, config, s.differing, seed):.4f}" for seed in (1, 2, 3))
    )
    print(line, flush=True)
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pools", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks per pool")
    parser.add_argument("--relays", type=int, default=2, help="relay sources per pool")
    parser.add_argument("--skip-quality", action="store_true", help="skip the simulator runs")
    parser.add_argument(
        "--quality",
        action="store_true",
        help="only the simulator runs (exact against summary, 8, 32 and 128 pools, both traces)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="only the exact index against the summary on this fleet (small)",
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="only the simulator runs with the exact index fed alongside the summary (differing answers)",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    if args.quality:
        lines = [
            "Command: `.venv/bin/python -m bench.bench_kv_summary --quality` (`globalrouter simulate --trace "
            "TRACE --policy default --kv-state exact|summary [FLAGS]`):",
            "",
            *quality_table(quality()),
        ]
        write_result("bench_kv_summary_quality.md", "\n".join(lines) + "\n")
        return 0
    if args.lockstep:
        lines = [lockstep(p.name, config) for p in sorted(TRACES.glob("*.jsonl")) for _, config in SIM_RUNS]
        write_result("bench_kv_summary_lockstep.md", "\n".join(lines) + "\n")
        return 0
    if args.compare:
        write_result("bench_kv_summary_compare.md", compare(args.pools, args.blocks, args.relays, rng))
        return 0
    print(f"fleet: {args.pools} pools x {args.blocks:,} blocks x {args.relays} relays", flush=True)
    f = fleet(args, rng)
    gc.collect()  # the fleet's arena goes before the next measurements
    snap = one_snapshot(rng)
    print(
        f"one 1M snapshot: wall p50 {snap[0]:.3f} s max {snap[1]:.3f} s, CPU p50 {snap[2]:.3f} s", flush=True
    )
    rows = [] if args.skip_quality else quality()
    stats = f["stats"]
    cmd = f".venv/bin/python -m bench.bench_kv_summary --pools {args.pools} --blocks {args.blocks} --relays {args.relays}"
    print(
        f"table {f['table_per_block']:.2f} B/(pool, block), arena {f['arena_per_block']:.2f}, RSS growth "
        f"{f['rss_per_block']:.2f}; load {f['load_s']:.0f} s; ingest {f['ingest_events_per_cpu_s']:,.0f} "
        f"events per CPU s; fp rate {f['fp_rate']:.2e}; {stats}",
        flush=True,
    )
    lines = [
        "## KV summary at fleet scale (`bench_kv_summary`)",
        "",
        f"Command: `{cmd}`; machine: {platform.machine()}, Python {platform.python_version()}, 2 cores "
        "shared with other work (wall-clock tails are mostly waiting for a core: CPU time of this thread "
        "in brackets). `globalrouter/kv_summary.py`: one two-choice fingerprint table per pool (16-bit "
        f"slots: 15-bit fingerprint + which-row bit, {kv_summary.SLOTS} slots a row), all pools' rows in one arena. Pool k "
        "holds distinct random blocks plus the prompt's first 1000 >> (k mod 8) blocks; relay-0's snapshot "
        "is applied (from a numpy array: a list of 1M Python ints per pool costs the same conversion for "
        f"every pool, measured apart below), the other {args.relays - 1} relay(s) of each pool join with "
        "an empty delta (their data would be the same pool-level set: it costs no memory). Decision = "
        "`pool_overlaps` + `Selector.select` over every pool, prompt hashing excluded.",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| (pool, block) entries | {f['entries']:,} |",
        f"| pool tables, bytes per (pool, block) | {f['table_per_block']:.2f} |",
        f"| arena (tables + unused rows), bytes per (pool, block) | {f['arena_per_block']:.2f} |",
        f"| RSS growth, bytes per (pool, block) | {f['rss_per_block']:.2f} ({f['rss_growth'] / 2**30:.2f} GiB) |",
        f"| load every pool's snapshot | {f['load_s']:.0f} s (CPU per {args.blocks:,}-block snapshot p50 "
        f"{f['fleet_snapshot_cpu_p50'] * 1e3:.0f} ms, max {f['fleet_snapshot_cpu_max'] * 1e3:.0f} ms) |",
        f"| one 1,000,000-block snapshot from a list of ints, p50 / max of 5 | {snap[0] * 1e3:.0f} / "
        f"{snap[1] * 1e3:.0f} ms (CPU {snap[2] * 1e3:.0f} / {snap[3] * 1e3:.0f}) |",
        *(
            f"| {name} p50 / p99 | {fmt(f[name])} |"
            for name in (
                "decision 16k cached",
                "decision 16k uncached",
                "decision 1k cached",
                "search 16k cached",
                "search 1k cached",
                "decision 16k cached, 1,000 pending",
            )
        ),
        f"| delta ingest (32 stored + 32 removed a call, folds included) | {f['ingest_events_per_cpu_s']:,.0f} "
        f"block events per CPU second ({f['ingest_events_per_wall_s']:,.0f} per wall second) |",
        f"| false-positive rate per probe (1M absent blocks on random pools) | {f['fp_rate']:.2e} |",
        f"| doublings / dropped blocks / skipped delta blocks | {stats.doublings} / {stats.dropped_blocks} / "
        f"{stats.skipped_deltas} |",
    ]
    if rows:
        lines += [
            "",
            "Routing quality: `globalrouter simulate --trace TRACE --policy default --kv-state exact|summary "
            "[FLAGS]` (pool model of issue 5; the summary's prefix search checks the "
            f"{kv_summary.VERIFY_TOP} longest pools block by block, so at 32 pools the others keep their bound):",
            "",
            *quality_table(rows),
        ]
    write_result("bench_kv_summary.md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

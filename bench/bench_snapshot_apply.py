"""A telemetry snapshot on the serving loop, before and after bounded steps, in one run.

Before: what the ingestion did until now, measured on the same index: the chunks' hashes
gathered as Python ints, then `KvIndex.apply_snapshot` at the last chunk (the loop blocked for
all of it), and a stream's end as `drop_source` (a pass over the whole table). After: the
TelemetryIngest path, chunks packed as they arrive and the snapshot applied at most `--step`
blocks per step of the loop (fewer when a step takes over 2 ms), and a stream's end removing its
own blocks in the same steps. The loop block is the longest single call the loop makes (a chunk's receive, or one step), in this thread's CPU time
(the wall clock's tail on a shared host is mostly waiting for a core); the index already holds
`--pools` x `--background` other blocks. A mass end (`--many` streams of `--many-blocks` each
ending at once, as in a network blip) is measured both ways too. The table is grown first so
that neither path pays a growth inside those figures.

`--growth SIZES` measures the table's growth instead: for each size, an index sized so that its
SIZE blocks fill it to just under the growth threshold takes 1,000,000-block snapshots from new
streams through TelemetryIngest's steps until the growth they start has ended; the longest loop
block (a chunk's receive, or one step) and the steps' total CPU are reported for this code and,
with `--old-src DIR` (a `git archive main` of the code before, e.g. /tmp/old-kvgrow), for that
code's KvIndex in the same run, fed the same snapshots.

    .venv/bin/python -m bench.bench_snapshot_apply [--blocks 1000000] [--pools 8] [--background 1000000]
    .venv/bin/python -m bench.bench_snapshot_apply --growth 1000000,4000000,8000000,16000000 --old-src DIR

With `--kv-state summary`, `--growth SIZES` measures a pool table's doubling in KvSummary: a pool
whose SIZE blocks fill its table to just under the doubling threshold takes deltas of 64 new
blocks (each folded, as a decision's read does), with one ingest step (`grow_step`, 8,192 rows)
after each while a growth is in progress, until the table has doubled and no growth is left;
the longest single call, the p99 and the calls' total CPU are reported for this code and
DIR's (`--old-src`, which doubles inside the write), fed the same deltas.

    .venv/bin/python -m bench.bench_snapshot_apply --growth 1000000,4000000,8000000 --kv-state summary --old-src DIR

`--compare DIR` applies 1,000,000-block snapshots through TelemetryIngest's steps to this code's
KvIndex and KvSummary and to DIR's, interleaved (`--repeat` rounds, a new stream each, into an
index already holding `--pools` x `--background` blocks and grown first), and reports each one's
CPU per snapshot (median and best of the rounds) and longest loop block: on a shared host, the
same run is the only fair comparison.

    .venv/bin/python -m bench.bench_snapshot_apply --compare DIR [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

from bench.measure import write_result
from globalrouter import kv_index
from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import KvSummary
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import TelemetryIngest
from meshkit.clock import FakeClock
from poolrelay.v1 import telemetry_pb2 as tm

CHUNK = 16_384
"""Hashes per KvSnapshot chunk, as the relay sends them (TelemetryHubConfig.chunk_size)."""


def chunks(hashes: np.ndarray, snapshot_id: int) -> list[tm.PublishPoolTelemetryRequest]:
    n = max(1, -(-hashes.size // CHUNK))
    return [
        tm.PublishPoolTelemetryRequest(
            kv_snapshot=tm.KvSnapshot(
                snapshot_id=snapshot_id,
                sequence=1,
                chunk_index=i,
                last=i == n - 1,
                block_hashes=hashes[i * CHUNK : (i + 1) * CHUNK].tolist(),
            )
        )
        for i in range(n)
    ]


def hello(pool: str, relay: str = "r") -> tm.TelemetryHello:
    return tm.TelemetryHello(
        pool_id=pool,
        relay_id=relay,
        incarnation=1,
        protocol_version=1,
        block_size=16,
        hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
    )


def run_steps(
    ingest: TelemetryIngest, step: int, each: list[float] | None = None
) -> tuple[float, float, int]:
    """Runs queued work a step at a time as the serving loop's worker does (TelemetryIngest.step):
    (total CPU seconds, longest step in CPU seconds, steps)."""
    total = longest = 0.0
    steps = 0
    more = ingest.has_work()
    while more:
        t = time.thread_time()
        more = ingest.step()
        dt = time.thread_time() - t
        total += dt
        longest = max(longest, dt)
        steps += 1
        if each is not None:
            each.append(dt)
    return total, longest, steps


def old_snapshot(index: KvIndex | KvSummary, source: str, msgs) -> tuple[float, float]:
    """The old path: (total seconds, longest single call)."""
    gathered: list[int] = []
    total = longest = 0.0
    for msg in msgs:
        t = time.thread_time()
        gathered.extend(msg.kv_snapshot.block_hashes)
        if msg.kv_snapshot.last:
            index.apply_snapshot(source, gathered)
        dt = time.thread_time() - t
        total += dt
        longest = max(longest, dt)
    return total, longest


def new_snapshot(
    ingest: TelemetryIngest, stream, msgs, step: int, each: list[float] | None = None
) -> tuple[float, float, int]:
    """The stepped path: (total seconds, longest single call, steps)."""
    total = longest = 0.0
    for msg in msgs:
        t = time.thread_time()
        ingest.receive(stream, msg)
        dt = time.thread_time() - t
        total += dt
        longest = max(longest, dt)
        if each is not None:
            each.append(dt)
    work, step_max, steps = run_steps(ingest, step, each)
    return total + work, max(longest, step_max), steps


def _growing(index) -> bool:
    return getattr(index, "_next", None) is not None or getattr(index, "_old", None) is not None


def growth_run(index_cls, size: int, step: int, snapshots: int | None) -> dict:
    """One growth at `size` blocks: 1,000,000-block snapshots from new streams through the
    stepped ingest until the growth ends (or `snapshots` of them, to feed another code the same)."""
    rng = np.random.default_rng(size)
    index = index_cls(capacity=math.ceil(size / (kv_index.MAX_LOAD - 0.002)))
    index.apply_snapshot("bg", rng.integers(0, 2**63, size, dtype=np.uint64))  # setup, not timed
    cap = index._cap
    ingest = TelemetryIngest(PoolTable(), index, FakeClock(), RouterMetrics(), step_blocks=step)
    longest = total = 0.0
    steps = k = 0
    grew = False
    each: list[float] = []
    while snapshots is None or k < snapshots:
        msgs = chunks(rng.integers(0, 2**63, 1_000_000, dtype=np.uint64), 1)
        stream = ingest.open(hello(f"g{k}"))
        took, block, n = new_snapshot(ingest, stream, msgs, step, each)
        total, longest, steps = total + took, max(longest, block), steps + n
        k += 1
        grew = grew or index._cap != cap
        if snapshots is None and grew and not _growing(index):
            break
        if snapshots is None and k >= 20:
            raise RuntimeError(f"no growth ended after {k} snapshots at {size:,} blocks")
    p99 = float(np.percentile(each, 99)) if each else 0.0
    out = {"snapshots": k, "longest": longest, "p99": p99, "total": total, "steps": steps, "grew": grew}
    del index, ingest
    gc.collect()
    return out


def summary_growth_run(summary_cls, size: int, step: int) -> dict:
    """One pool table's doubling at `size` blocks (see the module docstring): every call's CPU."""
    rng = np.random.default_rng(size)
    s = summary_cls()
    s.apply_snapshot("g/r", rng.integers(0, 2**63, size, dtype=np.uint64))  # setup, not timed
    p = s._pool_ids["g"]
    nb = int(s._nb[p])
    room = int(0.8 * 2 * nb) - size  # kv_summary.MAX_LOAD x SLOTS x buckets
    s.apply_delta("g/r", rng.integers(0, 2**63, room, dtype=np.uint64).tolist(), ())
    s.block_count("g/r")
    each: list[float] = []
    stepped = hasattr(s, "grow_step")
    while int(s._nb[p]) == nb or (stepped and s.growing()):
        batch = rng.integers(0, 2**63, 64, dtype=np.uint64).tolist()
        t = time.thread_time()
        s.apply_delta("g/r", batch, ())
        s.block_count("g/r")  # the fold (a decision's read does it)
        each.append(time.thread_time() - t)
        if stepped and s.growing():
            t = time.thread_time()
            s.grow_step(step)
            each.append(time.thread_time() - t)
        if len(each) > 100_000:
            raise RuntimeError(f"no growth ended at {size:,} blocks")
    out = {
        "calls": len(each),
        "longest": max(each),
        "p99": float(np.percentile(each, 99)),
        "total": sum(each),
        "entries": s.block_count("g/r"),
        "bytes": s.table_bytes() / s.block_count("g/r"),
    }
    del s
    gc.collect()
    return out


def summary_growth_main(args) -> int:
    sizes = [int(x) for x in args.growth.split(",") if x]
    old_cls = load_old(args.old_src, "kv_summary").KvSummary if args.old_src else None
    ms = 1e3
    lines = [
        f"Command: `.venv/bin/python -m bench.bench_snapshot_apply --growth {args.growth} --kv-state summary --step "
        f"{args.step}" + (" --old-src DIR`" if old_cls else "`") + f"; machine: {platform.machine()}, Python "
        f"{sys.version.split()[0]}, 2 shared cores. Each row: one pool whose SIZE blocks fill its table to just "
        f"under the doubling threshold takes deltas of 64 new blocks, each folded, and (this code) one "
        f"`grow_step({args.step})` after each while it grows, until the doubling has ended; CPU time of this thread "
        f"per call.",
        "",
        "| blocks in the table | longest call before | after | p99 call before | after | CPU of all those calls "
        "before | after | table bytes per block after the doubling, before / after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        new = summary_growth_run(KvSummary, size, args.step)
        old = summary_growth_run(old_cls, size, args.step) if old_cls else None
        before = f"{old['longest'] * ms:.1f} ms" if old else "-"
        before_p99 = f"{old['p99'] * ms:.2f} ms" if old else "-"
        before_total = f"{old['total'] * ms:,.0f} ms ({old['calls']} calls)" if old else "-"
        lines.append(
            f"| {size:,} | {before} | {new['longest'] * ms:.1f} ms | {before_p99} | {new['p99'] * ms:.2f} ms | "
            f"{before_total} | {new['total'] * ms:,.0f} ms ({new['calls']} calls) | "
            f"{old['bytes'] if old else float('nan'):.2f} / {new['bytes']:.2f} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    write_result("snapshot_growth_summary.md", text)
    return 0


def load_old(src: str, name: str):
    """Module `globalrouter/NAME.py` of another checkout, under a module name of its own."""
    path = Path(src) / "globalrouter" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_before", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def compare_main(args) -> int:
    """This code against DIR's, 1,000,000-block snapshots through the stepped ingest, interleaved."""
    rng = np.random.default_rng(11)
    background = [rng.integers(0, 2**63, args.background, dtype=np.uint64) for _ in range(args.pools)]
    snapshots = [rng.integers(0, 2**63, args.blocks, dtype=np.uint64) for _ in range(args.repeat)]
    msgs = [chunks(h, 1) for h in snapshots]
    ms = 1e3
    rows = []
    ones: list[str] = []
    for state in ("summary",) if args.summary_only else ("exact", "summary"):
        codes: list[tuple] = []
        for label, module in (
            ("before", load_old(args.compare, "kv_index" if state == "exact" else "kv_summary")),
            ("after", kv_index if state == "exact" else sys.modules[KvSummary.__module__]),
        ):
            if state == "summary" and not hasattr(module.KvSummary, "growing"):
                module.KvSummary.growing = lambda self: False  # DIR's has no stepped growth
            if state == "summary" and not hasattr(module.KvSummary, "settle_build"):
                module.KvSummary.settle_build = lambda self, source, budget: 0  # DIR's commit places all
            index = module.KvIndex() if state == "exact" else module.KvSummary()
            for k, h in enumerate(background):
                index.apply_snapshot(f"bg-{k}/r", h)
            if state == "exact":
                index._reserve(2 * args.blocks * args.repeat)  # grown first: the growth is measured apart
            ingest = TelemetryIngest(PoolTable(), index, FakeClock(), RouterMetrics(), step_blocks=args.step)
            ingest._summary = index if state == "summary" else None  # bench only: DIR's class is another
            codes.append((label, index, ingest, [], []))
        for r in range(args.repeat):
            for _label, _index, ingest, totals, blocks in codes:
                stream = ingest.open(hello(f"c{r}"))
                total, block, _ = new_snapshot(ingest, stream, msgs[r], args.step)
                totals.append(total)
                blocks.append(block)
                ingest.close(stream)
                run_steps(ingest, args.step)
        if state == "summary":  # the one-call path (apply_snapshot from a numpy array), interleaved
            one: dict[str, list[float]] = {label: [] for label, *_ in codes}
            for r in range(args.repeat):
                for label, index, *_ in codes:
                    t = time.thread_time()
                    index.apply_snapshot(f"one-{r}/r", snapshots[r])
                    one[label].append(time.thread_time() - t)
                    index.drop_source(f"one-{r}/r")
            for label, took in one.items():
                ones.append(
                    f"| summary, one call (`apply_snapshot`) | {label} | {np.median(took) * ms:.0f} ms | "
                    f"{min(took) * ms:.0f} ms | {max(took) * ms:.0f} ms |"
                )
                print(ones[-1], flush=True)
        for label, _index, _ingest, totals, blocks in codes:
            rows.append(
                f"| {state} | {label} | {np.median(totals) * ms:.0f} ms | {min(totals) * ms:.0f} ms | "
                f"{max(blocks) * ms:.1f} ms |"
            )
            print(rows[-1], flush=True)
        del codes
        gc.collect()
    lines = [
        f"Command: `.venv/bin/python -m bench.bench_snapshot_apply --compare DIR --repeat {args.repeat} --blocks "
        f"{args.blocks} --pools {args.pools} --background {args.background} --step {args.step}"
        + (" --summary-only" if args.summary_only else "")
        + "` (DIR: `git archive "
        f"main`); machine: {platform.machine()}, Python {sys.version.split()[0]}, 2 shared cores. CPU time of this "
        f"thread for all chunks' receives and steps of one {args.blocks:,}-block snapshot, rounds interleaved.",
        "",
        "| KV state | code | CPU per snapshot, median | best | longest loop block |",
        "|---|---|---:|---:|---:|",
        *rows,
        *ones,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    write_result("snapshot_compare_summary.md" if args.summary_only else "snapshot_compare.md", text)
    return 0


def growth_main(args) -> int:
    sizes = [int(x) for x in args.growth.split(",") if x]
    old_cls = load_old(args.old_src, "kv_index").KvIndex if args.old_src else None
    ms = 1e3
    lines = [
        f"Command: `.venv/bin/python -m bench.bench_snapshot_apply --growth {args.growth} --step {args.step}"
        + (" --old-src DIR`" if old_cls else "`")
        + f"; machine: {platform.machine()}, Python {sys.version.split()[0]}, 2 shared cores. Each row: an index "
        f"whose SIZE blocks fill it to just under the growth threshold takes 1,000,000-block snapshots from new "
        f"streams through TelemetryIngest's steps (at most {args.step:,} blocks, about 2 ms each) until the growth "
        f"ends; loop block = the longest single call (a chunk's receive or a step), CPU time of this thread.",
        "",
        "| blocks in the table | snapshots until the growth ended | longest loop block before | after | "
        "p99 loop block before | after | CPU of all those calls before | after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        new = growth_run(KvIndex, size, args.step, None)
        old = growth_run(old_cls, size, args.step, new["snapshots"]) if old_cls else None
        before = f"{old['longest'] * ms:.1f} ms" if old else "-"
        before_p99 = f"{old['p99'] * ms:.1f} ms" if old else "-"
        before_total = f"{old['total'] * ms:,.0f} ms" if old else "-"
        lines.append(
            f"| {size:,} | {new['snapshots']} | {before} | {new['longest'] * ms:.1f} ms | {before_p99} | "
            f"{new['p99'] * ms:.1f} ms | {before_total} | {new['total'] * ms:,.0f} ms ({new['steps']} steps) |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    write_result("snapshot_growth.md", text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks of the measured snapshot")
    parser.add_argument("--pools", type=int, default=8, help="other pools already in the index")
    parser.add_argument("--background", type=int, default=1_000_000, help="blocks of each other pool")
    parser.add_argument("--step", type=int, default=8192, help="blocks per step (--snapshot-step-blocks)")
    parser.add_argument("--many", type=int, default=64, help="streams ending at once")
    parser.add_argument("--many-blocks", type=int, default=10_000, help="blocks of each of them")
    parser.add_argument(
        "--growth", default="", help="measure the table's growth at these sizes (comma-separated)"
    )
    parser.add_argument("--old-src", default="", help="with --growth: a checkout whose KvIndex is 'before'")
    parser.add_argument("--compare", default="", help="compare snapshot CPU with this checkout's code")
    parser.add_argument("--repeat", type=int, default=5, help="with --compare: rounds")
    parser.add_argument("--summary-only", action="store_true", help="with --compare: KvSummary alone")
    parser.add_argument(
        "--kv-state", choices=("exact", "summary"), default="exact", help="KvIndex or KvSummary"
    )
    args = parser.parse_args()
    if args.growth and args.kv_state == "summary":
        return summary_growth_main(args)
    if args.growth:
        return growth_main(args)
    if args.compare:
        return compare_main(args)
    rng = np.random.default_rng(7)
    summary = args.kv_state == "summary"
    index: KvIndex | KvSummary = KvSummary() if summary else KvIndex()
    for k in range(args.pools):
        index.apply_snapshot(f"bg-{k}/r", rng.integers(0, 2**63, args.background, dtype=np.uint64))
    rebuild = None
    if isinstance(index, KvIndex):
        # Grow the table once for everything measured below (see the module docstring).
        room = 2 * args.blocks + 2 * args.many * args.many_blocks
        # bench only: the smallest growth the next new key would cause, timed, then room
        grow = int(kv_index.MAX_LOAD * index._cap) - index._used + 1
        t = time.thread_time()
        index._reserve(max(grow, room))
        rebuild = time.thread_time() - t
        assert index._used + room <= kv_index.MAX_LOAD * index._cap
    table = PoolTable()
    ingest = TelemetryIngest(table, index, FakeClock(), RouterMetrics(), step_blocks=args.step)
    hashes = rng.integers(0, 2**63, args.blocks, dtype=np.uint64)
    msgs = chunks(hashes, 1)

    old_total, old_block = old_snapshot(index, "old/r", msgs)
    t = time.thread_time()
    index.drop_source("old/r")
    old_end = time.thread_time() - t

    stream = ingest.open(hello("new"))
    new_total, new_block, steps = new_snapshot(ingest, stream, msgs, args.step)
    held = index.block_count(stream.source)
    assert held == args.blocks or (summary and held >= 0.999 * args.blocks), held
    t = time.thread_time()
    ingest.close(stream)
    close_call = time.thread_time() - t
    end_total, end_block, end_steps = run_steps(ingest, args.step)
    new_end_total, new_end_block = close_call + end_total, max(close_call, end_block)

    # Many streams ending at once: old = a pass over the table each; new = their own blocks.
    small = [rng.integers(0, 2**63, args.many_blocks, dtype=np.uint64) for _ in range(args.many)]
    for i, h in enumerate(small):
        index.apply_snapshot(f"many-old-{i}/r", h)
    t = time.thread_time()
    longest_old_many = 0.0
    for i in range(args.many):
        began = time.thread_time()
        index.drop_source(f"many-old-{i}/r")
        longest_old_many = max(longest_old_many, time.thread_time() - began)
    old_many = time.thread_time() - t
    streams = []
    for i, h in enumerate(small):
        s = ingest.open(hello(f"many-{i}"))
        for msg in chunks(h, 1):
            ingest.receive(s, msg)
        streams.append(s)
    run_steps(ingest, args.step)
    t = time.thread_time()
    for s in streams:
        ingest.close(s)
    closes = time.thread_time() - t
    many_total, many_block, _ = run_steps(ingest, args.step)
    assert sorted(index.sources()) == sorted(f"bg-{k}/r" for k in range(args.pools))

    size = (
        f"table {index._cap:,} slots"
        if isinstance(index, KvIndex)
        else f"arena {index.memory_bytes():,} bytes"
    )
    ms = 1e3
    lines = [
        f"Command: `.venv/bin/python -m bench.bench_snapshot_apply --kv-state {args.kv_state} --blocks {args.blocks} "
        f"--pools {args.pools} --background {args.background} --step {args.step} --many {args.many} "
        f"--many-blocks {args.many_blocks}`; "
        f"machine: {platform.machine()}, Python {sys.version.split()[0]}, 2 shared cores. Index ({args.kv_state}): "
        f"{args.pools} other pools x {args.background:,} blocks, {size}. "
        f"Loop block = the longest single call the serving loop makes for it; times are this thread's CPU time.",
        "",
        "| | before (apply at the last chunk, pass over the table) | after (packed chunks, bounded steps) |",
        "|---|---:|---:|",
        f"| snapshot of {args.blocks:,} blocks: CPU on the loop, all chunks + apply | "
        f"{old_total * ms:.0f} ms | {new_total * ms:.0f} ms ({steps} steps) |",
        f"| longest loop block during it | {old_block * ms:.0f} ms | {new_block * ms:.1f} ms |",
        f"| that stream ends: total | {old_end * ms:.1f} ms | {new_end_total * ms:.1f} ms ({end_steps} steps) |",
        f"| that stream ends: longest loop block | {old_end * ms:.1f} ms | {new_end_block * ms:.1f} ms |",
        f"| {args.many} streams of {args.many_blocks:,} blocks end at once: total | {old_many * ms:.0f} ms | "
        f"{(closes + many_total) * ms:.0f} ms |",
        f"| the same: longest loop block | {longest_old_many * ms:.1f} ms | {max(closes, many_block) * ms:.1f} ms |",
    ]
    if rebuild is not None:
        lines += [
            "",
            f"The table was grown first, at once (bench setup: {rebuild * ms:.0f} ms for its "
            f"{args.pools * args.background:,} live blocks), so that neither path pays a growth inside its "
            f"figures; growths run a step at a time (`--growth` measures them).",
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    write_result("snapshot_apply.md" if args.kv_state == "exact" else "snapshot_apply_summary.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Routing quality through the live mesh: `globalrouter replay` of the shared trace, next to the
simulator's prediction for the same requests and pool sizes, in the same run.

One real mesh on 127.0.0.1: discovery, POOLS mocker pools (one worker each, a KV cache of
CAPACITY trace blocks = CAPACITY x 32 mesh blocks of 16 tokens) with their relays, and one global
frontend. The replay sends the first N trace requests at their arrival times divided by the
replay speed-up S (outputs capped); the mocker's speed-up is chosen so that a pool prefills R
trace tokens per second of trace time (R x S / 20,000, the mocker worker's own rate being 20,000
tokens/s), so the mesh runs the load the simulator models. The baseline is `globalrouter
simulate` on the same requests with the same caps, the same R and the relays' load-report cadence
in trace time. Then the split: the live run's placements are fed through the simulator's pool
model, which separates where requests went (routing) from how the mesh cached them.
With --wait-slo T (trace seconds) the frontend runs `--wait-slo T/S` (real seconds) and the
simulator `--wait-slo T`. Writes bench/results/bench_replay.md (bench_replay_wait_slo.md with
--wait-slo).

Run: .venv/bin/python bench/bench_replay.py [--requests N] [--pools P] [--speedup S] [--runs K]
     [--wait-slo T]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from globalrouter.simulate import LruCache, ideal_hit_rate
from globalrouter.trace import TRACE_BLOCK_SIZE, TraceRequest, load_trace, write_trace
from meshkit.blocks import DEFAULT_BLOCK_SIZE
from meshlaunch import MODEL, Mesh, command, process_group

ROOT = Path(__file__).resolve().parent.parent

RESULT = ROOT / "bench" / "results" / "bench_replay.md"
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
MESH_BLOCKS_PER_TRACE_BLOCK = TRACE_BLOCK_SIZE // DEFAULT_BLOCK_SIZE
MOCKER_WORKER_RATE = 20_000
"""Prompt tokens per second one mocker worker prefills before its speed-up (mocker default)."""
RELAY_REPORT_INTERVAL = 0.2
"""Seconds between the mesh relays' load reports (tests.router.mesh starts them so)."""


def run_json(args: list[str], timeout: float) -> object:
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.stdout)


def placement_split(trace: list[TraceRequest], outcomes_path: Path, capacity: int, ideal: float) -> dict:
    """The live placements through the simulator's pool model: the share the model gives them,
    and the blocks lost where a request went elsewhere than the pool holding its longest prefix."""
    caches: dict[str, LruCache] = {}
    model_hits = lost = blocks = misses = known = 0
    holder_load: list[float] = []
    chosen_load: list[float] = []
    for line in outcomes_path.read_text().splitlines():
        o = json.loads(line)
        if not o["pools"]:
            continue
        r = trace[o["index"]]
        hits = {pool: c.prefix_hit(r.hash_ids) for pool, c in caches.items()}
        holder = max(hits, key=hits.__getitem__, default="")
        best = hits.get(holder, 0)
        cache = caches.setdefault(o["pools"][0], LruCache(capacity))
        hit = cache.prefix_hit(r.hash_ids)
        if best > hit + 1:  # more than the shared first block
            misses += 1
            lost += best - hit
            # what the frontend believed (Route just before): (pool, cached, total, prefill, load, pending)
            view = {c[0]: c for c in o["ranking"]}
            if holder in view and view[holder][1] > 0 and o["pools"][0] in view:
                known += 1
                holder_load.append(view[holder][4] + view[holder][5])
                chosen_load.append(view[o["pools"][0]][4] + view[o["pools"][0]][5])
        cache.insert(r.hash_ids)
        cache.stored.clear()
        cache.removed.clear()
        model_hits += hit
        blocks += len(r.hash_ids)
    return {
        "model_share": model_hits / blocks / ideal,
        "misses": misses,
        "lost_share": lost / blocks / ideal,
        "known": known,
        "holder_wait": statistics.median(holder_load) if holder_load else 0.0,
        "chosen_wait": statistics.median(chosen_load) if chosen_load else 0.0,
    }


def live_run(args: argparse.Namespace, mocker_speedup: float, outcomes: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp, process_group(Path(tmp)) as group:
        mesh = Mesh(group)
        mesh.start_discovery()
        for i in range(args.pools):
            mesh.start_pool(
                f"pool-{i}",
                "local",
                "--workers",
                "1",
                "--worker-capacity-blocks",
                str(args.capacity * MESH_BLOCKS_PER_TRACE_BLOCK),
                "--speedup",
                f"{mocker_speedup:g}",
                "--max-queue",
                "512",
                "--max-running-per-worker",
                "16",
                "--log-level",
                "warning",
            )
        slo = ("--wait-slo", f"{args.wait_slo / args.speedup:g}") if args.wait_slo else ()
        router = mesh.start_router("--log-level", "warning", *slo)
        mesh.wait_routable(router, mesh.pools)
        live = run_json(
            [
                command("globalrouter"),
                "replay",
                "--trace",
                args.trace,
                "--router",
                router.address,
                "--model",
                MODEL,
                "--speedup",
                f"{args.speedup:g}",
                "--limit",
                str(args.requests),
                "--max-output-tokens",
                str(args.max_output_tokens),
                "--ideal-capacity-blocks",
                str(args.pools * args.capacity),
                "--outcomes",
                str(outcomes),
                "--explain",
                "--json",
            ],
            timeout=900,
        )
    assert isinstance(live, dict)
    return live


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default=str(TRACE), help="Mooncake-format trace")
    parser.add_argument("--requests", type=int, default=1000, help="first N trace requests")
    parser.add_argument("--pools", type=int, default=4, help="mocker pools")
    parser.add_argument(
        "--capacity", type=int, default=4000, help="KV cache per pool, in 512-token trace blocks"
    )
    parser.add_argument("--speedup", type=float, default=4.0, help="replay arrival times divided by this")
    parser.add_argument(
        "--rate",
        type=float,
        default=24_000.0,
        help="R: pool work tokens/s in trace time (24,000: below saturation)",
    )
    parser.add_argument("--max-output-tokens", type=int, default=16, help="cap on each request's output")
    parser.add_argument("--runs", type=int, default=2, help="live replays (their spread is the noise)")
    parser.add_argument(
        "--wait-slo",
        type=float,
        default=None,
        help="trace seconds: the frontend and the simulator's default policy rank under this wait SLO",
    )
    args = parser.parse_args()
    if not Path(args.trace).exists():
        print(f"trace not found: {args.trace}", file=sys.stderr)
        return 2
    trace = load_trace(args.trace, args.requests)
    mocker_speedup = args.rate * args.speedup / MOCKER_WORKER_RATE
    load_interval = RELAY_REPORT_INTERVAL * args.speedup
    ideal = ideal_hit_rate(trace, args.pools * args.capacity)
    with tempfile.TemporaryDirectory(prefix="bench-replay-out-") as out:
        capped = Path(out) / "capped.jsonl"
        write_trace(
            capped,
            [
                TraceRequest(
                    r.arrival,
                    r.input_length,
                    min(max(1, r.output_length), args.max_output_tokens),
                    r.hash_ids,
                )
                for r in trace
            ],
        )
        sim = run_json(
            [
                command("globalrouter"),
                "simulate",
                "--trace",
                str(capped),
                "--pools",
                str(args.pools),
                "--pool-capacity-blocks",
                str(args.capacity),
                "--pool-rate",
                f"{args.rate:g}",
                "--load-interval",
                f"{load_interval:g}",
                "--policy",
                "all",
                *(("--wait-slo", f"{args.wait_slo:g}") if args.wait_slo else ()),
                "--json",
            ],
            timeout=600,
        )
        assert isinstance(sim, list)
        runs = []
        for k in range(args.runs):
            outcomes = Path(out) / f"outcomes-{k}.jsonl"
            live = live_run(args, mocker_speedup, outcomes)
            split = placement_split(trace, outcomes, args.capacity, ideal)
            runs.append((live, split))
            print(json.dumps(live), json.dumps(split), flush=True)
    sim_default = next(r for r in sim if r["policy"] == "default")
    for row in sim:
        print(
            f"simulate {row['policy']}: hit_rate {row['hit_rate']:.4f} share_of_ideal {row['share_of_ideal']:.4f}"
        )
    live_shares = [live["share_of_ideal"] for live, _ in runs]
    mean_live = statistics.mean(live_shares)
    gap = (sim_default["share_of_ideal"] - mean_live) / sim_default["share_of_ideal"]
    print(
        f"live mean share {mean_live:.4f} vs simulated {sim_default['share_of_ideal']:.4f}: {gap:+.1%} below"
    )

    cmd = (
        f".venv/bin/python bench/bench_replay.py --requests {args.requests} --pools {args.pools} "
        f"--capacity {args.capacity} --speedup {args.speedup:g} --rate {args.rate:g} "
        f"--max-output-tokens {args.max_output_tokens} --runs {args.runs}"
        + (f" --wait-slo {args.wait_slo:g}" if args.wait_slo else "")
    )
    heading = "## Routing quality through the live mesh (`bench_replay`)"
    if args.wait_slo:
        heading = (
            f"### The same under a wait SLO of {args.wait_slo:g} trace seconds (`--wait-slo`: the "
            f"frontend runs `--wait-slo {args.wait_slo / args.speedup:g}`, the simulator's default "
            f"`--wait-slo {args.wait_slo:g}`)"
        )
    lines = [
        heading,
        "",
        f"Command: `{cmd}` on {platform.machine()} with {os.cpu_count()} shared cores. The first "
        f"{args.requests} requests of `{Path(args.trace).name}`, replayed by `globalrouter replay` through one "
        f"global frontend to {args.pools} mocker pools (one worker each, a cache of {args.capacity} trace "
        f"blocks = {args.capacity * MESH_BLOCKS_PER_TRACE_BLOCK} blocks of 16 tokens), arrivals divided by "
        f"{args.speedup:g}, the mocker's speed-up {mocker_speedup:g} so that a pool prefills R = {args.rate:,.0f} "
        f"trace tokens per trace second, outputs capped at {args.max_output_tokens} tokens. The simulator runs "
        f"the same requests with the same cap, R and load reports every {load_interval:g} trace seconds "
        f"(the relays report every {RELAY_REPORT_INTERVAL} s). Hit rates are in 512-token trace blocks.",
        "",
        "| run | live share_of_ideal | simulated (default) | live placements through the simulator's pool "
        "model | requests sent away from the prefix holder | their lost share | of those, holder's prefix known "
        "to the frontend | its wait there / at the pool chosen, median (s) | lag p99 (s) | TTFT p50 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, (live, split) in enumerate(runs):
        lines.append(
            f"| {k + 1} | {live['share_of_ideal']:.4f} | {sim_default['share_of_ideal']:.4f} | "
            f"{split['model_share']:.4f} | {split['misses']} | {split['lost_share']:.4f} | {split['known']} | "
            f"{split['holder_wait']:.3f} / {split['chosen_wait']:.3f} | {live['lag_p99']:.3f} | "
            f"{live['ttft_p50']:.3f} |"
        )
    lines += [
        "",
        f"Live mean {mean_live:.4f} against the simulator's {sim_default['share_of_ideal']:.4f}: "
        f"{gap:+.1%} below (goal: within 3%). Each live request was preceded by a Route dry run "
        "(`replay --explain`), so the table says what the frontend believed when it sent a request away "
        "from the pool holding its prefix (waits in real seconds; x the replay speed-up in trace time).",
        "",
        "| policy (simulated, same run) | hit_rate | share_of_ideal |",
        "|---|---:|---:|",
        *[f"| {r['policy']} | {r['hit_rate']:.4f} | {r['share_of_ideal']:.4f} |" for r in sim],
        "",
    ]
    result = RESULT.with_name("bench_replay_wait_slo.md") if args.wait_slo else RESULT
    result.parent.mkdir(exist_ok=True)
    result.write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

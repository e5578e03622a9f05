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
simulator `--wait-slo T`; `--wait-slo dynamo` takes T = the `dynamo` policy's simulated wait
p99 on the same requests, `--wait-slo live-dynamo` the wait p99 of a live run of the frontend's
dynamo ranking (`serve --ranking dynamo`), run first. `--live-dynamo` replays the requests through
such a frontend after each of the mode's runs, so that the goal's p99 condition is also judged live
against live on the same host. `--dispatch late` (with `--dispatch-placement`, `--dispatch-order`,
`--dispatch-slo-feedback`, as `globalrouter serve` and `globalrouter simulate` take them) runs late
binding on both sides: the frontend holds each request in its dispatch queue, the simulator's
default policy does the same.

Wait = arrival to start, the frontend's dispatch queue included, in trace seconds, on both sides.
The simulator measures it directly. The replay client measures each request's first token from the
moment it sent it (after its own `lag` behind the schedule), so lag + TTFT covers the Route dry run
(`--explain`), the frontend's dispatch queue, the pool's queue, the prefill and the first decode
step; the live wait is that x S minus what the mocker spends to first token once it starts the
request (the uncached prompt tokens, as the pool reported them on admission, at R, plus one decode
interval), at least 0. Writes bench/results/bench_replay.md, or per mode (result_name):
bench_replay_wait_slo.md with --wait-slo, bench_replay_late_<placement>[_deadline][_feedback]... with
--dispatch late, `_dynamo` when T came from dynamo, `_<trace>` for a trace other than the default.

Run: .venv/bin/python bench/bench_replay.py [--requests N] [--pools P] [--speedup S] [--runs K]
     [--wait-slo T|dynamo|live-dynamo] [--live-dynamo] [--dispatch late [--dispatch-placement rank|match]
     [--dispatch-order fifo|deadline] [--dispatch-slo-feedback]] [--result FILE]
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

from globalrouter.dispatch import ORDERS, PLACEMENTS
from globalrouter.simulate import LruCache, ideal_hit_rate, percentile
from globalrouter.trace import TRACE_BLOCK_SIZE, TraceRequest, load_trace, write_trace
from meshkit.blocks import DEFAULT_BLOCK_SIZE
from meshkit.cli import int_at_least, non_negative_number, positive_number
from meshlaunch import MODEL, Mesh, command, process_group

ROOT = Path(__file__).resolve().parent.parent

RESULT = ROOT / "bench" / "results" / "bench_replay.md"
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
MESH_BLOCKS_PER_TRACE_BLOCK = TRACE_BLOCK_SIZE // DEFAULT_BLOCK_SIZE
MOCKER_WORKER_RATE = 20_000
"""Prompt tokens per second one mocker worker prefills before its speed-up (mocker default)."""
MOCKER_DECODE_RATE = 50
"""Output tokens per second one mocker request decodes before its speed-up (mocker default)."""
SHARE_GOALS = {"conversation": 0.95, "synthetic": 0.97}
"""Issue 20's share_of_ideal goals per trace (with the wait p99 no worse than dynamo's)."""
DYNAMO = "dynamo"
LIVE_DYNAMO = "live-dynamo"
"""--wait-slo live-dynamo: T = the wait p99 of a live run of the dynamo ranking (implies --live-dynamo)."""
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


def wait_slo_arg(value: str) -> float | str:
    """argparse type of --wait-slo: positive trace seconds, "dynamo" (dynamo's simulated p99) or
    "live-dynamo" (the p99 of a live run of the dynamo ranking on the same requests)."""
    if value in (DYNAMO, LIVE_DYNAMO):
        return value
    return positive_number(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default=str(TRACE), help="Mooncake-format trace")
    parser.add_argument("--requests", type=int_at_least(1), default=1000, help="first N trace requests")
    parser.add_argument("--pools", type=int_at_least(1), default=4, help="mocker pools")
    parser.add_argument(
        "--capacity", type=int_at_least(1), default=4000, help="KV cache per pool, in 512-token trace blocks"
    )
    parser.add_argument(
        "--speedup", type=positive_number, default=4.0, help="replay arrival times divided by this"
    )
    parser.add_argument(
        "--rate",
        type=positive_number,
        default=24_000.0,
        help="R: pool work tokens/s in trace time (24,000: below saturation)",
    )
    parser.add_argument(
        "--max-output-tokens", type=int_at_least(1), default=16, help="cap on each request's output"
    )
    parser.add_argument(
        "--runs", type=int_at_least(1), default=2, help="live replays (their spread is the noise)"
    )
    parser.add_argument(
        "--concurrency",
        type=int_at_least(1),
        default=256,
        help="replay client's requests in flight at most (above the frontend's and pools' queues, "
        "so that late binding's queue is the frontend's, not the client's)",
    )
    parser.add_argument(
        "--wait-slo",
        type=wait_slo_arg,
        default=None,
        metavar="T|dynamo|live-dynamo",
        help="trace seconds: the frontend and the simulator's default policy rank under this wait SLO; "
        "'dynamo': T = the dynamo policy's simulated wait p99 on the same requests; 'live-dynamo': T = "
        "the wait p99 of a live run of the dynamo ranking on them, run first (implies --live-dynamo)",
    )
    parser.add_argument(
        "--dispatch",
        choices=("early", "late"),
        default="early",
        help="late: the frontend (`serve --dispatch late`) and the simulator (`simulate --dispatch "
        "late`) hold each request in a dispatch queue until a pool can start it (default early)",
    )
    parser.add_argument(
        "--dispatch-placement", choices=PLACEMENTS, default="rank", help="late: as `serve` (default rank)"
    )
    parser.add_argument(
        "--dispatch-order",
        choices=ORDERS,
        default="fifo",
        help="late, with --wait-slo: as `serve` (default fifo)",
    )
    parser.add_argument(
        "--dispatch-slo-feedback", action="store_true", help="late, with --wait-slo: as `serve`"
    )
    parser.add_argument(
        "--routed-prefix-ttl",
        type=non_negative_number,
        default=0.0,
        metavar="SECONDS",
        help="trace seconds a prompt the mode's frontend sent counts as cached at its pool before the "
        "pool's KV events (`serve --routed-prefix-ttl` SECONDS / S; the simulator's default policy "
        "the same in trace time); not for the dynamo runs (default: off)",
    )
    parser.add_argument(
        "--live-dynamo",
        action="store_true",
        help="also replay the same requests through a frontend ranking as dynamo (`serve --ranking "
        "dynamo`, early, no SLO), one such run after each of the mode's, so that the goal's p99 "
        "condition is checked live against live on the same host, not only against the simulator",
    )
    parser.add_argument(
        "--result", default=None, help="results file (default: bench/results/ and a name per mode)"
    )
    args = parser.parse_args(argv)
    if args.wait_slo == LIVE_DYNAMO:
        args.live_dynamo = True  # the target comes from a live dynamo run, which is then the baseline too
    return args


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of flags (None: nothing); the same rules as `serve`'s, and
    late-binding flags without --dispatch late are refused rather than ignored."""
    if args.dispatch != "late":
        given = [
            flag
            for flag, on in (
                ("--dispatch-placement", args.dispatch_placement != "rank"),
                ("--dispatch-order", args.dispatch_order != "fifo"),
                ("--dispatch-slo-feedback", args.dispatch_slo_feedback),
            )
            if on
        ]
        if given:
            return f"{', '.join(given)} need --dispatch late (early binding has no dispatch queue)"
    if args.dispatch_order != "fifo" and args.wait_slo is None:
        return f"--dispatch-order {args.dispatch_order} needs --wait-slo (the order's target)"
    if args.dispatch_slo_feedback and args.wait_slo is None:
        return "--dispatch-slo-feedback needs --wait-slo (the feedback's target)"
    if not Path(args.trace).exists():
        return f"trace not found: {args.trace}"
    return None


def trace_kind(trace: str) -> str:
    """The issue's name for a trace ("conversation" / "synthetic"), else the file's stem."""
    name = Path(trace).name
    return next((kind for kind in SHARE_GOALS if kind in name), Path(trace).stem)


def mode_label(args: argparse.Namespace) -> str:
    """The mode in words, as the tables name it."""
    parts = ["late" if args.dispatch == "late" else "early"]
    if args.dispatch == "late":
        parts.append(args.dispatch_placement)
        if args.dispatch_order != "fifo":
            parts.append(args.dispatch_order)
        if args.dispatch_slo_feedback:
            parts.append("feedback")
    if args.wait_slo is not None:
        parts.append("--wait-slo T")
    if args.routed_prefix_ttl:
        parts.append(f"routed prefixes {args.routed_prefix_ttl:g} s")
    return ", ".join(parts)


def result_path(args: argparse.Namespace) -> Path:
    """bench/results/bench_replay[_late_<placement>[_<order>][_feedback]][_wait_slo[_dynamo]][_<trace>].md
    (--result wins): one file per mode, so one mode's run does not overwrite another's."""
    if args.result:
        return Path(args.result)
    parts = ["bench_replay"]
    if args.dispatch == "late":
        parts += ["late", args.dispatch_placement]
        if args.dispatch_order != "fifo":
            parts.append(args.dispatch_order)
        if args.dispatch_slo_feedback:
            parts.append("feedback")
    if args.wait_slo is not None:
        parts.append(
            {DYNAMO: "wait_slo_dynamo", LIVE_DYNAMO: "wait_slo_live_dynamo"}.get(args.wait_slo, "wait_slo")
        )
    if Path(args.trace).resolve() != TRACE.resolve():
        parts.append(trace_kind(args.trace))
    if args.routed_prefix_ttl:
        parts.append("routed")
    if args.live_dynamo and args.wait_slo != LIVE_DYNAMO:
        parts.append("live_dynamo")
    return RESULT.with_name("_".join(parts) + ".md")


def frontend_flags(args: argparse.Namespace, slo: float | None) -> list[str]:
    """`globalrouter serve` flags of the mode; `slo` is T in trace seconds (the frontend runs T / S)."""
    out = ["--wait-slo", f"{slo / args.speedup:g}"] if slo is not None else []
    if args.routed_prefix_ttl:
        out += ["--routed-prefix-ttl", f"{args.routed_prefix_ttl / args.speedup:g}"]
    if args.dispatch == "late":
        out += dispatch_flags(args)
    return out


def dispatch_flags(args: argparse.Namespace) -> list[str]:
    """--dispatch late and its settings, the same words for `serve` and `simulate`."""
    out = [
        "--dispatch",
        "late",
        "--dispatch-placement",
        args.dispatch_placement,
        "--dispatch-order",
        args.dispatch_order,
    ]
    if args.dispatch_slo_feedback:
        out.append("--dispatch-slo-feedback")
    return out


def simulate_argv(
    args: argparse.Namespace, trace: Path, policy: str, slo: float | None, ranking: str = "default"
) -> list[str]:
    """`globalrouter simulate` on the capped requests with the live mesh's pools, R and load-report
    cadence in trace time; with `policy` "all", the mode's flags (--wait-slo `slo`, late binding);
    with `ranking` dynamo, the default policy ranking as the live dynamo baseline (no mode flags)."""
    argv = [
        command("globalrouter"),
        "simulate",
        "--trace",
        str(trace),
        "--pools",
        str(args.pools),
        "--pool-capacity-blocks",
        str(args.capacity),
        "--pool-rate",
        f"{args.rate:g}",
        "--load-interval",
        f"{RELAY_REPORT_INTERVAL * args.speedup:g}",
        "--policy",
        policy,
    ]
    if ranking != "default":
        return [*argv, "--ranking", ranking, "--json"]
    if policy != DYNAMO:  # the dynamo run that sets T takes none of the mode's flags
        if args.routed_prefix_ttl:
            argv += ["--routed-prefix-ttl", f"{args.routed_prefix_ttl:g}"]
        if slo is not None:
            argv += ["--wait-slo", f"{slo:g}"]
        if args.dispatch == "late":
            argv += dispatch_flags(args)
    return [*argv, "--json"]


def live_waits(
    trace: list[TraceRequest], outcomes_path: Path, rate: float, speedup: float
) -> tuple[list[float], list[float]]:
    """Per answered request: its wait (arrival to start, trace seconds) and its TTFT from arrival
    (trace seconds). lag + ttft is first token minus scheduled arrival (the client's lag, the Route
    dry run, the frontend's dispatch queue, the pool's queue, the prefill, one decode interval); the
    wait takes off what the mocker spends from start to first token: the uncached prompt tokens
    (as the pool reported its cache on admission) at R, and one decode interval."""
    decode_interval = MOCKER_WORKER_RATE / (MOCKER_DECODE_RATE * rate)
    waits: list[float] = []
    ttfts: list[float] = []
    for line in outcomes_path.read_text().splitlines():
        o = json.loads(line)
        if o["code"] != "OK" or o["ttft"] is None:
            continue
        r = trace[o["index"]]
        uncached = r.input_length - min(o["cached_blocks"] * DEFAULT_BLOCK_SIZE, r.input_length)
        first_token = (o["lag"] + o["ttft"]) * speedup
        ttfts.append(first_token)
        waits.append(max(0.0, first_token - uncached / rate - decode_interval))
    return waits, ttfts


DYNAMO_FRONTEND = ["--ranking", "dynamo"]
"""`globalrouter serve` flags of the live dynamo baseline (--live-dynamo): early, no SLO."""


def live_run(args: argparse.Namespace, mocker_speedup: float, outcomes: Path, flags: list[str]) -> dict:
    """One replay through a fresh mesh whose frontend runs with `flags`; the replay's JSON."""
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
        router = mesh.start_router("--log-level", "warning", *flags)
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
                "--concurrency",
                str(args.concurrency),
                "--outcomes",
                str(outcomes),
                "--explain",
                "--json",
            ],
            timeout=900,
        )
    assert isinstance(live, dict)
    return live


def live_dynamo_lines(
    runs: list[tuple[dict, dict]],
    dynamo_runs: list[tuple[dict, dict]],
    sim_selector_dynamo: dict,
    sim_dynamo: dict,
    goal: float | None,
    kind: str,
) -> list[str]:
    """The results file's part on the live dynamo baseline (--live-dynamo): each round's pair of
    runs, the means, and the goal's p99 condition checked live against live."""
    share = statistics.mean(live["share_of_ideal"] for live, _ in runs)
    p99 = statistics.mean(split["wait_p99"] for _, split in runs)
    d_share = statistics.mean(live["share_of_ideal"] for live, _ in dynamo_runs)
    d_p99 = statistics.mean(split["wait_p99"] for _, split in dynamo_runs)
    out = [
        "",
        "The live dynamo baseline (`--live-dynamo`): the same requests through a fresh mesh whose frontend "
        "runs `globalrouter serve --ranking dynamo` (Dynamo's cost through the frontend's Selector: prefill "
        "left after the cached prefix plus queued work, equal weights; early, no SLO), one run after each of "
        "the mode's, so that both see the same host. In the simulator that ranking gives "
        f"{sim_selector_dynamo['share_of_ideal']:.4f} / {sim_selector_dynamo['wait_p99']:.3f} s on these "
        f"requests (the simulator's dynamo policy: {sim_dynamo['share_of_ideal']:.4f} / "
        f"{sim_dynamo['wait_p99']:.3f} s).",
        "",
        "| round | mode's live share / wait p99 (s) | live dynamo share / wait p99 (s) | live dynamo wait p50 (s) "
        "| live dynamo TTFT p99 (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for k, ((live, split), (d_live, d_split)) in enumerate(zip(runs, dynamo_runs, strict=True)):
        out.append(
            f"| {k + 1} | {live['share_of_ideal']:.4f} / {split['wait_p99']:.3f} | "
            f"{d_live['share_of_ideal']:.4f} / {d_split['wait_p99']:.3f} | {d_split['wait_p50']:.3f} | "
            f"{d_split['ttft_p99']:.3f} |"
        )
    out += [
        "",
        f"Means: the mode {share:.4f} / {p99:.3f} s, live dynamo {d_share:.4f} / {d_p99:.3f} s "
        f"(the mode's p99 / dynamo's: {p99 / d_p99 if d_p99 > 0 else float('inf'):.2f}).",
    ]
    if goal is not None:
        share_ok, p99_ok = share >= goal, p99 <= d_p99
        out += [
            "",
            f"Issue 20's goal on the {kind} trace, live against live dynamo on the same host: "
            f"{'met' if share_ok and p99_ok else 'not met'} (share {'met' if share_ok else 'not met'}, "
            f"p99 {'met' if p99_ok else 'not met'}, on the means).",
        ]
    return out


def command_line(args: argparse.Namespace) -> str:
    """The bench's own command, as the results file quotes it."""
    cmd = (
        f".venv/bin/python bench/bench_replay.py --requests {args.requests} --pools {args.pools} "
        f"--capacity {args.capacity} --speedup {args.speedup:g} --rate {args.rate:g} "
        f"--max-output-tokens {args.max_output_tokens} --runs {args.runs}"
    )
    if Path(args.trace).resolve() != TRACE.resolve():
        cmd = cmd.replace(" --requests", f" --trace {args.trace} --requests", 1)
    if args.concurrency != 256:
        cmd += f" --concurrency {args.concurrency}"
    if args.wait_slo is not None:
        cmd += (
            f" --wait-slo {args.wait_slo if isinstance(args.wait_slo, str) else format(args.wait_slo, 'g')}"
        )
    if args.dispatch == "late":
        cmd += " " + " ".join(dispatch_flags(args))
    if args.routed_prefix_ttl:
        cmd += f" --routed-prefix-ttl {args.routed_prefix_ttl:g}"
    if args.live_dynamo and args.wait_slo != LIVE_DYNAMO:
        cmd += " --live-dynamo"
    if args.result:
        cmd += f" --result {args.result}"
    return cmd


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    error = check_args(args)
    if error:
        print(f"bench_replay: {error}", file=sys.stderr)
        return 2
    trace = load_trace(args.trace, args.requests)
    mocker_speedup = args.rate * args.speedup / MOCKER_WORKER_RATE
    load_interval = RELAY_REPORT_INTERVAL * args.speedup
    ideal = ideal_hit_rate(trace, args.pools * args.capacity)
    late = args.dispatch == "late"
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
        runs: list[tuple[dict, dict]] = []
        dynamo_runs: list[tuple[dict, dict]] = []

        def replay(flags: list[str], name: str) -> tuple[dict, dict]:
            outcomes = Path(out) / f"outcomes-{name}.jsonl"
            live = live_run(args, mocker_speedup, outcomes, flags)
            split = placement_split(trace, outcomes, args.capacity, ideal)
            waits, ttfts = live_waits(trace, outcomes, args.rate, args.speedup)
            split.update(
                wait_p99=percentile(waits, 99), wait_p50=percentile(waits, 50), ttft_p99=percentile(ttfts, 99)
            )
            print(name, json.dumps(live), json.dumps(split), flush=True)
            return live, split

        slo: float | None
        if args.wait_slo == LIVE_DYNAMO:
            # the first live dynamo run comes first: its wait p99 is the mode's target
            dynamo_runs.append(replay(DYNAMO_FRONTEND, "dynamo-0"))
            slo = float(dynamo_runs[0][1]["wait_p99"])
            if slo <= 0:
                print(
                    "bench_replay: the live dynamo run's wait p99 is 0 at this load: no SLO", file=sys.stderr
                )
                return 2
            print(f"T = the live dynamo run's wait p99 = {slo:.3f} trace seconds", flush=True)
        elif args.wait_slo == DYNAMO:
            dyn = run_json(simulate_argv(args, capped, "dynamo", None), timeout=600)
            assert isinstance(dyn, dict)
            slo = float(dyn["wait_p99"])
            if slo <= 0:
                print("bench_replay: dynamo's simulated wait p99 is 0 at this load: no SLO", file=sys.stderr)
                return 2
            print(f"T = dynamo's simulated wait p99 = {slo:.3f} trace seconds", flush=True)
        else:
            slo = args.wait_slo
        sim = run_json(simulate_argv(args, capped, "all", slo), timeout=600)
        assert isinstance(sim, list)
        sim_selector_dynamo: dict | None = None
        if args.live_dynamo:
            # the live baseline's ranking in the simulator: dynamo's cost through the frontend's Selector
            selector_dynamo = run_json(simulate_argv(args, capped, "default", None, DYNAMO), timeout=600)
            assert isinstance(selector_dynamo, dict)
            sim_selector_dynamo = selector_dynamo
        for k in range(args.runs):
            # one after the other, so that both see the same machine over the bench's span
            runs.append(replay(frontend_flags(args, slo), f"mode-{k}"))
            if args.live_dynamo and len(dynamo_runs) < args.runs:
                dynamo_runs.append(replay(DYNAMO_FRONTEND, f"dynamo-{len(dynamo_runs)}"))
    # with --dispatch late, `simulate --policy all` runs every policy early, then the default late (last)
    sim_mode = sim[-1] if late else next(r for r in sim if r["policy"] == "default")
    sim_dynamo = next(r for r in sim if r["policy"] == DYNAMO)
    for row in sim:
        print(
            f"simulate {row['policy']}: hit_rate {row['hit_rate']:.4f} share_of_ideal {row['share_of_ideal']:.4f} "
            f"wait_p99 {row['wait_p99']:.3f}"
        )
    live_shares = [live["share_of_ideal"] for live, _ in runs]
    live_p99s = [split["wait_p99"] for _, split in runs]
    mean_live = statistics.mean(live_shares)
    mean_p99 = statistics.mean(live_p99s)
    gap = (sim_mode["share_of_ideal"] - mean_live) / sim_mode["share_of_ideal"]
    kind = trace_kind(args.trace)
    goal = SHARE_GOALS.get(kind)
    print(
        f"live mean share {mean_live:.4f} wait p99 {mean_p99:.3f} vs simulated {sim_mode['share_of_ideal']:.4f} "
        f"/ {sim_mode['wait_p99']:.3f}, dynamo {sim_dynamo['share_of_ideal']:.4f} / {sim_dynamo['wait_p99']:.3f}"
    )

    mode = mode_label(args)
    heading = f"## Routing quality through the live mesh (`bench_replay`): {kind}, {mode}"
    if slo is not None:
        source = {
            DYNAMO: "dynamo's simulated wait p99 of this run",
            LIVE_DYNAMO: "the wait p99 of the first live dynamo run, which ran before the mode's",
        }.get(args.wait_slo, "given")
        heading += (
            f" (T = {slo:.3f} trace seconds, {source}; the frontend runs `--wait-slo {slo / args.speedup:g}`)"
        )
    served = "; ".join(
        f"{live['ok']} of {live['requests']} answered"
        + (f", errors {live['errors']}" if live["errors"] else "")
        for live, _ in runs
    )
    lines = [
        heading,
        "",
        f"Command: `{command_line(args)}` on {platform.machine()} with {os.cpu_count()} shared cores. The first "
        f"{args.requests} requests of `{Path(args.trace).name}`, replayed by `globalrouter replay` through one "
        f"global frontend (`{' '.join(frontend_flags(args, slo)) or 'defaults'}`) to {args.pools} mocker pools "
        f"(one worker each, a cache of {args.capacity} trace "
        f"blocks = {args.capacity * MESH_BLOCKS_PER_TRACE_BLOCK} blocks of 16 tokens), arrivals divided by "
        f"{args.speedup:g}, the mocker's speed-up {mocker_speedup:g} so that a pool prefills R = {args.rate:,.0f} "
        f"trace tokens per trace second, outputs capped at {args.max_output_tokens} tokens. The simulator runs "
        f"the same requests with the same cap, R and load reports every {load_interval:g} trace seconds "
        f"(the relays report every {RELAY_REPORT_INTERVAL} s)"
        + (", `" + " ".join(dispatch_flags(args)) + "` for its default policy" if late else "")
        + f". Hit rates are in 512-token trace blocks. Live runs: {served}.",
        "",
        "Wait = arrival to start, trace seconds, the frontend's dispatch queue included: simulated directly; "
        "live, (client lag + TTFT) x the replay speed-up minus the mocker's time from start to first token "
        "(uncached prompt at R, one decode interval). Live TTFT p99 is first token minus arrival, unreduced.",
        "",
        f"| run | live share_of_ideal | simulated ({mode}) | live wait p99 (s) | simulated wait p99 (s) | "
        "dynamo simulated share / wait p99 (s) | live wait p50 (s) | live TTFT p99 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, (live, split) in enumerate(runs):
        lines.append(
            f"| {k + 1} | {live['share_of_ideal']:.4f} | {sim_mode['share_of_ideal']:.4f} | {split['wait_p99']:.3f} | "
            f"{sim_mode['wait_p99']:.3f} | {sim_dynamo['share_of_ideal']:.4f} / {sim_dynamo['wait_p99']:.3f} | "
            f"{split['wait_p50']:.3f} | {split['ttft_p99']:.3f} |"
        )
    lines += [
        "",
        f"Live mean {mean_live:.4f} (runs {min(live_shares):.4f}-{max(live_shares):.4f}) against the simulator's "
        f"{sim_mode['share_of_ideal']:.4f}: {gap:+.1%} below; live wait p99 mean {mean_p99:.3f} s "
        f"(runs {min(live_p99s):.3f}-{max(live_p99s):.3f}) against the simulator's {sim_mode['wait_p99']:.3f} s "
        f"and dynamo's simulated {sim_dynamo['wait_p99']:.3f} s.",
    ]
    if goal is not None:
        share_ok = mean_live >= goal
        p99_ok = mean_p99 <= sim_dynamo["wait_p99"]
        sim_ok = sim_mode["share_of_ideal"] >= goal and sim_mode["wait_p99"] <= sim_dynamo["wait_p99"]
        lines += [
            "",
            f"Issue 20's goal on the {kind} trace (share ≥ {goal} with wait p99 ≤ dynamo's): live "
            f"{'met' if share_ok and p99_ok else 'not met'} (share {'met' if share_ok else 'not met'}, "
            f"p99 {'met' if p99_ok else 'not met'}, on the means); simulated {'met' if sim_ok else 'not met'}.",
        ]
    if dynamo_runs and sim_selector_dynamo is not None:
        lines += live_dynamo_lines(runs, dynamo_runs, sim_selector_dynamo, sim_dynamo, goal, kind)
        print("\n".join(lines[-3:]))
    lines += [
        "",
        "| run | live placements through the simulator's pool model | requests sent away from the prefix holder "
        "| their lost share | of those, holder's prefix known to the frontend | its wait there / at the pool "
        "chosen, median (s) | lag p99 (s) | TTFT p50 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, (live, split) in enumerate(runs):
        lines.append(
            f"| {k + 1} | {split['model_share']:.4f} | {split['misses']} | {split['lost_share']:.4f} | "
            f"{split['known']} | {split['holder_wait']:.3f} / {split['chosen_wait']:.3f} | {live['lag_p99']:.3f} | "
            f"{live['ttft_p50']:.3f} |"
        )
    lines += [
        "",
        "Each live request was preceded by a Route dry run (`replay --explain`), so the table says what the "
        "frontend believed when it sent a request away from the pool holding its prefix (waits, lag and TTFT "
        "p50 here in real seconds; x the replay speed-up in trace time).",
        "",
        "| policy (simulated, same run) | hit_rate | share_of_ideal | wait p99 (s) |",
        "|---|---:|---:|---:|",
        *[
            f"| {r['policy']}{' (late)' if late and i == len(sim) - 1 and 'late' not in r['policy'] else ''} | "
            f"{r['hit_rate']:.4f} | "
            f"{r['share_of_ideal']:.4f} | {r['wait_p99']:.3f} |"
            for i, r in enumerate(sim)
        ],
        "",
    ]
    result = result_path(args)
    result.parent.mkdir(exist_ok=True)
    result.write_text("\n".join(lines))
    print(f"wrote {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

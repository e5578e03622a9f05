"""Routing quality through the live mesh: `globalrouter replay` of the shared trace, next to the
simulator's prediction for the same requests and pool sizes, in the same run.

One real mesh on 127.0.0.1: discovery, POOLS mocker pools (one worker each, a KV cache of
CAPACITY trace blocks = CAPACITY x 32 mesh blocks of 16 tokens, a high speed-up) with their
relays, and one global frontend. The replay sends the first N trace requests at their arrival
times divided by the replay speed-up (outputs capped) and reports hit rate, share of the ideal
cache, TTFT and requests per pool. The baseline is `globalrouter simulate` on the same requests
and cache sizes with every policy: it shows what the mesh's hit rate should be with the project's
policy and what the naive policies would give.
Writes bench/results/bench_replay.md.

Run: .venv/bin/python bench/bench_replay.py [--requests N] [--pools P] [--speedup X]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from globalrouter.trace import TRACE_BLOCK_SIZE
from meshkit.blocks import DEFAULT_BLOCK_SIZE
from meshlaunch import MODEL, Mesh, command, process_group

ROOT = Path(__file__).resolve().parent.parent

RESULT = ROOT / "bench" / "results" / "bench_replay.md"
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
MESH_BLOCKS_PER_TRACE_BLOCK = TRACE_BLOCK_SIZE // DEFAULT_BLOCK_SIZE


def run_json(args: list[str], timeout: float) -> object:
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.stdout)


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
    parser.add_argument("--speedup", type=float, default=40.0, help="replay arrival times divided by this")
    parser.add_argument("--max-output-tokens", type=int, default=16, help="cap on each request's output")
    args = parser.parse_args()
    if not Path(args.trace).exists():
        print(f"trace not found: {args.trace}", file=sys.stderr)
        return 2

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
                "50",
                "--max-queue",
                "512",
                "--max-running-per-worker",
                "16",
                "--log-level",
                "warning",
            )
        router = mesh.start_router("--log-level", "warning")
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
                "--json",
            ],
            timeout=900,
        )
    sim = run_json(
        [
            command("globalrouter"),
            "simulate",
            "--trace",
            args.trace,
            "--pools",
            str(args.pools),
            "--pool-capacity-blocks",
            str(args.capacity),
            "--limit",
            str(args.requests),
            "--policy",
            "all",
            "--json",
        ],
        timeout=300,
    )
    assert isinstance(live, dict) and isinstance(sim, list)
    print(json.dumps(live))
    for row in sim:
        print(
            f"simulate {row['policy']}: hit_rate {row['hit_rate']:.4f} share_of_ideal {row['share_of_ideal']:.4f}"
        )

    def f(x: object, digits: int = 4) -> str:
        return f"{x:.{digits}f}" if isinstance(x, float) else str(x)

    cmd = (
        f".venv/bin/python bench/bench_replay.py --requests {args.requests} --pools {args.pools} "
        f"--capacity {args.capacity} --speedup {args.speedup:g} --max-output-tokens {args.max_output_tokens}"
    )
    keys = [k for k in live if not isinstance(live[k], (dict, list))]
    lines = [
        "## Routing quality through the live mesh (`bench_replay`)",
        "",
        f"Command: `{cmd}` on {platform.machine()} with {os.cpu_count()} shared cores. The first "
        f"{args.requests} requests of the shared trace, replayed by `globalrouter replay` through one "
        f"global frontend to {args.pools} mocker pools (one worker each, a cache of {args.capacity} trace "
        f"blocks = {args.capacity * MESH_BLOCKS_PER_TRACE_BLOCK} blocks of 16 tokens, speed-up 50), arrivals "
        f"divided by {args.speedup:g}, outputs capped at {args.max_output_tokens} tokens. Hit rates are in "
        "512-token trace blocks; the ideal is one cache of all pools' blocks.",
        "",
        "| figure (live mesh) | value |",
        "|---|---:|",
        *[f"| {k} | {f(live[k])} |" for k in keys],
        "",
        f"Requests per pool: {json.dumps(live.get('requests_per_pool', {}))}",
        "",
        "Baseline in the same run: `globalrouter simulate` on the same requests and cache sizes "
        "(its pool rate is the simulator's default; the early part of the trace has little reuse, "
        "so hit rates are low for every policy):",
        "",
        "| policy (simulated) | hit_rate | share_of_ideal |",
        "|---|---:|---:|",
        *[f"| {r['policy']} | {r['hit_rate']:.4f} | {r['share_of_ideal']:.4f} |" for r in sim],
        "",
    ]
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

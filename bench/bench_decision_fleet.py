"""A routing decision at fleet scale, split in its two parts: KV overlaps (KvSummary) and Selector.select.

Run: `python -m bench.bench_decision_fleet [--pools 1000] [--blocks 2000] [--profile]`. Pools hold
random blocks plus the first 1024 >> (k mod 8) blocks of a 16k-token prompt (as in bench_kv_summary);
prints CPU-time p50 / p99 in µs of each part and of the whole for the cached and an uncached 16k
prompt (hashing excluded) and how many collections the cyclic garbage collector ran meanwhile,
and with --profile the top of a cProfile of both; --gc off|freeze shows what the collector adds
to the tail. For the decision goal
of issue 19 (p99 <= 2 ms for a 16k-token prompt at 1,000 pools): where the time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from typing import cast

import numpy as np

from bench.bench_kv_summary import PROMPT_BLOCKS, pool_states
from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import KvSummary
from globalrouter.selection import Selector, pool_overlaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=int, default=1000)
    parser.add_argument(
        "--blocks", type=int, default=2000, help="blocks per pool (small: the search is log2)"
    )
    parser.add_argument("--decisions", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--gc",
        choices=("on", "off", "freeze"),
        default="on",
        help="the cyclic GC while deciding: as is, disabled, or with the fleet's objects frozen first",
    )
    args = parser.parse_args()
    if args.pools <= 0 or args.blocks < PROMPT_BLOCKS or args.decisions <= 0:
        parser.error(f"--pools and --decisions must be > 0, --blocks >= {PROMPT_BLOCKS}")
    rng = np.random.default_rng(1)
    summary = KvSummary(reserve_blocks=args.pools * args.blocks)
    prompt = rng.integers(0, 2**64 - 1, PROMPT_BLOCKS, dtype=np.uint64)
    for k in range(args.pools):
        held = PROMPT_BLOCKS >> (k % 8)
        own = np.concatenate((rng.integers(0, 2**64 - 1, args.blocks - held, dtype=np.uint64), prompt[:held]))
        summary.apply_snapshot(f"pool-{k:02d}/relay-0", own)
        summary.apply_delta(f"pool-{k:02d}/relay-1", (), ())
    states = pool_states(args.pools, 2)
    selector = Selector()
    limits = selector.config.freshness
    index = cast(KvIndex, summary)
    if args.gc == "off":
        gc.disable()
    elif args.gc == "freeze":
        gc.collect()
        gc.freeze()  # the fleet's objects leave the generations a full collection walks

    def decide(p: list[int]) -> tuple[int, int]:
        t0 = time.thread_time_ns()
        cached = pool_overlaps(index, states, p, 1.0, limits)
        t1 = time.thread_time_ns()
        selector.select(states, "m", 16 * len(p), 100, cached, 1.0, affinity_key=p[0])
        return t1 - t0, time.thread_time_ns() - t1

    n = args.decisions
    print(
        f"{args.pools} pools x {args.blocks:,} blocks x 2 relays, gc {args.gc}; "
        f"CPU µs p50 / p99 over {n} decisions"
    )
    cases = (
        ("16k cached", prompt.tolist()),
        ("16k uncached", rng.integers(0, 2**64 - 1, PROMPT_BLOCKS, dtype=np.uint64).tolist()),
    )
    for name, p in cases:
        before = [g["collections"] for g in gc.get_stats()]
        parts = [decide(p) for _ in range(n)]
        runs = [g["collections"] - b for g, b in zip(gc.get_stats(), before, strict=True)]
        over = sorted(a for a, _ in parts)
        sel = sorted(b for _, b in parts)
        tot = sorted(a + b for a, b in parts)

        def q(v: list[int]) -> str:
            return f"{v[n // 2] / 1000:.0f} / {v[min(n - 1, int(n * 0.99))] / 1000:.0f}"

        print(
            f"  {name}: overlaps {q(over)}, select {q(sel)}, decision {q(tot)}; "
            f"GC collections gen0/1/2 {'/'.join(map(str, runs))}"
        )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            for _name, p in cases:
                decide(p)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Routed prefixes (`--routed-prefix-ttl`): what the records cost in memory and per decision.

In one process, no transport: a RoutingCore over 8 pools (exact KV index, every pool's KV empty,
as before a pool's first KV events), a 16k-token prompt of 1,000 blocks of 16 tokens.
- memory: tracemalloc over RoutedPrefixes filled to its bound (MAX_BLOCKS) with 16k-token records;
- per request, decide + record_routed (as an admission does), records off and on, in the same run,
  interleaved rounds, best of 5: a new prefix each time (nobody holds it), the same prefix again
  with the KV sets empty (only the record holds it), and the same prefix held in a KV set.

Run: PYTHONPATH=$PWD .venv/bin/python bench/bench_routed_prefixes.py
"""

from __future__ import annotations

import platform
import random
import time
import tracemalloc
from pathlib import Path

from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import LoadSignal, PoolCapacityHint, PoolState
from globalrouter.routed_prefixes import MAX_BLOCKS, RoutedPrefixes
from globalrouter.routing import RoutingCore
from globalrouter.selection import Selector
from meshkit.blocks import block_hashes
from meshkit.clock import FakeClock

PROMPT = 16_384
N = 300


def memory() -> tuple[int, int, float]:
    tracemalloc.start()
    routed = RoutedPrefixes(ttl=1e9)
    rng = random.Random(1)
    k = 0
    while routed.blocks + PROMPT // 16 <= MAX_BLOCKS:
        routed.record(f"p{k % 8}", block_hashes([rng.randrange(1 << 30) for _ in range(PROMPT)], 16), 0.0)
        k += 1
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return routed.blocks, len(routed), traced / 1e6


def core(on: bool, held: list[int] | None = None) -> RoutingCore:
    """8 idle pools; `held`: a prompt pool p0's KV set holds (else every set is empty)."""
    table, index = PoolTable(), KvIndex()
    for i in range(8):
        pool = PoolState(
            pool_id=f"p{i}",
            listed=True,
            model="m",
            frontends=("http://h:1",),
            block_size=16,
            capacity=PoolCapacityHint(prefill_tokens_per_second=10_000),
        )
        pool.kv_at, pool.kv_sources = 0.0, {f"p{i}/r/1"}
        pool.record_load(LoadSignal(), 0.0)
        index.apply_snapshot(f"p{i}/r/1", block_hashes(held, 16) if held and i == 0 else ())
        table.pools[pool.pool_id] = pool
    c = RoutingCore(table, index, Selector(), FakeClock(start=0.0), RouterMetrics())
    if on:
        c.routed = RoutedPrefixes(10.0)
    return c


def per_request(c: RoutingCore, prompts: list[list[int]]) -> float:
    """Mean µs of decide + record_routed at the first candidate, over the prompts."""
    started = time.perf_counter()
    for prompt in prompts:
        decision = c.decide("m", prompt, 16)
        c.record_routed(c.table.pools[decision.candidates[0].pool_id], decision, prompt)
    return (time.perf_counter() - started) / len(prompts) * 1e6


RESULT = Path(__file__).resolve().parent / "results" / "bench_routed_prefixes.md"


def main() -> None:
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(f"- {line}")

    blocks, records, mb = memory()
    say(f"memory: {blocks:,} block hashes in {records:,} records of {PROMPT:,} tokens: {mb:.1f} MB traced")
    rng = random.Random(2)
    fresh = [[rng.randrange(1 << 30) for _ in range(PROMPT)] for _ in range(N)]
    same = [fresh[0]] * N
    cases = (
        ("new prefix each time", fresh, None),
        ("the same prefix again, KV set empty", same, None),
        ("the same prefix again, held in p0's KV set", same, fresh[0]),
    )
    for name, prompts, held in cases:
        best = {False: float("inf"), True: float("inf")}
        for _ in range(5):
            for on in (False, True):  # interleaved: both see the same machine
                best[on] = min(best[on], per_request(core(on, held), prompts))
        say(
            f"{name}: decide + record {best[False]:.0f} us off, {best[True]:.0f} us on "
            f"({best[True] / best[False]:.2f}x), best of 5 x {N}"
        )
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(
        "## Routed prefixes: memory and cost per decision (`bench_routed_prefixes`)\n\n"
        f"Command: `PYTHONPATH=$PWD .venv/bin/python bench/bench_routed_prefixes.py` on {platform.machine()}, "
        f"Python {platform.python_version()}.\n\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()

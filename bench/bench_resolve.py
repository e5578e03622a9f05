"""What model-name resolution (aliases, adapters) and the adapter filter add to a routing decision.

Per request, on a table of N listed pools of one model (half serving the adapter `sql`): resolving
the model's own name, an alias (one target), a 0.9 / 0.1 split, `model:adapter`, an adapter's
bare name (the one form that scans the table); and the whole decision (overlaps + select, cold
prompt of 128 blocks) for the base model and for the adapter, in the same run.

    .venv/bin/python bench/bench_resolve.py [--repeat N]
"""

from __future__ import annotations

import argparse
import platform
import sys
import timeit

from bench.measure import synthetic_pool
from globalrouter.aliases import ModelResolver, parse_aliases
from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.routing import RoutingCore
from globalrouter.selection import Selector
from meshkit.clock import SystemClock

COMMAND = ".venv/bin/python bench/bench_resolve.py"


def core_of(pools: int) -> RoutingCore:
    table = PoolTable()
    for k in range(pools):
        p = synthetic_pool(k)
        if k % 2 == 0:
            p.adapters = {"m": frozenset({"sql"})}
        table.pools[p.pool_id] = p
    core = RoutingCore(table, KvIndex(), Selector(), SystemClock(), RouterMetrics())
    core.resolver = ModelResolver(
        parse_aliases({"aliases": {"one": "m", "split": {"m": 0.9, "m2": 0.1}}}, "bench")
    )
    return core


def micros(fn, repeat: int) -> float:
    """Median µs of one call over `repeat` rounds of 200 calls."""
    runs = sorted(timeit.repeat(fn, number=200, repeat=repeat))
    return runs[len(runs) // 2] / 200 * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    prompt = list(range(128 * 16))
    print(f"Command: `{COMMAND}`; x86_64 shared host, Python {platform.python_version()}; medians.\n")
    print("| pools | model | alias | split | model:adapter | adapter name | decide base | decide adapter |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pools in (16, 64, 1000):
        core = core_of(pools)
        row = [
            micros(lambda c=core, n=name: c.resolve(n, "req-1"), args.repeat)
            for name in ("m", "one", "split", "m:sql", "sql")
        ]
        row.append(micros(lambda c=core: c.decide("m", prompt, 16, dry_run=True), args.repeat))
        row.append(micros(lambda c=core: c.decide("m", prompt, 16, dry_run=True, adapter="sql"), args.repeat))
        print(f"| {pools} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    print("\nµs per call (resolve) and per decision (RoutingCore.decide, dry run, cold 2,048-token prompt).")
    return 0


if __name__ == "__main__":
    sys.exit(main())

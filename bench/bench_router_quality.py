"""What recording router quality costs per admission: RoutingCore.decide vs decide + record_admission.

16, 100 and 1,000 listed pools with fresh load and KV views, a 1,024-token prompt (64 blocks of 16)
that pool k caches the first (7k mod 64) blocks of. Both measured in the same run on the same core,
interleaved (alternating which runs first), as the best of several repeats (the shared host's noise only ever adds time):

    .venv/bin/python -m bench.bench_router_quality [--repeats N]
"""

from __future__ import annotations

import argparse
import gc
import timeit

from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import LoadSignal, PoolState
from globalrouter.routing import RoutingCore
from globalrouter.selection import Decision, Selector
from meshkit.blocks import block_hashes
from meshkit.clock import FakeClock

PROMPT = list(range(1024))
BLOCK = 16


def build(pools: int) -> RoutingCore:
    """A core whose pools all stay fresh (a fake clock that does not move)."""
    clock = FakeClock(start=100.0)
    table, index = PoolTable(), KvIndex()
    hashes = block_hashes(PROMPT, BLOCK)
    now = clock.monotonic()
    for i in range(pools):
        pool = PoolState(pool_id=f"p{i}", listed=True, model="m", frontends=("http://h:1",), block_size=BLOCK)
        source = f"p{i}/r/1"
        index.apply_snapshot(source, hashes[: (i * 7) % len(hashes)])
        pool.kv_sources, pool.kv_at = {source}, now
        load = LoadSignal(
            requests_running=i % 5, max_running_requests=8, prefill_tokens_in_flight=500 * (i % 7)
        )
        pool.record_load(load, now)
        table.pools[pool.pool_id] = pool
    return RoutingCore(table, index, Selector(), clock, RouterMetrics())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repeats per case")
    args = parser.parse_args()
    for pools in (16, 100, 1000):
        core = build(pools)
        number = max(5, 20_000 // pools)

        def decide(core: RoutingCore = core) -> None:
            core.decide("m", PROMPT, 64)

        def decide_and_record(core: RoutingCore = core) -> None:
            decision = core.decide("m", PROMPT, 64)
            core.record_admission(decision, decision.candidates[0].pool_id)

        decision = core.decide("m", PROMPT, 64)
        chosen = decision.candidates[0].pool_id

        def record(core: RoutingCore = core, decision: Decision = decision, chosen: str = chosen) -> None:
            core.record_admission(decision, chosen)

        gc.collect()
        alone: list[float] = []
        both: list[float] = []
        for repeat in range(args.repeats):
            runs = [(alone, decide), (both, decide_and_record)]
            for samples, call in runs if repeat % 2 else reversed(runs):  # neither always runs first
                samples.append(timeit.timeit(call, number=number) / number)
        r = min(timeit.repeat(record, number=2000, repeat=args.repeats)) / 2000
        a, b = min(alone), min(both)
        print(
            f"pools={pools:5} decide {a * 1e6:8.1f} us | decide + record_admission {b * 1e6:8.1f} us "
            f"(ratio {b / a:.3f}) | record_admission alone {r * 1e6:6.2f} us ({r / a:.1%} of a decision)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

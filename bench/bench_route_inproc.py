"""A Route call's CPU on the serving loop at fleet scale, in-process: the servicer's handler without gRPC.

Run: `python -m bench.bench_route_inproc [--pools 1000] [--calls 200] [--max-candidates K]`. A
frontend made by `create_server` (`--kv-state summary`, not started) with `--pools` listed pools,
fresh load and KV (each holds the first 1024 >> (k mod 8) blocks of the 16k prompts), answers Route
dry runs for a 1k- and a 16k-token prompt through `RouterServicer.Route` itself (hashing,
decision, the reply) and the reply's serialization, as one loop turn of the live frontend does.
Prints thread-CPU p50 / p99 in µs per prompt size, and the reply's size; then the median time
to hash the 16k prompt from the request's repeated field (as Route hands it over) and from a list. The same file runs
against an older tree (PYTHONPATH=that tree): `--max-candidates` is sent only where the contract
has it. For issue 19's live decision latency (BENCHMARKS.md, "what the long turns were").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time

import numpy as np

from bench.measure import synthetic_pool
from globalrouter.config import RouterConfig
from globalrouter.router_api import RouterServicer
from globalrouter.server import create_server
from globalrouter.v1 import router_pb2
from meshkit.blocks import block_hashes

BLOCK = 16


class _Context:
    """What Route reads of a servicer context on its success path (nothing); aborts are bugs here."""

    async def abort(self, *args: object) -> None:
        raise AssertionError(f"Route aborted: {args}")

    async def abort_with_status(self, *args: object) -> None:
        raise AssertionError(f"Route aborted: {args}")

    def invocation_metadata(self) -> tuple:
        return ()

    def set_trailing_metadata(self, *args: object) -> None:
        pass


async def run(pools: int, calls: int, max_candidates: int) -> None:
    router = create_server(RouterConfig(listen="127.0.0.1:0", kv_state="summary"))
    core = router.core
    now = core.clock.monotonic()
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(1, 50_000, 16_384)]
    hashes = np.array(block_hashes(prompt, BLOCK), dtype=np.uint64)
    for k in range(pools):
        pool = synthetic_pool(k, BLOCK)
        pool.kv_at = pool.load_at = now
        core.table.pools[pool.pool_id] = pool
        held = len(hashes) >> (k % 8)
        own = np.concatenate((rng.integers(0, 2**63, 2000 - held, dtype=np.uint64), hashes[:held]))
        core.index.apply_snapshot(f"{pool.pool_id}/relay-0", own)
    # create_server keeps the servicer only in the gRPC server's handlers: found among live objects.
    [servicer] = [o for o in gc.get_objects() if isinstance(o, RouterServicer)]
    field = "max_candidates" in router_pb2.RouteRequest.DESCRIPTOR.fields_by_name
    requests = {}
    for label, n in (("1k", 1024), ("16k", 16_384)):
        kw = {"max_candidates": max_candidates} if field and max_candidates else {}
        requests[label] = router_pb2.RouteRequest(
            model="m", prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=prompt[:n])), **kw
        )
    gc.collect()
    gc.freeze()  # as the frontend does once ready: the fleet's state out of the collector's passes
    ctx = _Context()
    took: dict[str, list[int]] = {k: [] for k in requests}
    size: dict[str, int] = {}
    for _ in range(calls):
        for label, req in requests.items():
            t0 = time.thread_time_ns()
            reply = await servicer.Route(req, ctx)  # type: ignore[arg-type]  # what Route reads of one
            size[label] = len(reply.SerializeToString())
            took[label].append(time.thread_time_ns() - t0)
    print(
        f"{pools} pools, {calls} calls each, max_candidates {max_candidates if field else 'n/a (old contract)'}; "
        "Route handler + serialization, thread CPU µs p50 / p99"
    )
    for label, v in took.items():
        v.sort()
        print(
            f"  {label}: {v[len(v) // 2] / 1000:.0f} / {v[min(len(v) - 1, int(len(v) * 0.99))] / 1000:.0f}"
            f" (reply {size[label]:,} bytes, {len(reply.candidates)} candidates)"
        )
    # The decision hashes the prompt as Route hands it over: the request's repeated field.
    field_ids = requests["16k"].prompt.token_ids.ids
    as_list = list(field_ids)
    for label, tokens in (("from the request's field", field_ids), ("from a list", as_list)):
        times = []
        for _ in range(calls):
            t0 = time.thread_time_ns()
            block_hashes(tokens, BLOCK)
            times.append(time.thread_time_ns() - t0)
        times.sort()
        print(f"  hashing the 16k prompt {label}: p50 {times[len(times) // 2] / 1000:.0f} us")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pools", type=int, default=1000)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--max-candidates", type=int, default=0, help="RouteRequest.max_candidates (0: all)")
    a = p.parse_args()
    if a.pools <= 0 or a.calls <= 0 or a.max_candidates < 0:
        p.error("--pools and --calls must be > 0, --max-candidates >= 0")
    asyncio.run(run(a.pools, a.calls, a.max_candidates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

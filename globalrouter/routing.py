"""The per-request routing decision: prompt block hashes once per block size → overlaps → Selector."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Collection, Sequence

from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import PoolState
from globalrouter.recent_events import RecentEvents
from globalrouter.selection import Decision, FilterReason, Selector, pool_overlaps
from meshkit.blocks import DEFAULT_BLOCK_SIZE, block_hashes
from meshkit.clock import Clock


def describe_filtered(decision: Decision) -> str:
    """One sentence naming every pool that was filtered out, and why."""
    return "; ".join(
        f"{f.pool_id}: {f.reason.name.lower().replace('_', ' ')}" + (f" ({f.detail})" if f.detail else "")
        for f in decision.filtered
    )


def affinity_key(tokens: Sequence[int]) -> int:
    """The prompt's tie-break key: the hash of its first block (or of all of it when shorter).

    Equal costs (idle pools, a prefix nobody caches) then spread new prefixes over the pools by
    rendezvous hashing, and every frontend breaks the tie the same way, so a prefix's first
    requests land together instead of all on the first pool in the table."""
    head = list(tokens[:DEFAULT_BLOCK_SIZE])
    hashes = block_hashes(head, len(head)) if head else []
    return hashes[0] if hashes else 0


class RoutingCore:
    """What Generate and Route share: the pool table, the KV index and the selector."""

    def __init__(
        self, table: PoolTable, index: KvIndex, selector: Selector, clock: Clock, metrics: RouterMetrics
    ):
        self.table = table
        self.index = index
        self.selector = selector
        self.clock = clock
        self.metrics = metrics
        self.events = RecentEvents()
        """Recent decisions, migrations and refusals (bounded), for the status page."""

    def overlaps(self, pools: Sequence[PoolState], tokens: Sequence[int], now: float) -> dict[str, int]:
        """Cached leading blocks per pool; the prompt is hashed once per distinct block size."""
        by_size: dict[int, list[PoolState]] = defaultdict(list)
        for pool in pools:
            if pool.block_size > 0 and pool.kv_sources:
                by_size[pool.block_size].append(pool)
        cached: dict[str, int] = {}
        limits = self.selector_limits
        for size, group in by_size.items():
            # Hashing a long prompt costs more than the rest of the decision: look at its first
            # block alone first, and hash the rest only when some pool holds that block.
            first = block_hashes(tokens[:size], size)
            if not first or not self.index.holds(first[0]):
                continue
            cached.update(pool_overlaps(self.index, group, block_hashes(tokens, size), now, limits))
        return cached

    @property
    def selector_limits(self):
        return self.selector.config.freshness

    def decide(
        self,
        model: str,
        tokens: Sequence[int],
        max_tokens: int,
        exclude: Collection[str] = (),
        *,
        dry_run: bool = False,
        regions: frozenset[str] | None = None,
    ) -> Decision:
        """Filter and rank the listed pools (minus `exclude`) for this prompt; a dry run (Route)
        sends nothing, so it does not count toward the wait SLO's price. `regions`: the caller's
        allowed regions (None: any)."""
        started = time.perf_counter()
        now = self.clock.monotonic()
        pools = [p for p in self.table.pools.values() if p.listed and p.pool_id not in exclude]
        cached = self.overlaps(pools, tokens, now)
        decision = self.selector.select(
            pools,
            model,
            len(tokens),
            max_tokens,
            cached,
            now,
            affinity_key=affinity_key(tokens),
            observe=not dry_run,
            regions=regions,
        )
        self.metrics.decision_latency.observe(time.perf_counter() - started)
        return decision


__all__ = ["FilterReason", "RoutingCore", "describe_filtered"]

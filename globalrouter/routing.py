"""The per-request routing decision: prompt block hashes once per block size → overlaps → Selector."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from operator import attrgetter
from typing import NamedTuple

from globalrouter.aliases import ModelResolver, Resolved
from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import KvSummary
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import PoolState
from globalrouter.recent_events import RecentEvents
from globalrouter.routed_prefixes import RoutedPrefixes, with_routed
from globalrouter.selection import Decision, FilterReason, Selector, pool_overlaps
from meshkit.blocks import DEFAULT_BLOCK_SIZE, adapter_seed, block_hashes
from meshkit.clock import Clock


def describe_filtered(decision: Decision) -> str:
    """One sentence naming every pool that was filtered out, and why."""
    return "; ".join(
        f"{f.pool_id}: {f.reason.name.lower().replace('_', ' ')}" + (f" ({f.detail})" if f.detail else "")
        for f in decision.filtered
    )


def affinity_key(tokens: Sequence[int], seed: int = 0) -> int:
    """The prompt's tie-break key: the hash of its first block (or of all of it when shorter).

    Equal costs (idle pools, a prefix nobody caches) then spread new prefixes over the pools by
    rendezvous hashing, and every frontend breaks the tie the same way, so a prefix's first
    requests land together instead of all on the first pool in the table."""
    head = list(tokens[:DEFAULT_BLOCK_SIZE])
    hashes = block_hashes(head, len(head), seed) if head else []
    return hashes[0] if hashes else seed


class PrefixQuality(NamedTuple):
    """One admission's cached prefix as the KV index saw it: what the admitting pool had against
    the best any eligible pool of the same decision had ("achieved" vs "available"). A NamedTuple:
    built once per admission, a frozen dataclass costs four times as much."""

    achieved: float
    """Cached share of the prompt's blocks at the admitting pool (0..1)."""
    available: float
    """Best cached share of the prompt's blocks over the decision's candidates (0..1)."""
    forgone_tokens: int
    """Prompt tokens the admitting pool prefills beyond what the best-cached candidate would."""


_uncached = attrgetter("uncached_tokens")


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
        self.resolver = ModelResolver()
        """Aliases and adapter names (globalrouter.aliases); replaced by the server's own."""
        self.routed: RoutedPrefixes | None = None
        """Prompts this frontend sent recently, counted as cached at their pool until its KV
        events arrive (`--routed-prefix-ttl`; globalrouter.routed_prefixes); None: off."""

    def resolve(self, name: str, request_id: str) -> Resolved:
        """What a request's model name stands for (alias, model, model:adapter or adapter), over
        the listed pools; raises ResolveError for an adapter name served on several models."""
        return self.resolver.resolve(name, request_id, self.table.pools.values())

    def overlaps(
        self,
        pools: Sequence[PoolState],
        tokens: Sequence[int],
        now: float,
        seed: int = 0,
        hashed: dict[int, Sequence[int]] | None = None,
    ) -> Mapping[str, int]:
        """Cached leading blocks per pool; the prompt is hashed once per distinct block size, from
        `seed` (a LoRA adapter's, meshkit.blocks.adapter_seed; 0 for the base model); the hashes
        computed go into `hashed` (block size -> hashes) when given."""
        by_size: dict[int, list[PoolState]] = defaultdict(list)
        for pool in pools:
            if pool.block_size > 0 and pool.kv_sources:
                by_size[pool.block_size].append(pool)
        cached: dict[str, int] = {}
        limits = self.selector_limits
        routed = self.routed
        # The exact index answers "does any pool hold this block" with a dict lookup; the summary
        # with a probe of every pool's table, which its prefix search makes again (about 0.1 ms
        # at 1,000 pools): it is asked for the prefixes straight away, and answers none itself
        # when no pool holds the first block.
        precheck = not isinstance(self.index, KvSummary)
        for size, group in by_size.items():
            # Hashing a long prompt costs more than the rest of the decision: look at its first
            # block alone first, and hash the rest only when some pool holds that block.
            first = block_hashes(tokens[:size], size, seed)
            if not first:
                continue
            sent = routed is not None and routed.holds(first[0])
            if not sent and precheck and not self.index.holds(first[0]):
                continue
            hashes = block_hashes(tokens, size, seed)
            if hashed is not None:
                hashed[size] = hashes
            every = len(group) == len(pools)
            # Every pool (the usual fleet): asked about the caller's own list, so that select
            # takes the rows and the array as they are.
            found = pool_overlaps(self.index, pools if every else group, hashes, now, limits)
            if sent:
                found = with_routed(found, routed, hashes, now)
            if every:
                return found
            cached.update(found)
        return cached

    def record_routed(
        self, pool: PoolState, decision: Decision, tokens: Sequence[int], adapter: str = ""
    ) -> None:
        """`tokens`, ranked by `decision`, were sent to `pool` (admitted there): the prompt counts
        as cached there for the routed-prefix TTL, so the next request sharing the prefix finds it
        before the pool's KV events do; hashed again only if the decision did not. Nothing when
        off or the pool states no block size."""
        routed = self.routed
        size = pool.block_size
        if routed is None or size <= 0:
            return
        hashes = decision.prompt_hashes.get(size) if decision.prompt_hashes else None
        if hashes is None:
            hashes = block_hashes(tokens, size, adapter_seed(adapter))
        routed.record(pool.pool_id, hashes, self.clock.monotonic())

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
        adapter: str = "",
    ) -> Decision:
        """Filter and rank the listed pools (minus `exclude`) for this prompt under `adapter` (a
        LoRA adapter of `model`, "" for none); a dry run (Route) sends nothing, so it does not
        count toward the wait SLO's price. `regions`: the caller's allowed regions (None: any)."""
        started, started_cpu = time.perf_counter(), time.thread_time()
        now = self.clock.monotonic()
        pools = [p for p in self.table.pools.values() if p.listed and p.pool_id not in exclude]
        seed = adapter_seed(adapter)
        hashed: dict[int, Sequence[int]] | None = {} if self.routed is not None and not dry_run else None
        cached = self.overlaps(pools, tokens, now, seed, hashed)
        decision = self.selector.select(
            pools,
            model,
            len(tokens),
            max_tokens,
            cached,
            now,
            affinity_key=affinity_key(tokens, seed),
            observe=not dry_run,
            regions=regions,
            adapter=adapter,
        )
        if hashed:
            decision = replace(decision, prompt_hashes=hashed)  # for record_routed at admission
        self.metrics.decision_latency.observe(time.perf_counter() - started)
        # The thread's own CPU apart from the wall time: on a busy host the wall time also holds
        # the time the loop's thread waited for a CPU or for the GIL (other threads, collections).
        self.metrics.decision_cpu.observe(time.thread_time() - started_cpu)
        return decision

    def record_admission(self, decision: Decision, pool_id: str) -> PrefixQuality | None:
        """Records how much of the cache the request got where it was admitted (`pool_id`, one of
        `decision`'s candidates) against the best any candidate had; None when no candidate has a
        full prompt block (nothing to cache) or `pool_id` is not a candidate.

        Called per admission rather than in `decide`: a refusal moves the request down the ranking,
        and what counts is the pool that took it (a Route dry run is never admitted, so it records
        nothing). "Available" is the share at the candidate left with the fewest prompt tokens to
        prefill (the most cached tokens, so pools of different block sizes compare)."""
        candidates = decision.candidates
        chosen = next((c for c in candidates if c.pool_id == pool_id), None)  # rank 1 but after refusals
        if chosen is None:
            return None
        # The best cache is where the fewest prompt tokens are left to prefill (the most cached
        # tokens, whatever the pools' block sizes): one pass in C over what the decision ranked.
        best = min(candidates, key=_uncached)
        available = best.cached_blocks / best.prompt_blocks if best.prompt_blocks else 0.0
        if not chosen.prompt_blocks and not available:
            return None  # no full block anywhere: nothing could be cached (nor forgone)
        achieved = chosen.cached_blocks / chosen.prompt_blocks if chosen.prompt_blocks else 0.0
        forgone = chosen.uncached_tokens - best.uncached_tokens
        self.metrics.cached_prefix_quality.observe(achieved, available, forgone)
        return PrefixQuality(achieved, available, forgone)

    def kv_ages(self) -> list[tuple[str, float]]:
        """(pool id, seconds since its last KV message) for each listed pool that has a KV view.

        Read from the metrics endpoint's thread at scrape time: list() copies the table's values in
        one step, and each pool's kv_at is read once."""
        now = self.clock.monotonic()
        out: list[tuple[str, float]] = []
        for pool in list(self.table.pools.values()):
            at = pool.kv_at
            if pool.listed and at is not None:
                out.append((pool.pool_id, max(0.0, now - at)))
        return out


__all__ = ["FilterReason", "PrefixQuality", "RoutingCore", "describe_filtered"]

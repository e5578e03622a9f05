"""Test-only reference: the per-pool Python Selector.select and pool_overlaps as they were before the columnar rewrite.

Kept verbatim (classes imported from globalrouter.selection so results compare equal) to prove
the vectorised selection gives the same decisions on random fleets (test_selection_equivalence).

Original docstring: pool selection, filter then rank.

Filter keeps the listed pools that serve the model, have it Ready, are not draining, list a
frontend and whose serving link is not in back-off. Rank orders them by an estimate of the
seconds the request would take there: the prefill work left after the pool's cached prefix,
plus the wait behind the pool's queued and running work (the last load report less what the
pool has served since, at its throughput) and behind what this frontend sent there since that
report, all divided by the pool's throughput (pools differ in size); plus a hotspot term for
a pool piling up work well above the others. A pool whose load is unknown ranks behind every
pool whose load is known. Nothing here knows about gRPC; `now` is a monotonic time passed in
by the caller. The simulator runs exactly this code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from globalrouter.kv_index import KvIndex
from globalrouter.pool_state import FreshnessLimits, PoolState
from globalrouter.selection import (
    Decision,
    FilteredPool,
    FilterReason,
    RankedPool,
    SelectionConfig,
)
from globalrouter.wait_slo import WaitPrice

_xxh3 = xxhash.xxh3_64_intdigest
_SEED_MASK = (1 << 64) - 1


def reference_pool_overlaps(
    index: KvIndex,
    pools: Iterable[PoolState],
    block_hashes: Sequence[int],
    now: float,
    limits: FreshnessLimits,
) -> dict[str, int]:
    """Pool id -> cached leading blocks: the max over the pool's KV sources, 0 when the pool's
    KV state is not fresh. One pass over the prompt for all pools."""
    by_source = index.prefix_overlaps(block_hashes)
    out: dict[str, int] = {}
    for pool in pools:
        best = 0
        if by_source and pool.kv_fresh(now, limits):
            for source in pool.kv_sources:
                n = by_source.get(source, 0)
                if n > best:
                    best = n
        out[pool.pool_id] = best
    return out


def _filter_reason(
    pool: PoolState, model: str, now: float, limits: FreshnessLimits, regions: frozenset[str] | None
) -> FilteredPool | None:
    if pool.model != model:
        return FilteredPool(pool.pool_id, FilterReason.OTHER_MODEL, f"serves {pool.model!r}, not {model!r}")
    if regions is not None and pool.region not in regions:
        return FilteredPool(
            pool.pool_id,
            FilterReason.REGION_NOT_ALLOWED,
            f"in region {pool.region!r}, outside the caller's allowed regions ({', '.join(sorted(regions))})",
        )
    if not pool.ready(model, now, limits):
        return FilteredPool(pool.pool_id, FilterReason.NOT_READY, f"model {model!r} is not Ready in the pool")
    if pool.draining():
        source = "discovery" if pool.directory_draining else "telemetry"
        return FilteredPool(pool.pool_id, FilterReason.DRAINING, f"the pool drains (from {source})")
    if not pool.frontends:
        return FilteredPool(
            pool.pool_id, FilterReason.NO_FRONTEND, "the pool registered no frontend: listed but not routable"
        )
    if pool.link_backoff_until > now:
        return FilteredPool(
            pool.pool_id,
            FilterReason.LINK_BACKOFF,
            f"serving link in failure back-off for {pool.link_backoff_until - now:.1f}s more",
        )
    return None


def _adapter_filter(pool: PoolState, model: str, adapter: str) -> FilteredPool | None:
    served = pool.adapters.get(model)
    if served is not None and adapter in served:
        return None
    listed = f"it lists {', '.join(sorted(served))}" if served else "it lists none"
    return FilteredPool(
        pool.pool_id,
        FilterReason.ADAPTER_NOT_SERVED,
        f"does not serve adapter {adapter!r} of {model!r} ({listed})",
    )


class ReferenceSelector:
    """Filter then rank, per request; stateless apart from its configuration and, with a wait
    SLO, the price of waiting beyond it (every `select` is one observation)."""

    __slots__ = ("config", "wait_price")

    def __init__(self, config: SelectionConfig = SelectionConfig()) -> None:  # noqa: B008
        self.config = config
        self.wait_price = WaitPrice(config.wait_slo) if config.wait_slo is not None else None

    @property
    def prefill_weight(self) -> float:
        """The prefill weight in use (the wait SLO's, else the configured one)."""
        slo = self.config.wait_slo
        return slo.prefill_weight if slo is not None else self.config.prefill_weight

    @property
    def wait_excess_weight(self) -> float:
        """The price of a second of estimated wait beyond the wait SLO (0 without one)."""
        return self.wait_price.excess_weight if self.wait_price is not None else 0.0

    def throughput(self, pool: PoolState) -> float:
        """Work tokens per second the pool serves (stated, else estimated from its slots)."""
        rate = pool.capacity.prefill_tokens_per_second
        if rate > 0:
            return float(rate)
        slots = pool.capacity.max_running_requests
        if not slots and pool.load is not None:
            slots = pool.load.max_running_requests
        if slots > 0:
            return slots * self.config.tokens_per_second_per_slot
        return self.config.default_tokens_per_second

    def _queue(self, pool: PoolState, known: bool, rate: float, now: float) -> tuple[float, float, float]:
        """(load_cost, pending_cost, assigned): the reported work left now and the pending work,
        in seconds of throughput, weighted; `assigned` is reported + pending undrained (what
        the hotspot term compares)."""
        cfg = self.config
        dw = cfg.decode_weight
        load_cost = reported = 0.0
        if known:
            load = pool.load
            reported = (
                cfg.load_weight * (load.prefill_tokens_in_flight + dw * load.decode_tokens_in_flight) / rate
            )
            load_cost = reported
            if cfg.drain_reports and reported > 0:
                # served since the report at the pool's throughput (load_weight scales seconds)
                load_cost = max(0.0, reported - cfg.load_weight * (now - pool.load_at))
        pending_cost = (
            cfg.pending_weight * (pool.pending_prefill_tokens + dw * pool.pending_decode_tokens) / rate
        )
        return load_cost, pending_cost, reported + pending_cost

    def select(
        self,
        pools: Iterable[PoolState],
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        cached_blocks: Mapping[str, int],
        now: float,
        affinity_key: int = 0,
        observe: bool = True,
        regions: frozenset[str] | None = None,
        adapter: str = "",
    ) -> Decision:
        """Filters the listed pools and ranks the eligible ones, best first.

        Equal costs (typically idle pools and a prompt no pool caches) are ordered by a
        rendezvous hash of `affinity_key` and the pool id: pass the prompt's first block hash,
        so new prefixes spread evenly over the pools while the same prefix ties the same way
        on every frontend. `observe` False (a dry run) leaves the wait SLO's price as it is.
        `regions`, when set, are the only regions the caller may use (residency, a hard filter).
        `adapter` (a LoRA adapter of `model`) keeps only the pools that serve it.
        """
        cfg = self.config
        limits = cfg.freshness
        rows: list[_Row] = []
        filtered: list[FilteredPool] = []
        model_served = False
        first_block_size = 0
        own_work = prompt_tokens + cfg.decode_weight * max_tokens
        price = self.wait_price
        if price is not None:
            prefill_weight = price.slo.prefill_weight
            excess_weight = price.excess_weight
            knee = price.slo.target_seconds
        else:
            prefill_weight = cfg.prefill_weight
            excess_weight = knee = 0.0
        for pool in pools:
            if not pool.listed:
                continue
            if pool.model == model and (not adapter or adapter in pool.adapters.get(model, ())):
                model_served = True
            if not first_block_size:
                first_block_size = pool.block_size
            reason = _filter_reason(pool, model, now, limits, regions)
            if reason is None and adapter:
                reason = _adapter_filter(pool, model, adapter)
            if reason is not None:
                filtered.append(reason)
                continue
            rate = self.throughput(pool)
            block_size = pool.block_size
            cached = cached_blocks.get(pool.pool_id, 0)
            if block_size > 0:
                blocks = prompt_tokens // block_size
                cached = min(cached, blocks)
                uncached = prompt_tokens - cached * block_size
            else:
                blocks = cached = 0
                uncached = prompt_tokens
            known = pool.load_fresh(now, limits)
            load_cost, pending_cost, assigned = self._queue(pool, known, rate, now)
            if excess_weight:
                over = load_cost + pending_cost - knee
                if over > 0:
                    load_cost += excess_weight * over
            rows.append(
                _Row(
                    pool,
                    known,
                    prefill_weight * uncached / rate,
                    load_cost,
                    pending_cost,
                    cached,
                    blocks,
                    uncached,
                    assigned,
                    own_work / rate,
                )
            )
        if cfg.hotspot_seconds > 0 and rows:
            _penalize_hotspots(rows, cfg.hotspot_seconds, cfg.hotspot_request_share)
        candidates: list[tuple[bool, float, RankedPool]] = []
        for r in rows:
            total = r.prefill_cost + r.load_cost + r.pending_cost
            ranked = _new_ranked(
                r.pool.pool_id,
                total,
                r.prefill_cost,
                r.load_cost,
                r.pending_cost,
                r.cached,
                r.blocks,
                r.known,
                r.pool.region,
                r.uncached,
            )
            candidates.append((not r.known, total, ranked))
        candidates.sort(key=_rank_key)
        filtered.sort(key=lambda f: f.pool_id)
        ranked_list = _break_ties(candidates, affinity_key & _SEED_MASK)
        if price is not None and observe and ranked_list:
            # The estimated wait at the pick, without the hotspot and wait-price terms: drained
            # reported work plus pending, in seconds (worked out again only here, off the path
            # without an SLO).
            first = next(r for r in rows if r.pool.pool_id == ranked_list[0].pool_id)
            load_cost, pending_cost, _ = self._queue(
                first.pool, first.known, self.throughput(first.pool), now
            )
            price.observe(load_cost + pending_cost)
        if ranked_list:
            prompt_blocks = ranked_list[0].prompt_blocks
        else:
            prompt_blocks = prompt_tokens // first_block_size if first_block_size > 0 else 0
        return Decision(ranked_list, filtered, prompt_blocks, model_served)


(
    _set_pool_id,
    _set_total,
    _set_prefill,
    _set_load,
    _set_pending,
    _set_cached,
    _set_blocks,
    _set_known,
    _set_region,
    _set_uncached,
) = (RankedPool.__dict__[f].__set__ for f in RankedPool.__slots__)


def _new_ranked(
    pool_id: str,
    total: float,
    prefill: float,
    load: float,
    pending: float,
    cached: int,
    blocks: int,
    known: bool,
    region: str,
    uncached: int,
) -> RankedPool:
    """RankedPool(...) without the frozen dataclass's __init__, which goes through
    object.__setattr__ per field and showed up in select()'s profile with many pools.
    Sets the slots directly (declaration order); the result equals the dataclass-built one."""
    r = object.__new__(RankedPool)
    _set_pool_id(r, pool_id)
    _set_total(r, total)
    _set_prefill(r, prefill)
    _set_load(r, load)
    _set_pending(r, pending)
    _set_cached(r, cached)
    _set_blocks(r, blocks)
    _set_known(r, known)
    _set_region(r, region)
    _set_uncached(r, uncached)
    return r


@dataclass(slots=True)
class _Row:
    """One eligible pool while its costs are worked out."""

    pool: PoolState
    known: bool
    prefill_cost: float
    load_cost: float
    pending_cost: float
    cached: int
    blocks: int
    uncached: int
    assigned: float
    """Reported + pending work in seconds, undrained (what the hotspot term compares)."""
    own_seconds: float
    """The request's whole service time at this pool with nothing cached."""


def _penalize_hotspots(rows: list[_Row], floor: float, request_share: float) -> None:
    """Adds E^2 / (floor + request_share * T + M) to the load term of pools whose assigned work
    exceeds the mean M of the known-load pools by E (T: the request's own service time there).

    The assigned work is undrained on purpose: the drained estimate is the better guess of the
    wait, but a pool that was given well above its share within the last report interval is
    where the next burst piles up, so spreading keys on what was assigned."""
    queues = [r.assigned for r in rows if r.known]
    if not queues:
        return
    mean = sum(queues) / len(queues)
    for r in rows:
        excess = r.assigned - mean
        if excess > 0:
            r.load_cost += excess * excess / (floor + request_share * r.own_seconds + mean)


def _rank_key(entry: tuple[bool, float, RankedPool]) -> tuple[bool, float]:
    return entry[0], entry[1]


def _break_ties(candidates: list[tuple[bool, float, RankedPool]], seed: int) -> list[RankedPool]:
    """The ranked pools, each run of equal keys reordered by rendezvous hash (hashes are only
    computed for ties, which are rare outside idle pools and uncached prompts)."""
    out = [c[2] for c in candidates]
    i, n = 0, len(candidates)
    while i < n:
        j = i + 1
        while j < n and candidates[j][0] == candidates[i][0] and candidates[j][1] == candidates[i][1]:
            j += 1
        if j - i > 1:
            out[i:j] = sorted(out[i:j], key=lambda r: _xxh3(r.pool_id.encode(), seed=seed))
        i = j
    return out

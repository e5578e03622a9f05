"""Pool selection, filter then rank: the pure core the global frontend runs for every request.

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

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

from globalrouter.kv_index import KvIndex
from globalrouter.pool_state import FreshnessLimits, PoolState
from globalrouter.wait_slo import WaitPrice, WaitSlo

_xxh3 = xxhash.xxh3_64_intdigest
_SEED_MASK = (1 << 64) - 1


class FilterReason(enum.Enum):
    """Why a pool is not a candidate (names match proto `globalrouter.v1.FilterReason`)."""

    OTHER_MODEL = 1
    NOT_READY = 2
    DRAINING = 3
    NO_FRONTEND = 4
    LINK_BACKOFF = 5
    REGION_NOT_ALLOWED = 6
    ADAPTER_NOT_SERVED = 7


@dataclass(frozen=True, slots=True)
class SelectionConfig:
    """Weights and defaults of the ranking; the defaults are what the live frontend uses."""

    freshness: FreshnessLimits = field(default_factory=FreshnessLimits)
    """How old each kind of signal may be before it counts as unknown."""
    prefill_weight: float = 1.3
    """Multiplier of the prefill term (work left after the cached prefix). 1 compares the
    request's own time only (wait + prefill); a little above 1 also counts what a second copy
    of the prefix costs later requests (cache space they miss), so a prefix's followers stay
    with its holder unless its wait exceeds the prefill they save by this margin."""
    load_weight: float = 1.0
    """Multiplier of the pool's reported queued and running work."""
    drain_reports: bool = True
    """Whether the reported work counts as served at the pool's throughput since the report
    arrived (a report up to a load interval old otherwise overstates the queue of a pool that
    has kept serving, which sends a prefix's followers away from an idle holder at light load).
    Pending work is never drained: when it arrived within the interval is not known."""
    pending_weight: float = 1.0
    """Multiplier of the work this frontend sent there since the pool's last load report."""
    decode_weight: float = 4.0
    """Work tokens one output token costs, in prefill-token equivalents (decode is memory bound,
    so one output token takes about as long as several prompt tokens of prefill)."""
    default_tokens_per_second: float = 10_000.0
    """Throughput (work tokens per second) assumed for a pool that states neither its prefill
    rate nor its running slots."""
    tokens_per_second_per_slot: float = 1_000.0
    """Throughput assumed per running slot for a pool that states max running requests but no
    prefill rate."""
    hotspot_seconds: float = 0.25
    """Seconds; the floor of the hotspot scale. A pool whose assigned work W (its last report
    plus pending, undrained, in seconds) exceeds the mean M of the eligible pools with known
    load by E = W - M gets E^2 / (hotspot_seconds + hotspot_request_share * T + M) added to its
    load term, T being the request's own uncached service time (whole prompt plus decode):
    a pool piling up behind a popular prefix sheds work before its tail latency grows, while
    pools near the mean are ranked on cache and queue alone. Measured against the mean, the
    term does not grow with the overall load. 0 turns it off."""
    hotspot_request_share: float = 0.6
    """How much of the request's own service time T widens the hotspot scale: a long request
    (whose prefill dwarfs a queue excess of the same size) is shed later than a short one, so
    the long prefixes that carry most of the cache hits stay with their holder."""
    wait_slo: WaitSlo | None = None
    """When set, the ranking runs under this wait SLO (`globalrouter.wait_slo`): the SLO's
    prefill weight replaces `prefill_weight`, and each pool's estimated wait beyond the SLO's
    target costs a price per second, found online from the estimated waits at the pools the
    decisions rank first (every `select` but a dry run is one observation)."""


@dataclass(frozen=True, slots=True)
class RankedPool:
    """One eligible pool with its cost terms (seconds of the pool's throughput)."""

    pool_id: str
    total_cost: float
    """The sum the ranking uses; lower ranks first (after the load_known split)."""
    prefill_cost: float
    """Prefill work left after the cached prefix, relative to the pool's throughput (weighted)."""
    load_cost: float
    """The pool's reported queued and running work, relative to its throughput (weighted);
    0 when the load is unknown; plus the hotspot term and, under a wait SLO, the price of the
    estimated wait beyond it."""
    pending_cost: float
    """Work sent there since the last load report, relative to its throughput (weighted)."""
    cached_blocks: int
    """Leading prompt blocks the pool holds."""
    prompt_blocks: int
    """Full blocks of the prompt at the pool's block size."""
    load_known: bool
    """False when the load report is missing or stale (such pools rank behind known load)."""
    region: str
    uncached_tokens: int = 0
    """Prompt tokens the pool still has to prefill (what to pass to `PoolState.record_sent`)."""


@dataclass(frozen=True, slots=True)
class FilteredPool:
    """A listed pool that is not a candidate, and why."""

    pool_id: str
    reason: FilterReason
    detail: str


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one selection."""

    candidates: list[RankedPool]
    """Eligible pools, best first."""
    filtered: list[FilteredPool]
    """Listed pools filtered out, ordered by pool_id."""
    prompt_blocks: int
    """Full prompt blocks at the best candidate's block size (else the first listed pool's)."""
    model_served: bool
    """Whether some listed pool serves the model at all (if not: NOT_FOUND)."""


def pool_overlaps(
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


class Selector:
    """Filter then rank, per request; stateless apart from its configuration and, with a wait
    SLO, the price of waiting beyond it (every `select` is one observation)."""

    __slots__ = ("config", "wait_price")

    def __init__(self, config: SelectionConfig = SelectionConfig()) -> None:
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
                cfg.load_weight
                * (load.prefill_tokens_in_flight + dw * load.decode_tokens_in_flight)  # type: ignore[union-attr]
                / rate
            )
            load_cost = reported
            if cfg.drain_reports and reported > 0:
                # served since the report at the pool's throughput (load_weight scales seconds)
                load_cost = max(0.0, reported - cfg.load_weight * (now - pool.load_at))  # type: ignore[operator]
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

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
import itertools
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import xxhash

from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import KvSummary
from globalrouter.pool_state import (
    BACKOFF,
    BLOCK_SIZE,
    BLOCKED,
    CAP_RATE,
    COLUMNS,
    FLAGS,
    KV_AT,
    LISTED,
    LOAD_AT,
    LOAD_DECODE,
    LOAD_PREFILL,
    LOAD_PRESENT,
    MODEL,
    NOT_READY,
    PEND_DECODE,
    PEND_PREFILL,
    REGION,
    SLOTS,
    STATE_AT,
    UNINTERNED,
    FreshnessLimits,
    PoolState,
)
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

    @classmethod
    def for_ranking(cls, ranking: str, **fields: Any) -> SelectionConfig:
        """The weights of a named ranking (RANKINGS), with `fields` (freshness, wait_slo, ...) set;
        ValueError names the known rankings, or says why a field does not go with the ranking."""
        if ranking not in RANKINGS:
            raise ValueError(f"unknown ranking {ranking!r}; known: {', '.join(RANKINGS)}")
        if ranking == "dynamo" and fields.get("wait_slo") is not None:
            raise ValueError(
                "the dynamo ranking (--ranking dynamo) takes no wait SLO (--wait-slo): its cost has fixed, equal weights"
            )
        return cls(**{**RANKINGS[ranking], **fields})


RANKINGS: dict[str, dict[str, object]] = {
    "default": {},
    "dynamo": {
        "prefill_weight": 1.0,
        "load_weight": 1.0,
        "pending_weight": 1.0,
        "drain_reports": False,
        "hotspot_seconds": 0.0,
    },
}
"""Named rankings (`--ranking`): field overrides of SelectionConfig. `dynamo` is the cost of
Dynamo's KV router one level up (the simulator's `dynamo` policy, globalrouter.policies): the
prefill left after the pool's cached prefix plus the pool's reported and pending work, equal
weights, no drain of reports, no hotspot term and no SLO; the frontend can run it live, so the
live mesh has the baseline the issue's goals compare against on the same host."""


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

    candidates: Sequence[RankedPool]
    """Eligible pools, best first (a `Ranking` from `select`: built as read, slices are lists)."""
    filtered: list[FilteredPool]
    """Listed pools filtered out, ordered by pool_id."""
    prompt_blocks: int
    """Full prompt blocks at the best candidate's block size (else the first listed pool's)."""
    model_served: bool
    """Whether some listed pool serves the model at all (if not: NOT_FOUND)."""
    prompt_hashes: Mapping[int, Sequence[int]] | None = None
    """Block size -> the prompt's block hashes, where the decision computed them (the routing
    core's overlaps), so recording where the prompt went does not hash it again."""


class PoolOverlaps(Mapping[str, int]):
    """Pool id -> cached leading blocks, as `pool_overlaps` gives it: the values in an array
    aligned with the pools it was asked about (their PoolColumns rows), which `Selector.select`
    reads directly when given the same pools; a dict is only built for callers that look up ids."""

    __slots__ = ("_dict", "counts", "pools", "rows")

    def __init__(self, pools: Sequence[PoolState], rows: np.ndarray, counts: np.ndarray) -> None:
        self.pools = pools
        self.rows = rows
        self.counts = counts
        self._dict: dict[str, int] | None = None

    def _as_dict(self) -> dict[str, int]:
        if self._dict is None:
            self._dict = dict(zip((p.pool_id for p in self.pools), self.counts.tolist(), strict=True))
        return self._dict

    def __getitem__(self, pool_id: str) -> int:
        return self._as_dict()[pool_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._as_dict())

    def __len__(self) -> int:
        return len(self._as_dict())

    def __repr__(self) -> str:
        return f"PoolOverlaps({self._as_dict()!r})"


_row_of = operator.attrgetter("row")
_ZEROS = itertools.repeat(0)


def _rows(pools: Sequence[PoolState]) -> np.ndarray:
    return np.fromiter(map(_row_of, pools), np.int64, len(pools))


def pool_overlaps(
    index: KvIndex | KvSummary,
    pools: Iterable[PoolState],
    block_hashes: Sequence[int],
    now: float,
    limits: FreshnessLimits,
) -> PoolOverlaps:
    """Pool id -> cached leading blocks: the max over the pool's KV sources, 0 when the pool's
    KV state is not fresh. One pass over the prompt for all pools.

    With a KvSummary (pool-level tables) a pool's sources answer with the table of the pool they
    name, looked up once per change of the pool's sources (PoolColumns.kv_table), so the answer
    for all pools is one gather; with the exact KvIndex, per source."""
    states = pools if isinstance(pools, list) else list(pools)
    rows = _rows(states)
    c = COLUMNS
    fresh = now - c.f[KV_AT, rows] <= limits.kv_max_age
    if isinstance(index, KvSummary):
        values = _summary_overlaps(index, states, rows, block_hashes)
        values[~fresh] = 0
    else:
        values = np.zeros(len(states), np.int64)
        by_source = index.prefix_overlaps(block_hashes)
        if by_source:
            get = by_source.get
            for i in np.flatnonzero(fresh).tolist():
                values[i] = max(map(get, states[i].kv_sources, _ZEROS), default=0)
    return PoolOverlaps(states, rows, values)


def _summary_overlaps(
    summary: KvSummary, states: list[PoolState], rows: np.ndarray, block_hashes: Sequence[int]
) -> np.ndarray:
    lengths = summary.pool_lengths(block_hashes)
    if lengths is None:  # no pool holds the first block (an uncached prompt)
        return np.zeros(len(states), np.int64)
    c = COLUMNS
    tables = summary.table_count()
    if c.kv_owner is None or c.kv_owner[0] is not summary or c.kv_owner[1] != tables:
        c.kv_owner = (summary, tables)
        c.kv_seen[:] = -1  # every row's table looked up again (a new summary, or new pools in it)
    stale = np.flatnonzero(c.kv_seen[rows] != c.sources_ver[rows])
    for i in stale.tolist():
        found = {summary.table_of(source) for source in states[i].kv_sources}
        found.discard(-1)
        row = int(rows[i])
        c.kv_table[row] = found.pop() if len(found) == 1 else (-2 if found else -1)
        c.kv_seen[row] = c.sources_ver[row]
    table = c.kv_table[rows]
    values: np.ndarray = np.where(table >= 0, lengths[table], 0)
    for i in np.flatnonzero(table == -2).tolist():  # sources naming several pools: the best
        values[i] = max(int(lengths[t]) for t in map(summary.table_of, states[i].kv_sources) if t >= 0)
    return values


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
        """Work tokens per second the pool serves (stated, else estimated from its slots); `select`
        works this out for all pools at once (`_rates`), the same way."""
        rate = pool.capacity.prefill_tokens_per_second
        if rate > 0:
            return float(rate)
        slots = pool.capacity.max_running_requests
        if not slots and pool.load is not None:
            slots = pool.load.max_running_requests
        if slots > 0:
            return slots * self.config.tokens_per_second_per_slot
        return self.config.default_tokens_per_second

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

        Works on the pools' PoolColumns rows as vectors (one numpy operation per term for all
        pools, the float operations in the same order as the per-pool rule, so the results are
        the same to the bit); candidates are built as a caller reads them (`Ranking`).
        """
        cfg = self.config
        limits = cfg.freshness
        c = COLUMNS
        states = pools if isinstance(pools, list) else list(pools)
        # Cached blocks straight from pool_overlaps' array when it was asked about these same
        # pools (the usual caller: the very list, whose rows it already has), else looked up by
        # id below.
        ov_values = None
        if type(cached_blocks) is PoolOverlaps and cached_blocks.pools is states:
            rows, ov_values = cached_blocks.rows, cached_blocks.counts
        else:
            rows = _rows(states)
            if type(cached_blocks) is PoolOverlaps:
                ov_rows = cached_blocks.rows
                if ov_rows.size == rows.size and not np.count_nonzero(ov_rows != rows):
                    ov_values = cached_blocks.counts
        ints = c.i[:, rows]
        flags = ints[FLAGS]
        if np.count_nonzero(flags & LISTED) != len(states):
            keep = ((flags & LISTED) != 0).nonzero()[0]
            rows, ints, flags = rows[keep], ints[:, keep], flags[keep]
            if ov_values is not None:
                ov_values = ov_values[keep]
            states = [states[i] for i in keep.tolist()]
        n = len(states)
        same_model = ints[MODEL] == c.code(model)
        f = c.f[:, rows]
        # The filter (the reasons and details come from _filter_reason, for the pools filtered out).
        bad = ~same_model | ((flags & BLOCKED) != 0) | (f[BACKOFF] > now)
        not_ready = flags & NOT_READY
        if np.count_nonzero(not_ready):  # only a fresh report counts
            bad |= (not_ready != 0) & (now - f[STATE_AT] <= limits.state_max_age)
        if regions is not None:
            bad |= ~np.isin(ints[REGION], [c.code(r) for r in regions])
        filtered: list[FilteredPool] = []
        if np.count_nonzero(bad):
            for i in bad.nonzero()[0].tolist():
                reason = _filter_reason(states[i], model, now, limits, regions)
                if reason is None:  # the rule has the last word (a column out of step)
                    bad[i] = False
                else:
                    filtered.append(reason)
            eligible = (~bad).nonzero()[0]
        else:
            eligible = None  # all of them (the usual case: no index arrays to apply)
        if adapter:
            ok = np.ones(n, bool)
            for i in range(n) if eligible is None else eligible.tolist():
                reason = _adapter_filter(states[i], model, adapter)
                if reason is not None:
                    filtered.append(reason)
                    ok[i] = False
            if np.count_nonzero(ok) != n:
                eligible = (ok if eligible is None else ok & ~bad).nonzero()[0]
        if filtered:
            filtered.sort(key=_pool_id_of)
        block_size = ints[BLOCK_SIZE]
        if eligible is not None or not n:
            if eligible is None or not eligible.size:
                return self._none_eligible(states, ints, same_model, model, adapter, prompt_tokens, filtered)
            f, flags, block_size = f[:, eligible], flags[eligible], block_size[eligible]
            if ov_values is not None:
                ov_values = ov_values[eligible]
            states = [states[i] for i in eligible.tolist()]
        if ov_values is not None:
            cached = ov_values
        else:
            get = cached_blocks.get
            cached = np.fromiter((get(p.pool_id, 0) for p in states), np.int64, len(states))
        price = self.wait_price
        if price is not None:
            prefill_weight = price.slo.prefill_weight
            excess_weight = price.excess_weight
            knee = price.slo.target_seconds
        else:
            prefill_weight = cfg.prefill_weight
            excess_weight = knee = 0.0
        dw = cfg.decode_weight
        rate = self._rates(f)
        sized = block_size > 0
        if np.count_nonzero(sized) == sized.size:
            blocks = prompt_tokens // block_size
            cached = np.minimum(cached, blocks)
            uncached = prompt_tokens - cached * block_size
        else:
            blocks = np.where(sized, prompt_tokens // np.where(sized, block_size, 1), 0)
            cached = np.where(sized, np.minimum(cached, blocks), 0)
            uncached = np.where(sized, prompt_tokens - cached * block_size, prompt_tokens)
        load_at = f[LOAD_AT]
        known = ((flags & LOAD_PRESENT) != 0) & (now - load_at <= limits.load_max_age)
        # Selector._queue of the per-pool rule, for all pools at once (the same operations in the
        # same order): the reported work (drained since the report) and the pending work.
        # (a weight of 1 is skipped: 1.0 * x is x to the bit, and each operation costs ~1 µs)
        reported = np.where(
            known, _weighted(cfg.load_weight, f[LOAD_PREFILL] + dw * f[LOAD_DECODE]) / rate, 0.0
        )
        load_cost = reported
        if cfg.drain_reports:
            # served since the report at the pool's throughput (load_weight scales seconds)
            load_cost = np.where(
                reported > 0, np.maximum(0.0, reported - _weighted(cfg.load_weight, now - load_at)), reported
            )
        pending_cost = _weighted(cfg.pending_weight, f[PEND_PREFILL] + dw * f[PEND_DECODE]) / rate
        wait = load_cost + pending_cost  # the estimated wait (what the wait SLO's price observes)
        if excess_weight:
            over = wait - knee
            load_cost = np.where(over > 0, load_cost + excess_weight * over, load_cost)
        prefill_cost = prefill_weight * uncached / rate
        if cfg.hotspot_seconds > 0:
            load_cost = _penalize_hotspots(
                load_cost,
                reported + pending_cost,
                known,
                (prompt_tokens + dw * max_tokens) / rate,
                cfg.hotspot_seconds,
                cfg.hotspot_request_share,
            )
        total = prefill_cost + load_cost + pending_cost
        # Known load first, then by cost (stable: equal keys keep the listing order until the
        # tie-break reorders them).
        if np.count_nonzero(known) == known.size:
            order = np.argsort(total, kind="stable")
            ts = total[order]
            ties = (ts[1:] == ts[:-1]).nonzero()[0]
        else:
            order = np.lexsort((total, ~known))
            ts, ks = total[order], known[order]
            ties = ((ts[1:] == ts[:-1]) & (ks[1:] == ks[:-1])).nonzero()[0]
        ranked = (
            order.tolist() if not ties.size else _break_ties(order, ties, states, affinity_key & _SEED_MASK)
        )
        ranking = Ranking(
            states, ranked, total, prefill_cost, load_cost, pending_cost, cached, blocks, known, uncached
        )
        if price is not None and observe:
            # The estimated wait at the pick, without the hotspot and wait-price terms.
            price.observe(float(wait[ranked[0]]))
        # a candidate serves the model (and the adapter)
        return Decision(ranking, filtered, int(blocks[ranked[0]]), True)

    @staticmethod
    def _none_eligible(
        states: list[PoolState],
        ints: np.ndarray,
        same_model: np.ndarray,
        model: str,
        adapter: str,
        prompt_tokens: int,
        filtered: list[FilteredPool],
    ) -> Decision:
        """The decision without candidates: whether some listed pool serves the model (and the
        adapter) at all, and the prompt's blocks at the first listed pool's block size."""
        odd = (ints[MODEL] == UNINTERNED).nonzero()[0]
        if odd.size:  # names past PoolColumns' bound: the pools' own model names decide
            same_model = same_model.copy()
            same_model[odd] = [states[i].model == model for i in odd.tolist()]
        if adapter:
            served = any(
                adapter in states[i].adapters.get(model, ()) for i in same_model.nonzero()[0].tolist()
            )
        else:
            served = bool(np.count_nonzero(same_model))
        sizes = ints[BLOCK_SIZE]
        nonzero = sizes.nonzero()[0]
        first = int(sizes[nonzero[0]]) if nonzero.size else 0
        return Decision(Ranking.empty(), filtered, prompt_tokens // first if first > 0 else 0, served)

    def _rates(self, f: np.ndarray) -> np.ndarray:
        """`throughput` of the pools whose PoolColumns.f columns are `f`, at once."""
        stated, slots = f[CAP_RATE], f[SLOTS]
        return np.where(
            stated > 0,
            stated,
            np.where(
                slots > 0,
                slots * self.config.tokens_per_second_per_slot,
                self.config.default_tokens_per_second,
            ),
        )


def _penalize_hotspots(
    load_cost: np.ndarray,
    assigned: np.ndarray,
    known: np.ndarray,
    own_seconds: np.ndarray,
    floor: float,
    share: float,
) -> np.ndarray:
    """Adds E^2 / (floor + share * T + M) to the load term of pools whose assigned work exceeds
    the mean M of the known-load pools by E (T: the request's own service time there).

    The assigned work is undrained on purpose: the drained estimate is the better guess of the
    wait, but a pool that was given well above its share within the last report interval is
    where the next burst piles up, so spreading keys on what was assigned."""
    queues = assigned[known]
    if not queues.size:
        return load_cost
    # Python's sum, as the per-pool rule had it (numpy's pairwise sum differs in the last bits)
    mean = sum(queues.tolist()) / queues.size
    excess = assigned - mean
    over = excess > 0
    if not np.count_nonzero(over):  # no pool above the mean (an idle or even fleet)
        return load_cost
    return np.where(over, load_cost + excess * excess / (floor + share * own_seconds + mean), load_cost)


def _weighted(weight: float, x: np.ndarray) -> np.ndarray:
    return x if weight == 1.0 else weight * x


def _pool_id_of(f: FilteredPool) -> str:
    return f.pool_id


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


def _break_ties(order: np.ndarray, ties: np.ndarray, pools: list[PoolState], seed: int) -> list[int]:
    """`order` with each run of equal keys reordered by rendezvous hash of the pool id (`ties`:
    positions i where keys i and i+1 are equal; hashes are only computed for ties, which are
    rare outside idle pools and uncached prompts)."""
    out: list[int] = order.tolist()
    starts = ties[np.concatenate(([True], ties[1:] != ties[:-1] + 1))].tolist()
    ends = ties[np.concatenate((ties[1:] != ties[:-1] + 1, [True]))].tolist()
    for i, j in zip(starts, ends, strict=True):
        run = out[i : j + 2]
        if len(run) <= _SHORT_RUN:
            out[i : j + 2] = sorted(run, key=lambda k: _xxh3(pools[k].pool_id.encode(), seed=seed))
        else:  # the same order (both sorts are stable) without a key call per pool: idle fleets tie whole
            keys = np.array([_xxh3(pools[k].pool_id.encode(), seed=seed) for k in run], np.uint64)
            out[i : j + 2] = [run[k] for k in np.argsort(keys, kind="stable").tolist()]
    return out


_SHORT_RUN = 16
"""Tied pools at or below which a run is sorted in Python (numpy's fixed cost is more there)."""


class Ranking(Sequence[RankedPool]):
    """A decision's candidates, best first: a read-only list whose RankedPools are built from
    the cost vectors as they are read (building 1,000 of them took as long as ranking them, and
    the request path reads the first few)."""

    __slots__ = ("_built", "_cols", "_order", "_pools")

    def __init__(
        self,
        pools: list[PoolState],
        order: list[int],
        total: np.ndarray,
        prefill: np.ndarray,
        load: np.ndarray,
        pending: np.ndarray,
        cached: np.ndarray,
        blocks: np.ndarray,
        known: np.ndarray,
        uncached: np.ndarray,
    ) -> None:
        """`pools` and the cost vectors in the pools' order; `order` ranks them (best first)."""
        self._pools = pools
        self._order = order
        self._cols = (total, prefill, load, pending, cached, blocks, known, uncached)
        self._built: list[RankedPool | None] = [None] * len(order)

    @classmethod
    def empty(cls) -> Ranking:
        z = np.zeros(0)
        return cls([], [], z, z, z, z, z, z, z, z)

    def _build(self, i: int) -> RankedPool:
        r = self._built[i]
        if r is None:
            total, prefill, load, pending, cached, blocks, known, uncached = self._cols
            k = self._order[i]
            pool = self._pools[k]
            r = self._built[i] = _new_ranked(
                pool.pool_id,
                float(total[k]),
                float(prefill[k]),
                float(load[k]),
                float(pending[k]),
                int(cached[k]),
                int(blocks[k]),
                bool(known[k]),
                pool.region,
                int(uncached[k]),
            )
        return r

    def _all(self) -> list[RankedPool]:
        built = self._built
        if None in built:
            total, prefill, load, pending, cached, blocks, known, uncached = (
                col.tolist() for col in self._cols
            )
            pools = self._pools
            for i, k in enumerate(self._order):
                if built[i] is None:
                    pool = pools[k]
                    built[i] = _new_ranked(
                        pool.pool_id,
                        total[k],
                        prefill[k],
                        load[k],
                        pending[k],
                        cached[k],
                        blocks[k],
                        known[k],
                        pool.region,
                        uncached[k],
                    )
        return built  # type: ignore[return-value]

    def rows(self, limit: int = 0) -> Iterator[tuple[PoolState, float, float, float, float, int, int, bool]]:
        """(pool, total, prefill, load, pending, cached, blocks, load_known) of the best `limit`
        candidates (0: all), best first, read from the cost vectors without building RankedPools:
        for a reply that lists them (Route), where building 1,000 RankedPools took as long as the
        reply's own messages."""
        order = self._order if limit <= 0 else self._order[:limit]
        if not order:
            return
        at = np.asarray(order, dtype=np.intp)
        total, prefill, load, pending, cached, blocks, known = (col[at].tolist() for col in self._cols[:7])
        pools = self._pools
        yield from zip(
            [pools[k] for k in order], total, prefill, load, pending, cached, blocks, known, strict=True
        )

    @overload
    def __getitem__(self, i: int) -> RankedPool: ...
    @overload
    def __getitem__(self, i: slice) -> list[RankedPool]: ...
    def __getitem__(self, i: int | slice) -> RankedPool | list[RankedPool]:
        if isinstance(i, slice):
            return [self._build(k) for k in range(*i.indices(len(self._order)))]
        n = len(self._order)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("candidate index out of range")
        return self._build(i)

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[RankedPool]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ranking | list | tuple):
            return self._all() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._all())

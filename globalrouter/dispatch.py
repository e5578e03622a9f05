"""Late binding at the global frontend: a bounded dispatch queue per model, priority classes,
token-weighted fairness between tenants, and shedding with a machine-readable reason.

Without it the frontend commits each request to a pool at arrival and the request then waits in
that pool's first-come-first-served queue, behind whatever the pool was given before, even when
another pool frees up first. With it the frontend holds the request and commits it only when a
pool can start it soon: its estimated backlog (the last load report drained at the pool's
throughput since it arrived, plus the work this frontend sent there since, drained the same way)
is at most `start_within_seconds`. The pool is chosen at dispatch time by the same filter ->
rank (`Selector`) as without the queue, on the KV state and loads of that moment.

Order: higher `priority` first; within a class, start-time fair queueing over tenants, each
request's tag advancing its tenant's virtual time by its tokens (prompt + max output) divided by
its tenant's weight, so backlogged tenants get tokens in proportion to their weights whatever
their request sizes. A request holds out for the pool the ranking puts first (where its prefix
is cached) while that pool is expected to start it within `affinity_hold_seconds` of its
arrival here (the pool's backlog plus what earlier requests hold out for there); otherwise it
takes the best-ranked pool that can start it now. A pool some earlier request holds out for is
not given to a later one, and a freed pool goes first to the queued requests of the top class
whose prompt it partly holds (a request any pool serves as well takes another). That is the
"rank" placement; `DispatchConfig.placement = "match"` is pool-driven instead: the free pools go
to the queued requests with the longest prefix cached there (`_match_model`).

Pacing (`pace_tokens_per_second`): a class listed there leaves the queue no faster than its rate
(a token bucket per class on the queue's clock, `_Pacer`), so work a budget admits in bursts
reaches the pools spread out; a held request keeps its place and its deadline, and a class is
only ever held by its own bucket.

Bounds: `max_queued` requests per model (a higher class arriving at a full queue displaces the
newest request of the lowest class below it, else it is refused), a deadline per request, and
per class an optional `shed_after_seconds` under overload. Every refusal is a `Shed` with a
`ShedReason` and a retry-after hint. Nothing here knows about transport; time comes from an
injectable `meshkit.clock.Clock`; the simulator runs exactly this code.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from globalrouter.pool_state import PoolState
from globalrouter.selection import Decision, RankedPool, Selector
from globalrouter.wait_slo import SloController, SloFeedback
from meshkit.clock import Clock

T = TypeVar("T")

PLACEMENTS = ("rank", "match")
"""DispatchConfig.placement's values."""
ORDERS = ("fifo", "deadline")
"""`DispatchConfig.for_wait_slo`'s orders: queue order only, or the deadline order under the SLO
(`DispatchConfig.late_after_seconds`)."""


class ShedReason(enum.Enum):
    """Why the dispatch queue refused or dropped a request (machine-readable; maps to 429 /
    RESOURCE_EXHAUSTED, except MODEL_NOT_SERVED which is NOT_FOUND)."""

    QUEUE_FULL = 1
    """The model's queue is full of requests of this class or higher."""
    DISPLACED = 2
    """Dropped from a full queue for a request of a higher class."""
    OVERLOADED = 3
    """The class sheds under overload: the request queued longer than its class allows."""
    DEADLINE_EXCEEDED = 4
    """No pool could start the request before its deadline."""
    MODEL_NOT_SERVED = 5
    """No listed pool serves the model."""
    NO_ELIGIBLE_POOL = 6
    """Pools serve the model but every one is filtered out (at arrival, with nothing queued)."""


@dataclass(frozen=True, slots=True)
class DispatchConfig:
    """Bounds and timing of the dispatch queue (per model)."""

    max_queued: int = 1024
    """Requests one model's queue holds."""
    start_within_seconds: float = 1.0
    """A pool can take work when its estimated backlog is at most this many seconds (0: only an
    idle pool; above 0 the pool keeps a short queue, which covers the trip to the pool and the
    error of the estimate, so it never idles while requests wait here)."""
    affinity_hold_seconds: float = 5.0
    """How long a request holds out for the pool ranked first before it takes any pool that can
    start it."""
    max_queue_seconds: float = 60.0
    """Default deadline: a request not dispatched this long after it was queued is shed."""
    shed_after_seconds: Mapping[int, float] = field(default_factory=dict)
    """Priority class -> seconds after which a queued request of that class is shed
    (OVERLOADED); classes not listed wait until their deadline."""
    reserved_pools: Mapping[int, int] = field(default_factory=dict)
    """Priority class -> pools that class leaves free for higher classes: its requests dispatch
    only while more pools than that can take work. Pools do not preempt, so without a reserve a
    request of a higher class arriving under a flood of a lower one waits for a pool to finish
    a lower-class request."""
    reserve_window_seconds: float = 0.0
    """With `reserved_pools`: a class listed there leaves free at least as many pools as higher
    classes were given work at within this many seconds (0: the fixed count only). A fixed count
    has to cover the higher classes' peak concurrency to keep their waits as without a flood
    (bench_dispatch: 7 of 8 pools); this follows their recent use instead, so a lower class gets
    the pools the higher ones have not been using."""
    pace_tokens_per_second: Mapping[int, float] = field(default_factory=dict)
    """Priority class -> tokens (prompt + max output) per second at which that class's requests
    may leave the queue at most (a token bucket on the queue's clock; classes not listed are
    not paced). Pools do not preempt, so a lower class admitted in bursts (a budget's bucket
    freeing at once) fills pools a higher class then waits for; paced at the budget's rate the
    same work arrives spread out. Held requests keep their deadlines."""
    pace_burst_seconds: float = 1.0
    """With `pace_tokens_per_second`: the bucket holds this many seconds of a class's rate (what
    an idle class may send at once). A request larger than the bucket still goes when the
    bucket is not in debt, and puts it in debt: over any span T a paced class dispatches at
    most rate * (T + burst) tokens plus one request."""
    record_sends: bool = True
    """Whether a dispatch counts the request in its pool's `PoolState.record_sent` (False when
    the caller's send path records it, as the live frontend's GenerateRun does)."""
    scan_limit: int = 256
    """Queued requests ranked per dispatch round at most (in dispatch order)."""
    min_retry_after_seconds: float = 1.0
    max_retry_after_seconds: float = 60.0
    placement: str = "rank"
    """How a free pool and a queued request are paired (PLACEMENTS): "rank", each request in
    queue order takes the pool the ranking puts first (holding out for it within
    `affinity_hold_seconds`); "match", pool-driven: the pools that can start work go to the
    queued requests with the longest prefix cached there (greedy over the (request, free pool)
    pairs, the prefix counted beyond what every pool holds), a request holds out for the pool
    caching its longest prefix while that pool is expected to start it within
    `affinity_hold_seconds` of its arrival, and the rest (prompts no pool holds more of than
    another, and requests whose hold ran out) take the best-ranked free pool in queue order."""
    late_after_seconds: float = 0.0
    """The deadline order under a wait SLO (0: off, queue order only): a queued request that has
    waited longer than this (the SLO's target) can no longer start within it, so within its
    class it goes behind the queued requests that still can, until it has waited `late_limit`
    times this long (then it takes its place in queue order again: none starves). A request
    that misses the target counts once in the SLO's quantile however long it then waits, so
    serving first those that can still meet it keeps fewer over it in a burst; the price is a
    longer wait for the few that miss (bench_dispatch)."""
    late_limit: float = 10.0
    """With `late_after_seconds`: how many times that long a late request waits at most behind
    the others (at least 1)."""
    slo_feedback: SloFeedback | None = None
    """When set, `start_within_seconds` and `affinity_hold_seconds` are scaled by a factor that
    follows the observed wait quantile over a sliding window of decisions (`SloController`):
    smaller while the window's quantile is over the SLO's target, larger while under (None:
    fixed)."""

    @classmethod
    def for_wait_slo(
        cls, target_seconds: float, placement: str = "rank", order: str = "fifo", feedback: bool = False
    ) -> DispatchConfig:
        """The settings measured best under a wait SLO of `target_seconds` (bench_dispatch).
        "rank": pools queue up to 0.85 of the target, a request holds out for its cached pool
        while it can start there within 1.7 times the target (the ranking's wait price keeps
        most far below it). "match": pools queue up to 0.2 of the target (a pool that frees
        picks among more requests) and a request holds out for the pool caching its prompt
        while it can start there within twice the target (bench_dispatch: the share goals at
        1.1-1.2 x dynamo's p99; 1.5 x: p99 within 1.05-1.1 x, share 0.92-0.97).
        `order` "deadline" adds the deadline order (`late_after_seconds` = the target) and, with
        "rank", pools queue up to 0.2 of the target instead (the frontend, not the pools, holds a
        burst, so the order decides who waits): bench_dispatch's SLO tracking. `feedback` scales
        the queue depth and the hold by the observed wait quantile (`SloFeedback`'s defaults:
        up to 64 times while the window's p99 is under the target, never below the settings
        here): more share where the fixed settings leave the tail far under the target."""
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        late_after = target_seconds if order == "deadline" else 0.0
        start_within = 0.85 if placement == "rank" and order == "fifo" else 0.2
        return cls(
            start_within_seconds=start_within * target_seconds,
            affinity_hold_seconds=(2.0 if placement == "match" else 1.7) * target_seconds,
            placement=placement,
            late_after_seconds=late_after,
            slo_feedback=SloFeedback(target_seconds) if feedback else None,
        )

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when none), each naming the field."""
        out = []
        if self.max_queued < 1:
            out.append(f"max_queued must be at least 1, got {self.max_queued!r}")
        for name in ("start_within_seconds", "affinity_hold_seconds"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                out.append(f"{name} must be a non-negative number of seconds, got {v!r}")
        if not (math.isfinite(self.max_queue_seconds) and self.max_queue_seconds > 0):
            out.append(f"max_queue_seconds must be positive, got {self.max_queue_seconds!r}")
        for cls, v in self.shed_after_seconds.items():
            if not (math.isfinite(v) and v >= 0):
                out.append(f"shed_after_seconds[{cls}] must be a non-negative number of seconds, got {v!r}")
        for cls, n in self.reserved_pools.items():
            if n < 0:
                out.append(f"reserved_pools[{cls}] must be at least 0, got {n!r}")
        if not (math.isfinite(self.reserve_window_seconds) and self.reserve_window_seconds >= 0):
            out.append(
                f"reserve_window_seconds must be a non-negative number of seconds, got {self.reserve_window_seconds!r}"
            )
        if not (math.isfinite(self.late_after_seconds) and self.late_after_seconds >= 0):
            out.append(
                f"late_after_seconds must be a non-negative number of seconds, got {self.late_after_seconds!r}"
            )
        if not (math.isfinite(self.late_limit) and self.late_limit >= 1):
            out.append(f"late_limit must be a number of at least 1, got {self.late_limit!r}")
        if self.placement not in PLACEMENTS:
            out.append(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        for cls, v in self.pace_tokens_per_second.items():
            if not (math.isfinite(v) and v > 0):
                out.append(
                    f"pace_tokens_per_second[{cls}] must be a positive number of tokens per second, got {v!r}"
                )
        if not (math.isfinite(self.pace_burst_seconds) and self.pace_burst_seconds >= 0):
            out.append(
                f"pace_burst_seconds must be a non-negative number of seconds, got {self.pace_burst_seconds!r}"
            )
        if self.slo_feedback is not None:
            out.extend(f"slo_feedback: {p}" for p in self.slo_feedback.problems())
        if self.scan_limit < 1:
            out.append(f"scan_limit must be at least 1, got {self.scan_limit!r}")
        if not 0 < self.min_retry_after_seconds <= self.max_retry_after_seconds:
            out.append(
                "retry-after bounds must satisfy 0 < min_retry_after_seconds <= max_retry_after_seconds, "
                f"got {self.min_retry_after_seconds!r}, {self.max_retry_after_seconds!r}"
            )
        return out


@dataclass(frozen=True, slots=True)
class DispatchRequest(Generic[T]):
    """One request as the queue sees it; `payload` is the caller's (returned as is)."""

    payload: T
    model: str
    prompt_tokens: int
    max_tokens: int
    affinity_key: int = 0
    """As `Selector.select`'s (the prompt's first block hash)."""
    priority: int = 0
    """Class; higher dispatches first (from the identity's policy)."""
    tenant: str = ""
    """Who shares the class with whom, by weight."""
    weight: float = 1.0
    """The tenant's share within its class (positive)."""
    deadline: float | None = None
    """Clock time after which the request is shed if not dispatched (None: the config's)."""
    regions: frozenset[str] | None = None
    """The regions the request may use (residency, as `Selector.select` takes them; None: any)."""
    adapter: str = ""
    """LoRA adapter of `model` ("" for none), as `Selector.select` takes it."""


@dataclass(frozen=True, slots=True)
class Dispatched(Generic[T]):
    """A request committed to a pool."""

    request: DispatchRequest[T]
    pool: RankedPool
    """The pool (as ranked at dispatch): send there. The queue has already counted the request
    in the pool's `PoolState.record_sent` (the caller must not count it again)."""
    decision: Decision
    queued_seconds: float
    """Time the request spent in this queue."""


@dataclass(frozen=True, slots=True)
class Shed(Generic[T]):
    """A request refused at arrival or dropped from the queue."""

    request: DispatchRequest[T]
    reason: ShedReason
    retry_after_seconds: float
    """Hint for Retry-After (whole seconds, within the config's bounds)."""
    detail: str
    queued_seconds: float = 0.0
    decision: Decision | None = None
    """The ranking that refused it (MODEL_NOT_SERVED, NO_ELIGIBLE_POOL at arrival), else None."""


Outcome = Dispatched[T] | Shed[T]


@dataclass(slots=True)
class _Entry(Generic[T]):
    request: DispatchRequest[T]
    queued_at: float
    deadline: float
    shed_at: float
    tag: float
    """Start tag (virtual time within the class)."""
    seq: int
    done: bool = False
    """Left the queue (dispatched or shed)."""

    def key(self) -> tuple[int, float, int]:
        return (-self.request.priority, self.tag, self.seq)


@dataclass(slots=True)
class _Backlog:
    """This frontend's estimate of one pool's backlog: `seconds` of work at time `at`, which
    drains at one second per second (the work is in seconds of the pool's throughput)."""

    load_at: float | None = None
    seconds: float = 0.0
    at: float = 0.0

    def now(self, now: float) -> float:
        left = self.seconds - (now - self.at)
        return left if left > 0 else 0.0


@dataclass(slots=True)
class _Class:
    """Virtual time of one priority class and its tenants' last finish tags."""

    vtime: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Bucket:
    """One paced class's allowance: `level` tokens at time `at` (negative: in debt), refilled
    at `rate` per second up to `capacity`."""

    rate: float
    capacity: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now

    def ready_at(self) -> float:
        """Clock time from which the class may dispatch (out of debt)."""
        return self.at if self.level >= 0 else self.at - self.level / self.rate


class _Pacer:
    """The pacing gate of the dispatch queue: per paced class a token bucket on the queue's
    clock; a request of that class is eligible to dispatch only while its bucket is not in debt,
    and each dispatch takes its tokens. Kept apart from placement (which pool) on purpose: it
    only says whether a request may leave now."""

    def __init__(self, rates: Mapping[int, float], burst_seconds: float) -> None:
        self.rates = dict(rates)
        self.burst_seconds = burst_seconds
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, priority: int, now: float) -> _Bucket | None:
        b = self._buckets.get(priority)
        if b is None:
            rate = self.rates.get(priority)
            if rate is None:
                return None
            capacity = rate * self.burst_seconds
            b = self._buckets[priority] = _Bucket(rate, capacity, capacity, now)
        return b

    def held(self, priority: int, now: float) -> bool:
        """Whether a request of class `priority` must stay queued now (its class is in debt)."""
        if priority not in self.rates:
            return False
        b = self._bucket(priority, now)
        assert b is not None
        # the epsilon: a wake-up computed for the instant the debt clears must find it cleared
        return now + 1e-9 < b.ready_at()

    def spend(self, priority: int, tokens: int, now: float) -> None:
        b = self._bucket(priority, now)
        if b is not None:
            b.refill(now)
            b.level -= tokens

    def ready_at(self, priority: int) -> float | None:
        """When class `priority` may dispatch again (None: not paced or never dispatched)."""
        b = self._buckets.get(priority)
        return None if b is None else b.ready_at()


class DispatchQueue(Generic[T]):
    """The late-binding queue of one frontend (all models; bounded per model).

    The caller enqueues requests (which may dispatch at once when the queue is empty and a pool
    is free), calls `poll` whenever something changed (a load report, a request finished) or
    `next_wakeup()` passed, and acts on the outcomes."""

    def __init__(
        self,
        config: DispatchConfig,
        clock: Clock,
        selector: Selector,
        pools: Callable[[], Iterable[PoolState]],
        overlaps: Callable[[DispatchRequest[T], float], Mapping[str, int]],
    ) -> None:
        problems = config.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self.clock = clock
        self.selector = selector
        self.pools = pools
        """The listed pools (as `Selector.select` takes them)."""
        self.overlaps = overlaps
        """Request, now -> pool id -> cached leading blocks (as `pool_overlaps` gives)."""
        self._queues: dict[str, list[tuple[tuple[int, float, int], _Entry[T]]]] = {}
        self._expiry: list[tuple[float, int, _Entry[T]]] = []
        """(first of deadline and shed time, seq, entry), a heap; entries leave it lazily (their
        `done` is set when they leave the queue) and it is rebuilt when mostly stale."""
        self._queued_work: dict[str, float] = {}
        """Model -> work tokens queued (prompt + decode-weighted output), for retry-after."""
        self._classes: dict[tuple[str, int], _Class] = {}
        self._backlog: dict[str, _Backlog] = {}
        self._seq = itertools.count()
        self._displaced: list[Shed[T]] = []
        self._pacer = (
            _Pacer(config.pace_tokens_per_second, config.pace_burst_seconds)
            if config.pace_tokens_per_second
            else None
        )
        self._recent: dict[int, dict[str, float]] = {}
        """Priority class -> pool id -> when a request of that class was last dispatched there
        (kept only with `reserve_window_seconds`; one entry per class and pool)."""
        """Requests displaced by enqueue since the last poll (the next poll reports them)."""
        self.feedback = SloController(config.slo_feedback) if config.slo_feedback is not None else None
        """The SLO's feedback on the queue depth and the hold (None: the config's, fixed)."""
        self._start_within = config.start_within_seconds
        self._hold_seconds = config.affinity_hold_seconds
        """The queue depth and the hold in use (the config's, scaled by the feedback)."""

    # ---- state --------------------------------------------------------------------------
    def queued(self, model: str | None = None) -> int:
        """Requests queued for `model` (all models when None)."""
        if model is not None:
            return len(self._queues.get(model, ()))
        return sum(len(q) for q in self._queues.values())

    def backlog_seconds(self, pool: PoolState, now: float) -> float:
        """The estimated seconds of work at `pool` before it could start another request."""
        return self._pool_backlog(pool, now).now(now)

    def _pool_backlog(self, pool: PoolState, now: float) -> _Backlog:
        b = self._backlog.get(pool.pool_id)
        if b is None:
            b = self._backlog[pool.pool_id] = _Backlog()
        if pool.load_at != b.load_at:
            # a new load report counts everything sent before it: start again from it
            b.load_at = pool.load_at
            load = pool.load
            if load is not None and pool.load_at is not None:
                dw = self.selector.config.decode_weight
                rate = self.selector.throughput(pool)
                b.seconds = (load.prefill_tokens_in_flight + dw * load.decode_tokens_in_flight) / rate
                b.at = pool.load_at
            else:
                b.seconds = b.at = 0.0
        return b

    def _can_start(self, pool: PoolState, now: float) -> bool:
        # the epsilon: a wake-up computed for the instant a pool frees must find it free
        return self._pool_backlog(pool, now).now(now) <= self._start_within + 1e-9

    # ---- enqueue ------------------------------------------------------------------------
    def enqueue(self, request: DispatchRequest[T]) -> Outcome[T] | None:
        """Queues `request`; returns its outcome when it is decided at once (dispatched to a
        free pool with nothing queued for the model, or refused), else None."""
        if not (math.isfinite(request.weight) and request.weight > 0):
            raise ValueError(f"weight must be positive, got {request.weight!r}")
        cfg = self.config
        now = self.clock.monotonic()
        queue = self._queues.get(request.model)
        if not queue:
            # the fast path: an empty queue and a free pool dispatch without queueing
            decision = self._rank(request, now)
            if not decision.model_served or not decision.candidates:
                reason = (
                    ShedReason.MODEL_NOT_SERVED if not decision.model_served else ShedReason.NO_ELIGIBLE_POOL
                )
                shed = self._shed(request, reason, now, now, "no pool can take it", queued=False)
                return Shed(shed.request, reason, shed.retry_after_seconds, shed.detail, 0.0, decision)
            pools = self._by_id()
            reserve = self._reserve(request.priority, now)
            first: Sequence[RankedPool] = decision.candidates[:1]
            if cfg.placement == "match":
                # a prompt some pool holds more of than the others goes there or waits (the
                # poll that follows decides between holding out and another pool)
                distinct, home = self._home(decision, pools, now, {})
                if distinct:
                    first = [home] if home is not None else []
            for ranked in first:
                pool = pools.get(ranked.pool_id)
                if (
                    pool is not None
                    and self._can_start(pool, now)
                    and (not reserve or self._free_count(pools, now) > reserve)
                    and not self._held(request.priority, now)
                ):
                    entry = self._new_entry(request, now)
                    return self._commit(entry, ranked, decision, now, pool)
            if queue is None:
                queue = self._queues[request.model] = []
        if len(queue) >= cfg.max_queued:
            lowest = queue[-1][1].request.priority  # sorted by class, highest first
            if lowest >= request.priority:
                return self._shed(
                    request,
                    ShedReason.QUEUE_FULL,
                    now,
                    now,
                    f"{len(queue)} requests of class {lowest} or higher are queued for {request.model!r}",
                    queued=False,
                )
            # the newest request of the lowest class makes room (it has waited least)
            victim = max((e for _, e in queue if e.request.priority == lowest), key=lambda e: e.queued_at)
            self._remove(victim)
            displaced = self._shed(
                victim.request,
                ShedReason.DISPLACED,
                now,
                victim.queued_at,
                f"displaced from a full queue by a request of class {request.priority}",
            )
            self._displaced.append(displaced)
        entry = self._new_entry(request, now)
        bisect.insort(queue, (entry.key(), entry), key=_first)
        heapq.heappush(self._expiry, (min(entry.deadline, entry.shed_at), entry.seq, entry))
        if len(self._expiry) > 2 * self.queued() + 64:
            self._expiry = [x for x in self._expiry if not x[2].done]
            heapq.heapify(self._expiry)
        self._queued_work[request.model] = self._queued_work.get(request.model, 0.0) + self._work(request)
        return None

    def _new_entry(self, request: DispatchRequest[T], now: float) -> _Entry[T]:
        cfg = self.config
        cls = self._classes.get((request.model, request.priority))
        if cls is None:
            cls = self._classes[(request.model, request.priority)] = _Class()
        start = max(cls.vtime, cls.finish.get(request.tenant, 0.0))
        cls.finish[request.tenant] = start + (request.prompt_tokens + request.max_tokens) / request.weight
        cls.queued[request.tenant] = cls.queued.get(request.tenant, 0) + 1
        deadline = request.deadline if request.deadline is not None else now + cfg.max_queue_seconds
        shed_after = cfg.shed_after_seconds.get(request.priority)
        return _Entry(
            request,
            now,
            deadline,
            now + shed_after if shed_after is not None else math.inf,
            start,
            next(self._seq),
        )

    def withdraw(self, request: DispatchRequest[T]) -> bool:
        """Takes a queued request out (its caller gave up, e.g. the client left); False when it
        is not queued (dispatched or shed already)."""
        for _, e in self._queues.get(request.model, ()):
            if e.request is request:
                self._remove(e)
                cls = self._classes.get((request.model, request.priority))
                if cls is not None and request.tenant in cls.queued:
                    self._forget(cls, request.tenant)
                return True
        return False

    # ---- dispatch -----------------------------------------------------------------------
    def poll(self) -> list[Outcome[T]]:
        """Dispatches what can start now and sheds what must go; the outcomes in order."""
        now = self.clock.monotonic()
        out: list[Outcome[T]] = list(self._displaced)
        self._displaced.clear()
        heap = self._expiry
        while heap and (heap[0][2].done or heap[0][0] <= now):
            e = heapq.heappop(heap)[2]
            if e.done:
                continue
            self._remove(e)
            if e.shed_at <= now and e.shed_at <= e.deadline:
                out.append(
                    self._shed(
                        e.request,
                        ShedReason.OVERLOADED,
                        now,
                        e.queued_at,
                        f"class {e.request.priority} sheds after {now - e.queued_at:.1f}s queued",
                    )
                )
            else:
                out.append(
                    self._shed(e.request, ShedReason.DEADLINE_EXCEEDED, now, e.queued_at, "deadline passed")
                )
        for model, queue in list(self._queues.items()):
            if queue:
                self._poll_model(queue, now, out)
            if not queue:
                del self._queues[model]
        return out

    def _poll_model(
        self, queue: list[tuple[tuple[int, float, int], _Entry[T]]], now: float, out: list[Outcome[T]]
    ) -> None:
        if not queue:
            return
        pools = self._by_id()
        free = {pid for pid, p in pools.items() if p.listed and self._can_start(p, now)}
        if not free:
            return
        if self.config.placement == "match":
            self._match_model(queue, pools, free, now, out)
            return
        window = self._window(queue, now)
        if not window:
            return  # every queued request is held by its class's pace
        top = window[0][1].request.priority
        reserves: dict[int, int] = {}

        def reserved(priority: int) -> int:
            n = reserves.get(priority)
            if n is None:
                n = reserves[priority] = self._reserve(priority, now)
            return n

        # First the requests of the top class whose best pool holds part of their prompt and is
        # free: a free pool goes to a request that it saves prefill for before one that any
        # pool would serve as well (committed at arrival, the latter could have taken it first).
        # (Not ranked at all while the class must leave the free pools to higher ones: under a
        # flood of a low class that is most polls, each of which would rank the whole window.)
        for _, e in window if len(free) > reserved(top) else ():
            if e.request.priority != top:
                break
            if self._held(top, now):
                break  # the class ran out of pace in this round
            decision = self._rank(e.request, now)
            if not decision.candidates:
                continue
            best = decision.candidates[0]
            if best.cached_blocks > 0 and best.pool_id in free and len(free) > reserved(top):
                self._remove(e)
                pool = pools[best.pool_id]
                out.append(self._commit(e, best, decision, now, pool))
                if not self._can_start(pool, now):
                    free.discard(best.pool_id)
                    if not free:
                        return
        # pool id -> seconds of work that earlier requests of this round hold out for there
        claimed: dict[str, float] = {}
        dw = self.selector.config.decode_weight
        for _, e in self._window(queue, now):
            if self._held(e.request.priority, now):
                continue  # its class ran out of pace in this round
            reserve = reserved(e.request.priority)
            if reserve and len(free.difference(claimed)) <= reserve:
                continue  # before ranking: under a flood most of the queue waits here
            decision = self._rank(e.request, now)
            if not decision.model_served:
                self._remove(e)
                out.append(
                    self._shed(
                        e.request, ShedReason.MODEL_NOT_SERVED, now, e.queued_at, "no listed pool serves it"
                    )
                )
                continue
            if not decision.candidates:
                continue
            best = decision.candidates[0]
            pick: RankedPool | None = None
            if best.pool_id in free and best.pool_id not in claimed:
                pick = best
            else:
                # hold out for the best pool while it is expected to start this request within
                # the affinity hold (its backlog plus what earlier requests hold out for there)
                pool = pools[best.pool_id]
                ahead = self.backlog_seconds(pool, now) + claimed.get(best.pool_id, 0.0)
                if now + ahead - e.queued_at <= self._hold_seconds:
                    own = (best.uncached_tokens + dw * e.request.max_tokens) / self.selector.throughput(pool)
                    claimed[best.pool_id] = claimed.get(best.pool_id, 0.0) + own
                    continue
                for ranked in decision.candidates[1:]:
                    if ranked.pool_id in free and ranked.pool_id not in claimed:
                        pick = ranked
                        break
            if pick is not None:
                self._remove(e)
                pool = pools[pick.pool_id]
                out.append(self._commit(e, pick, decision, now, pool))
                if not self._can_start(pool, now):
                    free.discard(pick.pool_id)
                if not free.difference(claimed):
                    break

    def _match_model(
        self,
        queue: list[tuple[tuple[int, float, int], _Entry[T]]],
        pools: Mapping[str, PoolState],
        free: set[str],
        now: float,
        out: list[Outcome[T]],
    ) -> None:
        """The "match" placement: one class at a time (highest first), the free pools go to the
        requests with the longest prefix cached there, then in queue order to the requests no
        pool favours and to those whose hold for their pool ran out, then to held requests
        whose wait costs more than their prefix saves."""
        dw = self.selector.config.decode_weight
        # pool id -> seconds of work that requests of this round hold out for there
        claimed: dict[str, float] = {}
        window = self._window(queue, now)  # pacing holds a class here as in the rank placement
        i = 0
        while i < len(window) and free:
            priority = window[i][1].request.priority
            j = i
            while j < len(window) and window[j][1].request.priority == priority:
                j += 1
            group = window[i:j]
            i = j
            reserve = self._reserve(priority, now)
            if reserve and len(free) <= reserve:
                continue  # before ranking: under a flood most of the queue waits here
            pairs: list[tuple[bool, int, int, _Entry[T], RankedPool, Decision]] = []
            rest: list[tuple[_Entry[T], Decision]] = []
            held: list[tuple[int, _Entry[T], RankedPool, Decision]] = []
            for n, (_, e) in enumerate(group):
                decision = self._rank(e.request, now)
                if not decision.model_served:
                    self._remove(e)
                    out.append(
                        self._shed(
                            e.request,
                            ShedReason.MODEL_NOT_SERVED,
                            now,
                            e.queued_at,
                            "no listed pool serves it",
                        )
                    )
                    continue
                if not decision.candidates:
                    continue
                distinct, home = self._home(decision, pools, now, claimed)
                if not distinct or home is None:
                    rest.append((e, decision))
                elif home.pool_id in free:
                    # older than the hold: ahead of any longer prefix (nothing starves)
                    aged = now - e.queued_at >= self._hold_seconds
                    pairs.append((not aged, -distinct, n, e, home, decision))
                elif self._hold(e, home, pools, claimed, now, dw):
                    held.append((distinct, e, home, decision))
                    continue
                else:
                    rest.append((e, decision))
            pairs.sort(key=lambda x: x[:3])
            for _, _, _, e, home, decision in pairs:
                if self._held(priority, now):
                    break  # the class ran out of pace in this round: the rest stay queued
                if home.pool_id in free and len(free) > reserve:
                    self._commit_to(e, home, decision, now, pools, free, out)
                elif not self._hold(e, home, pools, claimed, now, dw):
                    rest.append((e, decision))
            if pairs and rest:
                rest.sort(key=lambda x: x[0].key())  # back in queue order (class, tag)
            stale = bool(pairs)
            for e, decision in rest:
                if len(free) <= reserve or self._held(priority, now):
                    break
                if stale:  # pools were given work since it was ranked
                    decision = self._rank(e.request, now)
                pick = next((r for r in decision.candidates if r.pool_id in free), None)
                if pick is not None:
                    self._commit_to(e, pick, decision, now, pools, free, out)
                    stale = True
            # Pools still free go to held requests whose wait for their pool costs more than
            # the prefill their prefix saves there, at the ranking's price of a second of
            # prefill (the shortest prefixes first: they lose least by moving). Without this
            # a free pool idles while a hot pool's queue grows up to the hold.
            if held and len(free) > reserve:
                weight = self.selector.prefill_weight
                held.sort(key=lambda x: (x[0], x[1].key()))
                for distinct, e, home, _ in held:
                    if len(free) <= reserve or self._held(priority, now):
                        break
                    pool = pools[home.pool_id]
                    saved = distinct * pool.block_size / self.selector.throughput(pool)
                    if self.backlog_seconds(pool, now) <= weight * saved:
                        continue
                    decision = self._rank(e.request, now)
                    pick = next((r for r in decision.candidates if r.pool_id in free), None)
                    if pick is not None:
                        self._commit_to(e, pick, decision, now, pools, free, out)

    def _home(
        self, decision: Decision, pools: Mapping[str, PoolState], now: float, claimed: Mapping[str, float]
    ) -> tuple[int, RankedPool | None]:
        """(blocks of the prompt the best-holding eligible pool caches beyond what every eligible
        pool does, that pool); among equal holders the one expected to start work first. (0,
        None) when no pool holds more than another."""
        cands = decision.candidates
        hi = lo = cands[0].cached_blocks
        for r in cands:
            c = r.cached_blocks
            if c > hi:
                hi = c
            elif c < lo:
                lo = c
        if hi == lo:
            return 0, None
        best: RankedPool | None = None
        soonest = math.inf
        for r in cands:
            if r.cached_blocks == hi:
                pool = pools.get(r.pool_id)
                if pool is None:
                    continue
                t = self.backlog_seconds(pool, now) + claimed.get(r.pool_id, 0.0)
                if t < soonest:
                    best, soonest = r, t
        return hi - lo, best

    def _hold(
        self,
        e: _Entry[T],
        home: RankedPool,
        pools: Mapping[str, PoolState],
        claimed: dict[str, float],
        now: float,
        dw: float,
    ) -> bool:
        """Whether `e` holds out for `home` (expected to start it within the affinity hold of
        its arrival, behind what earlier requests of the round hold out for); if so counts its
        work there."""
        pool = pools[home.pool_id]
        ahead = self.backlog_seconds(pool, now) + claimed.get(home.pool_id, 0.0)
        if now + ahead - e.queued_at > self._hold_seconds:
            return False
        own = (home.uncached_tokens + dw * e.request.max_tokens) / self.selector.throughput(pool)
        claimed[home.pool_id] = claimed.get(home.pool_id, 0.0) + own
        return True

    def _commit_to(
        self,
        e: _Entry[T],
        ranked: RankedPool,
        decision: Decision,
        now: float,
        pools: Mapping[str, PoolState],
        free: set[str],
        out: list[Outcome[T]],
    ) -> None:
        self._remove(e)
        pool = pools[ranked.pool_id]
        out.append(self._commit(e, ranked, decision, now, pool))
        if not self._can_start(pool, now):
            free.discard(ranked.pool_id)

    def _commit(
        self, e: _Entry[T], ranked: RankedPool, decision: Decision, now: float, pool: PoolState
    ) -> Dispatched[T]:
        b = self._pool_backlog(pool, now)
        wait = b.now(now)
        price = self.selector.wait_price
        feedback = self.feedback
        if price is not None or feedback is not None:
            # the wait the SLO is about: time queued here plus the estimated wait at the pool
            observed = now - e.queued_at + wait
            if price is not None:
                price.observe(observed)
            if feedback is not None:
                feedback.observe(observed)
                scale = feedback.scale
                self._start_within = self.config.start_within_seconds * scale
                self._hold_seconds = self.config.affinity_hold_seconds * scale
        rate = self.selector.throughput(pool)
        b.seconds = (
            wait + (ranked.uncached_tokens + self.selector.config.decode_weight * e.request.max_tokens) / rate
        )
        b.at = now
        if self.config.reserve_window_seconds:
            self._recent.setdefault(e.request.priority, {})[ranked.pool_id] = now
        if self._pacer is not None:
            self._pacer.spend(e.request.priority, e.request.prompt_tokens + e.request.max_tokens, now)
        if self.config.record_sends:
            # recorded here, not by the caller, so the next request ranked in the same round sees it
            pool.record_sent(ranked.uncached_tokens, e.request.max_tokens)
        cls = self._classes.get((e.request.model, e.request.priority))
        if cls is not None:
            if e.tag > cls.vtime:
                cls.vtime = e.tag
            self._forget(cls, e.request.tenant)
        return Dispatched(e.request, ranked, decision, now - e.queued_at)

    def _work(self, request: DispatchRequest[T]) -> float:
        return request.prompt_tokens + self.selector.config.decode_weight * request.max_tokens

    def _remove(self, e: _Entry[T]) -> None:
        e.done = True
        model = e.request.model
        self._queued_work[model] = max(0.0, self._queued_work.get(model, 0.0) - self._work(e.request))
        queue = self._queues[model]
        key = e.key()
        i = bisect.bisect_left(queue, key, key=_first)
        if i < len(queue) and queue[i][1] is e:
            del queue[i]
        else:  # pragma: no cover - keys are unique (seq), so the bisect finds it
            queue[:] = [q for q in queue if q[1] is not e]

    def _forget(self, cls: _Class, tenant: str) -> None:
        left = cls.queued.get(tenant, 1) - 1
        if left > 0:
            cls.queued[tenant] = left
            return
        cls.queued.pop(tenant, None)
        if cls.finish.get(tenant, 0.0) <= cls.vtime:
            # an idle tenant at or behind virtual time starts from it anyway: keep no state
            cls.finish.pop(tenant, None)
        if len(cls.finish) > 2 * self.config.max_queued:
            for t in [t for t, f in cls.finish.items() if f <= cls.vtime and t not in cls.queued]:
                del cls.finish[t]

    def _shed(
        self,
        request: DispatchRequest[T],
        reason: ShedReason,
        now: float,
        queued_at: float,
        detail: str,
        *,
        queued: bool = True,
    ) -> Shed[T]:
        if queued:
            # a request dropped from the queue leaves its tenant's count (one refused at the
            # door, `queued` False, never entered it)
            cls = self._classes.get((request.model, request.priority))
            if cls is not None and request.tenant in cls.queued:
                self._forget(cls, request.tenant)
        return Shed(request, reason, self.retry_after(request.model, now), detail, now - queued_at)

    def retry_after(self, model: str, now: float) -> float:
        """Whole seconds until the model's queue would drain at the pools' throughput (bounded)."""
        cfg = self.config
        work = self._queued_work.get(model, 0.0)
        rate = 0.0
        backlog = 0.0
        for p in self.pools():
            if p.listed and p.model == model:
                rate += self.selector.throughput(p)
                backlog += self.backlog_seconds(p, now)
        seconds = (work / rate if rate else 0.0) + (backlog / max(1, len(self._backlog)))
        return float(min(cfg.max_retry_after_seconds, max(cfg.min_retry_after_seconds, math.ceil(seconds))))

    def next_wakeup(self) -> float | None:
        """The clock time at which `poll` may do something without other news (None: never)."""
        now = self.clock.monotonic()
        heap = self._expiry
        while heap and heap[0][2].done:
            heapq.heappop(heap)
        if not heap:
            return None
        soonest = heap[0][0]
        start_within = self._start_within
        for b in self._backlog.values():
            t = b.at + b.seconds - start_within
            if now < t < soonest:
                soonest = t
        if self._pacer is not None:
            for (_, priority), cls in self._classes.items():
                ready = self._pacer.ready_at(priority) if cls.queued else None
                if ready is not None and now < ready < soonest:
                    soonest = ready
        return soonest if math.isfinite(soonest) else None

    # ---- helpers ------------------------------------------------------------------------
    def _reserve(self, priority: int, now: float) -> int:
        """Pools a request of class `priority` must leave free for higher classes."""
        cfg = self.config
        n = cfg.reserved_pools.get(priority)
        if n is None:
            return 0
        window = cfg.reserve_window_seconds
        if window:
            since = now - window
            used: set[str] = set()
            for cls, last in self._recent.items():
                if cls > priority:
                    stale = [pid for pid, t in last.items() if t < since]
                    for pid in stale:  # what it keeps stays bounded by the pools in use
                        del last[pid]
                    used.update(last)
            n = max(n, len(used))
        return n

    def _held(self, priority: int, now: float) -> bool:
        """Whether pacing keeps a request of class `priority` queued now."""
        return self._pacer is not None and self._pacer.held(priority, now)

    def _window(
        self, queue: list[tuple[tuple[int, float, int], _Entry[T]]], now: float
    ) -> list[tuple[tuple[int, float, int], _Entry[T]]]:
        """The queued requests ranked this round: the first `scan_limit` not held by pacing (a
        held class must not use up the scan for the classes queued after it)."""
        limit = self.config.scan_limit
        if self._pacer is None:
            window = queue[:limit]
            return self._late_last(window, now) if self.config.late_after_seconds else window
        out: list[tuple[tuple[int, float, int], _Entry[T]]] = []
        i, n = 0, len(queue)
        while i < n and len(out) < limit:
            priority = queue[i][1].request.priority
            if self._held(priority, now):
                # skip the rest of the held class at once (the queue is sorted by class, highest first)
                i = bisect.bisect_left(queue, (-priority + 1, -math.inf, -1), lo=i, key=_first)
                continue
            out.append(queue[i])
            i += 1
        return self._late_last(out, now) if self.config.late_after_seconds else out

    def _late_last(
        self, window: list[tuple[tuple[int, float, int], _Entry[T]]], now: float
    ) -> list[tuple[tuple[int, float, int], _Entry[T]]]:
        """The deadline order (`late_after_seconds`): within each class, the requests queued
        longer than the target (and not yet `late_limit` times as long) after the others, each
        part in queue order."""
        cfg = self.config
        late_from = now - cfg.late_after_seconds  # queued before this: late
        back_from = now - cfg.late_limit * cfg.late_after_seconds  # before this: back in order
        if not any(back_from <= e.queued_at < late_from for _, e in window):
            return window
        # a stable sort: class first (the window is sorted by class), then on time before late
        return sorted(window, key=lambda x: (x[0][0], back_from <= x[1].queued_at < late_from))

    def _free_count(self, pools: Mapping[str, PoolState], now: float) -> int:
        return sum(1 for p in pools.values() if p.listed and self._can_start(p, now))

    def _by_id(self) -> dict[str, PoolState]:
        return {p.pool_id: p for p in self.pools()}

    def _rank(self, request: DispatchRequest[T], now: float) -> Decision:
        return self.selector.select(
            self.pools(),
            request.model,
            request.prompt_tokens,
            request.max_tokens,
            self.overlaps(request, now),
            now,
            affinity_key=request.affinity_key,
            observe=False,
            regions=request.regions,
            adapter=request.adapter,
        )


def _first(item: tuple[tuple[int, float, int], object]) -> tuple[int, float, int]:
    return item[0]

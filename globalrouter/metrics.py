"""Prometheus metrics of one global frontend, in a registry of its own (tests run several)."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from globalrouter.policy import OTHER_LABEL
from meshkit.metrics_http import MAX_SCRAPES, SCRAPE_SECONDS, MetricsEndpoint, serve_metrics
from meshkit.tls import SecurityConfig, ServerCertificates

DECISION_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
"""Bounds of the decision histograms, seconds; 2 ms is the fleet goal's bound for a 16k-token prompt."""


class RouterMetrics:
    """The counters and histograms a global frontend exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "globalrouter_requests",
            "Generate requests by model and outcome (gRPC code name)",
            ["model", "outcome"],
            registry=r,
        )
        self.decisions = Counter(
            "globalrouter_decisions", "Requests sent to each pool (admission attempts)", ["pool"], registry=r
        )
        self.prompt_blocks = Counter(
            "globalrouter_prompt_blocks",
            "Full prompt blocks of requests a pool admitted",
            ["pool"],
            registry=r,
        )
        self.cached_blocks = Counter(
            "globalrouter_cached_blocks",
            "Of those, blocks the pool had cached (its admission reply)",
            ["pool"],
            registry=r,
        )
        self.cached_prefix_ratio = Histogram(
            "globalrouter_cached_prefix_ratio",
            "Cached prompt blocks / prompt blocks at admission",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        self.cached_prefix_quality = CachedPrefixQuality()
        r.register(self.cached_prefix_quality)
        self.migrations = Counter(
            "globalrouter_migrations",
            "Requests moved mid-stream away from a failed pool",
            ["from_pool"],
            registry=r,
        )
        self.migration_aborts = Counter(
            "globalrouter_migration_aborts",
            "Requests ended at the migration limit (UNAVAILABLE, MIGRATION_LIMIT_REACHED)",
            registry=r,
        )
        self.refusals = Counter(
            "globalrouter_refusals", "Admission refusals by pool and gRPC code", ["pool", "code"], registry=r
        )
        self.decision_latency = Histogram(
            "globalrouter_decision_latency_seconds",
            "Time to filter and rank pools for one request (wall time: with any wait for the CPU or the GIL)",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.decision_cpu = Histogram(
            "globalrouter_decision_cpu_seconds",
            "CPU time the serving thread spent filtering and ranking pools for one request: the decision's "
            "own cost, without the time the thread waited for a CPU or the GIL meanwhile",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.wait_slo_price = Gauge(
            "globalrouter_wait_slo_price",
            "Cost of a second of estimated wait beyond --wait-slo, in seconds of wait (0: no SLO)",
            registry=r,
        )
        self.routed_prefix_blocks = Gauge(
            "globalrouter_routed_prefix_blocks",
            "Block hashes of the prompts this frontend sent recently, counted as cached at their pool "
            "until its KV events arrive (--routed-prefix-ttl; 0: off)",
            registry=r,
        )
        self.telemetry_lag = Histogram(
            "globalrouter_telemetry_lag_seconds",
            "Receive time minus the relay's send/observe time",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.telemetry_snapshot_requests = Counter(
            "globalrouter_telemetry_snapshot_requests", "SnapshotRequests sent to relays (gaps)", registry=r
        )
        self.telemetry_messages = Counter(
            "globalrouter_telemetry_messages",
            "Telemetry messages taken from relays after the hello (each message of a batch counts)",
            registry=r,
        )
        self.telemetry_batches = Counter(
            "globalrouter_telemetry_batches",
            "TelemetryBatch messages taken from relays (gRPC messages that carried several)",
            registry=r,
        )
        self.event_loop_lag = Histogram(
            "globalrouter_event_loop_lag_seconds",
            "How late a periodic task on the serving event loop wakes (what every call waited too)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        self.gc_pause = Histogram(
            "globalrouter_gc_pause_seconds",
            "Collections of Python's cyclic garbage collector, by generation: each pauses the serving loop",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.gc_frozen = Gauge(
            "globalrouter_gc_frozen_objects",
            "Objects gc.freeze() left out of the garbage collector's passes (at the start and once ready)",
            registry=r,
        )
        self.snapshot_blocks_held = Gauge(
            "globalrouter_telemetry_snapshot_blocks_held",
            "Snapshot blocks received and not yet applied, across telemetry streams (8 bytes each)",
            registry=r,
        )
        self.telemetry_refused = Counter(
            "globalrouter_telemetry_streams_refused",
            "Relay telemetry streams refused, by reason (UNAUTHENTICATED, NOT_AUTHORIZED, LIMIT_EXCEEDED):"
            " the router routes without that relay's KV and load",
            ["reason"],
            registry=r,
        )
        self.lease_grace = Counter(
            "globalrouter_pool_lease_grace",
            "Pools discovery dropped because their leases expired, by what followed: kept (their"
            " telemetry is live here, so they stay routable up to one lease longer) or dropped (at"
            " once); then for kept ones reregistered, expired, telemetry_stopped or removed",
            ["outcome"],
            registry=r,
        )
        self.pools_in_lease_grace = Gauge(
            "globalrouter_pools_in_lease_grace",
            "Pools routable now only by the lease grace (lease lapsed in discovery, telemetry live here)",
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "globalrouter_time_to_first_token_seconds",
            "From a request's routing decision to its first token (admission, queueing and retries included)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        # Per tenant: the label is the identity's policy key when --policy names it, else
        # "other", so callers cannot grow the label set.
        self.tenant_tokens = Counter(
            "globalrouter_tenant_tokens",
            "Tokens (prompt + generated) of finished requests, per tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_budget_refusals = Counter(
            "globalrouter_tenant_budget_refusals",
            "Requests refused over a tenant budget (429 / RESOURCE_EXHAUSTED BUDGET_EXCEEDED), per limit",
            ["tenant", "limit"],
            registry=r,
        )
        self.tenant_filter_refusals = Counter(
            "globalrouter_tenant_filter_refusals",
            "Requests refused by the tenant policy: MODEL_NOT_ALLOWED, or REGION_NOT_ALLOWED (no pool in "
            "the allowed regions)",
            ["tenant", "reason"],
            registry=r,
        )
        self.flow = FlowStats()
        """Per tenant and priority class: requests, tokens, dispatch queue, sheds, budget refusals."""
        r.register(self.flow)
        self._children: dict[tuple[object, tuple[str, ...]], object] = {}

    def pools_by_state(self, count: Callable[[], Mapping[str, int]]) -> None:
        """Exports globalrouter_pools{state}: `count()` (state -> pools), read at each scrape."""
        self.registry.register(_PoolStates(count))

    def pool_kv_ages(self, ages: Callable[[], Iterable[tuple[str, float]]]) -> None:
        """Exports globalrouter_pool_kv_age_seconds{pool}: `ages()` (pool, seconds), read at each scrape."""
        self.registry.register(_PoolKvAges(ages))

    def snapshot_readers(self, readers: Callable[[], tuple[int, int, int]]) -> None:
        """Exports the snapshot readers: `readers()` (reading, waiting, slots idled), read at each scrape."""
        self.registry.register(_SnapshotReaders(readers))

    def labelled(self, metric, *values: str):
        """`metric.labels(*values)`, looked up once per label set: prometheus validates the values
        and takes a lock on every labels() call, four times per request on the data path. Bounded
        as prometheus's own children are, by the label values the callers admit."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def serve(
        self,
        listen: str,
        security: SecurityConfig | None = None,
        certificates: ServerCertificates | None = None,
        *,
        scrape_seconds: float = SCRAPE_SECONDS,
        max_scrapes: int = MAX_SCRAPES,
    ) -> int:
        """Serves /metrics on HOST:PORT (port 0 picks one) in a background thread; returns the port.

        The shared bounded endpoint (meshkit.metrics_http): HTTPS under the process's TLS flags with
        `certificates` (the gRPC listener's reloader), mutual with --tls-ca; loopback only without
        TLS unless --insecure; `scrape_seconds` per connection, at most `max_scrapes` at once.
        """
        self._http = serve_metrics(
            self.registry,
            listen,
            security,
            certificates,
            flag="--metrics-listen",
            scrape_seconds=scrape_seconds,
            max_scrapes=max_scrapes,
        )
        return self._http.port

    def close(self) -> None:
        """Stops the /metrics endpoint if it runs."""
        endpoint: MetricsEndpoint | None = getattr(self, "_http", None)
        if endpoint is not None:
            endpoint.close()


POOL_STATES = ("ready", "not-ready", "draining", "stale")
"""Every state globalrouter_pools reports (zero when no pool is in it, so a panel's series persist)."""


class _PoolStates(Collector):
    """globalrouter_pools{state}: the directory's pools by state, computed when scraped."""

    def __init__(self, count: Callable[[], Mapping[str, int]]) -> None:
        self._count = count

    def collect(self):
        family = GaugeMetricFamily(
            "globalrouter_pools", "Pools in this frontend's directory by state", labels=["state"]
        )
        counts = self._count()
        for state in POOL_STATES:
            family.add_metric([state], counts.get(state, 0))
        yield family


class _PoolKvAges(Collector):
    """globalrouter_pool_kv_age_seconds{pool}: the age of each listed pool's KV view, computed when
    scraped (no work per KV event); the labels are the directory's listed pools, so bounded by it."""

    def __init__(self, ages: Callable[[], Iterable[tuple[str, float]]]) -> None:
        self._ages = ages

    def collect(self):
        family = GaugeMetricFamily(
            "globalrouter_pool_kv_age_seconds",
            "Seconds since the last KV message (snapshot chunk, delta or heartbeat) of each listed pool;"
            " past --kv-max-age its cached blocks count as none. Absent: no KV stream yet",
            labels=["pool"],
        )
        for pool_id, age in self._ages():
            family.add_metric([pool_id], age)
        yield family


class _SnapshotReaders(Collector):
    """globalrouter_telemetry_snapshot_readers{state} and _snapshot_slots_idled_total, read from the
    servicer's SnapshotReaders when scraped (nothing per message)."""

    def __init__(self, readers: Callable[[], tuple[int, int, int]]) -> None:
        self._readers = readers

    def collect(self):
        reading, waiting, idled = self._readers()
        family = GaugeMetricFamily(
            "globalrouter_telemetry_snapshot_readers",
            "Telemetry streams owing a snapshot: reading it with a slot, or waiting for one (--snapshot-readers)",
            labels=["state"],
        )
        family.add_metric(["reading"], reading)
        family.add_metric(["waiting"], waiting)
        yield family
        yield CounterMetricFamily(
            "globalrouter_telemetry_snapshot_slots_idled",
            "Snapshot-reader slots passed on because the relay sent no snapshot chunk within the idle bound",
            value=idled,
        )


SHARE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
"""Buckets of the cached-share histograms, those of globalrouter_cached_prefix_ratio (the pool's own
figure at admission), so the three read side by side."""


class CachedPrefixQuality(Collector):
    """Router quality per admission: the share of the prompt's blocks the admitting pool had cached
    as this frontend's KV index saw it, against the best share any eligible pool of the same
    decision had, and the prompt tokens prefilled for want of the best cache.

    globalrouter_cached_prefix_achieved_ratio and _available_ratio (histograms) and
    globalrouter_cached_prefix_forgone_tokens (a counter: tokens, not blocks, because pools may
    differ in block size and prefill is paid per token). Kept as plain numbers under one lock and
    turned into metric families at scrape time: two prometheus_client Histogram.observe calls and a
    Counter.inc cost ~9 us per admission (4% of a 16-pool decision), this observe ~0.3 us."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._achieved = [0] * (len(SHARE_BUCKETS) + 1)
        self._available = [0] * (len(SHARE_BUCKETS) + 1)
        self._achieved_sum = 0.0
        self._available_sum = 0.0
        self._forgone = 0

    def observe(self, achieved: float, available: float, forgone_tokens: int) -> None:
        """One admission: cached shares (0..1) at the admitting pool and at the best candidate."""
        i = bisect_left(SHARE_BUCKETS, achieved)  # the first bucket whose bound is >= the value
        j = bisect_left(SHARE_BUCKETS, available)
        with self._lock:
            self._achieved[i] += 1
            self._available[j] += 1
            self._achieved_sum += achieved
            self._available_sum += available
            self._forgone += forgone_tokens

    def collect(self):
        with self._lock:
            achieved, available = list(self._achieved), list(self._available)
            achieved_sum, available_sum, forgone = self._achieved_sum, self._available_sum, self._forgone
        yield _histogram(
            "globalrouter_cached_prefix_achieved_ratio",
            "Cached share of the prompt's blocks the admitting pool had (KV index), per admission",
            achieved,
            achieved_sum,
        )
        yield _histogram(
            "globalrouter_cached_prefix_available_ratio",
            "Best cached share of the prompt's blocks any eligible pool had (KV index), per admission",
            available,
            available_sum,
        )
        yield CounterMetricFamily(
            "globalrouter_cached_prefix_forgone_tokens",
            "Prompt tokens the admitting pool had to prefill beyond what the best-cached eligible pool"
            " had to (the load or a refusal moved the request off the cache)",
            value=forgone,
        )


def _histogram(name: str, documentation: str, counts: list[int], total: float) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, n in zip((*SHARE_BUCKETS, float("inf")), counts, strict=True):
        cumulative += n
        buckets.append((floatToGoString(bound), cumulative))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=total)


QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Buckets of globalrouter_flow_queue_seconds (the dispatch queue's default deadline is 60 s)."""
MAX_FLOW_SERIES = 2_000
"""(tenant, class) series kept at most; past it a new tenant counts under "other" in its class."""
RECENT_QUEUE_TIMES = 512
"""Queue times per series kept for the status page's quantiles (the newest)."""


class Flow:
    """One (tenant label, priority class) series of FlowStats. The request path looks it up once
    per request and calls these methods, which add to plain numbers without a lock: only the
    serving event loop writes them; the scrape thread copies them (CPython copies a list or dict
    in one step), so a scrape may see a request's sum before its bucket, never a torn value. Three
    calls per request cost about as much as one prometheus_client child's inc (which locks)."""

    __slots__ = (
        "budget_refusals",
        "priority",
        "queue_counts",
        "queue_sum",
        "queued",
        "quotas",
        "quotas_at",
        "recent",
        "requests",
        "sheds",
        "tenant",
        "tokens",
    )

    def __init__(self, tenant: str, priority: int) -> None:
        self.tenant = tenant
        self.priority = priority
        self.requests = 0
        """Requests the tenant gate let in (or every request, without --policy)."""
        self.tokens = 0
        """Prompt + generated tokens of finished requests."""
        self.queued = 0
        """Requests in the dispatch queue now (--dispatch late)."""
        self.queue_counts = [0] * (len(QUEUE_BUCKETS) + 1)
        self.queue_sum = 0.0
        self.recent: deque[float] = deque(maxlen=RECENT_QUEUE_TIMES)
        self.sheds: dict[str, int] = {}
        """ShedReason name -> requests the dispatch queue refused or dropped."""
        self.budget_refusals: dict[str, int] = {}
        """Budget limit (tokens_per_minute, ...) -> requests refused over it."""
        self.quotas: Sequence[Any] = ()
        """The budgets' state after this series' last admission (budgets.Quota), for the status page."""
        self.quotas_at = 0.0
        """Wall time of that admission."""

    def admitted(self, quotas: Sequence[Any] = ()) -> None:
        self.requests += 1
        if quotas:
            self.quotas = quotas
            self.quotas_at = time.time()

    def finished(self, tokens: int) -> None:
        if tokens > 0:
            self.tokens += tokens

    def enqueued(self) -> None:
        self.queued += 1

    def dequeued(self) -> None:
        if self.queued > 0:
            self.queued -= 1

    def dispatched(self, queued_seconds: float) -> None:
        """A request left the dispatch queue for a pool after `queued_seconds` (0: at once)."""
        self.queue_counts[bisect_left(QUEUE_BUCKETS, queued_seconds)] += 1
        self.queue_sum += queued_seconds
        self.recent.append(queued_seconds)

    def shed(self, reason: str) -> None:
        self.sheds[reason] = self.sheds.get(reason, 0) + 1

    def budget_refused(self, limit: str) -> None:
        self.budget_refusals[limit] = self.budget_refusals.get(limit, 0) + 1


class FlowStats(Collector):
    """Flow control per tenant and priority class, for /metrics and the status page.

    The tenant label is the policy's key for identities the policy names, else "other" (never a
    string a client chose), and at most MAX_FLOW_SERIES series exist: the label set stays bounded
    by the policy file. Exported at scrape time: globalrouter_flow_requests_total,
    _flow_tokens_total, _flow_queued, _flow_queue_seconds (histogram), _flow_sheds_total{reason},
    _flow_budget_refusals_total{limit}, each with labels tenant and class."""

    def __init__(self, max_series: int = MAX_FLOW_SERIES) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, int], Flow] = {}
        self.max_series = max_series

    def series(self, tenant: str, priority: int) -> Flow:
        """The series of (`tenant`, `priority`), created on first use; "other" past the cap."""
        flow = self._series.get((tenant, priority))
        if flow is not None:
            return flow
        with self._lock:
            if len(self._series) >= self.max_series:
                tenant = OTHER_LABEL
            flow = self._series.get((tenant, priority))
            if flow is None:
                flow = self._series[(tenant, priority)] = Flow(tenant, priority)
            return flow

    def snapshot(self) -> list[dict[str, Any]]:
        """Every series as plain values (highest class first, then by tenant), for the status page."""
        now = time.time()
        with self._lock:
            flows = sorted(self._series.values(), key=lambda f: (-f.priority, f.tenant))
            rows = [
                (
                    f,
                    f.requests,
                    f.tokens,
                    f.queued,
                    sorted(f.recent),
                    sum(f.queue_counts),
                    f.queue_sum,
                    dict(f.sheds),
                    dict(f.budget_refusals),
                    list(f.quotas),
                    f.quotas_at,
                )
                for f in flows
            ]
        out = []
        for f, requests, tokens, queued, recent, dispatched, queue_sum, sheds, refusals, quotas, at in rows:
            age = now - at
            out.append(
                {
                    "tenant": f.tenant,
                    "class": f.priority,
                    "requests": requests,
                    "tokens": tokens,
                    "queued": queued,
                    "dispatched": dispatched,
                    "queue_mean_s": round(queue_sum / dispatched, 4) if dispatched else None,
                    "queue_p50_s": _quantile(recent, 0.5),
                    "queue_p99_s": _quantile(recent, 0.99),
                    "sheds": sheds,
                    "budget_refusals": refusals,
                    "budget": [
                        {
                            "limit": str(q.kind),
                            "max": q.limit,
                            "remaining": q.remaining,
                            "as_of_s": round(age, 1),
                            "resets_in_s": round(max(0.0, q.reset_seconds - age), 1),
                        }
                        for q in quotas
                    ],
                }
            )
        return out

    def collect(self):
        labels = ["tenant", "class"]
        requests = CounterMetricFamily(
            "globalrouter_flow_requests",
            "Requests let in by the tenant gate (every request without --policy), per tenant and priority class",
            labels=labels,
        )
        tokens = CounterMetricFamily(
            "globalrouter_flow_tokens",
            "Tokens (prompt + generated) of finished requests, per tenant and priority class",
            labels=labels,
        )
        queued = GaugeMetricFamily(
            "globalrouter_flow_queued",
            "Requests waiting in the dispatch queue now (--dispatch late), per tenant and priority class",
            labels=labels,
        )
        queue = HistogramMetricFamily(
            "globalrouter_flow_queue_seconds",
            "Time a request spent in the dispatch queue before it went to a pool (--dispatch late; 0: at once)",
            labels=labels,
        )
        sheds = CounterMetricFamily(
            "globalrouter_flow_sheds",
            "Requests the dispatch queue refused or dropped (429 / RESOURCE_EXHAUSTED), by shed reason",
            labels=[*labels, "reason"],
        )
        refusals = CounterMetricFamily(
            "globalrouter_flow_budget_refusals",
            "Requests refused over a tenant budget (BUDGET_EXCEEDED), by limit",
            labels=[*labels, "limit"],
        )
        with self._lock:
            flows = [
                (
                    f.tenant,
                    str(f.priority),
                    f.requests,
                    f.tokens,
                    f.queued,
                    list(f.queue_counts),
                    f.queue_sum,
                    dict(f.sheds),
                    dict(f.budget_refusals),
                )
                for f in self._series.values()
            ]
        for tenant, cls, n, tok, q, counts, total, shed, refused in flows:
            requests.add_metric([tenant, cls], n)
            tokens.add_metric([tenant, cls], tok)
            queued.add_metric([tenant, cls], q)
            cumulative, buckets = 0, []
            for bound, c in zip((*QUEUE_BUCKETS, float("inf")), counts, strict=True):
                cumulative += c
                buckets.append((floatToGoString(bound), cumulative))
            queue.add_metric([tenant, cls], buckets, total)
            for reason, c in shed.items():
                sheds.add_metric([tenant, cls, reason], c)
            for limit, c in refused.items():
                refusals.add_metric([tenant, cls, limit], c)
        yield from (requests, tokens, queued, queue, sheds, refusals)


def _quantile(ordered: list[float], q: float) -> float | None:
    """The `q` quantile of sorted values (nearest rank), None when there are none."""
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

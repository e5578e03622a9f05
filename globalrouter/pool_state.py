"""Live pool signals as the global frontend holds them, each with its own freshness.

These are the signal types that selection ranks on. The gRPC layer (telemetry ingestion, the
directory watch, serving links) writes them; the simulator writes them too, so the simulator runs
exactly the selection code the frontend runs. Nothing here knows about gRPC; time is a monotonic
`now` passed in by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoadSignal:
    """One load report of a pool (summed over its workers)."""

    requests_waiting: int = 0
    """Requests admitted and waiting for a worker slot."""
    requests_running: int = 0
    """Requests running (prefill or decode)."""
    prefill_tokens_in_flight: int = 0
    """Uncached prompt tokens admitted whose prefill has not finished."""
    decode_tokens_in_flight: int = 0
    """Output tokens still to generate for admitted requests."""
    kv_blocks_used: int = 0
    """KV blocks in use across workers."""
    kv_blocks_total: int = 0
    """KV blocks across workers."""
    max_running_requests: int = 0
    """Requests the pool can run at once (0: not stated)."""
    max_waiting_requests: int = 0
    """Requests the pool queues beyond those it runs (0: not stated)."""


@dataclass(frozen=True, slots=True)
class FreshnessLimits:
    """How old each kind of signal may be before it counts as unknown."""

    load_max_age: float = 3.0
    """Seconds after which a load report is unknown (a few report intervals)."""
    kv_max_age: float = 30.0
    """Seconds without any message on a pool's KV streams after which its block set is unknown."""
    state_max_age: float = 30.0
    """Seconds after which telemetry readiness/drain state is unknown (then the directory decides)."""


@dataclass(frozen=True, slots=True)
class PoolCapacityHint:
    """What a pool says it can hold (from its registration); 0 means not stated."""

    max_running_requests: int = 0
    kv_cache_blocks: int = 0
    prefill_tokens_per_second: int = 0


@dataclass(slots=True)
class PoolState:
    """Everything one global frontend knows about one pool.

    Directory fields come from discovery (WatchPools); signal fields come from relay telemetry
    and carry the monotonic time they arrived; `pending_*` is what this frontend sent to the pool
    since its last load report (so a burst does not pile onto one stale minimum).
    """

    pool_id: str
    # --- from the directory (discovery) ---
    listed: bool = False
    """Whether discovery lists the pool (telemetry may arrive before the directory does)."""
    model: str = ""
    region: str = ""
    frontends: tuple[str, ...] = ()
    directory_draining: bool = False
    openai_http: bool = False
    """Whether the pool's frontends speak OpenAI HTTP (else the mesh's gRPC pool frontend)."""
    capacity: PoolCapacityHint = field(default_factory=PoolCapacityHint)
    # --- from telemetry ---
    block_size: int = 0
    """Tokens per block the pool's relay reported in its hello (0: no stream yet)."""
    models_ready: dict[str, bool] = field(default_factory=dict)
    """Model -> Ready, from the last readiness report (empty: unknown)."""
    adapters: dict[str, frozenset[str]] = field(default_factory=dict)
    """Model -> the LoRA adapters the pool serves on it, from the last readiness reports (kept
    while the reports go stale: adapters change rarely, and the pool's admission has the final say)."""
    telemetry_draining: bool = False
    load: LoadSignal | None = None
    load_at: float | None = None
    """Monotonic time the last load report arrived."""
    kv_at: float | None = None
    """Monotonic time the last KV message (snapshot chunk, delta or heartbeat) arrived."""
    state_at: float | None = None
    """Monotonic time the last readiness or drain report arrived."""
    kv_sources: set[str] = field(default_factory=set)
    """Keys of the KvIndex sources (one per telemetry stream) that describe this pool."""
    # --- this frontend's own bookkeeping ---
    pending_requests: int = 0
    pending_prefill_tokens: int = 0
    pending_decode_tokens: int = 0
    link_backoff_until: float = 0.0
    """Monotonic time until which the serving link is in failure back-off."""

    # ---- freshness -------------------------------------------------------------------------
    def load_fresh(self, now: float, limits: FreshnessLimits) -> bool:
        """True when a load report exists and is not older than its limit."""
        return (
            self.load is not None and self.load_at is not None and now - self.load_at <= limits.load_max_age
        )

    def kv_fresh(self, now: float, limits: FreshnessLimits) -> bool:
        """True when the pool's block set is current enough to rank on."""
        return self.kv_at is not None and now - self.kv_at <= limits.kv_max_age

    def state_fresh(self, now: float, limits: FreshnessLimits) -> bool:
        """True when telemetry readiness/drain state is current."""
        return self.state_at is not None and now - self.state_at <= limits.state_max_age

    def draining(self) -> bool:
        """Draining by either source; a stale telemetry drain flag still counts (drain is sticky)."""
        return self.directory_draining or self.telemetry_draining

    def ready(self, model: str, now: float, limits: FreshnessLimits) -> bool:
        """Whether `model` is Ready; unknown readiness (no or stale report) counts as Ready,
        because a listed pool registered the model and the pool's admission has the final say."""
        if not self.models_ready or not self.state_fresh(now, limits):
            return True
        return self.models_ready.get(model, False)

    # ---- writers ---------------------------------------------------------------------------
    def record_load(self, load: LoadSignal, now: float) -> None:
        """A new load report: it already counts what this frontend sent, so pending resets."""
        self.load = load
        self.load_at = now
        self.pending_requests = 0
        self.pending_prefill_tokens = 0
        self.pending_decode_tokens = 0

    def record_sent(self, prefill_tokens: int, decode_tokens: int) -> None:
        """This frontend sent a request there (counted until the next load report)."""
        self.pending_requests += 1
        self.pending_prefill_tokens += prefill_tokens
        self.pending_decode_tokens += decode_tokens

"""Live pool signals as the global frontend holds them, each with its own freshness.

These are the signal types that selection ranks on. The gRPC layer (telemetry ingestion, the
directory watch, serving links) writes them; the simulator writes them too, so the simulator runs
exactly the selection code the frontend runs. Nothing here knows about gRPC; time is a monotonic
`now` passed in by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


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


# Rows of PoolColumns.f (float64; times NaN when unknown: NaN compares false, so "no report" is
# never fresh) and PoolColumns.i (int64).
STATE_AT, BACKOFF, CAP_RATE, SLOTS, LOAD_AT, LOAD_PREFILL, LOAD_DECODE, PEND_PREFILL, PEND_DECODE, KV_AT = (
    range(10)
)
MODEL, REGION, BLOCK_SIZE, FLAGS = range(4)
# Bits of the FLAGS row.
LISTED = 1
BLOCKED = 2
"""Draining (either source) or no frontend listed."""
NOT_READY = 4
"""A readiness report says the pool's own model is not Ready (counts while the report is fresh)."""
LOAD_PRESENT = 8


MAX_CODES = 65_536
"""Distinct model and region names PoolColumns keeps codes for (names come from registrations:
the bound keeps a stream of ever-new names from growing the table without end)."""
UNINTERNED = -2


class PoolColumns:
    """The numeric signals selection ranks on, one column per live PoolState, as numpy arrays.

    Why: selection at 1,000 pools spent ~2 ms reading a dozen attributes per pool in Python.
    Every PoolState writes its tracked fields through to its column here as they are set (a
    numpy scalar store: ~0.2 µs more per KV message's kv_at, ~4 µs per load report, on the
    writers' paths), so a decision gathers its pools' columns in two fancy indexes (`f[:, rows]`,
    `i[:, rows]`) and works on vectors. One store per process (PoolStates of the frontend, the
    simulator and tests alike); columns are reused when a PoolState dies. Strings (model,
    region) are kept as small integer codes.

    `models_ready` must be replaced, not changed in place (every writer does; the NOT_READY flag
    says whether the pool's own model is Ready)."""

    __slots__ = (
        "_codes",
        "_free",
        "_size",
        "_ver",
        "f",
        "i",
        "ids",
        "kv_owner",
        "kv_seen",
        "kv_table",
        "sources_ver",
    )

    def __init__(self, rows: int = 64) -> None:
        self._size = 0
        self._free: list[int] = []
        self._codes: dict[str, int] = {}
        """Interned strings (models and regions) -> code; never shrinks (a fleet's names are few)."""
        self.f = np.zeros((10, rows), np.float64)
        self.i = np.zeros((4, rows), np.int64)
        self.ids = np.empty(rows, object)
        self._ver = 0
        self.sources_ver = np.zeros(rows, np.int64)
        """When kv_sources last changed (a process-wide counter): what pool_overlaps' cache of
        kv_table is checked against."""
        self.kv_table = np.full(rows, -1, np.int64)
        """The KV table (KvSummary) the pool's sources name: -1 none, -2 several (owned by
        selection.pool_overlaps, valid where kv_seen equals sources_ver, for kv_owner)."""
        self.kv_seen = np.full(rows, -1, np.int64)
        self.kv_owner: tuple[object, int] | None = None
        """(the KvSummary kv_table was worked out for, its table count then)."""

    def touch_sources(self, row: int) -> None:
        self._ver += 1
        self.sources_ver[row] = self._ver

    def code(self, text: str) -> int:
        """The code of a model or region name (-1 for a name never seen: matches no row)."""
        return self._codes.get(text, -1)

    def intern(self, text: str) -> int:
        """The code of a pool's model or region; UNINTERNED once MAX_CODES names were seen (those
        pools' rows never match a code, so selection asks the per-pool rule about them)."""
        code = self._codes.get(text)
        if code is None:
            if len(self._codes) >= MAX_CODES:
                return UNINTERNED
            code = self._codes[text] = len(self._codes)
        return code

    def alloc(self) -> int:
        if self._free:
            return self._free.pop()
        row = self._size
        if row == self.ids.size:
            for name in ("f", "i", "ids", "sources_ver", "kv_table", "kv_seen"):
                old = getattr(self, name)
                new = np.zeros((*old.shape[:-1], 2 * row), old.dtype)
                new[..., :row] = old
                setattr(self, name, new)
        self._size = row + 1
        return row

    def free(self, row: int) -> None:
        self.ids[row] = None
        self._free.append(row)

    def set_flag(self, row: int, bit: int, on: object) -> None:
        flags = int(self.i[FLAGS, row])
        self.i[FLAGS, row] = flags | bit if on else flags & ~bit


COLUMNS = PoolColumns()
"""The process's one column store (see PoolColumns)."""

_NAN = math.nan


def _w_pool_id(c: PoolColumns, r: int, s: PoolState, v: str) -> None:
    c.ids[r] = v


def _w_listed(c: PoolColumns, r: int, s: PoolState, v: bool) -> None:
    c.set_flag(r, LISTED, v)


def _w_ready(c: PoolColumns, r: int, s: PoolState, v: object) -> None:
    # Only the pool's own model matters: selection filters other models out before readiness.
    ready = getattr(s, "models_ready", None)
    c.set_flag(r, NOT_READY, ready and not ready.get(getattr(s, "model", ""), False))


def _w_model(c: PoolColumns, r: int, s: PoolState, v: str) -> None:
    c.i[MODEL, r] = c.intern(v)
    _w_ready(c, r, s, v)


def _w_region(c: PoolColumns, r: int, s: PoolState, v: str) -> None:
    c.i[REGION, r] = c.intern(v)


def _w_blocked(c: PoolColumns, r: int, s: PoolState, v: object) -> None:
    blocked = (
        getattr(s, "directory_draining", False)
        or getattr(s, "telemetry_draining", False)
        or not getattr(s, "frontends", ())
    )
    c.set_flag(r, BLOCKED, blocked)


def _w_slots(c: PoolColumns, r: int, s: PoolState, v: object) -> None:
    # Selector.throughput's slots: the stated ones, else the last load report's.
    cap = getattr(s, "capacity", None)
    slots = cap.max_running_requests if cap is not None else 0
    load = getattr(s, "load", None)
    if not slots and load is not None:
        slots = load.max_running_requests
    c.f[SLOTS, r] = slots


def _w_capacity(c: PoolColumns, r: int, s: PoolState, v: PoolCapacityHint) -> None:
    c.f[CAP_RATE, r] = v.prefill_tokens_per_second
    _w_slots(c, r, s, v)


def _w_block_size(c: PoolColumns, r: int, s: PoolState, v: int) -> None:
    c.i[BLOCK_SIZE, r] = v


def _w_load(c: PoolColumns, r: int, s: PoolState, v: LoadSignal | None) -> None:
    c.set_flag(r, LOAD_PRESENT, v is not None)
    if v is None:
        c.f[LOAD_PREFILL, r] = c.f[LOAD_DECODE, r] = 0.0
    else:
        c.f[LOAD_PREFILL, r] = v.prefill_tokens_in_flight
        c.f[LOAD_DECODE, r] = v.decode_tokens_in_flight
    _w_slots(c, r, s, v)


def _w_load_at(c: PoolColumns, r: int, s: PoolState, v: float | None) -> None:
    c.f[LOAD_AT, r] = _NAN if v is None else v


def _w_kv_at(c: PoolColumns, r: int, s: PoolState, v: float | None) -> None:
    c.f[KV_AT, r] = _NAN if v is None else v


def _w_state_at(c: PoolColumns, r: int, s: PoolState, v: float | None) -> None:
    c.f[STATE_AT, r] = _NAN if v is None else v


def _w_pend_prefill(c: PoolColumns, r: int, s: PoolState, v: int) -> None:
    c.f[PEND_PREFILL, r] = v


def _w_pend_decode(c: PoolColumns, r: int, s: PoolState, v: int) -> None:
    c.f[PEND_DECODE, r] = v


def _w_backoff(c: PoolColumns, r: int, s: PoolState, v: float) -> None:
    c.f[BACKOFF, r] = v


class SourceSet(set[str]):
    """PoolState.kv_sources: a set that tells PoolColumns when it changes (selection caches which
    KV tables each pool's sources name, and must see the telemetry ingest's add and discard)."""

    __slots__ = ("row",)

    def __init__(self, items: Iterable[str] = (), row: int = -1) -> None:
        super().__init__(items)
        self.row = row

    def _touched(self) -> None:
        if self.row >= 0:
            COLUMNS.touch_sources(self.row)


def _tracked(name: str) -> Callable[..., Any]:
    base = getattr(set, name)

    def method(self: SourceSet, *args: Any) -> Any:
        out = base(self, *args)
        self._touched()
        return out

    method.__name__ = name
    return method


for _name in (
    "add",
    "discard",
    "remove",
    "pop",
    "clear",
    "update",
    "difference_update",
    "intersection_update",
    "symmetric_difference_update",
    "__ior__",
    "__iand__",
    "__isub__",
    "__ixor__",
):
    setattr(SourceSet, _name, _tracked(_name))


def _w_sources(c: PoolColumns, r: int, s: PoolState, v: set[str]) -> None:
    if not (isinstance(v, SourceSet) and v.row == r):
        object.__setattr__(s, "kv_sources", SourceSet(v, r))
    c.touch_sources(r)


_WRITERS: dict[str, Callable[[PoolColumns, int, PoolState, Any], None]] = {
    "pool_id": _w_pool_id,
    "listed": _w_listed,
    "model": _w_model,
    "region": _w_region,
    "frontends": _w_blocked,
    "directory_draining": _w_blocked,
    "telemetry_draining": _w_blocked,
    "capacity": _w_capacity,
    "block_size": _w_block_size,
    "models_ready": _w_ready,
    "load": _w_load,
    "load_at": _w_load_at,
    "kv_at": _w_kv_at,
    "state_at": _w_state_at,
    "pending_prefill_tokens": _w_pend_prefill,
    "pending_decode_tokens": _w_pend_decode,
    "link_backoff_until": _w_backoff,
    "kv_sources": _w_sources,
}
"""Field -> how it writes through to its PoolColumns row (fields not named are not columns)."""


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
    lease_grace_until: float | None = None
    """Set while the pool is listed only by the lease grace (its leases lapsed in discovery, its
    telemetry is live here): the monotonic time the grace ends (pool_directory.PoolTable.lapse)."""
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
    row: int = field(default=-1, init=False, repr=False, compare=False)
    """This pool's row in COLUMNS (set on the first field write; read-only)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "row":
            return  # owned by the store (a copy must not share its original's row)
        object.__setattr__(self, name, value)
        write = _WRITERS.get(name)
        if write is not None:
            try:
                row = self.row
            except AttributeError:  # the first field __init__ sets
                row = COLUMNS.alloc()
                object.__setattr__(self, "row", row)
            write(COLUMNS, row, self, value)

    def __del__(self) -> None:
        try:
            row = self.row
        except AttributeError:
            return
        COLUMNS.free(row)

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

    def directory_state(self) -> str:
        """listed, lease_lapsed (listed only by the lease grace) or unlisted (router.v1.DirectoryState)."""
        if not self.listed:
            return "unlisted"
        return "listed" if self.lease_grace_until is None else "lease_lapsed"

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

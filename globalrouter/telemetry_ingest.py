"""TelemetryService: relay streams → per-stream KV sources in the KvIndex and signals in PoolState."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import grpc
import numpy as np

from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import FOLD_EVERY, PACED_FOLD_AT, KvSummary
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import LoadSignal
from globalrouter.snapshot_readers import SnapshotReaders
from meshkit.authz import Authorizer
from meshkit.clock import Clock
from meshkit.errors import Reason, abort_with_reason
from meshkit.limits import LimitExceeded, Oversized, Slots, add_sized_servicer, check_size
from meshkit.logs import get_logger
from meshkit.supervision import Supervisor
from meshkit.timeconv import duration, seconds, wall_seconds
from meshkit.validation import MAX_ID_LENGTH, Violations, check_identifier
from poolrelay.v1 import pool_events_pb2, telemetry_pb2, telemetry_pb2_grpc

log = get_logger(module="globalrouter.telemetry_ingest")

PROTOCOL_VERSION = 1
Request = telemetry_pb2.PublishPoolTelemetryRequest
Response = telemetry_pb2.PublishPoolTelemetryResponse
_DRAINING = (pool_events_pb2.DRAIN_STATE_DRAINING, pool_events_pb2.DRAIN_STATE_DRAINED)
_METHOD = "/poolrelay.v1.TelemetryService/PublishPoolTelemetry"
_NO_BLOCKS = np.empty(0, np.uint64)
LOG_TAIL = 4096
"""Stored-delta hashes a stream keeps as Python ints before packing them onto its block list."""
LOG_FLOOR = 65_536
"""A stream's block list is given up (its end then costs a pass over the table) once it holds more
than LOG_SLACK x max(the blocks the stream holds, LOG_FLOOR): stores of blocks later evicted pile
up on it, and this bounds that memory to a few times the stream's own set."""
LOG_SLACK = 4
STEP_SECONDS = 0.002
"""What one step of snapshot application or stream removal should take on the serving loop (CPU
time of the loop's thread): the blocks per step adapt to it (a block added costs 85 ns in a table
that fits the caches and several times that in one of tens of millions of slots)."""
MIN_STEP = 256
ADOPT_WITHIN = 10.0
"""Seconds within which another stream of the pool must have spoken for a new stream's first
snapshot to join that stream's set instead of being built (TelemetryIngest._adoptable): relays
write at least every report interval (1 s by default) or telemetry write interval (at most 5 s)."""
BUILD_FIRST_SECONDS = 0.012
"""CPU time the index worker may take per event-loop iteration while the frontend is not yet ready
(TelemetryServicer.builds_first): it serves nothing but health then (the probe port answers off
the loop), and its readiness waits on the builds, which at one STEP_SECONDS step a turn got about
a third of the loop beside 2,000 streams' messages in a restart (1,000 pools x 100,000 blocks:
every pool back 41.9 s)."""
SLICE_SECONDS = 0.002
"""Wall time one event-loop iteration may spend on telemetry messages before the rest wait for a
later iteration (IngestPacer): with 2,000 streams every iteration used to apply a message of each
(about 0.1 s at 1,000 pools), and a health check waits several iterations. 4 ms until the loop-lag
goal's runs at 1,000 pools: with 4 ms slices (and the rest of that change) the turns of over 10 ms
were as many as before it (BENCHMARKS.md, "Loop lag at 1,000 pools: the collector on a timer,
telemetry in 2 ms slices")."""


def validate_hello(hello: telemetry_pb2.TelemetryHello) -> Violations:
    """Every problem of a hello, each naming its field."""
    v = Violations()
    check_identifier(v, "hello.pool_id", hello.pool_id)
    check_identifier(v, "hello.relay_id", hello.relay_id)
    if hello.incarnation == 0:
        v.add("hello.incarnation", "must be > 0")
    if hello.protocol_version != PROTOCOL_VERSION:
        v.add(
            "hello.protocol_version",
            f"unsupported protocol version {hello.protocol_version}; this frontend speaks {PROTOCOL_VERSION}",
        )
    if hello.block_size == 0:
        v.add("hello.block_size", "must be > 0")
    if hello.hash_scheme != telemetry_pb2.HASH_SCHEME_XXH3_64_CHAINED_U32LE:
        v.add("hello.hash_scheme", "must be HASH_SCHEME_XXH3_64_CHAINED_U32LE")
    return v


MAX_BATCH = 256
"""Messages one TelemetryBatch may carry (a relay batches what queued for a stream in one write:
its few latest reports and up to its queue of deltas; the pacer applies a batch in one go)."""
BATCHABLE = frozenset({"kv_delta", "load", "readiness", "drain", "heartbeat"})
"""What a batch may carry: a hello only opens a stream, a snapshot chunk goes alone (its size is
the message limit's), and batches do not nest."""


def validate_batch(batch: telemetry_pb2.TelemetryBatch) -> Violations:
    """Every problem of a batch, each naming its field (the first bad inner message's kind is enough
    to refuse it; at most MAX_LISTED_VIOLATIONS are named)."""
    v = Violations()
    count = len(batch.messages)
    if count == 0:
        v.add("batch.messages", "a batch must carry at least one message")
    elif count > MAX_BATCH:
        v.add("batch.messages", f"{count} messages; a batch carries at most {MAX_BATCH}")
        return v  # not worth looking into each
    for i, inner in enumerate(batch.messages):
        kind = inner.WhichOneof("payload")
        if kind not in BATCHABLE:
            what = f"a {kind}" if kind else "a message without a payload"
            v.add(
                f"batch.messages[{i}]",
                f"{what} may not travel in a batch (only kv_delta, load, readiness, drain and heartbeat)",
            )
    return v


MAX_ADAPTERS_PER_MODEL = 256
"""LoRA adapters taken per model from a readiness report (outside input: a relay's report is bounded)."""


def reported_adapters(models: Iterable[pool_events_pb2.ModelStatus]) -> dict[str, frozenset[str]]:
    """Model -> LoRA adapters of a readiness report; names past the id length limit, and past
    MAX_ADAPTERS_PER_MODEL of one model, are left out."""
    out: dict[str, frozenset[str]] = {}
    for m in models:
        if m.adapters:
            names = [a for a in m.adapters[:MAX_ADAPTERS_PER_MODEL] if 0 < len(a) <= MAX_ID_LENGTH]
            out[m.model] = frozenset(names)
    return out


def load_signal(load: pool_events_pb2.PoolLoad) -> LoadSignal:
    """The selection's view of a relay's load report."""
    return LoadSignal(
        requests_waiting=load.requests_waiting,
        requests_running=load.requests_running,
        prefill_tokens_in_flight=load.prefill_tokens_in_flight,
        decode_tokens_in_flight=load.decode_tokens_in_flight,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_total=load.kv_blocks_total,
        max_running_requests=load.max_running_requests,
        max_waiting_requests=load.max_waiting_requests,
    )


@dataclass(slots=True)
class StreamState:
    """What one relay stream contributes: its own KV source and its place in the delta sequence."""

    source: str
    """The stream's current KvIndex source key ("" until its first snapshot is applied). Every
    snapshot is built under a fresh key while the previous set still answers, then swapped in."""
    pool_id: str
    relay_id: str
    incarnation: int
    block_size: int = 0
    """Tokens per block of this stream's hashes (its hello's)."""
    report_interval: float = 0.0
    """The longest gap between this stream's messages when all is well: its hello's report
    interval, or the batch interval asked in the hello ack when longer (0: none announced)."""
    next_sequence: int | None = None
    """The delta sequence expected next; None while waiting for a snapshot (deltas are ignored)."""
    snapshot_id: int | None = None
    snapshot_sequence: int = 0
    snapshot_chunks: list[np.ndarray] = field(default_factory=list)
    """The partial snapshot's chunks, packed (8 bytes a block), until its last chunk arrives."""
    snapshot_blocks: int = 0
    """Blocks in snapshot_chunks."""
    next_chunk: int = 0
    skipped_blocks: int = 0
    """Blocks of the partial snapshot not kept (skipping): another stream of the pool covers its set."""
    skipping: bool = False
    """The partial snapshot's chunks are counted, not kept (see TelemetryIngest._covered)."""
    awaiting: bool = False
    """Its whole snapshot was skipped while another stream's build of the pool's set was queued:
    it joins that set when the build is swapped in (_adopt_waiting), or is asked for a fresh
    snapshot at its next message if no build of the pool is left (the builder's stream ended)."""
    superseded: bool = False
    """A newer stream of the same (pool, relay) took over; this one's messages are ignored."""
    kv_applied: bool = False
    models_ready: dict[str, bool] | None = None
    """This stream's last readiness report (None: none yet). The pool's view combines its streams'."""
    adapters: dict[str, frozenset[str]] = field(default_factory=dict)
    """Model -> LoRA adapters, from this stream's last readiness report."""
    draining: bool = False
    """This stream's last drain report."""
    last_seen: float | None = None
    """Clock time of the stream's last message (None: none since its hello)."""
    building: _Build | None = None
    """A whole snapshot being applied a step at a time (None: none)."""
    backlog: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """Deltas that arrived while `building`, applied in order once it is swapped in."""
    held: int = 0
    """Blocks of this stream counted against the snapshot budgets (partial snapshot, snapshot
    being applied, backlog)."""
    log: list[np.ndarray] | None = field(default_factory=list)
    """Every block ever added to `source` (a superset of its set), so that removing the source
    touches only these; None once given up (then removal is a pass over the table)."""
    log_tail: list[int] = field(default_factory=list)
    log_blocks: int = 0
    end: Callable[[], None] | None = None
    """Ends the stream's call now (set by the servicer while the call runs): a superseded stream
    must not wait for its next message to go."""


@dataclass(slots=True)
class _Build:
    """A complete snapshot applied in bounded steps under `source`, swapped in when done."""

    stream: StreamState
    source: str
    parts: list[np.ndarray]
    """Not yet applied (first one partly: from `offset`)."""
    blocks: int
    """Blocks not yet applied."""
    offset: int = 0
    done: list[np.ndarray] = field(default_factory=list)
    """Applied slices: the new source's block list."""
    begun: bool = False
    """The summary's table for it is allocated (at its first step, not when its last chunk
    arrives: a build adopted before it starts never touches memory)."""
    total: int = 0
    """Blocks of the whole snapshot (the summary's table is sized for them)."""


@dataclass(slots=True)
class _Drop:
    """A source leaving the index: its own blocks removed in bounded steps, then the source."""

    source: str
    parts: list[np.ndarray] | None
    """Its blocks (None: unknown, one pass over the table)."""
    offset: int = 0


class IngestPacer:
    """Bounds the telemetry work of each event-loop iteration so that other calls (a health check,
    a Route, a Generate) are served between slices: a health check then waits a few slices of
    SLICE_SECONDS, not a pass over every stream's message.

    A message is applied at once while the current iteration's ingest has run for less than
    `slice_seconds` (wall time since its first message in this iteration) and none is waiting;
    otherwise it waits, in arrival order, for one task that applies the waiting ones a slice per
    iteration. A stream whose message waits reads no further one, so gRPC's flow control holds its
    relay back (which then sends fewer, larger deltas) instead of this loop falling behind unseen.
    Waiting is bounded: at most one message per open stream.

    Pacing keeps the main port's calls (a health check too: gRPC's asyncio server takes every call
    through this loop) prompt; probes that must answer whatever the loop does go to the probe
    port instead (globalrouter.health_probe: its own threads, ready only while this loop ticks;
    docs/operations.md, "Health under load").

    Measured on and off (BENCHMARKS.md, "The pacer measured again"): 2-11 us of CPU a message, and
    in snapshot storms the first load ready sooner and a restart's slowest health check 2 to 5
    times shorter; no consistent difference in the steady state."""

    def __init__(
        self,
        apply: Callable[[StreamState, Request], Response | None],
        slice_seconds: float = SLICE_SECONDS,
        now: Callable[[], float] = time.perf_counter,
        *,
        due: Callable[[], bool] | None = None,
        work: Callable[[], None] | None = None,
        pending: Callable[[], bool] | None = None,
        within: float = 0.0,
    ) -> None:
        if not slice_seconds > 0:
            raise ValueError(f"slice_seconds must be > 0 (got {slice_seconds})")
        if (due is None) != (work is None):
            raise ValueError("due and work go together")
        if pending is not None and (work is None or not within > 0):
            raise ValueError("pending needs work and within > 0 seconds")
        self._apply = apply
        self._due = due
        self._work = work
        """Work the messages leave behind (the summary's fold: `due` says when), done first thing in
        a slice of its own: once it is due, later messages wait for that slice instead of being
        applied in the current one, so the work never comes on top of a slice already spent."""
        self._pending = pending
        """Whether the messages left work that is not due yet (the summary's logged deltas): it is
        then done `within` seconds after the message that left it, in a loop callback of its own,
        so nothing waits for the next message or for the work to come due. It is counted in that
        turn's slice, or waits for the next turn's when the messages spent this one's."""
        self._within = within
        self._later: asyncio.TimerHandle | None = None
        """The scheduled `_late_work`, while one is."""
        self.works = 0
        """Times the pacer did `work`."""
        self.slice_seconds = slice_seconds
        self._now = now
        self._start = 0.0
        self._open = False
        self._queue: deque[tuple[StreamState, Request, asyncio.Future[Response | None]]] = deque()
        self._worker: asyncio.Task[None] | None = None
        self.deferred = 0
        """Messages that waited for a later iteration (a busy loop's sign; a metric)."""
        self.slices = 0
        """Slices the waiting task ran."""

    @property
    def waiting(self) -> int:
        """Messages waiting for a later iteration."""
        return len(self._queue)

    def _begin(self) -> None:
        # The first telemetry work of an iteration opens its slice; a callback that runs in the
        # next iteration closes it (asyncio runs callbacks scheduled now only in the next one).
        if not self._open:
            self._open = True
            self._start = self._now()
            asyncio.get_running_loop().call_soon(self._close)

    def _close(self) -> None:
        self._open = False

    def _work_later(self) -> None:
        # Called while no _late_work is scheduled: schedules one `within` seconds on if there is work.
        assert self._pending is not None
        if self._pending():
            self._later = asyncio.get_running_loop().call_later(self._within, self._late_work)

    def _late_work(self) -> None:
        self._later = None
        if self._pending is None or self._work is None or not self._pending():
            return
        self._begin()
        if self._now() - self._start >= self.slice_seconds:
            # This iteration's telemetry slice is spent: the work takes a slice of the next one
            # (on top of a spent slice it made the loop's longest turns).
            self._later = asyncio.get_running_loop().call_later(0, self._late_work)
            return
        self._work()  # counted in this slice: messages after it in this iteration wait if it spent it
        self.works += 1

    def _owed(self) -> bool:
        # The work is due: messages wait for the slice it opens.
        return self._due is not None and self._due()

    async def submit(self, stream: StreamState, msg: Request) -> Response | None:
        """Applies `msg` now or in a later iteration; its answer, or what applying it raised."""
        self._begin()
        if not self._queue and self._now() - self._start < self.slice_seconds and not self._owed():
            out = self._apply(stream, msg)
            if self._later is None and self._pending is not None:
                self._work_later()
            return out
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Response | None] = loop.create_future()
        self._queue.append((stream, msg, waiter))
        self.deferred += 1
        if self._worker is None:
            self._worker = loop.create_task(self._drain(), name="telemetry-ingest-slices")
        return await waiter

    async def _drain(self) -> None:
        queue = self._queue
        try:
            while queue:
                await asyncio.sleep(0)  # the next iteration: what waited for the loop runs first
                self._begin()
                self.slices += 1
                if self._work is not None and self._owed():
                    self._work()  # counted in this slice: its messages get what is left
                    self.works += 1
                first = True  # at least one message a slice, so waiting ones always move on
                while queue and (
                    first or (self._now() - self._start < self.slice_seconds and not self._owed())
                ):
                    stream, msg, waiter = queue.popleft()
                    if waiter.done():
                        continue  # its call was cancelled (stream ended or replaced)
                    first = False
                    try:
                        waiter.set_result(self._apply(stream, msg))
                    except Exception as exc:  # the stream's own call raises it (StreamRejected, a bug)
                        waiter.set_exception(exc)
                if self._later is None and self._pending is not None:
                    self._work_later()
        finally:
            self._worker = None
            for _, _, waiter in queue:  # only when cancelled (the loop is closing): nobody waits any more
                waiter.cancel()
            queue.clear()


class StreamRejected(Exception):
    """The stream must end with `code`, the ErrorInfo `reason` and `message`."""

    def __init__(
        self, code: grpc.StatusCode, reason: Reason, message: str, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata = dict(metadata or {})


class TelemetryIngest:
    """The pure ingestion rules (no gRPC): one method per message kind; returns what to answer.

    Heavy index work (applying a whole snapshot, removing a leaving stream's blocks) is queued and
    done a `step` at a time (about STEP_SECONDS, at most `step_blocks` blocks), so the serving loop
    that runs the steps between other work is never held long. With `step_blocks=0` every call
    finishes its work before returning (the pure tests and tools that have no loop)."""

    def __init__(
        self,
        table: PoolTable,
        index,
        clock: Clock,
        metrics: RouterMetrics,
        *,
        max_snapshot_blocks: int = 4_194_304,
        max_snapshot_blocks_per_relay: int = 8_388_608,
        max_snapshot_blocks_total: int = 268_435_456,
        step_blocks: int = 0,
    ) -> None:
        self.max_snapshot_blocks = max_snapshot_blocks
        self.max_snapshot_blocks_per_relay = max_snapshot_blocks_per_relay
        self.max_snapshot_blocks_total = max_snapshot_blocks_total
        self.step_blocks = step_blocks
        self._table = table
        self._index = index
        self._summary = index if isinstance(index, KvSummary) else None
        """The KV state as per-pool tables (`--kv-state summary`): a snapshot is built in a table
        of its own and swapped in (begin/commit), a pool's table is sized from its load reports'
        kv_blocks_total, and streams keep no block logs (a pool's table goes with its last source
        at once, not block by block)."""
        self._clock = clock
        self._metrics = metrics
        self._ids = itertools.count(1)
        self.streams: dict[tuple[str, str], StreamState] = {}
        """(pool_id, relay_id) -> the stream that currently speaks for that relay replica."""
        self._by_pool: dict[str, dict[str, StreamState]] = {}
        """pool_id -> relay_id -> stream: a pool's readiness and drain combine these streams' reports."""
        self.snapshot_blocks_held = 0
        """Blocks of every stream counted against the snapshot budgets (StreamState.held)."""
        self.held_by_relay: dict[tuple[str, str], int] = {}
        """(pool_id, relay_id) -> its streams' held blocks. The relay identity a stream may speak
        for is its hello's (pool, relay) (the authorizer checks it), so this is per identity."""
        self._work: deque[_Build | _Drop] = deque()
        self._step_size = max(MIN_STEP, step_blocks)
        """Blocks the next `step` does: halved after a step over STEP_SECONDS, doubled (up to
        step_blocks) after one under half of it."""
        self.stopping = False
        """Set on stop: leaving streams' blocks are not removed from an index about to go."""
        self.snapshots_adopted = 0
        """Snapshots not built: their stream joined the set its pool's summary already held."""

    def stop(self) -> None:
        """The process is stopping: queued index work is dropped and leaving streams queue none
        (the index goes with the process; its last seconds are for in-flight calls)."""
        self.stopping = True
        for job in self._work:
            if isinstance(job, _Build):
                job.stream.building = None
        self._work.clear()

    @property
    def index(self) -> KvIndex | KvSummary:
        """The KV state this ingest feeds (the servicer paces the summary's folds)."""
        return self._index

    def last_heard(self, pool_id: str) -> float | None:
        """Clock time of the latest message on the pool's open streams (None: none yet, or no
        stream): the lease grace's evidence that the pool's relay is alive (PoolTable.lapse)."""
        heard = [s.last_seen for s in self._by_pool.get(pool_id, {}).values() if s.last_seen is not None]
        return max(heard, default=None)

    def report_interval(self, pool_id: str) -> float:
        """The longest report interval the pool's open streams announce (0: none), for the lease
        grace's liveness bound (PoolTable.live_within_for)."""
        return max((s.report_interval for s in self._by_pool.get(pool_id, {}).values()), default=0.0)

    # ---- stream life cycle ------------------------------------------------------------------
    def open(self, hello: telemetry_pb2.TelemetryHello) -> StreamState:
        """Accepts a hello (already validated) or raises StreamRejected."""
        key = (hello.pool_id, hello.relay_id)
        listed = self._table.lease_incarnation(hello.pool_id, hello.relay_id)
        if listed > hello.incarnation:
            raise StreamRejected(
                grpc.StatusCode.PERMISSION_DENIED,
                Reason.TELEMETRY_STALE_INCARNATION,
                f"relay {hello.relay_id!r} of pool {hello.pool_id!r} is listed under a newer incarnation "
                f"({listed} > {hello.incarnation})",
            )
        old = self.streams.get(key)
        if old is not None and old.incarnation > hello.incarnation:
            raise StreamRejected(
                grpc.StatusCode.PERMISSION_DENIED,
                Reason.TELEMETRY_STALE_INCARNATION,
                f"relay {hello.relay_id!r} of pool {hello.pool_id!r} already streams under a newer "
                f"incarnation ({old.incarnation} > {hello.incarnation})",
            )
        # Hashes of different block sizes never match: one relay with another size would zero
        # the pool's cache view (and a pool's hashes are computed with one size per pool).
        for relay_id, other in self._by_pool.get(hello.pool_id, {}).items():
            if relay_id != hello.relay_id and other.block_size != hello.block_size:
                raise StreamRejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    Reason.TELEMETRY_BLOCK_SIZE_MISMATCH,
                    f"hello.block_size: {hello.block_size} differs from the {other.block_size} "
                    f"of pool {hello.pool_id!r}'s live stream from relay {relay_id!r}",
                    {"field": "hello.block_size", "pool_block_size": str(other.block_size)},
                )
        if old is not None:
            # A reconnect or a restarted relay: the new stream replaces the old one's state, and
            # the old stream ends now (silent, it would otherwise hold its call until it spoke).
            self._release(old)
            old.superseded = True
            if old.end is not None:
                old.end()
        stream = StreamState(
            source="",
            pool_id=hello.pool_id,
            relay_id=hello.relay_id,
            incarnation=hello.incarnation,
            block_size=hello.block_size,
            # Outside input: a negative or unset interval is none (PoolTable bounds the rest).
            report_interval=max(seconds(hello.report_interval), 0.0),
        )
        self.streams[key] = stream
        self._by_pool.setdefault(hello.pool_id, {})[hello.relay_id] = stream
        self._table.stream_counts[hello.pool_id] = self._table.stream_counts.get(hello.pool_id, 0) + 1
        pool = self._table.get(hello.pool_id)
        pool.block_size = hello.block_size  # equal to the other live streams' (checked above)
        if not pool.listed:  # what the relay says until discovery says otherwise
            pool.model = hello.model or pool.model
            pool.region = hello.region or pool.region
        self._settle()
        return stream

    def close(self, stream: StreamState) -> None:
        """The stream ended: only its own state goes."""
        if stream.superseded:
            return
        self._release(stream)
        stream.superseded = True
        if self.streams.get((stream.pool_id, stream.relay_id)) is stream:
            del self.streams[(stream.pool_id, stream.relay_id)]
            pool_streams = self._by_pool.get(stream.pool_id, {})
            pool_streams.pop(stream.relay_id, None)
            if not pool_streams:
                self._by_pool.pop(stream.pool_id, None)
            elif stream.pool_id in self._table.pools:
                self._combine_state(self._table.get(stream.pool_id))
        self._settle()

    def _release(self, stream: StreamState) -> None:
        self._drop_snapshot(stream)
        self._cancel_build(stream)
        self._unhold(stream, stream.held)
        stream.backlog = []
        pool = self._table.pools.get(stream.pool_id)
        if stream.source:
            if pool is not None:
                pool.kv_sources.discard(stream.source)
            self._drop(stream.source, stream)
            stream.source = ""
        count = self._table.stream_counts.get(stream.pool_id, 1) - 1
        if count > 0:
            self._table.stream_counts[stream.pool_id] = count
        else:
            self._table.stream_counts.pop(stream.pool_id, None)
        if pool is None:
            return
        if count <= 0:
            # The last stream of the pool is gone: its signals are unknown now, not zero.
            pool.load = None
            pool.load_at = None
            pool.kv_at = None
            pool.state_at = None
            pool.models_ready = {}
            pool.telemetry_draining = False
            pool.block_size = 0
            self._table.forget_if_unused(stream.pool_id)

    # ---- snapshot budgets -------------------------------------------------------------------
    def _hold(self, stream: StreamState, blocks: int, what: str) -> None:
        """Counts `blocks` more of the stream's against the budgets, or raises StreamRejected
        (RESOURCE_EXHAUSTED, LIMIT_EXCEEDED, ErrorInfo metadata `limit` naming the bound)."""
        if not blocks:
            return
        key = (stream.pool_id, stream.relay_id)
        relay = self.held_by_relay.get(key, 0) + blocks
        if relay > self.max_snapshot_blocks_per_relay:
            raise self._over(
                "max_snapshot_blocks_per_relay",
                f"{what}: relay {stream.relay_id!r} of pool {stream.pool_id!r} would hold {relay} "
                f"snapshot blocks not yet applied, over {self.max_snapshot_blocks_per_relay}",
            )
        total = self.snapshot_blocks_held + blocks
        if total > self.max_snapshot_blocks_total:
            raise self._over(
                "max_snapshot_blocks_total",
                f"{what}: telemetry streams would hold {total} snapshot blocks not yet applied, "
                f"over this frontend's {self.max_snapshot_blocks_total}",
            )
        self.held_by_relay[key] = relay
        self.snapshot_blocks_held = total
        stream.held += blocks

    def _unhold(self, stream: StreamState, blocks: int) -> None:
        if not blocks:
            return
        key = (stream.pool_id, stream.relay_id)
        left = self.held_by_relay.get(key, 0) - blocks
        if left > 0:
            self.held_by_relay[key] = left
        else:
            self.held_by_relay.pop(key, None)
        self.snapshot_blocks_held -= blocks
        stream.held -= blocks

    def _over(self, limit: str, message: str) -> StreamRejected:
        return StreamRejected(
            grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.LIMIT_EXCEEDED, message, {"limit": limit}
        )

    def _drop_snapshot(self, stream: StreamState) -> None:
        """Forgets the stream's partial snapshot (and gives its blocks back to the budgets)."""
        self._unhold(stream, stream.snapshot_blocks)
        stream.snapshot_chunks = []
        stream.snapshot_blocks = 0
        stream.snapshot_id = None
        stream.skipped_blocks = 0
        stream.skipping = False

    # ---- bounded index work -----------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether index work is queued (`run` does it), a summary table's growth included."""
        return bool(self._work) or (self._summary is not None and self._summary.growing())

    def run(self, budget: int) -> bool:
        """Does up to about `budget` blocks of queued index work (all of it when budget <= 0);
        returns whether work is left."""
        if self.stopping:
            self.stop()  # chunks that arrived since: no index work for an index about to go
            return False
        work = self._work
        left = budget if budget > 0 else -1
        while work and left != 0:
            job = work[0]
            used, finished = self._step(job, left)
            if finished:
                work.popleft()
            if left > 0:
                left = max(0, left - max(used, 1))
        summary = self._summary
        if summary is not None and left != 0 and summary.growing():
            # A pool table doubling (deltas overfilled it) moves a slice of rows a step.
            return summary.grow_step(max(left, 0)) or bool(work)
        return bool(work)

    def step(self) -> bool:
        """One step of queued work, sized to take about STEP_SECONDS; returns whether work is left."""
        size = self._step_size
        # This thread's CPU time, not the wall's: on a loaded machine the process is preempted
        # mid-step, a step's wall time passes STEP_SECONDS whatever its size, and the steps shrink
        # to MIN_STEP blocks, one per loop iteration (test_ingest_steps): a snapshot storm is then
        # applied slowest exactly when the machine is busiest.
        start = time.thread_time()
        more = self.run(size)
        took = time.thread_time() - start
        if took > STEP_SECONDS:
            self._step_size = max(MIN_STEP, size // 2)
        elif took < STEP_SECONDS / 2 and more:
            self._step_size = min(max(MIN_STEP, self.step_blocks), size * 2)
        return more

    def _settle(self) -> None:
        """Without a stepping loop (step_blocks 0), work is done at once."""
        if self.step_blocks <= 0 and self._work:
            self.run(0)

    def _step(self, job: _Build | _Drop, budget: int) -> tuple[int, bool]:
        if isinstance(job, _Drop):
            parts = job.parts
            if parts is None:  # the source's blocks are not known: one pass over the table
                self._index.drop_source(job.source)
                return 0, True
            if parts:
                used = self._index_slice(parts, job, budget, self._index.remove_blocks, job.source)
                if parts:
                    return used, False
            else:
                used = 0
            self._index.drop_source(job.source)  # holds nothing any more: no pass over the table
            return used, True
        stream = job.stream
        if self._summary is not None and not job.begun:
            job.begun = True
            self._summary.begin_snapshot(job.source, job.total, stream.pool_id)
        if job.parts:
            done = job.done if self._summary is None else None
            used = self._index_slice(job.parts, job, budget, self._index.add_blocks, job.source, done)
            self._unhold(stream, used)
            job.blocks -= used
            if job.parts:
                return used, False
        else:
            used = 0
        if self._summary is not None:
            # What the build's steps left for later is placed in steps too, not in the commit.
            if budget > 0 and used >= budget:
                return used, False
            settled = self._summary.settle_build(job.source, budget - used if budget > 0 else 0)
            if settled:
                return used + settled, False
        self._swap_in(job)
        return used, True

    def _index_slice(self, parts, job, budget: int, apply, source: str, done=None) -> int:
        """Applies up to `budget` blocks from the front of `parts` (consumed as it goes)."""
        head = parts[0]
        end = head.size if budget < 0 else min(head.size, job.offset + budget)
        piece = head[job.offset : end]
        apply(source, piece)
        if done is not None:
            done.append(piece)
        if end == head.size:
            parts.pop(0)
            job.offset = 0
        else:
            job.offset = end
        return int(piece.size)

    def _swap_in(self, job: _Build) -> None:
        """The whole snapshot is in the index under its own key: it replaces the stream's set."""
        stream = job.stream
        stream.building = None
        pool = self._table.get(stream.pool_id)
        if self._summary is not None:
            self._summary.commit_snapshot(job.source)  # before the old source leaves: the pool keeps a set
        if stream.source:
            pool.kv_sources.discard(stream.source)
            self._drop(stream.source, stream)
        stream.source = job.source
        stream.log = job.done if self._summary is None else None
        stream.log_tail = []
        stream.log_blocks = sum(int(p.size) for p in job.done)
        stream.kv_applied = True
        pool.kv_sources.add(stream.source)
        pool.kv_at = self._clock.monotonic()
        backlog, stream.backlog = stream.backlog, []
        for stored, removed in backlog:
            self._unhold(stream, len(stored) + len(removed))
            self._apply_delta(stream, stored, removed)
        if self._summary is not None:
            self._adopt_waiting(stream.pool_id)

    def _adoptable(self, stream: StreamState) -> bool:
        """Whether the stream's first snapshot need not be built: with the per-pool summary, a pool
        has one set, which one of its streams feeds (the replicas of a pool's relay carry the same
        set: the summary takes no other's deltas). A stream with no set of its own yet (a fresh
        connection, so not the feeder, whose lost deltas a rebuild must make up for) joins the set
        another live stream of its pool already holds instead of building it again: after a mass
        redial or a restart every pool's set was built twice, the second build replacing the first
        with the same blocks (half of the storm's index work on the serving loop)."""
        if self._summary is None or stream.source:
            return False
        # The set joined must be kept current: by a stream that spoke lately (a silent one may be
        # stuck; then the new stream's snapshot is built and the new stream feeds the set).
        since = self._clock.monotonic() - ADOPT_WITHIN
        return any(
            o is not stream
            and not o.superseded
            and o.source
            and o.last_seen is not None
            and o.last_seen >= since
            for o in self._by_pool.get(stream.pool_id, {}).values()
        )

    def _adopt(self, stream: StreamState) -> None:
        """The stream joins its pool's set as a source (see _adoptable): its snapshot is dropped
        unbuilt, and deltas that waited behind a build of it go too (the summary follows the
        pool's feeder, not this stream, while the feeder is live)."""
        assert self._summary is not None
        self._cancel_build(stream)
        self._drop_snapshot(stream)
        for stored, removed in stream.backlog:
            self._unhold(stream, len(stored) + len(removed))
        stream.backlog = []
        source = f"{stream.pool_id}/{stream.relay_id}/{stream.incarnation}#{next(self._ids)}"
        # An empty delta makes `source` a source of its pool (a member, the feeder only when the
        # pool has none): what commit_snapshot does, without a table to build.
        self._summary.apply_delta(source, (), ())
        stream.source = source
        stream.log = None
        stream.kv_applied = True
        stream.awaiting = False
        pool = self._table.get(stream.pool_id)
        pool.kv_sources.add(source)
        pool.kv_at = self._clock.monotonic()
        self.snapshots_adopted += 1

    def _building(self, stream: StreamState) -> bool:
        """Whether another live stream of the stream's pool has a whole snapshot queued for a build."""
        return any(
            o is not stream and not o.superseded and o.building is not None
            for o in self._by_pool.get(stream.pool_id, {}).values()
        )

    def _covered(self, stream: StreamState) -> bool:
        """Whether the stream's snapshot need not be kept: with the per-pool summary, a stream with
        no set of its own whose pool's set another live stream already holds (_adoptable) or has
        queued whole for a build. Its chunks are then counted, not kept (after a restart or a mass
        redial both replicas of every pool send their snapshot at once: the second was converted,
        held against the budgets and given a table, only to be adopted unbuilt). Never for a
        snapshot another stream is itself still receiving: two streams would skip each other's."""
        if self._summary is None or stream.source:
            return False
        return self._building(stream) or self._adoptable(stream)

    def _adopt_waiting(self, pool_id: str) -> None:
        """A pool's set was just swapped in: its other streams whose first snapshot is still queued
        for a build, or was skipped for this one (awaiting), join it instead."""
        for other in list(self._by_pool.get(pool_id, {}).values()):
            if (
                (other.building is not None or other.awaiting)
                and not other.superseded
                and self._adoptable(other)
            ):
                self._adopt(other)

    def _drop(self, source: str, stream: StreamState) -> None:
        """Queues the source's removal (from its own block list when the stream kept one)."""
        if self.stopping:
            return  # the index goes with the process: no work for the last seconds
        parts = stream.log
        if parts is not None and stream.log_tail:
            parts = [*parts, np.fromiter(stream.log_tail, np.uint64, len(stream.log_tail))]
        self._work.append(_Drop(source, parts))
        stream.log, stream.log_tail, stream.log_blocks = [], [], 0

    def _cancel_build(self, stream: StreamState) -> None:
        job = stream.building
        if job is None:
            return
        stream.building = None
        self._unhold(stream, job.blocks)
        job.parts, job.blocks = [], 0
        try:
            self._work.remove(job)
        except ValueError:
            pass
        if self.stopping:
            return  # as in _drop: no work for an index about to go
        if job.done:
            self._work.append(_Drop(job.source, job.done))
        else:
            self._index.drop_source(job.source)  # never touched: O(1)

    # ---- messages ---------------------------------------------------------------------------
    def receive(self, stream: StreamState, msg: Request) -> Response | None:
        """Applies one message (a batch: each of its messages in order, as if each had come alone;
        it must have passed validate_batch); returns a SnapshotRequest to send back, or None."""
        if stream.superseded:
            return None
        if stream.awaiting and not self._building(stream) and msg.WhichOneof("payload") != "kv_snapshot":
            # The build its skipped snapshot waited for is gone (its stream ended or was replaced
            # before the swap): it joins the pool's set if one is live, else its relay is asked for
            # a fresh snapshot (relays answer SnapshotRequest); then the message as usual.
            stream.awaiting = False
            if self._adoptable(stream):
                self._adopt(stream)
                return self.receive(stream, msg)
            asked = self._ask_snapshot(stream, "the build this stream's skipped snapshot waited for is gone")
            return self.receive(stream, msg) or asked
        if msg.WhichOneof("payload") == "batch":
            # At most one answer per batch: only a delta's gap asks for a snapshot, and the deltas
            # after it are ignored until a snapshot comes, which never travels in a batch.
            answer = None
            for inner in msg.batch.messages:
                answer = self.receive(stream, inner) or answer
            return answer
        now = self._clock.monotonic()
        stream.last_seen = now
        pool = self._table.get(stream.pool_id)
        kind = msg.WhichOneof("payload")
        if stream.kv_applied:
            pool.kv_at = now  # any message proves the stream, and so its in-order KV set, is live
        if kind == "kv_delta":
            return self._delta(stream, msg.kv_delta, now)
        if kind == "kv_snapshot":
            answer = self._snapshot_chunk(stream, msg.kv_snapshot, now)
            self._settle()
            return answer
        if kind == "load":
            pool.record_load(load_signal(msg.load.load), now)
            if self._summary is not None and msg.load.load.kv_blocks_total:
                # Sized before deltas fill it: a table that doubles loses a fingerprint bit.
                # No snapshot may pass max_snapshot_blocks: neither may a table's size.
                self._summary.expect_pool(
                    stream.pool_id, min(msg.load.load.kv_blocks_total, self.max_snapshot_blocks)
                )
            if msg.load.HasField("observe_time"):
                self._lag(wall_seconds(msg.load.observe_time))
        elif kind == "readiness":
            ready = {m.model: m.state == pool_events_pb2.MODEL_STATE_READY for m in msg.readiness.models}
            adapters = reported_adapters(msg.readiness.models)
            # Relays repeat their reports every interval: the pool's combined view is rebuilt only
            # when this stream's report changed (4,000 rebuilds a second at 1,000 pools, 3% of the loop).
            if ready != stream.models_ready or adapters != stream.adapters:
                stream.models_ready = ready
                stream.adapters = adapters
                self._combine_state(pool)
            pool.state_at = now
        elif kind == "drain":
            draining = msg.drain.drain.state in _DRAINING
            if draining != stream.draining:
                stream.draining = draining
                self._combine_state(pool)
            pool.state_at = now
        elif kind == "heartbeat":
            if msg.heartbeat.HasField("send_time"):
                self._lag(wall_seconds(msg.heartbeat.send_time))
        elif kind == "hello":
            raise StreamRejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                Reason.TELEMETRY_PROTOCOL,
                "hello may only be the first message",
            )
        return None

    def _combine_state(self, pool) -> None:
        """The pool's readiness and drain from its live streams' own reports, so one replica's
        report never overwrites another's: a model is ready when a stream reports it ready, and
        the pool is draining when any stream reports a drain."""
        streams = [s for s in self._by_pool.get(pool.pool_id, {}).values() if not s.superseded]
        ready: dict[str, bool] = {}
        for s in streams:
            for model, is_ready in (s.models_ready or {}).items():
                ready[model] = ready.get(model, False) or is_ready
        pool.models_ready = ready
        adapters: dict[str, frozenset[str]] = {}
        for s in streams:
            for model, names in s.adapters.items():
                adapters[model] = adapters.get(model, frozenset()) | names
        pool.adapters = adapters
        pool.telemetry_draining = any(s.draining for s in streams)

    def _lag(self, sent_wall: float) -> None:
        self._metrics.telemetry_lag.observe(max(0.0, self._clock.wall() - sent_wall))

    def _snapshot_chunk(
        self, stream: StreamState, chunk: telemetry_pb2.KvSnapshot, now: float
    ) -> Response | None:
        if chunk.chunk_index == 0:
            self._drop_snapshot(stream)
            stream.awaiting = False
            stream.snapshot_id = chunk.snapshot_id
            stream.snapshot_sequence = chunk.sequence
            stream.next_chunk = 0
        if stream.snapshot_id != chunk.snapshot_id or chunk.chunk_index != stream.next_chunk:
            expected = stream.next_chunk
            self._drop_snapshot(stream)
            return self._ask_snapshot(
                stream,
                f"snapshot chunk out of order: expected chunk {expected}, "
                f"got {chunk.chunk_index} of snapshot {chunk.snapshot_id}",
            )
        hashes = chunk.block_hashes
        size = len(hashes)
        if stream.snapshot_blocks + stream.skipped_blocks + size > self.max_snapshot_blocks:
            # Chunks that never end would grow this stream without bound: a relay's whole pool
            # fits, anything larger is refused and the stream's partial snapshot dropped.
            self._drop_snapshot(stream)
            raise self._over(
                "max_snapshot_blocks",
                f"kv_snapshot.block_hashes: snapshot {chunk.snapshot_id} exceeds {self.max_snapshot_blocks} blocks",
            )
        if not stream.skipping and self._covered(stream):
            # From here on this snapshot is counted, not kept: what it holds so far goes too.
            stream.skipping = True
            stream.skipped_blocks += stream.snapshot_blocks
            self._unhold(stream, stream.snapshot_blocks)
            stream.snapshot_chunks = []
            stream.snapshot_blocks = 0
        if stream.skipping:
            stream.skipped_blocks += size
            size = 0
        try:
            self._hold(stream, size, "kv_snapshot.block_hashes")
        except StreamRejected:
            self._drop_snapshot(stream)
            raise
        if size:
            # Packed as it arrives: 8 bytes a block instead of a Python int's 36. np.array takes
            # upb's repeated field through its __array__ in one copy (6 us a 16,384-hash chunk);
            # np.fromiter made a Python int of each hash (2.9 ms a chunk, on the serving loop).
            stream.snapshot_chunks.append(np.array(hashes, np.uint64))
            stream.snapshot_blocks += size
        stream.next_chunk += 1
        if not chunk.last:
            return None
        if self._adoptable(stream):
            self._adopt(stream)
            stream.next_sequence = stream.snapshot_sequence + 1
            return None
        if stream.skipping:
            skipped = stream.skipped_blocks
            self._drop_snapshot(stream)
            if not self._building(stream):  # the build it was skipped for is gone: a fresh one
                return self._ask_snapshot(
                    stream,
                    f"snapshot {chunk.snapshot_id} ({skipped} blocks) was skipped for a build that is gone",
                )
            stream.awaiting = True  # joins the set being built when it is swapped in
            stream.next_sequence = stream.snapshot_sequence + 1
            return None
        # The whole snapshot arrived: it is built under a key of its own, a step at a time, and
        # replaces this stream's set in one swap once complete (until then the old set answers).
        self._cancel_build(stream)
        job = _Build(
            stream,
            f"{stream.pool_id}/{stream.relay_id}/{stream.incarnation}#{next(self._ids)}",
            stream.snapshot_chunks,
            stream.snapshot_blocks,
        )
        stream.snapshot_chunks = []
        stream.snapshot_blocks = 0  # still held: by the build now, until applied
        stream.snapshot_id = None
        for stored, removed in stream.backlog:  # deltas before this snapshot are in it
            self._unhold(stream, len(stored) + len(removed))
        stream.backlog = []
        stream.building = job
        job.total = job.blocks
        self._work.append(job)
        stream.next_sequence = stream.snapshot_sequence + 1
        return None

    def _delta(self, stream: StreamState, delta: telemetry_pb2.KvDelta, now: float) -> Response | None:
        if stream.next_sequence is None:
            return None  # waiting for a snapshot: deltas cannot be placed
        if delta.sequence != stream.next_sequence:
            return self._ask_snapshot(stream, f"gap: expected {stream.next_sequence}, got {delta.sequence}")
        stream.next_sequence += 1
        if stream.awaiting:
            return None  # the set it will join follows its builder's deltas (as an adopted stream's)
        if stream.building is not None:
            # The snapshot they follow is still being applied: they wait (counted) behind it.
            stored, removed = list(delta.stored), list(delta.removed)
            self._hold(stream, len(stored) + len(removed), "kv_delta")
            stream.backlog.append((stored, removed))
            return None
        self._apply_delta(stream, delta.stored, delta.removed)
        return None

    def _apply_delta(self, stream: StreamState, stored, removed) -> None:
        self._index.apply_delta(stream.source, stored, removed)
        if stream.log is None or not stored:
            return
        tail = stream.log_tail
        tail.extend(stored)
        if len(tail) >= LOG_TAIL:
            stream.log.append(np.fromiter(tail, np.uint64, len(tail)))
            stream.log_blocks += len(tail)
            stream.log_tail = []
            if (
                stream.log_blocks > LOG_SLACK * LOG_FLOOR
                and stream.log_blocks > LOG_SLACK * self._index.block_count(stream.source)
            ):
                stream.log = None  # see LOG_FLOOR
                stream.log_blocks = 0

    def _ask_snapshot(self, stream: StreamState, reason: str) -> Response:
        stream.next_sequence = None
        stream.awaiting = False  # its fresh snapshot decides anew
        for stored, removed in stream.backlog:
            self._unhold(stream, len(stored) + len(removed))
        stream.backlog = []
        self._metrics.telemetry_snapshot_requests.inc()
        log.info("asking for a snapshot", pool_id=stream.pool_id, relay_id=stream.relay_id, reason=reason)
        return Response(snapshot_request=telemetry_pb2.SnapshotRequest(reason=reason))


def _carries_snapshot(msg: object) -> bool:
    """Whether a received message is (or batches) a snapshot chunk: what keeps a reader's slot."""
    if not isinstance(msg, Request):
        return False  # EOF, or an Oversized refused right after
    kind = msg.WhichOneof("payload")
    if kind == "kv_snapshot":
        return True
    return kind == "batch" and any(m.WhichOneof("payload") == "kv_snapshot" for m in msg.batch.messages)


def _unaccepted() -> Violations:
    v = Violations()
    v.add("batch", "this frontend's hello ack did not accept batches")
    return v


class TelemetryServicer(telemetry_pb2_grpc.TelemetryServiceServicer):
    """The gRPC face of TelemetryIngest: one bidirectional stream per relay replica."""

    def __init__(
        self,
        ingest: TelemetryIngest,
        frontend_id: str,
        *,
        authorizer: Authorizer | None = None,
        max_streams: int = 4096,
        slice_seconds: float = SLICE_SECONDS,
        snapshot_readers: SnapshotReaders | None = None,
        accepts_batches: bool = True,
        batch_interval: float = 0.0,
        cpu_now: Callable[[], float] = time.thread_time,
    ) -> None:
        self._ingest = ingest
        self.snapshot_readers = snapshot_readers if snapshot_readers is not None else SnapshotReaders()
        """Streams owing a snapshot read it a few at a time (globalrouter.snapshot_readers)."""
        self.builds_first: Callable[[], bool] = lambda: False
        """True while the frontend is not ready (the server sets it from its Readiness): the index
        worker then takes up to BUILD_FIRST_SECONDS of each loop iteration instead of one step."""
        self._cpu_now = cpu_now
        self.accepts_batches = accepts_batches
        """Said in every hello ack: relays then send what they queued as one TelemetryBatch."""
        self.batch_interval = batch_interval
        """Seconds between a relay's writes asked in the hello ack (with accepts_batches only; 0: none)."""
        # Every stream's messages go through the pacer: the loop's telemetry work is bounded per
        # iteration. The summary's folds are paced too (each opens a slice); the exact index's
        # overlay merge is left as it was. Test doubles of the ingest may have no index.
        index = getattr(ingest, "index", None)
        self.pacer: IngestPacer
        if isinstance(index, KvSummary):
            index.fold_at = PACED_FOLD_AT
            index.reads_fold = False  # decisions read the last fold: the pacer folds within FOLD_EVERY
            self.pacer = IngestPacer(
                ingest.receive,
                slice_seconds,
                due=lambda: index.fold_due,
                work=index.fold,
                pending=lambda: index.pending,
                within=FOLD_EVERY,
            )
        else:
            self.pacer = IngestPacer(ingest.receive, slice_seconds)
        self.frontend_id = frontend_id
        self.closing = False
        self.sized_on_receipt = False
        """Each message was measured as received (add_to_server): only an Oversized is refused
        here. False (registered otherwise, e.g. by telemetry_pb2_grpc): each is measured with
        ByteSize()."""
        self._authorizer = authorizer
        self.streams = Slots("telemetry streams", per_key=max_streams, total=max_streams)
        self._worker: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()
        """The tasks of the open streams' calls, cancelled by end_streams."""
        self._cut: set[asyncio.Task] = set()
        """Those end_streams cancelled (a cancel from gRPC itself is not answered)."""
        self.supervisor: Supervisor | None = None
        """Runs the index worker when set (meshkit.supervision)."""
        if authorizer is not None:
            authorizer.on_refusal(_METHOD, lambda refusal: self._refused(str(refusal.reason), str(refusal)))

    def _refused(self, reason: str, why: str) -> None:
        """Routing without a relay's KV and load must never be silent: each refused stream is
        counted by reason and logged."""
        self._ingest._metrics.telemetry_refused.labels(reason).inc()
        log.warning(
            "telemetry stream refused: routing goes on without that relay's KV and load",
            reason=reason,
            why=why,
        )

    def stop_index_work(self) -> None:
        """First thing on stop: queued and future index work is dropped, so the loop is free for
        the stop's own calls (unregistering) instead of applying snapshots for an index about to go."""
        self._ingest.stop()

    def end_streams(self) -> None:
        """Ends every open stream now, UNAVAILABLE with reason SHUTTING_DOWN (relays redial
        another frontend), and drops queued index work: the index goes with the process.

        Called on stop after unregistering: telemetry streams never finish by themselves, so they
        must not hold the grace period that in-flight Generates need (waiting for each stream's
        next message, or the grace's end, kept a loaded frontend's stop for seconds)."""
        self.closing = True
        self._ingest.stop()
        for task in list(self._calls):
            self._cut.add(task)
            task.cancel()

    def _kick(self) -> None:
        """Starts the index worker if work is queued and it is not running."""
        if self._ingest.has_work() and (self._worker is None or self._worker.done()):
            if self.supervisor is not None:  # the frontend's: a worker that dies fails the frontend
                self._worker = self.supervisor.spawn("telemetry-index-work", self._work, one_shot=True)
            else:
                self._worker = asyncio.get_running_loop().create_task(
                    self._work(), name="telemetry-index-work"
                )

    async def _work(self) -> None:
        """Queued index work, a step of about STEP_SECONDS at a time, yielding to the loop in between
        (while the frontend is not ready, steps up to BUILD_FIRST_SECONDS of CPU an iteration)."""
        ingest = self._ingest
        now = self._cpu_now
        more = True
        while more:
            start = now()
            more = ingest.step()
            while more and self.builds_first() and now() - start < BUILD_FIRST_SECONDS:
                more = ingest.step()
            await asyncio.sleep(0)  # let the loop serve between two steps

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext,
        code: grpc.StatusCode,
        reason: Reason,
        message: str,
        metadata: Mapping[str, str] | None = None,
        **where: object,
    ) -> None:
        """Ends the call with the reason, and says so in the log (raises, like abort)."""
        log.warning("telemetry stream refused", code=code.name, reason=str(reason), error=message, **where)
        await abort_with_reason(context, code, reason, message, metadata)

    def _hello_ack(self) -> telemetry_pb2.TelemetryHelloAck:
        """The ack of every hello: batches accepted, and the write interval asked (only with them:
        a relay that cannot batch could not honour it)."""
        ack = telemetry_pb2.TelemetryHelloAck(
            frontend_id=self.frontend_id, accepts_batches=self.accepts_batches
        )
        if self.accepts_batches and self.batch_interval > 0:
            ack.batch_interval.CopyFrom(duration(self.batch_interval))
        return ack

    async def PublishPoolTelemetry(self, request_iterator, context: grpc.aio.ServicerContext):  # type: ignore[override]  # writes with context.write instead of yielding
        try:
            self.streams.acquire("all")
        except LimitExceeded as exc:
            self._refused(str(Reason.LIMIT_EXCEEDED), str(exc))
            await context.abort_with_status(exc.status())
        task = asyncio.current_task()
        if task is not None:
            self._calls.add(task)
        try:
            await self._publish(context)
        except asyncio.CancelledError:
            if task is None or task not in self._cut or task.cancelling() == 0:
                raise
            # end_streams' cancel, not the server's: the relay learns why, and redials elsewhere.
            task.uncancel()
            await abort_with_reason(
                context,
                grpc.StatusCode.UNAVAILABLE,
                Reason.SHUTTING_DOWN,
                "the global frontend is stopping",
            )
        finally:
            self._calls.discard(task)
            self._cut.discard(task)
            self.streams.release("all")

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers TelemetryService on `server` with a request deserializer that measures each
        message by the bytes received (meshkit.limits.add_sized_servicer), so no message is
        measured again with protobuf's ByteSize() (a walk of the message: 0.9-8% of a 1,000-pool
        frontend's CPU in profiles), and one over the cap is refused without being decoded."""
        add_sized_servicer(server, self, telemetry_pb2.DESCRIPTOR.services_by_name["TelemetryService"])
        self.sized_on_receipt = True

    async def _too_large(
        self, context: grpc.aio.ServicerContext, msg: object, where: Mapping[str, object]
    ) -> None:
        """Aborts the call when `msg` (a received message or an Oversized) is over the cap."""
        try:
            check_size(_METHOD, msg)
        except LimitExceeded as exc:
            log.warning("telemetry stream refused", error=str(exc), **where)
            await context.abort_with_status(exc.status())

    async def _publish(self, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        if type(first) is Oversized:
            await self._too_large(context, first, {})
        if first.WhichOneof("payload") != "hello":
            v = Violations()
            v.add("hello", "the first message of a telemetry stream must be a TelemetryHello")
            log.warning("telemetry stream refused", code="INVALID_ARGUMENT", error=str(v))
            await v.abort_if_any(context)
        hello = first.hello
        # The hello must name the calling relay's own pool and relay id.
        refusal = self._authorizer.check_message(_METHOD, first) if self._authorizer else None
        if refusal is not None:
            log.warning(
                "telemetry stream refused", pool_id=hello.pool_id, relay_id=hello.relay_id, error=str(refusal)
            )
            await context.abort_with_status(refusal.status())
        problems = validate_hello(hello)
        if problems:
            log.warning(
                "telemetry stream refused",
                code="INVALID_ARGUMENT",
                pool_id=hello.pool_id,
                relay_id=hello.relay_id,
                error=str(problems),
            )
            await problems.abort_if_any(context)
        where = {"pool_id": hello.pool_id, "relay_id": hello.relay_id, "incarnation": hello.incarnation}
        if self.closing:
            await self._refuse(
                context,
                grpc.StatusCode.UNAVAILABLE,
                Reason.SHUTTING_DOWN,
                "the global frontend is stopping",
                **where,
            )
        try:
            stream = self._ingest.open(hello)
        except StreamRejected as exc:
            await self._refuse(context, exc.code, exc.reason, exc.message, exc.metadata, **where)
        if self.accepts_batches:  # the relay then holds messages up to the batch interval
            stream.report_interval = max(stream.report_interval, self.batch_interval)
        slog = log.bind(**where)
        slog.info("telemetry stream opened")
        task = asyncio.current_task()
        ended = False

        def end() -> None:
            # A newer stream of this relay took over: wake this call from its read at once.
            nonlocal ended
            ended = True
            if task is not None:
                task.cancel()

        stream.end = end
        turn = self.snapshot_readers.turn()
        try:
            self._kick()
            await context.write(Response(hello_ack=self._hello_ack()))
            metrics = self._ingest._metrics
            sized = self.sized_on_receipt
            while True:
                # A stream owing a snapshot (asked for one, or partway through one its relay
                # began) reads only with a slot: the rest of a storm's snapshots wait in their
                # connections, not in this loop's turns.
                if stream.next_sequence is None or stream.snapshot_id is not None:
                    await turn.take()
                elif turn.holding or turn.free_run:
                    turn.give_back()
                msg = await context.read()
                if turn.holding and _carries_snapshot(msg):
                    turn.got()
                if msg is grpc.aio.EOF:
                    break
                if type(msg) is Oversized or not sized:
                    await self._too_large(context, msg, where)
                if self.closing:
                    await abort_with_reason(
                        context,
                        grpc.StatusCode.UNAVAILABLE,
                        Reason.SHUTTING_DOWN,
                        "the global frontend is stopping",
                    )
                if stream.superseded:
                    break  # replaced between two reads: ends ABORTED below
                if msg.WhichOneof("payload") == "batch":
                    problems = validate_batch(msg.batch) if self.accepts_batches else _unaccepted()
                    if problems:
                        log.warning(
                            "telemetry stream refused", code="INVALID_ARGUMENT", error=str(problems), **where
                        )
                        await problems.abort_if_any(context)
                    metrics.telemetry_batches.inc()
                    metrics.telemetry_messages.inc(len(msg.batch.messages))
                else:
                    metrics.telemetry_messages.inc()
                try:
                    answer = await self.pacer.submit(stream, msg)
                except StreamRejected as exc:
                    await self._refuse(context, exc.code, exc.reason, exc.message, exc.metadata, **where)
                self._kick()
                if answer is not None:
                    await context.write(answer)
        except asyncio.CancelledError:
            if not ended or task is None:
                raise
            # Our own cancel (superseded), not the server's: the call ends with its reason below.
            task.uncancel()
        finally:
            turn.give_back()
            replaced = stream.superseded
            stream.end = None
            self._ingest.close(stream)
            self._kick()
            slog.info("telemetry stream closed", replaced=replaced)
        if replaced:
            await abort_with_reason(
                context,
                grpc.StatusCode.ABORTED,
                Reason.TELEMETRY_SUPERSEDED,
                "a newer stream of this relay replaced this one",
            )

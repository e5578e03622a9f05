"""TelemetryService: relay streams → per-stream KV sources in the KvIndex and signals in PoolState."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import grpc

from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import LoadSignal
from meshkit.authz import Authorizer
from meshkit.clock import Clock
from meshkit.errors import Reason, abort_with_reason
from meshkit.limits import LimitExceeded, Slots, check_size
from meshkit.logs import get_logger
from meshkit.timeconv import wall_seconds
from meshkit.validation import Violations, check_identifier
from poolrelay.v1 import pool_events_pb2, telemetry_pb2, telemetry_pb2_grpc

log = get_logger(module="globalrouter.telemetry_ingest")

PROTOCOL_VERSION = 1
Request = telemetry_pb2.PublishPoolTelemetryRequest
Response = telemetry_pb2.PublishPoolTelemetryResponse
_DRAINING = (pool_events_pb2.DRAIN_STATE_DRAINING, pool_events_pb2.DRAIN_STATE_DRAINED)
_METHOD = "/poolrelay.v1.TelemetryService/PublishPoolTelemetry"


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
    """The stream's KvIndex source key (unique per stream)."""
    pool_id: str
    relay_id: str
    incarnation: int
    next_sequence: int | None = None
    """The delta sequence expected next; None while waiting for a snapshot (deltas are ignored)."""
    snapshot_id: int | None = None
    snapshot_sequence: int = 0
    snapshot_chunks: list[int] = field(default_factory=list)
    next_chunk: int = 0
    superseded: bool = False
    """A newer stream of the same (pool, relay) took over; this one's messages are ignored."""
    kv_applied: bool = False
    models_ready: dict[str, bool] | None = None
    """This stream's last readiness report (None: none yet). The pool's view combines its streams'."""
    draining: bool = False
    """This stream's last drain report."""


class StreamRejected(Exception):
    """The stream must end with `code`, the ErrorInfo `reason` and `message`."""

    def __init__(self, code: grpc.StatusCode, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


class TelemetryIngest:
    """The pure ingestion rules (no gRPC): one method per message kind; returns what to answer."""

    def __init__(
        self,
        table: PoolTable,
        index,
        clock: Clock,
        metrics: RouterMetrics,
        *,
        max_snapshot_blocks: int = 4_194_304,
    ) -> None:
        self.max_snapshot_blocks = max_snapshot_blocks
        self._table = table
        self._index = index
        self._clock = clock
        self._metrics = metrics
        self._ids = itertools.count(1)
        self.streams: dict[tuple[str, str], StreamState] = {}
        """(pool_id, relay_id) -> the stream that currently speaks for that relay replica."""
        self._by_pool: dict[str, dict[str, StreamState]] = {}
        """pool_id -> relay_id -> stream: a pool's readiness and drain combine these streams' reports."""

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
        if old is not None:
            if old.incarnation > hello.incarnation:
                raise StreamRejected(
                    grpc.StatusCode.PERMISSION_DENIED,
                    Reason.TELEMETRY_STALE_INCARNATION,
                    f"relay {hello.relay_id!r} of pool {hello.pool_id!r} already streams under a newer "
                    f"incarnation ({old.incarnation} > {hello.incarnation})",
                )
            # A reconnect or a restarted relay: the new stream replaces the old one's state.
            self._release(old)
            old.superseded = True
        stream = StreamState(
            source=f"{hello.pool_id}/{hello.relay_id}/{hello.incarnation}#{next(self._ids)}",
            pool_id=hello.pool_id,
            relay_id=hello.relay_id,
            incarnation=hello.incarnation,
        )
        self.streams[key] = stream
        self._by_pool.setdefault(hello.pool_id, {})[hello.relay_id] = stream
        self._table.stream_counts[hello.pool_id] = self._table.stream_counts.get(hello.pool_id, 0) + 1
        pool = self._table.get(hello.pool_id)
        pool.block_size = hello.block_size
        if not pool.listed:  # what the relay says until discovery says otherwise
            pool.model = hello.model or pool.model
            pool.region = hello.region or pool.region
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

    def _release(self, stream: StreamState) -> None:
        self._index.drop_source(stream.source)
        pool = self._table.pools.get(stream.pool_id)
        count = self._table.stream_counts.get(stream.pool_id, 1) - 1
        if count > 0:
            self._table.stream_counts[stream.pool_id] = count
        else:
            self._table.stream_counts.pop(stream.pool_id, None)
        if pool is None:
            return
        pool.kv_sources.discard(stream.source)
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

    # ---- messages ---------------------------------------------------------------------------
    def receive(self, stream: StreamState, msg: Request) -> Response | None:
        """Applies one message; returns a SnapshotRequest to send back, or None."""
        if stream.superseded:
            return None
        now = self._clock.monotonic()
        pool = self._table.get(stream.pool_id)
        kind = msg.WhichOneof("payload")
        if stream.kv_applied:
            pool.kv_at = now  # any message proves the stream, and so its in-order KV set, is live
        if kind == "kv_delta":
            return self._delta(stream, msg.kv_delta, now)
        if kind == "kv_snapshot":
            return self._snapshot_chunk(stream, msg.kv_snapshot, now)
        if kind == "load":
            pool.record_load(load_signal(msg.load.load), now)
            if msg.load.HasField("observe_time"):
                self._lag(wall_seconds(msg.load.observe_time))
        elif kind == "readiness":
            stream.models_ready = {
                m.model: m.state == pool_events_pb2.MODEL_STATE_READY for m in msg.readiness.models
            }
            self._combine_state(pool)
            pool.state_at = now
        elif kind == "drain":
            stream.draining = msg.drain.drain.state in _DRAINING
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
        pool.telemetry_draining = any(s.draining for s in streams)

    def _lag(self, sent_wall: float) -> None:
        self._metrics.telemetry_lag.observe(max(0.0, self._clock.wall() - sent_wall))

    def _snapshot_chunk(
        self, stream: StreamState, chunk: telemetry_pb2.KvSnapshot, now: float
    ) -> Response | None:
        if chunk.chunk_index == 0:
            stream.snapshot_id = chunk.snapshot_id
            stream.snapshot_sequence = chunk.sequence
            stream.snapshot_chunks = []
            stream.next_chunk = 0
        if stream.snapshot_id != chunk.snapshot_id or chunk.chunk_index != stream.next_chunk:
            stream.snapshot_id = None
            stream.snapshot_chunks = []
            return self._ask_snapshot(
                stream,
                f"snapshot chunk out of order: expected chunk {stream.next_chunk}, "
                f"got {chunk.chunk_index} of snapshot {chunk.snapshot_id}",
            )
        if len(stream.snapshot_chunks) + len(chunk.block_hashes) > self.max_snapshot_blocks:
            # Chunks that never end would grow this stream without bound: a relay's whole pool
            # fits, anything larger is refused and the stream's partial snapshot dropped.
            stream.snapshot_chunks = []
            stream.snapshot_id = None
            raise StreamRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                Reason.LIMIT_EXCEEDED,
                f"kv_snapshot.block_hashes: snapshot {chunk.snapshot_id} exceeds {self.max_snapshot_blocks} blocks",
            )
        stream.snapshot_chunks.extend(chunk.block_hashes)
        stream.next_chunk += 1
        if not chunk.last:
            return None
        # The whole snapshot arrived: it replaces this stream's set in one step.
        self._index.apply_snapshot(stream.source, stream.snapshot_chunks)
        stream.snapshot_chunks = []
        stream.snapshot_id = None
        stream.next_sequence = stream.snapshot_sequence + 1
        stream.kv_applied = True
        pool = self._table.get(stream.pool_id)
        pool.kv_sources.add(stream.source)
        pool.kv_at = now
        return None

    def _delta(self, stream: StreamState, delta: telemetry_pb2.KvDelta, now: float) -> Response | None:
        if stream.next_sequence is None:
            return None  # waiting for a snapshot: deltas cannot be placed
        if delta.sequence != stream.next_sequence:
            return self._ask_snapshot(stream, f"gap: expected {stream.next_sequence}, got {delta.sequence}")
        self._index.apply_delta(stream.source, delta.stored, delta.removed)
        stream.next_sequence += 1
        return None

    def _ask_snapshot(self, stream: StreamState, reason: str) -> Response:
        stream.next_sequence = None
        self._metrics.telemetry_snapshot_requests.inc()
        log.info("asking for a snapshot", pool_id=stream.pool_id, relay_id=stream.relay_id, reason=reason)
        return Response(snapshot_request=telemetry_pb2.SnapshotRequest(reason=reason))


class TelemetryServicer(telemetry_pb2_grpc.TelemetryServiceServicer):
    """The gRPC face of TelemetryIngest: one bidirectional stream per relay replica."""

    def __init__(
        self,
        ingest: TelemetryIngest,
        frontend_id: str,
        *,
        authorizer: Authorizer | None = None,
        max_streams: int = 1024,
    ) -> None:
        self._ingest = ingest
        self.frontend_id = frontend_id
        self.closing = False
        self._authorizer = authorizer
        self.streams = Slots("telemetry streams", per_key=max_streams, total=max_streams)
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

    def end_streams(self) -> None:
        """Ends every open stream at its next message (relays send at least every report interval).

        Called on stop after unregistering: telemetry streams never finish by themselves, so they
        must not hold the grace period that in-flight Generates need."""
        self.closing = True

    async def PublishPoolTelemetry(self, request_iterator, context: grpc.aio.ServicerContext):  # type: ignore[override]  # writes with context.write instead of yielding
        try:
            self.streams.acquire("all")
        except LimitExceeded as exc:
            self._refused(str(Reason.LIMIT_EXCEEDED), str(exc))
            await context.abort_with_status(exc.status())
        try:
            await self._publish(context)
        finally:
            self.streams.release("all")

    async def _publish(self, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        if first.WhichOneof("payload") != "hello":
            v = Violations()
            v.add("hello", "the first message of a telemetry stream must be a TelemetryHello")
            await v.abort_if_any(context)
        # The hello must name the calling relay's own pool and relay id.
        refusal = self._authorizer.check_message(_METHOD, first) if self._authorizer else None
        if refusal is not None:
            await context.abort_with_status(refusal.status())
        await validate_hello(first.hello).abort_if_any(context)
        if self.closing:
            await abort_with_reason(
                context, grpc.StatusCode.UNAVAILABLE, Reason.SHUTTING_DOWN, "the global frontend is stopping"
            )
        try:
            stream = self._ingest.open(first.hello)
        except StreamRejected as exc:
            await abort_with_reason(context, exc.code, exc.reason, exc.message)
        slog = log.bind(pool_id=stream.pool_id, relay_id=stream.relay_id, incarnation=stream.incarnation)
        slog.info("telemetry stream opened")
        try:
            await context.write(
                Response(hello_ack=telemetry_pb2.TelemetryHelloAck(frontend_id=self.frontend_id))
            )
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    break
                try:
                    check_size(_METHOD, msg)
                except LimitExceeded as exc:
                    await context.abort_with_status(exc.status())
                if self.closing:
                    await abort_with_reason(
                        context,
                        grpc.StatusCode.UNAVAILABLE,
                        Reason.SHUTTING_DOWN,
                        "the global frontend is stopping",
                    )
                if stream.superseded:
                    await abort_with_reason(
                        context,
                        grpc.StatusCode.ABORTED,
                        Reason.TELEMETRY_SUPERSEDED,
                        "a newer stream of this relay replaced this one",
                    )
                try:
                    answer = self._ingest.receive(stream, msg)
                except StreamRejected as exc:
                    await abort_with_reason(context, exc.code, exc.reason, exc.message)
                if answer is not None:
                    await context.write(answer)
        finally:
            self._ingest.close(stream)
            slog.info("telemetry stream closed")

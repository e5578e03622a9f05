"""Telemetry to every global frontend: one publisher (stream, bounded queue, reconnect) per frontend.

Each publisher dials out, sends a hello, a chunked snapshot of the pool-level block set, then
numbered deltas and the latest load, readiness and drain state. Each has its own bounded delta
queue: a slow frontend never stalls the others; when its queue overflows its deltas are dropped
(and counted) and it gets a fresh snapshot once the in-flight write completes, never silent drift.

What every stream sends alike (deltas, load, readiness, drain, heartbeats) is built and serialized
once by the hub and the same bytes are handed to every publisher (their calls pass bytes through),
so the per-event work does not grow with the number of frontends; only the gRPC write is per stream.
While streams still have deltas queued, the hub lets transitions accumulate (up to
`batch_max_delay` and `chunk_size` blocks) instead of taking one small delta per batch window, so
that a busy relay writes fewer, larger deltas to each frontend.

To a frontend whose hello ack accepts batches, everything queued for the stream when it writes
(the latest reports, then deltas) goes out as one TelemetryBatch, put together from the bytes
already serialized (batch_wire): the frontend's cost is per gRPC message far more than per byte.
When the ack also asks for a write interval (batch_interval), a stream writes at most one batch per
interval: what is queued meanwhile waits (never longer than the interval) and goes as one, unless
a full batch is queued already; the hello, snapshots and a stream's end are not delayed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import grpc
from tenacity import RetryCallState

from meshkit import tracing
from meshkit.channels import aio_channel, client_security, peer_identity_of, url_to_target
from meshkit.clock import Clock
from meshkit.identity import IdentityError, Role
from meshkit.limits import message_cap
from meshkit.logs import get_logger
from meshkit.supervision import Supervisor
from meshkit.timeconv import duration, seconds, timestamp
from meshkit.tls import is_loopback
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.retry import TELEMETRY_RECONNECT, describe_error, reconnect_forever
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import status_pb2
from poolrelay.v1 import telemetry_pb2 as tm

log = get_logger(module="poolrelay.telemetry_publisher")

PROTOCOL_VERSION = 1
Req = tm.PublishPoolTelemetryRequest
State = status_pb2.TelemetryStreamState
PUBLISH_METHOD = "/poolrelay.v1.TelemetryService/PublishPoolTelemetry"
MAX_BATCH = 256
"""Messages in one TelemetryBatch: the contract's bound (telemetry.proto)."""
BATCH_BYTES = message_cap(PUBLISH_METHOD) // 2
"""Bytes of inner messages one batch takes at most: well inside the frontend's message limit (a
single message larger than this, a delta of a whole chunk's blocks, goes alone)."""
MAX_BATCH_INTERVAL = 5.0
"""Longest write interval a frontend's ack may ask for (a longer one is taken as this much): the
frontend's own bound (--telemetry-batch-interval), so a wrong ack cannot stall a stream's deltas."""
_BATCH_TAG = bytes([Req.BATCH_FIELD_NUMBER << 3 | 2])
_MESSAGES_TAG = bytes([tm.TelemetryBatch.MESSAGES_FIELD_NUMBER << 3 | 2])


def varint(n: int) -> bytes:
    """A non-negative int in protobuf's base-128 varint encoding (a field tag or a length)."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def batch_wire(parts: list[bytes]) -> bytes:
    """PublishPoolTelemetryRequest(batch=TelemetryBatch(messages=parts)) on the wire, from the parts'
    own serialized bytes: each is written as it is, behind its field tag and length (protobuf's
    encoding of a length-delimited field), so nothing is parsed or serialized again per stream."""
    body = b"".join(b"".join((_MESSAGES_TAG, varint(len(p)), p)) for p in parts)
    return b"".join((_BATCH_TAG, varint(len(body)), body))


def _passthrough(data: bytes) -> bytes:
    """The request serializer of a publisher's call: messages arrive serialized already."""
    return data


def wire(msg: Req) -> bytes:
    """A request's bytes on the wire (protobuf's serialization: what the generated stub would send)."""
    return msg.SerializeToString()


# A frontend that ends a stream with one of these refused it (not a broken link): redialing at
# once would be refused again, so the next attempt waits out the back-off like a failed dial.
_REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class NotAFrontend(Exception):
    """The peer at a frontend URL did not prove a global frontend identity: no telemetry goes there."""


def _refused(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _REFUSALS


def bearer_metadata(url: str) -> tuple[tuple[str, str], ...]:
    """The relay's API key (--api-key-file) as `authorization: Bearer` metadata for a stream to
    `url` over plain text (a loopback router with --api-keys, whose keys file maps the key to
    relay/POOL/RELAY); over TLS the channel's call credentials carry it already, and in clear it
    goes only to a loopback address. Read at each connect, so a rotated key file is used from the
    next stream on. Raises ValueError when the file cannot be read or is empty, or the frontend is
    not on loopback (the stream backs off, and its last_error says so)."""
    security = client_security()
    target, tls = url_to_target(url)
    if not security.api_key or tls:
        return ()
    if not is_loopback(target):
        # A key sent in clear could be read off the network and replayed: only to this machine.
        raise ValueError(f"not sending the API key in clear to {target}: use TLS (--tls-cert, --tls-key)")
    try:
        token = Path(security.api_key).read_text().strip()
    except OSError as exc:
        raise ValueError(f"--api-key-file {security.api_key}: {exc.strerror}") from exc
    if not token:
        raise ValueError(f"--api-key-file {security.api_key} is empty")
    return (("authorization", f"Bearer {token}"),)


@dataclass(frozen=True)
class TelemetryConfig:
    """What every telemetry stream of this relay says about itself, and its limits."""

    pool_id: str
    """The routing pool id (the hello's pool_id)."""
    relay_id: str
    """This relay replica's id."""
    incarnation: int
    """This relay process's incarnation (> 0)."""
    region: str
    """The pool's region."""
    block_size: int = 16
    """Tokens per KV block (replaced by the pool's own once its status is read)."""
    report_interval: float = 1.0
    """Seconds between periodic load / readiness / drain reports and heartbeats."""
    chunk_size: int = 16_384
    """Block hashes per KvSnapshot chunk (16,384 x 8 bytes = 128 KiB per message)."""
    queue_limit: int = 1024
    """Deltas one frontend's queue holds before it overflows into a fresh snapshot."""
    batch_window: float = 0.005
    """Seconds transitions are coalesced into one delta."""
    batch_max_delay: float = 0.05
    """Seconds transitions may wait, beyond `batch_window`, while streams still have deltas queued
    (a busy relay sends fewer, larger deltas; an idle one still sends after `batch_window`)."""

    def __post_init__(self) -> None:
        if self.batch_window <= 0 or self.batch_max_delay < 0:
            raise ValueError(
                f"batch_window must be > 0 and batch_max_delay >= 0 "
                f"(got {self.batch_window}, {self.batch_max_delay})"
            )
        if self.chunk_size <= 0 or self.queue_limit <= 0:
            raise ValueError(
                f"chunk_size and queue_limit must be > 0 (got {self.chunk_size}, {self.queue_limit})"
            )


class Publisher:
    """One telemetry stream to one global frontend."""

    def __init__(self, hub: TelemetryHub, url: str) -> None:
        self.hub = hub
        self.url = url
        self.state = State.TELEMETRY_STREAM_STATE_CONNECTING
        self.last_error = ""
        self.messages_sent = 0
        """Messages sent (a batch's each count; exported as messages_sent)."""
        self.batches_sent = 0
        """TelemetryBatch writes (gRPC messages that carried several of messages_sent)."""
        self.batching = False
        """Whether this stream's frontend accepts batches (its hello ack said so)."""
        self.batch_interval = 0.0
        """Seconds between writes this stream's frontend asked for (its hello ack; 0: none)."""
        self._last_write: float | None = None
        """The hub clock's time of this stream's last write of queued messages (None: none yet)."""
        self.connects = 0
        self.snapshots_sent = 0
        self.messages_dropped = 0
        self._deltas: deque[tuple[int, bytes]] = deque()
        self._delta_bytes = 0
        """Bytes of the queued deltas (whether a held-back write has a full batch already)."""
        self._latest: dict[str, bytes] = {}
        self._resync = True
        self._restart = False
        self._wake = asyncio.Event()
        self._channel = aio_channel(url)
        # Not the generated stub: its serializer would serialize every message again per stream.
        self._publish = self._channel.stream_stream(
            PUBLISH_METHOD,
            request_serializer=_passthrough,
            response_deserializer=tm.PublishPoolTelemetryResponse.FromString,
        )
        self._task: asyncio.Task | None = None

    @property
    def queue_depth(self) -> int:
        """Messages waiting to be sent."""
        return len(self._deltas) + len(self._latest)

    def start(self) -> None:
        supervisor = self.hub.supervisor  # the relay's: a publisher that dies fails the relay
        if supervisor is not None:
            self._task = supervisor.spawn(f"telemetry {self.url}", self._run)
        else:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"telemetry {self.url}")

    @property
    def backlogged(self) -> bool:
        """Whether deltas wait to be written (a stream due for a snapshot does not count)."""
        return bool(self._deltas) and not self._resync

    def enqueue_delta(self, sequence: int, data: bytes) -> None:
        """Queues a delta (serialized); on overflow drops every queued delta and asks for a fresh snapshot."""
        if self._resync:
            self.messages_dropped += 1  # a snapshot is due anyway and will include it
            return
        if len(self._deltas) >= self.hub.config.queue_limit:
            self.messages_dropped += len(self._deltas) + 1
            self._deltas.clear()
            self._delta_bytes = 0
            self._resync = True
            log.warning("telemetry queue overflow; a fresh snapshot follows", frontend=self.url)
        else:
            self._deltas.append((sequence, data))
            self._delta_bytes += len(data)
        self._wake.set()

    def offer(self, kind: str, data: bytes) -> None:
        """Queues the latest message (serialized) of a kind (load, readiness, drain, heartbeat), replacing older."""
        self._latest[kind] = data
        self._wake.set()

    def request_snapshot(self) -> None:
        self._resync = True
        self._wake.set()

    def restart(self) -> None:
        """Reopens the stream (e.g. the hello's model changed)."""
        self._restart = True
        self._wake.set()

    async def close(self) -> None:
        """Closes the stream for good."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.state = State.TELEMETRY_STREAM_STATE_CLOSED
        await self._channel.close()

    def _backing_off(self, state: RetryCallState) -> None:
        failure = state.outcome.exception() if state.outcome else None
        # A refusal is not a broken link: status and metrics say so (the redial waits the same).
        refused = failure is not None and _refused(failure)
        self.state = (
            State.TELEMETRY_STREAM_STATE_REFUSED if refused else State.TELEMETRY_STREAM_STATE_BACKING_OFF
        )
        self.last_error = describe_error(failure)

    async def _run(self) -> None:
        await reconnect_forever(self._session, TELEMETRY_RECONNECT, self._backing_off)

    async def _write(self, call, data: bytes) -> None:
        await call.write(data)
        self.messages_sent += 1

    async def _write_queued(self, call) -> None:
        """Writes what is queued (the latest reports, then deltas): one batch of as many as fit
        MAX_BATCH and BATCH_BYTES when the frontend accepts batches, else the first of them."""
        latest, deltas = self._latest, self._deltas
        if not self.batching or len(latest) + len(deltas) == 1:
            if latest:
                kind = next(iter(latest))
                await self._write(call, latest.pop(kind))
            else:
                data = deltas.popleft()[1]
                self._delta_bytes -= len(data)
                await self._write(call, data)
            return
        parts = list(latest.values())  # a few reports: always fit
        latest.clear()
        size = sum(len(p) for p in parts)
        while deltas and len(parts) < MAX_BATCH:
            data = deltas[0][1]
            if parts and size + len(data) > BATCH_BYTES:
                break
            parts.append(data)
            size += len(data)
            self._delta_bytes -= len(data)
            deltas.popleft()
        await call.write(parts[0] if len(parts) == 1 else batch_wire(parts))
        self.messages_sent += len(parts)
        if len(parts) > 1:
            self.batches_sent += 1

    def _write_delay(self) -> float:
        """Seconds the next write of queued messages waits for the frontend's write interval: 0 when
        none was asked, none was written yet, the interval has passed, or a full batch is queued."""
        if not self.batching or self.batch_interval <= 0 or self._last_write is None:
            return 0.0
        wait = self._last_write + self.batch_interval - self.hub.clock.monotonic()
        if wait <= 0 or len(self._latest) + len(self._deltas) >= MAX_BATCH:
            return 0.0
        size = self._delta_bytes + sum(len(p) for p in self._latest.values())  # a few reports
        return 0.0 if size >= BATCH_BYTES else wait

    async def _hold(self, wait: float, reader: asyncio.Future) -> None:
        """Waits `wait` seconds, or less when something is queued (a full batch may be due), a
        snapshot or a restart is asked for, or the frontend's side ends."""
        self._wake.clear()
        waiter = asyncio.ensure_future(self._wake.wait())
        timer = asyncio.ensure_future(self.hub.clock.sleep(wait))
        try:
            await asyncio.wait([waiter, timer, reader], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            timer.cancel()

    async def _send_snapshot(self, call) -> None:
        self._resync = False
        self._deltas.clear()  # every queued delta is older than the snapshot
        self._delta_bytes = 0
        snapshot_id, sequence, hashes = self.hub.snapshot()
        size = self.hub.config.chunk_size
        chunks = max(1, -(-len(hashes) // size))
        for i in range(chunks):
            part = hashes[i * size : (i + 1) * size]
            snap = tm.KvSnapshot(
                snapshot_id=snapshot_id,
                sequence=sequence,
                chunk_index=i,
                last=i == chunks - 1,
                block_hashes=part,
            )
            await self._write(call, wire(Req(kv_snapshot=snap)))
        self.snapshots_sent += 1
        # Deltas queued while the chunks went out continue from `sequence`.
        while self._deltas and self._deltas[0][0] <= sequence:
            self._delta_bytes -= len(self._deltas.popleft()[1])

    async def _read(self, call) -> None:
        async for resp in call:
            if resp.HasField("hello_ack"):
                # An older frontend leaves accepts_batches false: it gets one message per write.
                self.batching = resp.hello_ack.accepts_batches
                # Asked only along with batches; bounded, so that a wrong ack cannot hold deltas back.
                interval = seconds(resp.hello_ack.batch_interval) if self.batching else 0.0
                self.batch_interval = min(max(interval, 0.0), MAX_BATCH_INTERVAL)
                self._wake.set()
            elif resp.HasField("snapshot_request"):
                log.info("frontend asked for a snapshot", frontend=self.url, why=resp.snapshot_request.reason)
                self.request_snapshot()

    async def _session(self) -> None:
        self.state = State.TELEMETRY_STREAM_STATE_CONNECTING
        self.connects += 1
        self._restart = False
        # With mutual TLS, pool state goes only to a peer whose certificate names a frontend.
        try:
            peer = await peer_identity_of(self.url)
        except IdentityError as exc:
            raise NotAFrontend(f"{self.url} has no mesh identity ({exc}); no telemetry sent") from exc
        if peer is not None and peer.role is not Role.FRONTEND:
            raise NotAFrontend(f"{self.url} is {peer}, not a global frontend; no telemetry sent")
        span = None
        if tracing.enabled():
            span = tracing.start_span(
                "poolrelay.telemetry_stream",
                attributes={"pool.id": self.hub.config.pool_id, "frontend.url": self.url},
            )
        sent_before, snapshots_before = self.messages_sent, self.snapshots_sent
        self.batching = False  # until this stream's frontend says otherwise
        self.batch_interval = 0.0
        self._last_write = None
        call = self._publish(metadata=bearer_metadata(self.url))
        reader = asyncio.ensure_future(self._read(call))
        productive = False
        failure: BaseException | None = None
        try:
            await self._write(call, wire(Req(hello=self.hub.hello())))
            self._resync = True
            self._latest.update(self.hub.current_wire())
            while not self._restart:
                if self._resync:
                    await self._send_snapshot(call)
                    if not productive:
                        productive = True
                        self.state = State.TELEMETRY_STREAM_STATE_STREAMING
                        self.last_error = ""
                    continue
                if self._latest or self._deltas:
                    if (wait := self._write_delay()) > 0:
                        if reader.done():
                            break
                        await self._hold(wait, reader)
                        continue
                    had_deltas = bool(self._deltas)
                    self._last_write = self.hub.clock.monotonic()
                    await self._write_queued(call)
                    if had_deltas and not self._deltas:
                        self.hub.stream_caught_up()
                    continue
                if reader.done():
                    break
                self._wake.clear()
                waiter = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait([waiter, reader], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            if reader.done() and (failure := reader.exception()) is not None:
                raise failure
        except Exception as exc:
            failure = exc
            error = describe_error(exc)
            if _refused(exc) and error != self.last_error:
                # Not a broken link: the frontend routes without this pool's KV and load until
                # the relay's identity or the frontend's configuration is fixed (said once per error).
                log.warning("telemetry stream refused by the frontend", frontend=self.url, error=error)
            self.last_error = error
            if not productive or _refused(exc):
                raise
            log.info("telemetry stream broke; redialing", frontend=self.url, error=self.last_error)
        finally:
            reader.cancel()
            call.cancel()
            if productive:
                self.state = State.TELEMETRY_STREAM_STATE_BACKING_OFF
            if span is not None:
                tracing.end_span(
                    span,
                    failure,
                    **{
                        "telemetry.messages_sent": self.messages_sent - sent_before,
                        "telemetry.snapshots_sent": self.snapshots_sent - snapshots_before,
                    },
                )


class TelemetryHub:
    """The set of publishers and what they all publish: blocks, load, readiness, drain."""

    def __init__(self, config: TelemetryConfig, blocks: PoolBlocks, clock: Clock) -> None:
        self.config = config
        self.blocks = blocks
        self.clock = clock
        self.block_size = config.block_size
        self.model = ""
        self.publishers: dict[str, Publisher] = {}
        self._static: set[str] = set()
        self._dynamic: set[str] = set()
        self._snapshot_id = 0
        self._flush_handle: asyncio.TimerHandle | None = None
        self._reports: dict[str, Req] = {}
        self._wire: dict[str, bytes] = {}  # the reports serialized once, for every stream
        self._pending_since: float | None = None  # loop time the oldest unpublished transition waits from
        self.deltas_published = 0
        self.supervisor: Supervisor | None = None
        """Runs the publishers' tasks when set (meshkit.supervision)."""

    # --- what every stream says -------------------------------------------------------------

    def hello(self) -> tm.TelemetryHello:
        c = self.config
        return tm.TelemetryHello(
            pool_id=c.pool_id,
            relay_id=c.relay_id,
            incarnation=c.incarnation,
            protocol_version=PROTOCOL_VERSION,
            block_size=self.block_size,
            hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
            report_interval=duration(c.report_interval),
            model=self.model,
            region=c.region,
        )

    def snapshot(self) -> tuple[int, int, list[int]]:
        """(snapshot id, sequence, blocks); publishes pending transitions first so none is lost."""
        self.flush()
        self._snapshot_id += 1
        sequence, hashes = self.blocks.snapshot()
        return self._snapshot_id, sequence, hashes

    def current_reports(self) -> dict[str, Req]:
        """The latest load, readiness and drain reports (what a new stream gets after its snapshot)."""
        return dict(self._reports)

    def current_wire(self) -> dict[str, bytes]:
        """The latest reports as serialized once for every stream."""
        return dict(self._wire)

    # --- inputs -----------------------------------------------------------------------------

    def blocks_changed(self) -> None:
        """The block set changed: publish the transitions after the batch window."""
        if self._flush_handle is None and self.blocks.pending:
            loop = asyncio.get_running_loop()
            if self._pending_since is None:
                self._pending_since = loop.time()
            self._flush_handle = loop.call_later(self.config.batch_window, self._timed_flush)
        elif self.blocks.pending_count >= self.config.chunk_size:
            self.flush()  # a delta no larger than a snapshot chunk, however busy the streams are

    def _timed_flush(self) -> None:
        """The batch window passed: publish now, unless streams are still writing earlier deltas
        (then the transitions keep accumulating, up to `batch_max_delay`, and go out as soon as
        every stream has caught up)."""
        self._flush_handle = None
        loop = asyncio.get_running_loop()
        since = self._pending_since if self._pending_since is not None else loop.time()
        waited = loop.time() - since
        if waited < self.config.batch_max_delay and any(p.backlogged for p in self.publishers.values()):
            wait = min(self.config.batch_window, self.config.batch_max_delay - waited)
            self._flush_handle = loop.call_later(wait, self._timed_flush)
            return
        self.flush()

    def stream_caught_up(self) -> None:
        """A publisher wrote its last queued delta: a held-back delta goes out once every stream has."""
        if (
            self._flush_handle is not None
            and self._pending_since is not None
            and asyncio.get_running_loop().time() - self._pending_since >= self.config.batch_window
            and not any(p.backlogged for p in self.publishers.values())
        ):
            self.flush()

    def flush(self) -> None:
        """Publishes pending transitions as one delta to every stream now (built and serialized once)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._pending_since = None
        delta = self.blocks.take_delta()
        if delta is None:
            return
        self.deltas_published += 1
        data = wire(
            Req(kv_delta=tm.KvDelta(sequence=delta.sequence, stored=delta.stored, removed=delta.removed))
        )
        for p in self.publishers.values():
            p.enqueue_delta(delta.sequence, data)

    def _report(self, kind: str, msg: Req, *, changed: bool) -> None:
        self._reports[kind] = msg
        self._wire[kind] = wire(msg)  # once per report, whatever the number of streams
        if changed:
            data = self._wire[kind]
            for p in self.publishers.values():
                p.offer(kind, data)

    def set_status(self, status: pe.WatchPoolStatusResponse, observed_wall: float) -> None:
        """The pool's latest status: load, readiness and drain (published at once when they change)."""
        if status.block_size:
            self.block_size = status.block_size
        old = self._reports
        ready = Req(readiness=tm.ReadinessReport(models=status.models))
        drain = Req(drain=tm.DrainReport(drain=status.drain))
        if status.HasField("load"):
            load = Req(load=tm.LoadReport(load=status.load, observe_time=timestamp(observed_wall)))
            self._report("load", load, changed="load" not in old or old["load"].load.load != status.load)
        else:  # the pool could not read its load: receivers see the last report go stale
            self.forget_load()
        self._report("readiness", ready, changed=old.get("readiness") != ready)
        self._report("drain", drain, changed=old.get("drain") != drain)

    def forget_load(self) -> None:
        """The pool cannot be read: stop repeating its last load, so receivers see it go stale."""
        self._reports.pop("load", None)
        self._wire.pop("load", None)

    def set_drain(self, drain: pe.DrainStatus) -> None:
        """A drain the relay learned elsewhere (passed on from discovery)."""
        msg = Req(drain=tm.DrainReport(drain=drain))
        self._report("drain", msg, changed=self._reports.get("drain") != msg)

    def set_model(self, model: str) -> None:
        """The registered model (named in the hello): streams reopen when it changes."""
        if model != self.model:
            self.model = model
            for p in self.publishers.values():
                p.restart()

    def set_frontends(self, *, static: list[str] | None = None, dynamic: list[str] | None = None) -> None:
        """Adds publishers for new frontends and closes those of frontends that left."""
        if static is not None:
            self._static = set(static)
        if dynamic is not None:
            self._dynamic = set(dynamic)
        wanted = self._static | self._dynamic
        for url in sorted(wanted - set(self.publishers)):
            log.info("telemetry stream added", frontend=url)
            p = self.publishers[url] = Publisher(self, url)
            p.start()
        for url in sorted(set(self.publishers) - wanted):
            log.info("telemetry stream closed", frontend=url)
            asyncio.get_running_loop().create_task(self.publishers.pop(url).close())

    async def run_periodic(self) -> None:
        """Every report interval: the latest reports again, and a heartbeat, on every stream."""
        while True:
            await self.clock.sleep(self.config.report_interval)
            beat = wire(Req(heartbeat=tm.TelemetryHeartbeat(send_time=timestamp(self.clock.wall()))))
            for p in self.publishers.values():
                for kind, data in self._wire.items():
                    p.offer(kind, data)
                p.offer("heartbeat", beat)

    async def close(self) -> None:
        """Closes every stream."""
        self.flush()
        for p in list(self.publishers.values()):
            await p.close()

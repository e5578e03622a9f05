"""In-process fakes for relay tests: a pool (PoolEventsService), a discovery, a telemetry receiver, and
an engine (vLLM's HTTP endpoints, its KV event publisher and replay socket)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import zmq
import zmq.asyncio
from aiohttp import web

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from meshkit.timeconv import duration, timestamp
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import pool_events_pb2_grpc as pe_grpc
from poolrelay.v1 import telemetry_pb2 as tm
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc
from tests.support import free_port


async def start_server(*servicers) -> tuple[grpc.aio.Server, str]:
    """An aio server on 127.0.0.1:<free> with the given (add_fn, servicer) pairs."""
    server = grpc.aio.server()
    for add, servicer in servicers:
        add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class FakePool(pe_grpc.PoolEventsServiceServicer):
    """A pool whose status and KV events a test sets; streams them like the contract says."""

    def __init__(self, models: dict[str, bool] | None = None) -> None:
        self.models = dict(models or {})
        self.drain = pe.DrainStatus(state=pe.DRAIN_STATE_ACTIVE)
        self.load = pe.PoolLoad(max_running_requests=8, kv_blocks_total=1000)
        self.workers: dict[str, set[int]] = {}
        self.event_ids: dict[str, int] = {}
        self.drain_calls: list[pe.StartDrainRequest] = []
        self._status_changed = asyncio.Event()
        self._kv_queues: list[asyncio.Queue] = []
        self._seq = 0

    def status(self) -> pe.WatchPoolStatusResponse:
        self._seq += 1
        return pe.WatchPoolStatusResponse(
            models=[
                pe.ModelStatus(model=m, state=pe.MODEL_STATE_READY if r else pe.MODEL_STATE_NOT_READY)
                for m, r in sorted(self.models.items())
            ],
            load=self.load,
            drain=self.drain,
            block_size=16,
            pool_id="fake",
            sequence=self._seq,
            prefill_tokens_per_second=5000,
        )

    def changed(self) -> None:
        self._status_changed.set()

    async def WatchPoolStatus(self, request, context):
        interval = max(0.01, request.interval.seconds + request.interval.nanos / 1e9 or 1.0)
        while True:
            self._status_changed.clear()
            yield self.status()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._status_changed.wait(), interval)

    def kv_event(self, worker: str, stored=(), removed=(), cleared=False) -> None:
        held = self.workers.setdefault(worker, set())
        if cleared:
            held.clear()
        held.difference_update(removed)
        held.update(stored)
        self.event_ids[worker] = self.event_ids.get(worker, 0) + 1
        ev = pe.WorkerKvEvent(
            worker_id=worker, event_id=self.event_ids[worker], stored=stored, removed=removed, cleared=cleared
        )
        for q in self._kv_queues:
            q.put_nowait(pe.WatchKvEventsResponse(event=ev))

    @property
    def kv_subscribers(self) -> int:
        """Open WatchKvEvents streams (events sent now reach them live)."""
        return len(self._kv_queues)

    def pool_blocks(self) -> set[int]:
        return set().union(*self.workers.values()) if self.workers else set()

    async def WatchKvEvents(self, request, context):
        q: asyncio.Queue = asyncio.Queue()
        self._kv_queues.append(q)
        try:
            for w, held in sorted(self.workers.items()):
                snap = pe.WorkerKvSnapshot(worker_id=w, event_id=self.event_ids.get(w, 0), block_hashes=held)
                yield pe.WatchKvEventsResponse(snapshot=snap)
            while True:
                yield await q.get()
        finally:
            self._kv_queues.remove(q)

    async def StartDrain(self, request, context):
        self.drain_calls.append(request)
        if self.drain.state == pe.DRAIN_STATE_ACTIVE:
            self.drain = pe.DrainStatus(state=pe.DRAIN_STATE_DRAINING, deadline=timestamp(2e9))
            self.changed()
        return pe.StartDrainResponse(drain=self.drain)


class FakeDiscovery(dpb_grpc.DiscoveryServiceServicer):
    """Records RegisterPool / KeepAlivePools / UnregisterPool calls; can be told to fail, to request a
    drain, to break its keep-alive streams or to hold their replies back."""

    def __init__(self, heartbeat: float = 0.2, lease: float = 0.6) -> None:
        self.heartbeat = heartbeat
        self.lease = lease
        self.registers: list[dpb.RegisterPoolRequest] = []
        self.transports: list[str] = []
        """For each of `registers`: "unary" or "stream"."""
        self.unregisters: list[dpb.UnregisterPoolRequest] = []
        self.fail = False
        self.drain_requested = False
        self.frontends: list[str] = []
        self.streams_opened = 0
        self.break_streams = False
        """While set, a keep-alive message ends its stream with UNAVAILABLE instead of a reply."""
        self.replying = asyncio.Event()
        """Cleared: keep-alive messages are read but not answered until it is set again."""
        self.replying.set()

    def _reply(self, request: dpb.RegisterPoolRequest) -> dpb.RegisterPoolResponse:
        return dpb.RegisterPoolResponse(
            heartbeat_interval=duration(self.heartbeat),
            lease_duration=duration(self.lease),
            lease_expire_time=timestamp(2e9),
            frontends=[dpb.Frontend(frontend_id=f"fe{i}", url=u) for i, u in enumerate(self.frontends)],
            drain_requested=self.drain_requested,
            drain_deadline=timestamp(2e9) if self.drain_requested else None,
        )

    async def RegisterPool(self, request, context):
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake discovery told to fail")
        self.registers.append(request)
        self.transports.append("unary")
        return self._reply(request)

    async def KeepAlivePools(self, request_iterator, context):
        self.streams_opened += 1
        async for message in request_iterator:
            if self.break_streams:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake discovery broke the stream")
            await self.replying.wait()
            if self.fail:
                error = dpb.KeepAliveError(
                    code=grpc.StatusCode.UNAVAILABLE.value[0], message="fake discovery told to fail"
                )
                yield dpb.KeepAlivePoolsResponse(sequence=message.sequence, error=error)
                continue
            self.registers.append(message.register)
            self.transports.append("stream")
            yield dpb.KeepAlivePoolsResponse(
                sequence=message.sequence, register=self._reply(message.register)
            )

    async def UnregisterPool(self, request, context):
        self.unregisters.append(request)
        return dpb.UnregisterPoolResponse(pool_removed=True)


class UnaryOnlyDiscovery(FakeDiscovery):
    """A discovery from before KeepAlivePools: the stream is UNIMPLEMENTED."""

    KeepAlivePools = dpb_grpc.DiscoveryServiceServicer.KeepAlivePools


class TelemetryReceiver(tm_grpc.TelemetryServiceServicer):
    """A global frontend's telemetry side, reduced to what tests check: the block set per stream.

    Verifies the protocol as it goes (hello first, snapshot before deltas, deltas numbered without
    gaps, batches only when its ack accepted them) and records every violation in `errors`.
    `stall` (an Event that is set while stalled) makes it stop reading, so the relay's writes back
    up. `accepts_batches` is what its hello ack says (False: a frontend older than batches).
    """

    def __init__(self, accepts_batches: bool = False) -> None:
        self.accepts_batches = accepts_batches
        self.writes = 0
        """gRPC messages read after the hello (a batch counts once)."""
        self.batches = 0
        self.batch_sizes: list[int] = []
        self.kinds: list[str] = []
        """Every message's kind in the order applied (a batch's messages each)."""
        self.hellos: list[tm.TelemetryHello] = []
        self.blocks: set[int] = set()
        self.sequence: int | None = None
        self.errors: list[str] = []
        self.deltas = 0
        self.snapshots = 0
        self.loads = 0
        self.readiness: list[tm.ReadinessReport] = []
        self.drains: list[tm.DrainReport] = []
        self.heartbeats = 0
        self.stalled = asyncio.Event()
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.changed = asyncio.Event()
        self.snapshot_requests: asyncio.Queue[str] = asyncio.Queue()
        self._chunks: list[int] = []
        self._chunk_id: int | None = None
        self.server: grpc.aio.Server | None = None  # set by tests that stop the receiver's server

    def stall(self) -> None:
        self.resumed.clear()

    def resume(self) -> None:
        self.resumed.set()

    def _apply(self, req: tm.PublishPoolTelemetryRequest) -> None:
        kind = req.WhichOneof("payload")
        if kind == "batch":
            self.batches += 1
            self.batch_sizes.append(len(req.batch.messages))
            if not self.accepts_batches:
                self.errors.append("a batch to a frontend whose ack did not accept batches")
            for inner in req.batch.messages:
                if inner.WhichOneof("payload") in ("hello", "kv_snapshot", "batch", None):
                    self.errors.append(f"{inner.WhichOneof('payload')} inside a batch")
                self._apply(inner)
            return
        self.kinds.append(str(kind))
        if kind == "hello":
            self.hellos.append(req.hello)
            self.sequence = None
        elif kind == "kv_snapshot":
            s = req.kv_snapshot
            if s.chunk_index == 0:
                self._chunks, self._chunk_id = [], s.snapshot_id
            elif s.snapshot_id != self._chunk_id:
                self.errors.append(f"chunk of snapshot {s.snapshot_id} inside {self._chunk_id}")
            self._chunks.extend(s.block_hashes)
            if s.last:
                self.blocks = set(self._chunks)
                self.sequence = s.sequence
                self.snapshots += 1
        elif kind == "kv_delta":
            d = req.kv_delta
            if self.sequence is None:
                self.errors.append(f"delta {d.sequence} before any snapshot")
            elif d.sequence != self.sequence + 1:
                self.errors.append(f"gap: expected {self.sequence + 1}, got {d.sequence}")
            self.sequence = d.sequence
            self.blocks.update(d.stored)
            self.blocks.difference_update(d.removed)
            self.deltas += 1
        elif kind == "load":
            self.loads += 1
        elif kind == "readiness":
            self.readiness.append(req.readiness)
        elif kind == "drain":
            self.drains.append(req.drain)
        elif kind == "heartbeat":
            self.heartbeats += 1
        self.changed.set()

    async def PublishPoolTelemetry(self, request_iterator, context):
        first = True
        reader = request_iterator.__aiter__()
        while True:
            await self.resumed.wait()
            try:
                req = await reader.__anext__()
            except StopAsyncIteration:
                return
            if first and req.WhichOneof("payload") != "hello":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must be a hello")
            if first:
                first = False
                ack = tm.TelemetryHelloAck(frontend_id="test", accepts_batches=self.accepts_batches)
                yield tm.PublishPoolTelemetryResponse(hello_ack=ack)
            else:
                self.writes += 1
            self._apply(req)
            while not self.snapshot_requests.empty():
                reason = self.snapshot_requests.get_nowait()
                yield tm.PublishPoolTelemetryResponse(snapshot_request=tm.SnapshotRequest(reason=reason))


async def wait_for(predicate, within: float = 10.0, message: str = "condition") -> None:
    """Polls `predicate` on the event loop until it holds, or fails after `within` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{message} not reached within {within}s")
        await asyncio.sleep(0.01)


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1000"} 1.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 512.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e+09
"""


class FakeEngine:
    """/health, /metrics and /v1/models like a vLLM server; `up` and `metrics` are switched by the test."""

    def __init__(self) -> None:
        self.up = True
        self.metrics = VLLM_METRICS
        self.metrics_status = 200
        """What /metrics answers (500: up, but its load cannot be read)."""
        self.models_body: dict = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
        """What /v1/models answers."""

    async def health(self, request):
        return web.Response(status=200 if self.up else 503)

    async def metrics_page(self, request):
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status)
        return web.Response(text=self.metrics)

    async def models(self, request):
        return web.json_response(self.models_body)

    async def start(self):
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"


REPLAY_END = (-1).to_bytes(8, "big", signed=True)


class FakeEngineEvents:
    """An engine's KV event sockets on 127.0.0.1: a publisher and a replay ROUTER answering from `buffer`.

    The publisher is an XPUB, so a test sees the relay's subscription arrive (`subscribed`) and
    publishes nothing before anyone listens. Replies follow vLLM: `[id, "", seq, payload]` per
    buffered batch from the asked sequence on, then `[id, "", -1, ""]`.
    """

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.events = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: list[tuple[int, bytes]] = []
        self.asked: list[int] = []
        """The start sequence of every replay request, in order."""
        self.bad_replies = 0
        """Malformed replies to send before the next answer (then back to 0)."""
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._answer_replays())

    async def subscribed(self, within: float = 10.0) -> None:
        """Waits for a subscriber's subscription (XPUB hands it up as b"\\x01" + topic)."""
        async with asyncio.timeout(within):
            while True:
                frame = await self.pub.recv()
                if frame[:1] == b"\x01":
                    return

    async def publish(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        """Buffers batch `seq` for replay and (unless `live` is False: a batch the relay misses) publishes it."""
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def send_raw(self, frames: list[bytes]) -> None:
        """Publishes `frames` as they are (a malformed message)."""
        await self.pub.send_multipart(frames)

    async def _answer_replays(self) -> None:
        while True:
            ident, _empty, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.asked.append(first)
            for _ in range(self.bad_replies):
                await self.router.send_multipart([ident, b"", b"not a sequence", b""])
            self.bad_replies = 0
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", REPLAY_END, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.ctx.destroy(linger=0)

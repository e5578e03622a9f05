"""The relay batches what is queued for a stream into one TelemetryBatch, only to a frontend whose
hello ack accepts batches, from the bytes already serialized."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from meshkit.clock import FakeClock, SystemClock
from meshkit.timeconv import duration
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.telemetry_publisher import (
    BATCH_BYTES,
    MAX_BATCH,
    Publisher,
    TelemetryConfig,
    TelemetryHub,
    batch_wire,
)
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import telemetry_pb2 as tm
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc
from tests.relay.fakes import TelemetryReceiver, start_server, wait_for

Req = tm.PublishPoolTelemetryRequest
PER_DELTA = 2000  # ~32 KiB a delta: a stalled receiver's flow control backs the relay's writes up


def _delta(sequence: int, n: int) -> bytes:
    return Req(
        kv_delta=tm.KvDelta(sequence=sequence, stored=range(n), removed=range(n, 2 * n))
    ).SerializeToString()


def _reports() -> list[bytes]:
    return [
        Req(load=tm.LoadReport(load=pe.PoolLoad(requests_running=3))).SerializeToString(),
        Req(
            readiness=tm.ReadinessReport(models=[pe.ModelStatus(model="m", state=pe.MODEL_STATE_READY)])
        ).SerializeToString(),
        Req(drain=tm.DrainReport(drain=pe.DrainStatus(state=pe.DRAIN_STATE_ACTIVE))).SerializeToString(),
        Req(heartbeat=tm.TelemetryHeartbeat()).SerializeToString(),
    ]


def test_batch_wire_is_protobufs_own_encoding():
    # Small and large parts: lengths of one, two and three varint bytes.
    parts = [*_reports(), _delta(7, 1), _delta(8, 1000), _delta(9, 0)]
    data = batch_wire(parts)
    parsed = Req.FromString(data)
    assert parsed.WhichOneof("payload") == "batch"
    assert [m.SerializeToString() for m in parsed.batch.messages] == parts
    built = Req(batch=tm.TelemetryBatch(messages=[Req.FromString(p) for p in parts]))
    assert data == built.SerializeToString()


class _Call:
    """A call that records what is written."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.written.append(data)


def _publisher() -> Publisher:
    hub = TelemetryHub(
        TelemetryConfig(pool_id="p", relay_id="r", incarnation=1, region="x"), PoolBlocks(), SystemClock()
    )
    return Publisher(hub, "http://127.0.0.1:1")


async def test_what_is_queued_goes_as_one_batch_reports_first():
    pub = _publisher()
    call = _Call()
    reports = _reports()
    for kind, data in zip(("load", "readiness", "drain", "heartbeat"), reports, strict=True):
        pub.offer(kind, data)
    deltas = [_delta(s, 5) for s in (1, 2, 3)]
    pub._resync = False
    for s, d in enumerate(deltas, 1):
        pub.enqueue_delta(s, d)
    pub.batching = True
    await pub._write_queued(call)
    assert len(call.written) == 1
    assert [m.SerializeToString() for m in Req.FromString(call.written[0]).batch.messages] == reports + deltas
    assert pub.queue_depth == 0 and pub.messages_sent == 7 and pub.batches_sent == 1
    # A single queued message goes out unwrapped.
    pub.enqueue_delta(4, d4 := _delta(4, 5))
    await pub._write_queued(call)
    assert call.written[1] == d4 and pub.batches_sent == 1
    await pub.close()


async def test_a_batch_is_bounded_in_count_and_bytes():
    pub = _publisher()
    call = _Call()
    pub._resync = False
    pub.batching = True
    small = [_delta(s, 1) for s in range(1, MAX_BATCH + 11)]
    for s, d in enumerate(small, 1):
        pub.enqueue_delta(s, d)
    await pub._write_queued(call)
    assert len(Req.FromString(call.written[0]).batch.messages) == MAX_BATCH
    await pub._write_queued(call)
    assert len(Req.FromString(call.written[1]).batch.messages) == 10
    big = _delta(1, 20_000)  # ~320 KB: two do not fit one batch
    assert 2 * len(big) > BATCH_BYTES
    pub.enqueue_delta(1, big)
    pub.enqueue_delta(2, big)
    await pub._write_queued(call)
    assert call.written[2] == big and pub.queue_depth == 1
    await pub.close()


async def test_without_an_accepting_ack_one_message_per_write():
    pub = _publisher()
    call = _Call()
    pub._resync = False
    for kind, data in zip(("load", "drain"), _reports()[:2], strict=True):
        pub.offer(kind, data)
    pub.enqueue_delta(1, d1 := _delta(1, 5))
    assert not pub.batching  # until an ack says otherwise
    await pub._write_queued(call)
    await pub._write_queued(call)
    await pub._write_queued(call)
    assert call.written == [*_reports()[:2], d1] and pub.batches_sent == 0
    await pub.close()


async def _backlog_then_resume(accepts_batches: bool) -> tuple[TelemetryReceiver, Publisher, PoolBlocks]:
    """A relay whose stream backs up behind a stalled receiver (deltas and a drain report queue),
    then drains it once the receiver reads again."""
    recv = TelemetryReceiver(accepts_batches=accepts_batches)
    server, addr = await start_server((tm_grpc.add_TelemetryServiceServicer_to_server, recv))
    url = f"http://{addr}"
    blocks = PoolBlocks()
    config = TelemetryConfig(pool_id="p", relay_id="r", incarnation=1, region="x", report_interval=30)
    hub = TelemetryHub(config, blocks, SystemClock())
    hub.set_frontends(static=[url])
    pub = hub.publishers[url]
    try:
        await wait_for(lambda: recv.snapshots, message="first snapshot")
        await wait_for(lambda: pub.batching == accepts_batches, message="the ack read")
        recv.stall()
        for i in range(300):
            new = range((i + 1) * PER_DELTA, (i + 2) * PER_DELTA)
            blocks.apply_event(
                "w", stored=new, removed=range(i * PER_DELTA, (i + 1) * PER_DELTA) if i else ()
            )
            hub.flush()
            await asyncio.sleep(0.005)
            if pub.queue_depth >= 8:
                break
        assert pub.queue_depth >= 8, "the stalled receiver held the relay's writes back"
        hub.set_drain(pe.DrainStatus(state=pe.DRAIN_STATE_DRAINING))
        recv.resume()
        await wait_for(
            lambda: recv.sequence == blocks.sequence and recv.drains, within=20, message="caught up"
        )
        assert recv.blocks == set(range((i + 1) * PER_DELTA, (i + 2) * PER_DELTA))
        assert recv.errors == []
        return recv, pub, blocks
    finally:
        await hub.close()
        await server.stop(0)


@pytest.mark.timeout(60)
async def test_relay_batches_after_an_accepting_ack():
    recv, pub, _ = await _backlog_then_resume(accepts_batches=True)
    assert recv.batches >= 1 and pub.batches_sent == recv.batches
    assert max(recv.batch_sizes) > 1
    # The drain report queued behind the deltas went out first (as it does unbatched).
    assert recv.kinds.index("drain") < len(recv.kinds) - 1
    assert recv.writes < pub.messages_sent - 1  # fewer gRPC messages than messages (hello aside)


@pytest.mark.timeout(60)
async def test_relay_sends_no_batch_to_a_frontend_whose_ack_does_not_accept_them():
    # An older frontend: its ack has no accepts_batches (false); it gets one message per write.
    recv, pub, _ = await _backlog_then_resume(accepts_batches=False)
    assert recv.batches == 0 and pub.batches_sent == 0
    assert recv.writes == pub.messages_sent - 1  # every message but the hello, one write each


# -- the write interval a frontend's ack asks for (TelemetryHelloAck.batch_interval) ------------


class _Stream:
    """A telemetry call that records each write with the fake clock's time, and answers the hello
    with `ack` (then nothing until cancelled)."""

    def __init__(self, clock: FakeClock, ack: tm.TelemetryHelloAck) -> None:
        self.clock = clock
        self.ack = ack
        self.written: list[tuple[float, Req]] = []
        self._ended = asyncio.Event()

    async def write(self, data: bytes) -> None:
        self.written.append((self.clock.monotonic(), Req.FromString(data)))

    def __aiter__(self):
        return self._responses()

    async def _responses(self):
        yield tm.PublishPoolTelemetryResponse(hello_ack=self.ack)
        await self._ended.wait()

    def cancel(self) -> None:
        self._ended.set()


def _ack(interval: float | None) -> tm.TelemetryHelloAck:
    ack = tm.TelemetryHelloAck(frontend_id="f", accepts_batches=True)
    if interval is not None:
        ack.batch_interval.CopyFrom(duration(interval))
    return ack


async def _streaming(
    ack: tm.TelemetryHelloAck, queue_limit: int = 1024
) -> tuple[Publisher, _Stream, FakeClock]:
    """A publisher on a fake clock and a fake call, past its hello and first snapshot."""
    clock = FakeClock()
    config = TelemetryConfig(
        pool_id="p", relay_id="r", incarnation=1, region="x", report_interval=30, queue_limit=queue_limit
    )
    hub = TelemetryHub(config, PoolBlocks(), clock)
    pub = Publisher(hub, "http://127.0.0.1:1")
    stream = _Stream(clock, ack)
    pub._publish = lambda metadata=(): stream  # type: ignore[assignment]
    hub.publishers[pub.url] = pub
    pub.start()
    await wait_for(lambda: pub.batching and pub.snapshots_sent == 1, message="ack read, snapshot sent")
    return pub, stream, clock


def _kinds(msg: Req) -> list[str]:
    if msg.WhichOneof("payload") == "batch":
        return [str(m.WhichOneof("payload")) for m in msg.batch.messages]
    return [str(msg.WhichOneof("payload"))]


async def test_a_stream_writes_one_batch_per_interval_when_its_frontend_asks():
    pub, stream, clock = await _streaming(_ack(1.0))
    try:
        assert pub.batch_interval == 1.0
        start = clock.monotonic()
        written = len(stream.written)  # the hello and the snapshot
        pub.enqueue_delta(1, _delta(1, 5))  # nothing written for a while: at once
        await wait_for(lambda: len(stream.written) == written + 1, message="first delta")
        assert stream.written[-1][0] == start
        pub.enqueue_delta(2, _delta(2, 5))
        pub.offer("load", _reports()[0])
        pub.enqueue_delta(3, _delta(3, 5))
        await wait_for(lambda: clock.parked_at(start + 1.0), message="the stream waits out its interval")
        await clock.advance(0.5)
        assert len(stream.written) == written + 1, "held until the interval has passed"
        await clock.advance(0.5)
        await wait_for(lambda: len(stream.written) == written + 2, message="the batch")
        at, msg = stream.written[-1]
        assert at == start + 1.0 and _kinds(msg) == ["load", "kv_delta", "kv_delta"]
        assert pub.batches_sent == 1 and pub.queue_depth == 0
    finally:
        await pub.close()


async def test_no_message_waits_longer_than_the_interval():
    pub, stream, clock = await _streaming(_ack(1.0))
    try:
        written = len(stream.written)
        queued_at: dict[int, float] = {}
        for seq in range(1, 31):  # a delta every 0.1 s for 3 s
            queued_at[seq] = clock.monotonic()
            pub.enqueue_delta(seq, _delta(seq, 2))
            await clock.settle(10)
            await clock.advance(0.1)
        await clock.advance(1.0)
        await wait_for(lambda: pub.queue_depth == 0, message="all written")
        sent_at: dict[int, float] = {}
        for at, msg in stream.written[written:]:
            inner = msg.batch.messages if msg.WhichOneof("payload") == "batch" else [msg]
            for m in inner:
                sent_at[m.kv_delta.sequence] = at
        assert sorted(sent_at) == list(range(1, 31))
        assert max(sent_at[s] - queued_at[s] for s in sent_at) <= 1.0 + 1e-6
        writes = [at for at, _ in stream.written[written:]]
        assert len(writes) <= 5  # the first at once, then one per second (not one per delta)
        assert all(b - a >= 1.0 - 1e-6 for a, b in itertools.pairwise(writes))
    finally:
        await pub.close()


async def test_a_snapshot_a_full_batch_and_an_overflow_are_not_held_back():
    pub, stream, clock = await _streaming(_ack(2.0), queue_limit=300)
    try:
        start = clock.monotonic()
        pub.enqueue_delta(1, _delta(1, 5))
        await wait_for(lambda: pub.queue_depth == 0, message="first delta")
        # A snapshot the frontend asks for goes at once (the delta held behind it is in it).
        pub.enqueue_delta(2, _delta(2, 5))
        await wait_for(lambda: clock.parked_at(start + 2.0), message="held")
        pub.request_snapshot()
        await wait_for(lambda: pub.snapshots_sent == 2, message="snapshot")
        assert stream.written[-1][0] == start and _kinds(stream.written[-1][1]) == ["kv_snapshot"]
        # A full batch goes at once.
        for seq in range(1, MAX_BATCH + 1):
            pub.enqueue_delta(seq, _delta(seq, 1))
        await wait_for(lambda: pub.queue_depth == 0, message="full batch")
        at, msg = stream.written[-1]
        assert at == start and len(msg.batch.messages) == MAX_BATCH
        # So does a batch full in bytes (two such deltas do not fit one: the first goes alone).
        big = _delta(1, 20_000)
        pub.enqueue_delta(1, big)
        pub.enqueue_delta(2, big)
        await wait_for(lambda: pub.queue_depth == 1, message="a batch's bytes")
        assert stream.written[-1] == (start, Req.FromString(big)) and pub._delta_bytes == len(big)
        # A queue that overflows while held still gets a fresh snapshot at once.
        for seq in range(1, 302):
            pub.enqueue_delta(seq, _delta(seq, 1))
        await wait_for(lambda: pub.snapshots_sent == 3, message="snapshot after the overflow")
        assert stream.written[-1][0] == start and pub.messages_dropped >= 301
    finally:
        await pub.close()


@pytest.mark.parametrize(
    ("asked", "taken"), [(None, 0.0), (0.0, 0.0), (-1.0, 0.0), (0.25, 0.25), (3600.0, 5.0)]
)
async def test_the_asked_interval_is_bounded(asked, taken):
    pub, _stream, _clock = await _streaming(_ack(asked))
    try:
        assert pub.batch_interval == taken
    finally:
        await pub.close()

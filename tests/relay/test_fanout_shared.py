"""Fan-out work is shared: each delta is serialized once for every stream, the bytes are protobuf's,
and while streams are busy the hub sends fewer, larger deltas, each stream still gap-free."""

from __future__ import annotations

import asyncio

import pytest

from meshkit.clock import SystemClock
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.telemetry_publisher import TelemetryConfig, TelemetryHub
from poolrelay.v1 import telemetry_pb2 as tm
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc
from tests.relay.fakes import TelemetryReceiver, start_server, wait_for

Req = tm.PublishPoolTelemetryRequest


class FakePublisher:
    """Records what the hub hands a stream; `backlogged` as the test sets it."""

    def __init__(self) -> None:
        self.deltas: list[tuple[int, bytes]] = []
        self.offers: dict[str, bytes] = {}
        self.backlogged = False

    def enqueue_delta(self, sequence: int, data: bytes) -> None:
        self.deltas.append((sequence, data))

    def offer(self, kind: str, data: bytes) -> None:
        self.offers[kind] = data


def hub_with(n: int, **config) -> tuple[TelemetryHub, PoolBlocks, list[FakePublisher]]:
    blocks = PoolBlocks()
    cfg = TelemetryConfig(pool_id="p", relay_id="r", incarnation=1, region="x", report_interval=30, **config)
    hub = TelemetryHub(cfg, blocks, SystemClock())
    fakes = [FakePublisher() for _ in range(n)]
    hub.publishers = {f"http://f{i}": f for i, f in enumerate(fakes)}  # type: ignore[misc]
    return hub, blocks, fakes


async def test_every_stream_gets_the_same_protobuf_bytes():
    hub, blocks, fakes = hub_with(3)
    blocks.apply_event("w", stored=[1, 2**64 - 1, 12345], removed=[])
    hub.flush()
    blocks.apply_event("w", stored=[7], removed=[1])
    hub.flush()
    expected = [
        Req(kv_delta=tm.KvDelta(sequence=1, stored=sorted([1, 2**64 - 1, 12345]))),
        Req(kv_delta=tm.KvDelta(sequence=2, stored=[7], removed=[1])),
    ]
    for f in fakes:
        assert [s for s, _ in f.deltas] == [1, 2]
        # Sets come out in any order: compare the parsed sets, then the bytes of that very message.
        got = [Req.FromString(d) for _, d in f.deltas]
        assert sorted(got[0].kv_delta.stored) == sorted(expected[0].kv_delta.stored)
        for (_, data), msg in zip(f.deltas, got, strict=True):
            assert data == msg.SerializeToString()
            assert (
                data
                == Req(
                    kv_delta=tm.KvDelta(
                        sequence=msg.kv_delta.sequence,
                        stored=msg.kv_delta.stored,
                        removed=msg.kv_delta.removed,
                    )
                ).SerializeToString()
            )
        assert got[1] == expected[1] and f.deltas[1][1] == expected[1].SerializeToString()
        assert f.deltas[0][1] is fakes[0].deltas[0][1], "one bytes object for every stream"
    hub._report("drain", Req(drain=tm.DrainReport()), changed=True)
    assert {f.offers["drain"] for f in fakes} == {Req(drain=tm.DrainReport()).SerializeToString()}


async def hub_streaming_to(n: int):
    """A relay's hub streaming to `n` real receiving frontends: (receivers, servers, blocks, hub)."""
    receivers = [TelemetryReceiver() for _ in range(n)]
    servers, urls = [], []
    for recv in receivers:
        server, addr = await start_server((tm_grpc.add_TelemetryServiceServicer_to_server, recv))
        servers.append(server)
        urls.append(f"http://{addr}")
    blocks = PoolBlocks()
    config = TelemetryConfig(pool_id="p", relay_id="r", incarnation=1, region="x", report_interval=30)
    hub = TelemetryHub(config, blocks, SystemClock())
    hub.set_frontends(static=urls)
    return receivers, servers, blocks, hub


@pytest.mark.timeout(60)
async def test_a_delta_is_serialized_once_whatever_the_number_of_frontends(monkeypatch):
    calls: list[str | None] = []
    original = Req.SerializeToString

    def counting(self, *args, **kwargs):
        calls.append(self.WhichOneof("payload"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Req, "SerializeToString", counting)
    receivers, servers, blocks, hub = await hub_streaming_to(5)
    try:
        await wait_for(lambda: all(r.snapshots for r in receivers), within=20, message="first snapshots")
        calls.clear()
        for i in range(10):
            blocks.apply_event(
                "w", stored=range(i * 100, (i + 1) * 100), removed=range((i - 1) * 100, i * 100)
            )
            hub.flush()
        await wait_for(
            lambda: all(r.sequence == blocks.sequence for r in receivers), within=20, message="deltas"
        )
        assert calls.count("kv_delta") == 10, (
            f"serialized {calls.count('kv_delta')} times for 10 deltas, 5 streams"
        )
        assert all(r.errors == [] and r.blocks == set(range(900, 1000)) for r in receivers)
    finally:
        await hub.close()
        for s in servers:
            await s.stop(0)


async def test_busy_streams_hold_the_delta_until_they_catch_up():
    hub, blocks, fakes = hub_with(2, batch_window=0.001, batch_max_delay=30.0)
    fakes[1].backlogged = True
    blocks.apply_event("w", stored=[1, 2])
    hub.blocks_changed()
    await asyncio.sleep(0.05)
    blocks.apply_event("w", stored=[3], removed=[2])
    hub.blocks_changed()
    await asyncio.sleep(0.05)
    assert hub.deltas_published == 0, "held while a stream still writes earlier deltas"
    fakes[1].backlogged = False
    hub.stream_caught_up()
    assert hub.deltas_published == 1
    msg = Req.FromString(fakes[0].deltas[0][1])
    assert (
        msg.kv_delta.sequence == 1
        and sorted(msg.kv_delta.stored) == [1, 3]
        and list(msg.kv_delta.removed) == []
    )


async def test_a_held_delta_goes_out_after_the_max_delay():
    hub, blocks, fakes = hub_with(2, batch_window=0.001, batch_max_delay=0.05)
    fakes[0].backlogged = True  # e.g. a stalled frontend: the others must not wait for it for long
    blocks.apply_event("w", stored=[1])
    hub.blocks_changed()
    await wait_for(lambda: hub.deltas_published == 1, within=10, message="delta after the max delay")
    assert [s for s, _ in fakes[1].deltas] == [1]


async def test_a_delta_never_grows_past_a_chunk():
    hub, blocks, fakes = hub_with(1, chunk_size=4, batch_max_delay=30.0)
    fakes[0].backlogged = True
    for i in range(10):
        blocks.apply_event("w", stored=[i])
        hub.blocks_changed()
    sizes = [len(Req.FromString(d).kv_delta.stored) for _, d in fakes[0].deltas]
    assert sizes == [4, 4], "flushed at once at chunk_size, however busy the streams are"
    hub.flush()
    assert [s for s, _ in fakes[0].deltas] == [1, 2, 3]


@pytest.mark.timeout(60)
async def test_unpaced_events_reach_every_frontend_in_order():
    receivers, servers, blocks, hub = await hub_streaming_to(6)
    try:
        await wait_for(lambda: all(r.snapshots for r in receivers), within=20, message="first snapshots")
        for i in range(3000):  # as fast as it goes: deltas coalesce while the streams are busy
            blocks.apply_event(
                f"w{i % 3}", stored=range(i * 8, i * 8 + 8), removed=range((i - 30) * 8, (i - 29) * 8)
            )
            hub.blocks_changed()
            if i % 64 == 0:
                await asyncio.sleep(0)
        hub.flush()
        want = set(blocks.snapshot()[1])
        await wait_for(
            lambda: all(r.sequence == blocks.sequence for r in receivers), within=30, message="every delta"
        )
        for r in receivers:
            assert r.errors == [] and r.blocks == want and r.snapshots == 1
            assert r.deltas == blocks.sequence, "numbered deltas, none skipped"
    finally:
        await hub.close()
        for s in servers:
            await s.stop(0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("batch_window", 0.0), ("batch_max_delay", -1.0), ("chunk_size", 0), ("queue_limit", 0)],
)
def test_bad_batching_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        TelemetryConfig(pool_id="p", relay_id="r", incarnation=1, region="x", **{field: value})

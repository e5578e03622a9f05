"""Telemetry ingestion over real gRPC streams: snapshot, deltas, gaps, incarnations, broken streams."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from globalrouter.selection import pool_overlaps
from meshkit.blocks import block_hashes
from meshkit.errors import Reason, reason_of
from meshkit.validation import bad_request_fields
from poolrelay.v1 import pool_events_pb2, telemetry_pb2
from tests.router.fakes import FakeRelay, eventually, pool_msg, start_router

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["exact", "summary"])
async def router(request):
    r, _stub, channel = await start_router(kv_state=request.param)
    yield r
    await channel.close()
    await r.handle.server.stop(0)


def overlaps(router, tokens, pool_id="p1"):
    pool = router.core.table.pools[pool_id]
    hashes = block_hashes(tokens, pool.block_size)
    now = router.clock.monotonic()
    return pool_overlaps(router.core.index, [pool], hashes, now, router.config.freshness)[pool_id]


PROMPT = list(range(64))  # four blocks of 16
HASHES = block_hashes(PROMPT, 16)


async def test_snapshot_in_chunks_then_deltas(router):
    relay = FakeRelay(f"127.0.0.1:{router.port}")
    ack = await relay.open("p1", model="m", region="eu")
    assert ack.hello_ack.frontend_id == router.config.frontend_id
    await relay.send(
        kv_snapshot=telemetry_pb2.KvSnapshot(
            snapshot_id=1, sequence=5, chunk_index=0, block_hashes=HASHES[:1]
        )
    )
    await relay.send(
        kv_snapshot=telemetry_pb2.KvSnapshot(
            snapshot_id=1, sequence=5, chunk_index=1, last=True, block_hashes=HASHES[1:2]
        )
    )
    await eventually(lambda: "p1" in router.core.table.pools and router.core.table.pools["p1"].kv_sources)
    pool = router.core.table.pools["p1"]
    assert not pool.listed and pool.model == "m" and pool.region == "eu"  # accepted before the directory
    assert overlaps(router, PROMPT) == 2
    await relay.send(kv_delta=telemetry_pb2.KvDelta(sequence=6, stored=HASHES[2:4]))
    await eventually(lambda: overlaps(router, PROMPT) == 4)
    await relay.send(kv_delta=telemetry_pb2.KvDelta(sequence=7, removed=[HASHES[1]]))
    await eventually(lambda: overlaps(router, PROMPT) == 1)
    await relay.close()


async def test_gap_asks_for_snapshot_and_ignores_deltas_until_it(router):
    relay = FakeRelay(f"127.0.0.1:{router.port}")
    await relay.open("p1")
    await relay.send(
        kv_snapshot=telemetry_pb2.KvSnapshot(snapshot_id=1, sequence=0, last=True, block_hashes=HASHES[:1])
    )
    await relay.send(kv_delta=telemetry_pb2.KvDelta(sequence=2, stored=HASHES[1:2]))  # 1 is missing
    answer = await relay.read()
    assert answer.snapshot_request.reason == "gap: expected 1, got 2"
    await relay.send(kv_delta=telemetry_pb2.KvDelta(sequence=3, stored=HASHES[1:3]))  # ignored
    await relay.send(
        kv_snapshot=telemetry_pb2.KvSnapshot(snapshot_id=2, sequence=10, last=True, block_hashes=HASHES[:2])
    )
    await relay.send(kv_delta=telemetry_pb2.KvDelta(sequence=11, stored=HASHES[2:3]))
    await eventually(lambda: overlaps(router, PROMPT) == 3)
    assert router.metrics.telemetry_snapshot_requests._value.get() == 1
    await relay.close()


async def test_signals_land_in_pool_state(router):
    relay = FakeRelay(f"127.0.0.1:{router.port}")
    await relay.open("p1")
    await relay.send(
        load=telemetry_pb2.LoadReport(
            load=pool_events_pb2.PoolLoad(requests_running=3, max_running_requests=8)
        )
    )
    await relay.send(
        readiness=telemetry_pb2.ReadinessReport(
            models=[pool_events_pb2.ModelStatus(model="m", state=pool_events_pb2.MODEL_STATE_NOT_READY)]
        )
    )
    await relay.send(
        drain=telemetry_pb2.DrainReport(
            drain=pool_events_pb2.DrainStatus(state=pool_events_pb2.DRAIN_STATE_DRAINING)
        )
    )
    await eventually(
        lambda: "p1" in router.core.table.pools and router.core.table.pools["p1"].telemetry_draining
    )
    pool = router.core.table.pools["p1"]
    assert pool.load.requests_running == 3 and pool.load_at is not None
    assert pool.models_ready == {"m": False} and pool.state_at is not None
    await relay.close()


async def test_newer_incarnation_replaces_older_stream(router):
    old = FakeRelay(f"127.0.0.1:{router.port}")
    await old.open("p1", incarnation=1)
    await old.send(kv_snapshot=telemetry_pb2.KvSnapshot(snapshot_id=1, last=True, block_hashes=HASHES))
    await eventually(lambda: "p1" in router.core.table.pools and overlaps(router, PROMPT) == 4)
    new = FakeRelay(f"127.0.0.1:{router.port}")
    await new.open("p1", incarnation=2)
    await eventually(lambda: not router.core.table.pools["p1"].kv_sources)  # the old state went at once
    await new.send(kv_snapshot=telemetry_pb2.KvSnapshot(snapshot_id=1, last=True, block_hashes=HASHES[:1]))
    await eventually(lambda: overlaps(router, PROMPT) == 1)
    # The old stream's later messages are refused, and its end does not touch the new state.
    await old.send(kv_delta=telemetry_pb2.KvDelta(sequence=1, stored=HASHES[1:]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await old.read()
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert reason_of(err.value) == Reason.TELEMETRY_SUPERSEDED
    await old.close()
    await eventually(lambda: router.core.table.stream_counts.get("p1") == 1)  # the old stream is closed
    assert overlaps(router, PROMPT) == 1
    # An older incarnation than the one streaming now is refused.
    stale = FakeRelay(f"127.0.0.1:{router.port}")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stale.open("p1", incarnation=1)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert reason_of(err.value) == Reason.TELEMETRY_STALE_INCARNATION
    await stale.close()
    await new.close()


async def test_lower_incarnation_than_directory_lease_is_denied(router):
    router.core.table.apply_listed(
        pool_msg("p1", "http://127.0.0.1:1", leases=[{"relay_id": "relay-1", "incarnation": 7}])
    )
    relay = FakeRelay(f"127.0.0.1:{router.port}")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await relay.open("p1", incarnation=6)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "newer incarnation" in err.value.details()
    await relay.close()


async def test_broken_stream_clears_only_its_own_state(router):
    if router.config.kv_state == "summary":
        pytest.skip("per-stream sets: the summary's relays share the pool's set (test_telemetry_summary)")
    a, b = FakeRelay(f"127.0.0.1:{router.port}"), FakeRelay(f"127.0.0.1:{router.port}")
    await a.open("p1", relay_id="relay-a")
    await b.open("p1", relay_id="relay-b")
    await a.send(kv_snapshot=telemetry_pb2.KvSnapshot(snapshot_id=1, last=True, block_hashes=HASHES))
    await b.send(kv_snapshot=telemetry_pb2.KvSnapshot(snapshot_id=1, last=True, block_hashes=HASHES[:2]))
    await b.send(load=telemetry_pb2.LoadReport(load=pool_events_pb2.PoolLoad(requests_running=1)))
    await eventually(lambda: len(router.core.table.pools["p1"].kv_sources) == 2)
    assert overlaps(router, PROMPT) == 4
    await a.close()  # relay-a's stream breaks
    await eventually(lambda: len(router.core.table.pools["p1"].kv_sources) == 1)
    pool = router.core.table.pools["p1"]
    assert overlaps(router, PROMPT) == 2
    assert pool.load is not None and router.core.table.stream_counts["p1"] == 1
    await b.close()  # the pool's last stream: its signals become unknown, the unlisted pool goes
    await eventually(lambda: "p1" not in router.core.table.pools)


async def test_bad_hello_names_the_fields(router):
    relay = FakeRelay(f"127.0.0.1:{router.port}")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await relay.open("", incarnation=0, protocol_version=2, block_size=0, hash_scheme=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(bad_request_fields(err.value)) == {
        "hello.pool_id",
        "hello.incarnation",
        "hello.protocol_version",
        "hello.block_size",
        "hello.hash_scheme",
    }
    await relay.close()


async def test_stop_ends_telemetry_streams_at_once_without_waiting_for_their_next_message(router):
    relay = FakeRelay(f"127.0.0.1:{router.port}")
    await relay.open("p1")
    await relay.send(kv_snapshot=telemetry_pb2.KvSnapshot(snapshot_id=1, last=True, block_hashes=HASHES))
    await eventually(lambda: "p1" in router.core.table.pools and router.core.table.pools["p1"].kv_sources)
    router.telemetry.end_streams()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(relay.read(), 10)  # the relay sends nothing more
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert reason_of(err.value) == Reason.SHUTTING_DOWN
    await eventually(lambda: "p1" not in router.core.table.pools)
    await relay.close()


async def test_a_streamed_message_that_does_not_parse_is_invalid_argument_naming_the_field(router):
    """Streamed requests are parsed like unary ones: invalid UTF-8 names its field, not UNKNOWN."""
    hello = telemetry_pb2.PublishPoolTelemetryRequest(hello=telemetry_pb2.TelemetryHello(pool_id="AAAA"))
    raw = hello.SerializeToString().replace(b"AAAA", b"\xff\xfeAA")
    release = asyncio.Event()

    async def requests():
        yield raw
        await release.wait()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        call = channel.stream_stream(
            "/poolrelay.v1.TelemetryService/PublishPoolTelemetry",
            request_serializer=bytes,
            response_deserializer=bytes,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call(requests(), timeout=10):
                pass
        release.set()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["hello.pool_id"]
    assert router.core.table.stream_counts == {}

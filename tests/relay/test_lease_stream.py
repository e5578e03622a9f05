"""The relay's registrations over a KeepAlivePools stream: one stream, broken → failed call →
retried on the heartbeat schedule, silent → failed, refused per message, UNIMPLEMENTED → unary."""

from __future__ import annotations

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from meshkit.clock import FakeClock
from poolrelay.lease_stream import KeepAliveClient, StreamBroken
from poolrelay.relay import Relay, RelayConfig
from poolrelay.v1 import pool_events_pb2_grpc as pe_grpc
from tests.relay.fakes import FakeDiscovery, FakePool, UnaryOnlyDiscovery, start_server, wait_for

pytestmark = pytest.mark.timeout(30)


def config(pool: str, discovery: str) -> RelayConfig:
    return RelayConfig(
        pool=pool,
        discovery=discovery,
        pool_id="pool-a",
        region="eu",
        frontends=("http://127.0.0.1:9000",),
        relay_id="relay-1",
        incarnation=7,
    )


@pytest.fixture
async def started():
    """Starts a FakePool and the given discovery servicer; yields a function making a relay on them."""
    servers = []
    relays = []

    async def start(disco: FakeDiscovery, clock=None) -> Relay:
        pool_server, pool = await start_server(
            (pe_grpc.add_PoolEventsServiceServicer_to_server, FakePool({"m1": True}))
        )
        disco_server, address = await start_server((dpb_grpc.add_DiscoveryServiceServicer_to_server, disco))
        servers.extend([pool_server, disco_server])
        relay = Relay(config(pool, address), clock=clock)
        relays.append(relay)
        await relay.start()
        return relay

    yield start
    for relay in relays:
        if not relay.stopped:
            await relay.stop()
    for server in servers:
        await server.stop(0)


async def test_renewals_go_over_one_stream(started):
    # The relay waits for each reply at most one heartbeat, then drops the stream: on a 0.1 s
    # heartbeat a reply held up by a loaded machine opened a second stream. 1 s, as the fallback test.
    disco = FakeDiscovery(heartbeat=1.0, lease=3.0)
    relay = await started(disco)
    await wait_for(lambda: len(disco.registers) >= 3, message="a registration and two renewals")
    assert set(disco.transports) == {"stream"}
    assert disco.streams_opened == relay.keepalive.streams_opened == 1
    assert {(r.pool_id, r.model, r.relay_id, r.incarnation) for r in disco.registers} == {
        ("pool-a", "m1", "relay-1", 7)
    }
    assert relay.registered_model == "m1" and relay.call_error == ""
    n = len(disco.registers)
    await relay.stop()
    assert disco.unregisters == [], "a stop only stops renewing (PR #18077)"
    assert len(disco.registers) == n, "no renewal after the stop"


async def break_a_renewal(started) -> tuple[FakeClock, FakeDiscovery, Relay, float]:
    """A relay on a FakeClock whose first renewal (5 s after its registration) meets a stream that
    breaks; returns once that failure is recorded, with the registration's time."""
    clock = FakeClock()
    disco = FakeDiscovery(heartbeat=5.0, lease=15.0)
    relay = await started(disco, clock)
    await wait_for(lambda: len(disco.registers) == 1, message="the first registration")
    start = clock.monotonic()
    # The discovery saw the registration; the relay may not have parked until its renewal yet.
    await wait_for(lambda: clock.parked_at(start + 5.0), message="the relay waiting for its renewal")
    disco.break_streams = True
    await clock.advance(5.0)
    await wait_for(lambda: relay.call_error != "", message="the failed renewal")
    return clock, disco, relay, start


async def test_a_broken_stream_is_a_failed_call_retried_on_schedule_over_a_new_stream(started):
    clock, disco, relay, start = await break_a_renewal(started)
    assert "UNAVAILABLE" in relay.call_error
    assert relay.heartbeat.schedule.next_at == start + 5.0 + 1.0  # retried after 1 s
    disco.break_streams = False
    await wait_for(lambda: clock.parked_at(start + 6.0), message="the relay waiting for its retry")
    await clock.advance(0.9)
    assert len(disco.registers) == 1 and disco.streams_opened == 1
    await clock.advance(0.1)
    await wait_for(lambda: len(disco.registers) == 2, message="the retry")
    await wait_for(lambda: relay.call_error == "", message="the success recorded")
    assert disco.streams_opened == 2 and disco.transports == ["stream", "stream"]
    assert relay.heartbeat.schedule.next_at == start + 6.0 + 5.0  # back on the interval


async def test_a_second_failure_doubles_the_wait(started):
    clock, disco, relay, start = await break_a_renewal(started)
    await wait_for(lambda: clock.parked_at(start + 6.0), message="the relay waiting for its retry")
    await clock.advance(1.0)
    await wait_for(lambda: disco.streams_opened == 2, message="the retry's new stream")
    await wait_for(lambda: relay.heartbeat.schedule.next_at == start + 6.0 + 2.0, message="a 2 s wait")
    assert len(disco.registers) == 1


async def test_a_reply_that_does_not_come_fails_the_call_and_drops_the_stream():
    disco = FakeDiscovery()
    server, address = await start_server((dpb_grpc.add_DiscoveryServiceServicer_to_server, disco))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            client = KeepAliveClient(dpb_grpc.DiscoveryServiceStub(channel), unary_timeout=3.0)
            req = dpb.RegisterPoolRequest(pool_id="pool-a", model="m1", relay_id="r", incarnation=1)
            await client.register(req, 2.0)
            disco.replying.clear()
            with pytest.raises(StreamBroken, match=r"no KeepAlivePools reply within 0\.2 s"):
                await client.register(req, 0.2)
            disco.replying.set()
            reply = await client.register(req, 2.0)
            assert reply.heartbeat_interval.ToNanoseconds() == 200_000_000
            assert client.streams_opened == disco.streams_opened == 2
            await client.close()
    finally:
        await server.stop(0)


async def test_a_refused_message_fails_only_its_call(started):
    disco = FakeDiscovery(heartbeat=0.1, lease=0.5)
    relay = await started(disco)
    await wait_for(lambda: len(disco.registers) >= 1, message="the first registration")
    disco.fail = True
    await wait_for(lambda: relay.call_error != "", message="a refused renewal")
    assert relay.call_error == "UNAVAILABLE: fake discovery told to fail"
    disco.fail = False
    n = len(disco.registers)
    await wait_for(lambda: len(disco.registers) > n and relay.call_error == "", message="renewals again")
    assert disco.streams_opened == 1  # the refusals did not end the stream


async def test_unimplemented_stream_falls_back_to_unary(started):
    # A 1 s heartbeat: a renewal's reply is late after min(heartbeat, 2 s), and a loaded machine must
    # not turn a slow reply into the failure this test says the fallback is not.
    disco = UnaryOnlyDiscovery(heartbeat=1.0, lease=3.0)
    relay = await started(disco)
    await wait_for(lambda: len(disco.registers) >= 2, message="unary registrations")
    assert set(disco.transports) == {"unary"}
    assert relay.keepalive.unary
    # 1, or 2 when a loaded machine let the first attempt's UNIMPLEMENTED come after its timeout.
    opened = relay.keepalive.streams_opened
    assert opened in (1, 2)
    n = len(disco.registers)
    await wait_for(lambda: len(disco.registers) >= n + 2, message="more unary renewals")
    assert relay.keepalive.streams_opened == opened, "no stream is tried once the fallback is taken"
    assert set(disco.transports) == {"unary"}
    assert relay.call_error == ""  # the fallback is not a failure

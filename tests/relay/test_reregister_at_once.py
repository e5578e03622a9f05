"""A relay whose renewals fail while discovery is down registers again as soon as discovery answers
(its channel connects), not at the end of its doubled retry wait: a pool whose lease lapsed in the
outage is listed again that much sooner."""

from __future__ import annotations

import time

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from poolrelay.relay import Relay, RelayConfig
from poolrelay.v1 import pool_events_pb2_grpc as pe_grpc
from tests.relay.fakes import FakeDiscovery, FakePool, start_server, wait_for

HEARTBEAT = 4.0
"""The interval discovery dictates: the retry waits double 1, 2, 4 s, capped at it."""


@pytest.mark.timeout(60)
async def test_the_relay_registers_as_soon_as_discovery_answers_again():
    pool = FakePool({"m1": True})
    disco = FakeDiscovery(heartbeat=HEARTBEAT, lease=60.0)
    pool_server, pool_address = await start_server((pe_grpc.add_PoolEventsServiceServicer_to_server, pool))
    disco_server, disco_address = await start_server((dpb_grpc.add_DiscoveryServiceServicer_to_server, disco))
    relay = Relay(
        RelayConfig(
            pool=pool_address,
            discovery=disco_address,
            pool_id="pool-a",
            region="eu",
            frontends=("http://127.0.0.1:9000",),
            relay_id="relay-1",
            incarnation=7,
            report_interval=0.2,
        )
    )
    await relay.start()
    try:
        await wait_for(lambda: disco.registers, message="the first registration")
        await disco_server.stop(0)  # discovery goes down
        schedule = relay.heartbeat.schedule
        await wait_for(lambda: schedule.failures >= 3, within=20, message="three failed renewals")
        due = schedule.next_at  # the doubled wait: 4 s after the third failure
        assert due - time.monotonic() > 2.5
        registered = len(disco.registers)
        server = grpc.aio.server()
        dpb_grpc.add_DiscoveryServiceServicer_to_server(disco, server)
        server.add_insecure_port(disco_address)
        await server.start()  # discovery answers again, at the same address
        try:
            await wait_for(lambda: len(disco.registers) > registered, within=15, message="registered again")
            late = time.monotonic() - due
            assert late < 0, f"registered {late:.2f} s after the retry's doubled wait ended: not at once"
            assert schedule.failures == 0
        finally:
            await server.stop(0)
    finally:
        await relay.stop()
        await pool_server.stop(0)

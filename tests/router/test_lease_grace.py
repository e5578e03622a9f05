"""The lease grace: a pool whose leases lapsed in discovery stays routable for one lease duration
while its telemetry to this frontend is live (the watch against a fake discovery, on a FakeClock)."""

from __future__ import annotations

import asyncio

import pytest

from globaldiscovery.v1 import discovery_pb2
from globalrouter.http_api.status_page import status
from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import DirectoryWatcher, PoolTable
from globalrouter.telemetry_ingest import StreamState, TelemetryIngest
from globalrouter.v1 import router_pb2
from meshkit.clock import FakeClock
from poolrelay.v1 import telemetry_pb2 as tm
from tests.router.fakes import FakeRelay, eventually, pool_msg, start_router
from tests.router.test_directory import discovery, snapshot  # noqa: F401 - the fixture
from tests.router.test_telemetry_budgets import hello

pytestmark = pytest.mark.timeout(30)
Ev = discovery_pb2.WatchPoolsResponse
T = discovery_pb2.WatchEventType
LEASE = 20.0
"""The lease duration discovery dictates in these tests (the grace)."""


def removed(pool_id: str, reason=discovery_pb2.REMOVAL_REASON_LEASE_EXPIRED) -> Ev:
    return Ev(type=T.WATCH_EVENT_TYPE_REMOVED, pool=pool_msg(pool_id, "http://h:1"), removal_reason=reason)


def added(pool_id: str) -> Ev:
    return Ev(type=T.WATCH_EVENT_TYPE_ADDED, pool=pool_msg(pool_id, "http://h:1"))


def listed(table: PoolTable) -> list[str]:
    return sorted(p.pool_id for p in table.listed())


class Relays:
    """Telemetry streams into a real TelemetryIngest on the test's FakeClock."""

    def __init__(self, table: PoolTable, clock: FakeClock) -> None:
        self.ingest = TelemetryIngest(table, KvIndex(), clock, RouterMetrics())
        table.telemetry_heard = self.ingest.last_heard
        self.streams: dict[str, StreamState] = {}

    def open(self, pool_id: str) -> None:
        self.streams[pool_id] = self.ingest.open(hello(pool_id, "r1"))
        self.speak(pool_id)

    def speak(self, pool_id: str) -> None:
        """A heartbeat on the pool's stream (relays send one every report interval)."""
        self.ingest.receive(
            self.streams[pool_id], tm.PublishPoolTelemetryRequest(heartbeat=tm.TelemetryHeartbeat())
        )

    def close(self, pool_id: str) -> None:
        self.ingest.close(self.streams.pop(pool_id))


async def watching(fake, channel, table: PoolTable, clock: FakeClock, *pool_ids: str):
    """The task of a running watcher whose first snapshot listed `pool_ids`."""
    watcher = DirectoryWatcher(table, channel, clock, None, lambda: LEASE)
    fake.watches.put_nowait(snapshot(*(pool_msg(p, "http://h:1") for p in pool_ids)))
    task = asyncio.create_task(watcher.run())
    await eventually(lambda: table.synced and fake.live)
    return task


async def advance(clock: FakeClock, seconds: float, relays: Relays | None = None, *speaking: str) -> None:
    """Moves the clock `seconds` a second at a time, the `speaking` pools' relays beating each second."""
    while seconds > 0:
        step = min(1.0, seconds)
        await clock.advance(step)
        seconds -= step
        for pool_id in speaking:
            assert relays is not None
            relays.speak(pool_id)


async def test_a_lapsed_lease_keeps_a_pool_with_live_telemetry_routable_until_it_registers_again(discovery):  # noqa: F811
    """Fails on the code before the grace: the pool was dropped at the LEASE_EXPIRED event."""
    fake, channel = discovery
    table, clock = PoolTable(), FakeClock()
    heard = {"a": clock.monotonic()}  # a's relay streams telemetry here and spoke just now; b's does not
    table.telemetry_heard = heard.get
    outcomes: list[str] = []
    table.on_grace = outcomes.append
    task = await watching(fake, channel, table, clock, "a", "b")
    try:
        table.stream_counts["a"] = 1
        fake.live[-1].put_nowait(removed("a"))
        fake.live[-1].put_nowait(removed("b"))
        await eventually(lambda: "b" not in table.pools)  # no telemetry: it leaves at once, as before
        assert listed(table) == ["a"], "a's relay is alive: its pool stays routable"
        assert table.pools["a"].directory_state() == "lease_lapsed"
        assert table.pools["a"].lease_grace_until == clock.monotonic() + LEASE
        heard["a"] = clock.monotonic() + 3.0
        await clock.advance(3.0)
        assert listed(table) == ["a"]
        fake.live[-1].put_nowait(added("a"))  # the relay registered again: nothing changed
        await eventually(lambda: table.pools["a"].directory_state() == "listed")
        assert table.lease_grace == {} and table.pools["a"].lease_grace_until is None
        assert outcomes == ["kept", "dropped", "reregistered"]
    finally:
        task.cancel()


async def test_the_grace_lasts_one_lease_and_the_pool_leaves_if_it_never_registers(discovery):  # noqa: F811
    fake, channel = discovery
    table, clock = PoolTable(), FakeClock()
    relays = Relays(table, clock)
    relays.open("a")
    outcomes: list[str] = []
    table.on_grace = outcomes.append
    task = await watching(fake, channel, table, clock, "a")
    try:
        fake.live[-1].put_nowait(removed("a"))
        await eventually(lambda: bool(table.lease_grace))
        await advance(clock, LEASE - 1.0, relays, "a")  # telemetry live all along
        assert listed(table) == ["a"]
        await advance(clock, 1.0, relays, "a")
        await eventually(lambda: not table.listed())
        assert "a" in table.pools and not table.pools["a"].listed  # kept unlisted: it still streams
        assert outcomes == ["kept", "expired"]
        # Further lapses of an unlisted pool change nothing.
        assert not table.lapse("a", clock.monotonic(), LEASE)
    finally:
        task.cancel()


async def test_telemetry_that_ends_or_goes_silent_ends_the_grace(discovery):  # noqa: F811
    fake, channel = discovery
    table, clock = PoolTable(), FakeClock()
    relays = Relays(table, clock)
    relays.open("a")
    relays.open("b")
    outcomes: list[str] = []
    table.on_grace = outcomes.append
    task = await watching(fake, channel, table, clock, "a", "b")
    try:
        fake.live[-1].put_nowait(removed("a"))
        fake.live[-1].put_nowait(removed("b"))
        await eventually(lambda: len(table.lease_grace) == 2)
        relays.close("a")  # a's relay died: its stream ended
        await advance(clock, 1.0, relays, "b")
        await eventually(lambda: listed(table) == ["b"])
        # b's stream stays open but says nothing (a SIGSTOPped relay): it stops counting as live.
        await advance(clock, table.live_within - 1.0)
        assert listed(table) == ["b"]
        await advance(clock, 2.0)
        await eventually(lambda: not table.listed())
        assert clock.monotonic() < 1000.0 + LEASE, "well before the grace would have ended"
        assert outcomes == ["kept", "kept", "telemetry_stopped", "telemetry_stopped"]
    finally:
        task.cancel()


async def test_a_silent_stream_gets_no_grace_and_other_removals_act_at_once(discovery):  # noqa: F811
    fake, channel = discovery
    table, clock = PoolTable(), FakeClock()
    relays = Relays(table, clock)
    for pool_id in ("a", "b", "c", "d", "e"):
        relays.open(pool_id)
    outcomes: list[str] = []
    table.on_grace = outcomes.append
    task = await watching(fake, channel, table, clock, "a", "b", "c", "d", "e")
    try:
        await clock.advance(table.live_within + 1.0)
        for pool_id in ("b", "c", "d", "e"):
            relays.speak(pool_id)
        fake.live[-1].put_nowait(removed("a"))  # a's stream is open but silent for too long
        fake.live[-1].put_nowait(removed("b", discovery_pb2.REMOVAL_REASON_REMOVED))  # an operator
        fake.live[-1].put_nowait(removed("c", discovery_pb2.REMOVAL_REASON_UNREGISTERED))  # its relay left
        fake.live[-1].put_nowait(removed("d", discovery_pb2.REMOVAL_REASON_DRAINED))  # a completed drain
        fake.live[-1].put_nowait(removed("e"))
        await eventually(lambda: bool(table.lease_grace))
        assert listed(table) == ["e"]
        fake.live[-1].put_nowait(removed("e", discovery_pb2.REMOVAL_REASON_REMOVED))  # within its grace
        await eventually(lambda: not table.listed())
        assert outcomes == ["dropped", "kept", "removed"]
    finally:
        task.cancel()


def test_the_rule_alone():
    """PoolTable's grace on explicit times: no grace without live telemetry or a positive grace,
    a lapse during a grace never extends it, and sweep_grace ends it on time."""
    table = PoolTable(live_within=5.0)
    heard: dict[str, float] = {}
    table.telemetry_heard = heard.get
    for pool_id in ("a", "b", "c"):
        table.apply_listed(pool_msg(pool_id, "http://h:1"))
        table.stream_counts[pool_id] = 1
    heard.update(a=100.0, b=100.0)
    assert not table.lapse("c", 100.0, 15.0), "no message heard on c's stream"
    assert not table.lapse("b", 100.0, 0.0), "no grace to give"
    assert listed(table) == ["a"]
    assert table.lapse("a", 100.0, 15.0)
    assert table.next_grace_end() == 115.0
    heard["a"] = 110.0
    assert table.lapse("a", 110.0, 15.0) and table.next_grace_end() == 115.0, "never extended"
    assert table.sweep_grace(114.9) == [] and listed(table) == ["a"]
    assert table.sweep_grace(115.0) == ["a"] and listed(table) == []
    assert table.next_grace_end() is None


async def test_list_pools_route_the_status_page_and_metrics_show_the_grace():
    router, stub, channel = await start_router()
    relay = FakeRelay(f"127.0.0.1:{router.port}")
    try:
        table = router.core.table
        table.apply_listed(pool_msg("p1", "http://127.0.0.1:1"))
        await relay.open("p1")
        await relay.send(heartbeat=tm.TelemetryHeartbeat())
        await eventually(lambda: table.telemetry_live("p1", router.clock.monotonic()))
        assert table.lapse("p1", router.clock.monotonic(), 30.0)
        page = await stub.ListPools(router_pb2.ListPoolsRequest())
        (view,) = page.pools
        assert view.listed and view.directory_state == router_pb2.DIRECTORY_STATE_LEASE_LAPSED
        assert 25.0 < view.lease_grace_left.ToTimedelta().total_seconds() <= 30.0
        reply = await stub.Route(
            router_pb2.RouteRequest(model="m", prompt=router_pb2.Prompt(token_ids={"ids": [1] * 40}))
        )
        assert [(c.pool_id, c.directory_state) for c in reply.candidates] == [
            ("p1", router_pb2.DIRECTORY_STATE_LEASE_LAPSED)
        ]
        registry = router.metrics.registry
        assert registry.get_sample_value("globalrouter_pool_lease_grace_total", {"outcome": "kept"}) == 1
        assert registry.get_sample_value("globalrouter_pools_in_lease_grace") == 1
        (row,) = status(router.core, "fe")["regions"][0]["pools"]
        assert row["directory_state"] == "lease_lapsed" and 25.0 < row["lease_grace_left_s"] <= 30.0
        table.apply_listed(pool_msg("p1", "http://127.0.0.1:1"))  # registered again
        page = await stub.ListPools(router_pb2.ListPoolsRequest())
        assert page.pools[0].directory_state == router_pb2.DIRECTORY_STATE_LISTED
        assert not page.pools[0].HasField("lease_grace_left")
        assert registry.get_sample_value("globalrouter_pools_in_lease_grace") == 0
    finally:
        await relay.close()
        await channel.close()
        await router.handle.server.stop(0)

"""The lease grace: a pool whose leases lapsed in discovery stays routable for one lease duration
while its telemetry to this frontend is live (the watch against a fake discovery, on a FakeClock)."""

from __future__ import annotations

import asyncio
from typing import Any

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


# ---- the liveness bound follows the relays' announced report interval -----------------------------


class SlowRelays(Relays):
    """Relays whose hello announces `report_interval` seconds (and that speak that often)."""

    def __init__(self, table: PoolTable, clock: FakeClock, report_interval: float) -> None:
        super().__init__(table, clock)
        table.telemetry_interval = lambda pool_id: self.ingest.report_interval(pool_id)
        self.report_interval = report_interval

    def open(self, pool_id: str) -> None:
        first = hello(pool_id, "r1")
        first.report_interval.FromNanoseconds(round(self.report_interval * 1e9))
        self.streams[pool_id] = self.ingest.open(first)
        self.speak(pool_id)


async def test_a_relay_reporting_every_8_s_keeps_its_pool_through_the_grace(discovery):  # noqa: F811
    """Fails on the code with the fixed 5 s bound: the lapse came 7 s after the relay's last report
    (it reports every 8 s, as its hello says), so the pool was dropped; and in the grace it would
    have been dropped between two reports."""
    fake, channel = discovery
    table, clock = PoolTable(), FakeClock()
    relays = SlowRelays(table, clock, report_interval=8.0)
    relays.open("a")
    outcomes: list[str] = []
    table.on_grace = outcomes.append
    task = await watching(fake, channel, table, clock, "a")
    try:
        await clock.advance(7.0)  # just before its next report
        fake.live[-1].put_nowait(removed("a"))
        await eventually(lambda: outcomes == ["kept"])
        assert listed(table) == ["a"]
        until = table.next_grace_end()
        assert until is not None
        silent = 7.0
        while clock.monotonic() < until - 1.0:  # through the grace, reporting every 8 s: routable
            await clock.advance(1.0)
            silent += 1.0
            if silent == 8.0:
                relays.speak("a")
                silent = 0.0
            assert listed(table) == ["a"], clock.monotonic()
        fake.live[-1].put_nowait(added("a"))
        await eventually(lambda: outcomes == ["kept", "reregistered"])
    finally:
        task.cancel()


async def test_a_slow_relay_that_goes_silent_still_loses_the_grace_after_five_of_its_reports(discovery):  # noqa: F811
    fake, channel = discovery
    table, clock = PoolTable(), FakeClock()
    relays = SlowRelays(table, clock, report_interval=3.0)
    relays.open("a")
    outcomes: list[str] = []
    table.on_grace = outcomes.append
    task = await watching(fake, channel, table, clock, "a")
    try:
        fake.live[-1].put_nowait(removed("a"))
        await eventually(lambda: outcomes == ["kept"])
        await advance(clock, 14.0)  # silent (a wedged relay), but within 5 x 3 s
        assert listed(table) == ["a"]
        await advance(clock, 2.0)
        await eventually(lambda: not table.listed())
        assert outcomes == ["kept", "telemetry_stopped"]
    finally:
        task.cancel()


def test_the_bound_is_five_reports_of_the_slowest_stream_between_5_and_60_s():
    table = PoolTable()
    heard: dict[str, float] = {}
    intervals: dict[str, float] = {}
    table.telemetry_heard = heard.get
    table.telemetry_interval = lambda pool_id: intervals.get(pool_id, 0.0)
    for pool_id, interval in (
        ("fast", 0.2),
        ("default", 1.0),
        ("unannounced", 0.0),
        ("slow", 4.0),
        ("huge", 1e9),
    ):
        table.apply_listed(pool_msg(pool_id, "http://h:1"))
        table.stream_counts[pool_id] = 1
        intervals[pool_id] = interval
        heard[pool_id] = 100.0
    assert table.telemetry_live("slow", 120.0) and not table.telemetry_live("slow", 120.1)
    assert {p: table.live_within_for(p) for p in intervals} == {
        "fast": 5.0,  # never tighter than before
        "default": 5.0,
        "unannounced": 5.0,
        "slow": 20.0,  # five of its reports
        "huge": 60.0,  # a relay's announcement is outside input: bounded
    }
    assert table.telemetry_live("huge", 160.0) and not table.telemetry_live("huge", 160.1)
    assert not table.telemetry_live("default", 105.1)
    assert table.lapse("slow", 115.0, 15.0) and not table.lapse("default", 115.0, 15.0)
    with pytest.raises(ValueError, match="live_within must be > 0 and at most 60"):
        PoolTable(live_within=0.0)


async def test_the_frontend_takes_the_interval_from_the_hello_and_its_own_batch_interval():
    """Through the servicer: the hello's report_interval, or the batch interval this frontend asks
    for when longer (a batching relay holds its messages that long)."""
    for batch, announced, bound in ((0.0, 3.0, 15.0), (2.0, 1.0, 10.0), (2.0, 0.0, 10.0), (0.0, 0.0, 5.0)):
        router, _stub, channel = await start_router(telemetry_batch_interval=batch)
        relay = FakeRelay(f"127.0.0.1:{router.port}")
        try:
            kw: dict[str, Any] = {"report_interval": {"seconds": int(announced)}} if announced else {}
            await relay.open("p1", **kw)
            await relay.send(heartbeat=tm.TelemetryHeartbeat())
            table = router.core.table
            heard = table.telemetry_heard
            assert heard is not None
            await eventually(lambda: heard("p1") is not None)  # noqa: B023
            at = heard("p1")
            assert at is not None
            assert table.telemetry_live("p1", at + bound - 0.01), (batch, announced)
            assert not table.telemetry_live("p1", at + bound + 0.01), (batch, announced)
        finally:
            await relay.close()
            await channel.close()
            await router.handle.server.stop(0)

"""The directory watch and the frontend lease, against an in-process fake discovery, on a FakeClock."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2, discovery_pb2_grpc
from globalrouter.frontend_lease import FrontendRegistration, next_delay
from globalrouter.pool_directory import DirectoryWatcher, PoolTable
from meshkit.clock import FakeClock
from meshkit.server import create_server
from meshkit.timeconv import duration
from tests.router.fakes import eventually, pool_msg

pytestmark = pytest.mark.timeout(30)
Ev = discovery_pb2.WatchPoolsResponse
T = discovery_pb2.WatchEventType


class FakeDiscovery(discovery_pb2_grpc.DiscoveryServiceServicer):
    """Serves one scripted watch per call; counts frontend registrations."""

    def __init__(self) -> None:
        self.watches: asyncio.Queue[list[Ev]] = asyncio.Queue()
        self.live: list[asyncio.Queue] = []
        self.registrations: list[discovery_pb2.RegisterFrontendRequest] = []
        self.unregistrations = 0
        self.fail_registrations = 0
        self.starts: list[int] = []
        """Each watch's start_revision."""

    async def WatchPools(self, request, context):
        self.starts.append(request.start_revision)
        events = await self.watches.get()
        for ev in events:
            yield ev
        more: asyncio.Queue = asyncio.Queue()
        self.live.append(more)
        while (ev := await more.get()) is not None:
            yield ev
        await context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")

    async def RegisterFrontend(self, request, context):
        self.registrations.append(request)
        if self.fail_registrations:
            self.fail_registrations -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not now")
        return discovery_pb2.RegisterFrontendResponse(
            heartbeat_interval=duration(2.0), lease_duration=duration(6.0)
        )

    async def UnregisterFrontend(self, request, context):
        self.unregistrations += 1
        return discovery_pb2.UnregisterFrontendResponse()


@pytest.fixture
async def discovery():
    fake = FakeDiscovery()

    def register(server):
        discovery_pb2_grpc.add_DiscoveryServiceServicer_to_server(fake, server)
        return ["globaldiscovery.v1.DiscoveryService"]

    handle = create_server("127.0.0.1:0", register)
    await handle.server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    yield fake, channel
    for q in fake.live:
        q.put_nowait(None)
    await channel.close()
    await handle.server.stop(0)


def snapshot(*pools, complete=True) -> list[Ev]:
    return [
        *(Ev(type=T.WATCH_EVENT_TYPE_ADDED, pool=p) for p in pools),
        Ev(type=T.WATCH_EVENT_TYPE_SNAPSHOT_DONE, complete=complete),
    ]


async def test_watch_keeps_the_directory_through_an_outage_and_a_new_snapshot_replaces_it(discovery):
    fake, channel = discovery
    table = PoolTable()
    watcher = DirectoryWatcher(table, channel, FakeClock())
    fake.watches.put_nowait(snapshot(pool_msg("a", "http://h:1"), pool_msg("b", "http://h:2")))
    task = asyncio.create_task(watcher.run())
    await eventually(lambda: table.synced)
    assert sorted(p.pool_id for p in table.listed()) == ["a", "b"]
    await eventually(lambda: fake.live)
    fake.live[-1].put_nowait(
        Ev(type=T.WATCH_EVENT_TYPE_UPDATED, pool=pool_msg("a", "http://h:1", draining=True))
    )
    await eventually(lambda: table.pools["a"].directory_draining)
    fake.live[-1].put_nowait(None)  # discovery goes away: the watch breaks
    await eventually(lambda: watcher.watches_started == 2)
    assert sorted(p.pool_id for p in table.listed()) == ["a", "b"]  # losing signals deletes nothing
    fake.watches.put_nowait(snapshot(pool_msg("b", "http://h:2"), pool_msg("c", "http://h:3")))
    await eventually(lambda: "c" in table.pools and table.pools["c"].listed)
    assert sorted(p.pool_id for p in table.listed()) == ["b", "c"]  # the new snapshot is the truth
    assert "a" not in table.pools
    await eventually(lambda: len(fake.live) == 2)
    fake.live[-1].put_nowait(Ev(type=T.WATCH_EVENT_TYPE_REMOVED, pool=pool_msg("b", "http://h:2")))
    await eventually(lambda: "b" not in table.pools)
    task.cancel()


def test_unlisted_pool_with_telemetry_stays_known():
    table = PoolTable()
    table.apply_listed(pool_msg("a", "http://h:1", leases=[{"relay_id": "r", "incarnation": 3}]))
    assert table.lease_incarnation("a", "r") == 3
    table.stream_counts["a"] = 1
    table.apply_removed("a")
    assert "a" in table.pools and not table.pools["a"].listed
    assert table.lease_incarnation("a", "r") == 0


def test_retry_schedule():
    assert [next_delay(5.0, n) for n in range(5)] == [5.0, 1.0, 2.0, 4.0, 5.0]


async def test_registration_renews_at_the_dictated_interval_and_retries_failures(discovery):
    fake, channel = discovery
    clock = FakeClock()
    reg = FrontendRegistration(
        channel, clock, frontend_id="fe-1", url="http://127.0.0.1:9", region="", incarnation=5
    )
    fake.fail_registrations = 2
    task = asyncio.create_task(reg.run())
    await eventually(lambda: len(fake.registrations) == 1 and clock.sleepers == 1)
    await clock.advance(1.0)  # retried after 1 s
    await eventually(lambda: len(fake.registrations) == 2 and clock.sleepers == 1)
    await clock.advance(1.9)
    assert len(fake.registrations) == 2  # then after 2 s (doubling), not sooner
    await clock.advance(0.1)
    await eventually(lambda: len(fake.registrations) == 3 and clock.sleepers == 1)
    assert reg.heartbeat == 2.0 and reg.failures == 0
    await clock.advance(2.0)  # renewals at the server-dictated heartbeat
    await eventually(lambda: len(fake.registrations) == 4)
    task.cancel()
    await reg.unregister()
    assert fake.unregistrations == 1
    assert fake.registrations[0].frontend_id == "fe-1" and fake.registrations[0].incarnation == 5


async def test_incomplete_snapshot_adds_but_removes_nothing_then_resyncs(discovery):
    fake, channel = discovery
    table = PoolTable()
    watcher = DirectoryWatcher(table, channel, FakeClock(), lease_duration=lambda: 0.2)
    fake.watches.put_nowait(snapshot(pool_msg("a", "http://h:1"), pool_msg("b", "http://h:2")))
    task = asyncio.create_task(watcher.run())
    await eventually(lambda: table.synced)
    fake.live[-1].put_nowait(None)
    fake.watches.put_nowait(snapshot(pool_msg("b", "http://h:2"), complete=False))  # a fresh replica
    # The second watch open says nothing of its snapshot: wait until the incomplete one is applied
    # (table.complete turns False), else a snapshot that wrongly removed `a` could pass unseen.
    await eventually(lambda: watcher.watches_started == 2 and len(fake.live) == 2 and not table.complete)
    assert sorted(p.pool_id for p in table.listed()) == ["a", "b"]
    fake.watches.put_nowait(snapshot(pool_msg("b", "http://h:2")))  # complete now: a is gone
    await eventually(lambda: watcher.watches_started == 3 and "a" not in table.pools)
    task.cancel()


# ----- resumed watches: no change missed or applied twice -----


class Counting(PoolTable):
    """A PoolTable counting the directory events applied to it."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[tuple[str, str]] = []
        self.snapshots = 0

    def replace_directory(self, *args, **kwargs):
        self.snapshots += 1
        return super().replace_directory(*args, **kwargs)

    def apply_listed(self, msg):
        self.applied.append(("listed", msg.pool_id))
        return super().apply_listed(msg)

    def apply_removed(self, pool_id, outcome="removed"):
        self.applied.append(("removed", pool_id))
        super().apply_removed(pool_id, outcome)


def added(pool_id: str, revision: int) -> Ev:
    return Ev(type=T.WATCH_EVENT_TYPE_ADDED, pool=pool_msg(pool_id, "http://h:1"), revision=revision)


async def test_a_broken_watch_resumes_after_the_last_revision_with_no_change_twice(discovery):
    fake, channel = discovery
    table = Counting()
    watcher = DirectoryWatcher(table, channel, FakeClock())
    fake.watches.put_nowait(
        [
            Ev(type=T.WATCH_EVENT_TYPE_ADDED, pool=pool_msg("a", "http://h:1"), revision=10),
            Ev(type=T.WATCH_EVENT_TYPE_SNAPSHOT_DONE, complete=True, revision=10),
            added("b", 11),
            added("c", 12),
        ]
    )
    task = asyncio.create_task(watcher.run())
    await eventually(lambda: watcher.last_revision == 12)
    assert fake.starts == [0]
    fake.live[-1].put_nowait(None)  # the stream breaks after revision 12
    # The new replica replays from 11 (it overlaps what we applied), then a change we missed.
    fake.watches.put_nowait(
        [
            Ev(type=T.WATCH_EVENT_TYPE_SNAPSHOT_DONE, complete=True, revision=12, resumed=True),
            added("c", 12),
            Ev(type=T.WATCH_EVENT_TYPE_REMOVED, pool=pool_msg("a", "http://h:1"), revision=13),
            added("d", 14),
        ]
    )
    await eventually(lambda: watcher.last_revision == 14)
    assert fake.starts == [0, 12]
    assert watcher.resumes == 1
    assert table.applied == [
        ("listed", "a"),  # the snapshot
        ("listed", "b"),
        ("listed", "c"),
        ("removed", "a"),  # c at 12 was not applied again
        ("listed", "d"),
    ]
    assert sorted(p.pool_id for p in table.listed()) == ["b", "c", "d"]
    task.cancel()


async def test_a_reset_snapshot_replaces_the_directory_and_its_revision(discovery):
    fake, channel = discovery
    table = PoolTable()
    watcher = DirectoryWatcher(table, channel, FakeClock())
    fake.watches.put_nowait(
        [added("a", 50), Ev(type=T.WATCH_EVENT_TYPE_SNAPSHOT_DONE, complete=True, revision=50)]
    )
    task = asyncio.create_task(watcher.run())
    await eventually(lambda: watcher.last_revision == 50)
    fake.live[-1].put_nowait(None)
    # A replica that cannot resume from 50 (restarted: its revisions are its own) sends a snapshot.
    fake.watches.put_nowait(
        [
            Ev(type=T.WATCH_EVENT_TYPE_ADDED, pool=pool_msg("b", "http://h:1"), revision=7),
            Ev(type=T.WATCH_EVENT_TYPE_SNAPSHOT_DONE, complete=True, revision=7),
        ]
    )
    await eventually(lambda: watcher.last_revision == 7)
    assert fake.starts == [0, 50]
    assert [p.pool_id for p in table.listed()] == ["b"]
    await eventually(lambda: len(fake.live) == 2)
    fake.live[-1].put_nowait(added("c", 8))  # later changes apply although below the old revision
    await eventually(lambda: "c" in table.pools and table.pools["c"].listed)
    task.cancel()


async def test_an_incomplete_snapshot_is_followed_by_a_snapshot_not_a_resume(discovery):
    fake, channel = discovery
    table = PoolTable()
    watcher = DirectoryWatcher(table, channel, FakeClock(), lease_duration=lambda: 0.0)
    fake.watches.put_nowait(
        [added("a", 5), Ev(type=T.WATCH_EVENT_TYPE_SNAPSHOT_DONE, complete=False, revision=5)]
    )
    fake.watches.put_nowait(
        [added("a", 6), Ev(type=T.WATCH_EVENT_TYPE_SNAPSHOT_DONE, complete=True, revision=6)]
    )
    task = asyncio.create_task(watcher.run())
    await eventually(lambda: table.complete)
    assert fake.starts == [0, 0]
    task.cancel()

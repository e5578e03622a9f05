"""A watch resumed on another discovery replica of one etcd: etcd's revisions are shared, so the
resume is exact (the missed changes, none repeated, `resumed` set); a revision no replica can
reach back to (compacted, re-read) gets a reset snapshot; a replica behind the revision waits."""

from __future__ import annotations

import asyncio

import aetcd
import grpc
import pytest

from globaldiscovery.records import EventKind, Removal
from globaldiscovery.store.etcd import PREFIX
from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from globaldiscovery.watch_fanout import WatcherClosed
from meshlaunch.process import Proc
from tests.discovery.etcd_support import etcd_replicas, pause, resume, running_etcd, wipe_discovery_keys
from tests.discovery.helpers import reg, start_discovery

pytestmark = pytest.mark.timeout(120)
T = pb.WatchEventType
WAIT = 15.0


class Stream:
    """One WatchPools stream read event by event (a thread-free wrapper of the sync call)."""

    def __init__(self, address: str, start_revision: int = 0) -> None:
        self.channel = grpc.insecure_channel(address)
        stub = pb_grpc.DiscoveryServiceStub(self.channel)
        self.call = stub.WatchPools(pb.WatchPoolsRequest(start_revision=start_revision), timeout=60)

    def next(self) -> pb.WatchPoolsResponse:
        return next(self.call)

    def opening(self) -> tuple[list[str], pb.WatchPoolsResponse]:
        """The pool ids of the snapshot, and its SNAPSHOT_DONE."""
        pools: list[str] = []
        while True:
            event = self.next()
            if event.type == T.WATCH_EVENT_TYPE_SNAPSHOT_DONE:
                return pools, event
            pools.append(event.pool.pool_id)

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


def summary(event: pb.WatchPoolsResponse) -> tuple[int, str, int, int]:
    return (event.type, event.pool.pool_id, event.removal_reason, event.revision)


def register(address: str, pool: str, relay: str = "r1", inc: int = 1) -> None:
    with grpc.insecure_channel(address) as channel:
        pb_grpc.DiscoveryServiceStub(channel).RegisterPool(
            pb.RegisterPoolRequest(
                pool_id=pool,
                model="m",
                region="eu",
                frontends=[f"http://{pool}:80"],
                relay_id=relay,
                incarnation=inc,
            ),
            timeout=10,
        )


def unregister(address: str, pool: str, relay: str = "r1", inc: int = 1) -> None:
    with grpc.insecure_channel(address) as channel:
        pb_grpc.DiscoveryServiceStub(channel).UnregisterPool(
            pb.UnregisterPoolRequest(pool_id=pool, relay_id=relay, incarnation=inc), timeout=10
        )


def serve(procs, etcd: str, address: str | None = None) -> tuple[Proc, str]:
    """A `globaldiscovery serve --store etcd` replica (on `address`, else a free port) with leases
    far longer than a test, so only the test's own changes happen."""
    return start_discovery(
        procs,
        "--store",
        "etcd",
        "--etcd-endpoints",
        etcd,
        "--heartbeat-interval",
        "10",
        "--lease-duration",
        "60",
        address=address,
    )


def test_a_watch_seen_on_one_replica_resumes_exactly_on_another(procs, etcd):
    asyncio.run(wipe_discovery_keys(etcd))
    proc_a, a = serve(procs, etcd)
    _, b = serve(procs, etcd)
    on_b = Stream(b)  # a live watch on B all along: the reference for what B numbers each change
    on_a = Stream(a)
    try:
        on_b.opening()
        on_a.opening()
        register(a, "keep")
        register(a, "gone")
        seen_a = [on_a.next(), on_a.next()]
        seen_b = [on_b.next(), on_b.next()]
        assert [summary(e) for e in seen_a] == [summary(e) for e in seen_b], "one change, one revision"
        last = seen_a[-1].revision
        on_a.close()
        proc_a.stop()  # the client's replica is gone; changes go on through B

        register(b, "new")
        unregister(b, "gone")
        register(b, "keep", relay="r2")  # a second lease: the pool is UPDATED
        missed = [summary(on_b.next()) for _ in range(3)]
        assert [(kind, pool) for kind, pool, _, _ in missed] == [
            (T.WATCH_EVENT_TYPE_ADDED, "new"),
            (T.WATCH_EVENT_TYPE_REMOVED, "gone"),
            (T.WATCH_EVENT_TYPE_UPDATED, "keep"),
        ]
        assert missed[1][2] == pb.REMOVAL_REASON_UNREGISTERED

        resumed = Stream(b, start_revision=last)
        try:
            pools, done = resumed.opening()
            assert pools == [] and done.resumed and done.revision == last
            assert [summary(resumed.next()) for _ in range(3)] == missed  # exactly the missed changes
            register(b, "after")  # the next event is the live one: nothing was repeated before it
            after = summary(resumed.next())
            assert after[:2] == (T.WATCH_EVENT_TYPE_ADDED, "after") and after[3] > missed[-1][3]
        finally:
            resumed.close()
    finally:
        on_b.close()


async def compact(endpoint: str) -> int:
    """Compacts etcd's history up to now; returns the revision compacted to."""
    host, _, port = endpoint.rpartition(":")
    client = aetcd.Client(host=host, port=int(port))
    await client.connect()
    try:
        revision = (await client.get_prefix(PREFIX + b"probe/")).header.revision
        await client.compact(revision, physical=True)
        return revision
    finally:
        await client.close()


def test_a_replica_started_after_the_revision_reads_the_changes_from_etcd_unless_compacted(procs):
    with running_etcd() as etcd:  # its own etcd: this test compacts the history away
        _, a = serve(procs, etcd)
        on_a = Stream(a)
        try:
            on_a.opening()
            register(a, "p1")
            seen = on_a.next().revision
            register(a, "p2")
            unregister(a, "p1")
            missed = [summary(on_a.next()) for _ in range(2)]
            _, c = serve(procs, etcd)  # its history starts after R: etcd still has the changes
            late = Stream(c, start_revision=seen)
            try:
                pools, done = late.opening()
                assert pools == [] and done.resumed and done.revision == seen
                assert [summary(late.next()) for _ in range(2)] == missed  # as A numbered them
                register(c, "p3")  # then C's own events, nothing repeated before them
                assert summary(late.next())[:2] == (T.WATCH_EVENT_TYPE_ADDED, "p3")
            finally:
                late.close()

            asyncio.run(compact(etcd))
            _, d = serve(procs, etcd)  # started after R, and etcd's history of R is gone
            reset = Stream(d, start_revision=seen)
            try:
                pools, done = reset.opening()
                assert not done.resumed and sorted(pools) == ["p2", "p3"] and done.revision > seen
            finally:
                reset.close()
            again = Stream(a, start_revision=seen)  # A still holds the changes after R
            try:
                pools, done = again.opening()
                assert pools == [] and done.resumed
                assert [summary(again.next()) for _ in range(2)] == missed
            finally:
                again.close()
        finally:
            on_a.close()


# ----- in-process: a replica behind the revision waits; one that lost etcd's history re-reads -----


@pytest.fixture
async def pair(etcd):
    """Two replicas sharing one etcd, with leases far longer than the test."""
    async with etcd_replicas(etcd, 2, heartbeat_interval=5.0, lease_duration=60.0) as stores:
        yield stores


async def events(watcher, count: int) -> list[tuple[EventKind, str | None, int]]:
    out = []
    for _ in range(count):
        event = await asyncio.wait_for(watcher.next(), WAIT)
        assert event is not None, "the watcher ended"
        out.append((event.kind, event.pool.pool_id if event.pool else None, event.revision))
    return out


async def test_a_replica_behind_the_revision_waits_for_it_then_resumes_exactly(pair):
    a, b = pair
    live = await a.watch(model="", region="")
    [(_, _, start)] = await events(live, 1)  # SNAPSHOT_DONE
    await pause(b)
    await a.register_pool(reg("p1"))
    await a.register_pool(reg("p2"))
    seen = await events(live, 2)
    waiting = asyncio.create_task(b.watch(model="", region="", start_revision=seen[0][2]))
    resume(b)  # B catches up from etcd's history, change by change
    # Had B answered before applying the revision, the resume would have been a reset snapshot.
    watcher = await asyncio.wait_for(waiting, WAIT)
    marker, *replay = await events(watcher, 2)
    assert marker == (EventKind.SNAPSHOT_DONE, None, seen[0][2])
    assert watcher.pending() == 0 and replay == seen[1:]  # the change after it, as A numbered it
    # A revision this etcd has not reached is no revision of it: a reset, without waiting.
    future = await asyncio.wait_for(b.watch(model="", region="", start_revision=10**12), WAIT)
    snapshot = await events(future, 3)
    assert [pool for _, pool, _ in snapshot] == ["p1", "p2", None] and start < snapshot[-1][2] < 10**12
    for store, w in ((a, live), (b, watcher), (b, future)):
        store.unwatch(w)


async def test_a_replica_whose_etcd_history_was_compacted_rereads_and_ends_its_watches(pair, etcd):
    a, b = pair
    watcher = await b.watch(model="", region="")
    [(_, _, start)] = await events(watcher, 1)
    await pause(b)
    await a.register_pool(reg("p1"))
    await a.unregister_pool("p1", "r1", 1, Removal.UNREGISTERED)
    await a.register_pool(reg("p2"))
    await compact(etcd)
    resume(b)  # etcd no longer has the changes B missed: B re-reads everything
    assert await asyncio.wait_for(watcher.next(), WAIT) is None
    assert watcher.closed is WatcherClosed.RESYNC
    pools, _, _ = await b.list_pools(model="", region="", after=None, limit=10)
    assert [p.pool_id for p in pools] == ["p2"]
    reset = await b.watch(model="", region="", start_revision=start)
    snapshot = await events(reset, 2)
    assert [(kind, pool) for kind, pool, _ in snapshot] == [
        (EventKind.ADDED, "p2"),
        (EventKind.SNAPSHOT_DONE, None),
    ]
    b.unwatch(reset)


async def test_a_replica_ahead_of_a_replaced_etcd_rereads_it_and_numbers_changes_as_etcd_does(pair):
    a, b = pair
    await pause(b)
    b._applied += 1_000  # as if etcd had been replaced by one whose revision is behind the mirror's
    b.directory.at_revision(b._applied)
    stale = await b.watch(model="", region="")
    await events(stale, 1)
    resume(b)  # watching from the mirror's revision would wait for nothing: it re-reads etcd
    assert await asyncio.wait_for(stale.next(), WAIT) is None and stale.closed is WatcherClosed.RESYNC
    live_a, live_b = await a.watch(model="", region=""), await b.watch(model="", region="")
    await events(live_a, 1)
    await events(live_b, 1)
    await a.register_pool(reg("p9"))
    assert await events(live_a, 1) == await events(live_b, 1)  # one change, one revision again
    for store, w in ((a, live_a), (b, live_b)):
        store.unwatch(w)

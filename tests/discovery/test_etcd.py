"""The etcd store against a real etcd: replicas share state, etcd's leases carry expiry."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from globaldiscovery.lease_rules import DrainCompleted, ModelConflict, NotFound, StaleIncarnation
from globaldiscovery.records import EventKind, Removal
from globaldiscovery.store.base import StoreUnavailable
from globaldiscovery.store.etcd import EtcdStore, _decode, _lease_key
from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshkit.clock import SystemClock
from meshlaunch import wait_until
from tests.discovery.etcd_support import etcd_replicas, pause, resume, wipe_discovery_keys
from tests.discovery.helpers import reg, run_pools, start_discovery

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def replicas(etcd):
    """Two discovery replicas sharing one etcd."""
    async with etcd_replicas(etcd, 2, heartbeat_interval=0.5, lease_duration=2.0) as stores:
        yield stores


async def next_event(watcher, kind: EventKind):
    while True:
        event = await asyncio.wait_for(watcher.next(), 15)
        assert event is not None
        if event.kind is kind:
            return event


async def test_replicas_share_registrations_and_unregister(replicas):
    a, b = replicas
    watcher = await b.watch(model="", region="")
    await a.register_pool(reg("share-1"))
    result = await a.register_pool(reg("share-1", relay="r2"))
    assert [lease.relay_id for lease in result.pool.leases] == ["r1", "r2"]
    added = await next_event(watcher, EventKind.ADDED)
    assert added.pool.pool_id == "share-1"  # so b's mirror holds it: its listing needs no wait
    pools, _, complete = await b.list_pools(model="", region="", after=None, limit=100)
    assert complete and [p.pool_id for p in pools if p.pool_id == "share-1"] == ["share-1"]
    assert await a.unregister_pool("share-1", "r1", 1, Removal.UNREGISTERED) is False
    assert await a.unregister_pool("share-1", "r2", 1, Removal.UNREGISTERED) is True
    removed = await next_event(watcher, EventKind.REMOVED)
    assert removed.pool.pool_id == "share-1" and removed.reason is Removal.UNREGISTERED


async def test_lapsed_lease_leaves_every_replica_after_its_expiry(replicas):
    a, b = replicas
    watcher = await b.watch(model="lapse", region="")
    result = await a.register_pool(reg("lapse-1", model="lapse"))
    assert a.lease_duration == 2.0
    await next_event(watcher, EventKind.ADDED)
    removed = await next_event(watcher, EventKind.REMOVED)
    assert removed.reason is Removal.LEASE_EXPIRED
    assert time.time() >= result.lease_expire_wall  # never early


async def test_incarnations_conflicts_and_renewal(replicas):
    a, b = replicas
    await a.register_pool(reg("inc-1", inc=5))
    with pytest.raises(StaleIncarnation):
        await b.register_pool(reg("inc-1", inc=4))
    with pytest.raises(StaleIncarnation):
        await b.unregister_pool("inc-1", "r1", 4, Removal.UNREGISTERED)
    await b.register_pool(reg("inc-1", inc=6))  # a restarted relay takes over, through the other replica
    with pytest.raises(ModelConflict):
        await a.register_pool(reg("inc-1", relay="r2", model="other"))
    assert (await a.list_pools(model="m", region="", after="inc-0", limit=1))[0][0].pool_id == "inc-1"


async def test_a_renewal_through_the_other_replica_refreshes_the_same_etcd_lease(etcd):
    a, b = (
        EtcdStore(SystemClock(), endpoint=etcd, heartbeat_interval=1.0, lease_duration=4.0) for _ in range(2)
    )
    for store in (a, b):
        await store.start()
    try:
        await a.register_pool(reg("renew-1", inc=2))
        key = _lease_key("renew-1", "r1")
        lease_id = _decode((await a._client.get(key)).value)[1]

        async def seconds_left() -> int:  # etcd reports whole seconds, rounded down
            return (await a._client.get_lease_info(lease_id)).TTL

        deadline = time.monotonic() + 15
        while await seconds_left() > 1:  # wait until over half the lease has run down
            assert time.monotonic() < deadline, "the etcd lease never counted down"
            await asyncio.sleep(0.05)  # poll interval of a wait on state
        await b.register_pool(reg("renew-1", inc=2))
        assert await seconds_left() >= 3  # renewed to the full length again
        assert _decode((await a._client.get(key)).value)[1] == lease_id  # the same etcd lease
        assert "renew-1" in [
            p.pool_id for p in (await a.list_pools(model="", region="", after=None, limit=10))[0]
        ]
    finally:
        for store in (a, b):
            await store.close()


@pytest.mark.parametrize("action", ["drain", "remove"])
async def test_an_operator_action_through_a_lagging_replica_sees_the_registration(replicas, action):
    """A registration acknowledged by replica a, then an operator action through replica b whose
    mirror has not applied it yet: b waits for its mirror to reach discovery's newest record, not
    NOT_FOUND."""
    a, b = replicas
    await pause(b)
    await a.register_pool(reg(f"{action}-lag", inc=1))
    assert b.directory.get_pool(f"{action}-lag", b.clock.monotonic()) is None  # b is behind
    if action == "drain":
        task = asyncio.create_task(b.drain_pool(f"{action}-lag", 5.0))
    else:
        task = asyncio.create_task(b.remove_pool(f"{action}-lag"))
    await asyncio.sleep(0)  # the action's first step runs (and looks) while b is still behind
    resume(b)
    view = await task
    assert view.pool_id == f"{action}-lag"
    assert view.draining or action == "remove"


async def test_an_operator_action_does_not_wait_for_writes_outside_discoverys_prefix(replicas):
    """etcd's revision also counts other writers' keys (the frontends' budgets may share the etcd),
    which a mirror never applies: a drain waits for discovery's newest record, not for those."""
    a, b = replicas
    watcher = await b.watch(model="", region="")
    await a.register_pool(reg("beside-1", inc=1))
    await next_event(watcher, EventKind.ADDED)  # so b's mirror holds the pool
    await a._client.put(b"/globalrouter/v1/budget/test-beside", b"1")  # a newer revision, not discovery's
    view = await asyncio.wait_for(b.drain_pool("beside-1", 5.0), 5)  # the mirror's own bound is 10 s
    assert view.pool_id == "beside-1" and view.draining


async def test_drain_through_one_replica_completes_everywhere(replicas):
    a, b = replicas
    await a.register_pool(reg("drain-1", inc=3))
    watcher = await a.watch(model="", region="")
    await b.drain_pool("drain-1", 1.0)
    renewal = await a.register_pool(reg("drain-1", inc=3))
    assert renewal.drain_requested and renewal.pool.draining
    removed = await next_event(watcher, EventKind.REMOVED)
    assert removed.pool.pool_id == "drain-1" and removed.reason is Removal.DRAINED

    async def refused() -> bool:
        try:
            await a.register_pool(reg("drain-1", inc=3))
        except DrainCompleted:
            return True
        except (StoreUnavailable, NotFound):
            # Raced with the replicas ending the drained leases (the lease was written, then the
            # pool left before it could be read back): a relay retries.
            return False
        await a.unregister_pool("drain-1", "r1", 3, Removal.UNREGISTERED)
        return False

    # Bounded by time, not by tries: on a loaded machine the replicas' lease ends can take seconds.
    deadline = time.monotonic() + 30
    while not await refused():
        assert time.monotonic() < deadline, "the drained incarnation was not refused"
        await asyncio.sleep(0.1)
    while True:  # a restarted relay may register again; a concurrent change says retry
        try:
            restarted = await b.register_pool(reg("drain-1", inc=4))
            break
        except StoreUnavailable:
            assert time.monotonic() < deadline + 30, "the restarted relay's registration never went through"
            await asyncio.sleep(0.1)
    assert restarted.pool.pool_id == "drain-1"


def test_two_serve_processes_share_one_etcd(procs, etcd):
    addresses = [
        start_discovery(procs, "--store", "etcd", "--etcd-endpoints", etcd, "--lease-duration", "3")[1]
        for _ in range(2)
    ]
    with grpc.insecure_channel(addresses[0]) as channel:
        reply = pb_grpc.DiscoveryServiceStub(channel).RegisterPool(
            pb.RegisterPoolRequest(
                pool_id="proc-1",
                model="m",
                region="eu",
                frontends=["http://h:1"],
                relay_id="r",
                incarnation=1,
            ),
            timeout=10,
        )
        assert reply.lease_duration.seconds == 3

    def listed_by_second() -> list[str]:
        done = run_pools(addresses[1], "--json")
        return [json.loads(line)["pool_id"] for line in done.stdout.splitlines()]

    assert "proc-1" in wait_until(listed_by_second, timeout=10, message="the other replica to list the pool")
    for proc in procs.procs:
        assert proc.terminate() == 0


async def test_mirror_resyncs_after_its_watch_breaks(replicas):
    a, b = replicas
    watcher = await a.watch(model="resync", region="")
    await b.register_pool(reg("resync-1", model="resync"))
    await next_event(watcher, EventKind.ADDED)
    await a._watch.cancel()  # the watch breaks (as when etcd restarts)
    await b.unregister_pool("resync-1", "r1", 1, Removal.UNREGISTERED)
    removed = await next_event(watcher, EventKind.REMOVED)
    assert removed.pool.pool_id == "resync-1"
    await b.register_pool(reg("resync-2", model="resync"))
    assert (await next_event(watcher, EventKind.ADDED)).pool.pool_id == "resync-2"


async def test_keepalive_stream_renews_through_the_etcd_store(etcd):
    from globaldiscovery.config import DiscoveryConfig
    from globaldiscovery.server import build_server
    from tests.discovery.test_server import register_request

    store = EtcdStore(SystemClock(), endpoint=etcd, heartbeat_interval=0.5, lease_duration=2.0)
    handle = build_server(DiscoveryConfig(listen="127.0.0.1:0"), store)
    await store.start()
    await handle.server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = pb_grpc.DiscoveryServiceStub(channel)
            await stub.RegisterPool(register_request(pool_id="ka-etcd", incarnation=5))
            requests = [
                pb.KeepAlivePoolsRequest(
                    register=register_request(pool_id="ka-etcd", incarnation=5), sequence=1
                ),
                pb.KeepAlivePoolsRequest(
                    register=register_request(pool_id="ka-etcd", incarnation=4), sequence=2
                ),
                pb.KeepAlivePoolsRequest(
                    register=register_request(pool_id="ka-etcd", incarnation=5), sequence=3
                ),
            ]
            replies = [r async for r in stub.KeepAlivePools(iter(requests))]
            assert [r.sequence for r in replies] == [1, 2, 3]
            assert [r.WhichOneof("result") for r in replies] == ["register", "error", "register"]
            assert replies[1].error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
            assert replies[2].register.pool.leases[0].incarnation == 5
            # The renewal went through etcd: another store reading the same etcd sees the lease.
            other = EtcdStore(SystemClock(), endpoint=etcd, heartbeat_interval=0.5, lease_duration=2.0)
            await other.start()
            try:
                pools, _, _ = await other.list_pools(model="", region="", after=None, limit=100)
                assert "ka-etcd" in [p.pool_id for p in pools]
            finally:
                await other.close()
    finally:
        await store.close()
        await handle.server.stop(0)


async def test_unreadable_or_out_of_range_records_in_etcd_never_make_the_directory_unreadable(etcd):
    """Records written past the server (an older version, a hand edit) are skipped or clamped, not fatal."""
    import dataclasses

    import aetcd

    from globaldiscovery.config import DiscoveryConfig
    from globaldiscovery.server import build_server
    from globaldiscovery.store.etcd import LEASES, SEP, _encode

    await wipe_discovery_keys(etcd)
    host, _, port = etcd.rpartition(":")
    client = aetcd.Client(host=host, port=int(port))
    await client.connect()
    try:
        await client.put(LEASES + b"junk" + SEP + b"r1", b"{not json")
        far = dataclasses.replace(
            reg("far", draining=True), drain_deadline_wall=1e13, expire_wall=time.time() + 60
        )
        await client.put(LEASES + b"far" + SEP + b"r1", _encode(far, 0))
    finally:
        await client.close()
    store = EtcdStore(SystemClock(), endpoint=etcd, heartbeat_interval=0.5, lease_duration=5.0)
    handle = build_server(DiscoveryConfig(listen="127.0.0.1:0"), store)
    await store.start()  # the bad record does not stop the start
    await handle.server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = pb_grpc.DiscoveryServiceStub(channel)
            # A registration into the pool with the unreadable record still goes through.
            await stub.RegisterPool(
                pb.RegisterPoolRequest(
                    pool_id="junk",
                    model="m",
                    region="eu",
                    frontends=["http://h:1"],
                    relay_id="r2",
                    incarnation=1,
                )
            )
            listed = await stub.ListPools(pb.ListPoolsRequest())
            assert [p.pool_id for p in listed.pools] == ["far", "junk"]
            assert listed.pools[0].drain_deadline.seconds == 253402300799  # clamped, not an error
            watch = stub.WatchPools(pb.WatchPoolsRequest())
            ids = []
            async for event in watch:
                if event.type == pb.WATCH_EVENT_TYPE_SNAPSHOT_DONE:
                    break
                ids.append(event.pool.pool_id)
            watch.cancel()
            assert ids == ["far", "junk"]
    finally:
        await store.close()
        await handle.server.stop(0)


async def test_two_replicas_registering_different_models_into_one_pool_have_one_winner(replicas):
    """Issue 17: the decision was read outside the write's transaction, so two relays of different
    models registering one pool through two replicas could both commit (the pool flapped)."""
    a, b = replicas
    for round_ in range(50):
        pool = f"race-{round_}"
        results = await asyncio.gather(
            a.register_pool(reg(pool, relay="ra", model="model-a")),
            b.register_pool(reg(pool, relay="rb", model="model-b")),
            return_exceptions=True,
        )
        winners = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, ModelConflict)]
        assert len(winners) == 1 and len(refused) == 1, f"round {round_}: {results!r}"
        # etcd holds the winner's lease alone, and so does every mirror.
        stored = await a._client.get_prefix(_lease_key(pool, ""))
        assert [_decode(kv.value)[0].model for kv in stored] == [winners[0].pool.model]
        for store in (a, b):
            view = store.directory.get_pool(pool, store.clock.monotonic())
            if view is not None:  # b's mirror may not have applied the write yet
                assert {lease.relay_id for lease in view.leases} == {winners[0].pool.leases[0].relay_id}

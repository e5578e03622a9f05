"""A discovery replica cut off from etcd stops serving instead of serving a frozen directory
(issue 17): after its isolation timeout it turns NOT_SERVING, ends its watches and refuses every
call with UNAVAILABLE / STORE_UNAVAILABLE, and it serves again by itself once its mirror has
re-synced. The timing rule runs on a fake clock; the rest against real etcd members that are
stopped (connection refused) or frozen (SIGSTOP: connections hang), then brought back."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from globaldiscovery.config import DiscoveryConfig
from globaldiscovery.server import serve
from globaldiscovery.store.etcd import EtcdStore
from globaldiscovery.store.etcd_link import EtcdLink, LinkChange
from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshkit.clock import FakeClock, SystemClock
from meshkit.errors import Reason, reason_of
from meshlaunch.etcd_cluster import EtcdCluster
from tests.discovery.etcd_support import require_etcd
from tests.discovery.helpers import reg

pytestmark = pytest.mark.timeout(180)

ISOLATION = 1.0  # the replicas' isolation timeout in these tests
WAIT = 30.0  # the longest any awaited state may take on a loaded machine, never slept for


# ----- the rule, on a fake clock -----


def test_link_is_lost_only_after_the_timeout_and_regained_only_once_the_mirror_follows():
    clock = FakeClock()
    link = EtcdLink(2.0, clock.monotonic())
    assert link.probe_interval == 0.5
    clock.set(clock.monotonic() + 2.0)
    assert link.check(clock.monotonic()) is None  # exactly the timeout: still in touch
    link.contact(clock.monotonic())
    clock.set(clock.monotonic() + 2.01)
    assert link.check(clock.monotonic()) is LinkChange.LOST
    assert link.isolated and link.check(clock.monotonic()) is None  # said once
    link.broke()  # the store drops its watch to re-sync
    link.contact(clock.monotonic())  # etcd answers a probe, but the mirror does not follow yet
    assert link.check(clock.monotonic()) is None and link.isolated
    clock.set(clock.monotonic() + 5.0)
    link.followed(clock.monotonic())  # re-synced
    assert link.check(clock.monotonic()) is LinkChange.REGAINED
    assert not link.isolated and link.check(clock.monotonic()) is None


def test_a_watch_that_broke_is_not_in_touch_even_while_probes_answer():
    clock = FakeClock()
    link = EtcdLink(1.0, clock.monotonic())
    link.broke()  # the mirror's watch ended; its re-sync keeps failing
    for _ in range(5):
        clock.set(clock.monotonic() + 0.25)
        link.contact(clock.monotonic())  # probes answer all the same
    assert link.check(clock.monotonic()) is LinkChange.LOST


# ----- a real etcd, cut -----


class Replica:
    """`globaldiscovery serve --store etcd` run in this process (the real serve(), health included)."""

    def __init__(self, endpoints: str) -> None:
        self.config = DiscoveryConfig(
            listen="127.0.0.1:0",
            heartbeat_interval=0.5,
            lease_duration=3.0,
            store="etcd",
            etcd_endpoints=endpoints,
            etcd_isolation_timeout=ISOLATION,
        )
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.address = ""

    async def __aenter__(self) -> Replica:
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(
            serve(self.config, stop_event=self.stop, on_started=lambda h: started.set_result(h.port))
        )
        self.address = f"127.0.0.1:{await asyncio.wait_for(started, WAIT)}"
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = pb_grpc.DiscoveryServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await self.channel.close()
        assert self.task is not None
        await asyncio.wait_for(self.task, WAIT)

    async def serving(self) -> bool:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def wait_serving(self, want: bool) -> None:
        deadline = time.monotonic() + WAIT
        while await self.serving() != want:
            assert time.monotonic() < deadline, f"health never became {'SERVING' if want else 'NOT_SERVING'}"
            await asyncio.sleep(0.05)  # poll interval of a wait on state


def registration(pool: str, relay: str = "r1") -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(
        pool_id=pool, model="m", region="eu", frontends=[f"http://{pool}:80"], relay_id=relay, incarnation=1
    )


async def refused_unavailable(call) -> grpc.aio.AioRpcError:
    """The error of `call`, which must be UNAVAILABLE with reason STORE_UNAVAILABLE, answered at once."""
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert reason_of(info.value) == Reason.STORE_UNAVAILABLE
    assert "etcd" in (info.value.details() or "")
    assert time.monotonic() - started < 5.0  # refused, not left to hang on the dead link
    return info.value


async def watch_opening(stub, start_revision: int = 0):
    """A WatchPools call and its events up to SNAPSHOT_DONE."""
    call = stub.WatchPools(pb.WatchPoolsRequest(start_revision=start_revision))
    events = []
    while True:
        event = await asyncio.wait_for(call.read(), WAIT)
        events.append(event)
        if event.type == pb.WATCH_EVENT_TYPE_SNAPSHOT_DONE:
            return call, events


async def events_until(call, pool_id: str) -> list[pb.WatchPoolsResponse]:
    """A watch's events up to the first that names `pool_id`."""
    events = []
    while True:
        event = await asyncio.wait_for(call.read(), WAIT)
        events.append(event)
        if event.pool.pool_id == pool_id:
            return events


@pytest.mark.parametrize("cut", ["stopped", "frozen"])
async def test_a_replica_cut_off_from_etcd_stops_serving_then_recovers_by_itself(procs, cut):
    require_etcd()
    cluster = EtcdCluster(procs, 1).start()
    member = cluster.members[0]
    async with Replica(member.endpoint) as replica:
        await replica.stub.RegisterPool(registration("before"), timeout=10)
        watch, opening = await watch_opening(replica.stub)
        assert [e.pool.pool_id for e in opening[:-1]] == ["before"]
        revision = opening[-1].revision
        assert await replica.serving()

        cut_at = time.monotonic()
        if cut == "stopped":
            cluster.kill9(0)
        else:
            assert member.proc is not None
            os.kill(member.proc.pid, signal.SIGSTOP)  # its sockets stay open; nothing answers
        try:
            # The open watch ends with UNAVAILABLE (the client re-watches elsewhere), not before
            # the isolation timeout and well within a bound.
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(watch.read(), WAIT)
            took = time.monotonic() - cut_at
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert reason_of(ended.value) == Reason.STORE_UNAVAILABLE
            # Never early: the last contact (a probe every ISOLATION / 4) was at most that long before the cut.
            assert ISOLATION * 0.75 <= took < ISOLATION + 10, f"{took:.2f} s"
            await replica.wait_serving(False)
            # Every call is refused at once with the reason, writes and reads alike.
            await refused_unavailable(replica.stub.RegisterPool(registration("during"), timeout=10))
            await refused_unavailable(replica.stub.ListPools(pb.ListPoolsRequest(), timeout=10))
            await refused_unavailable(replica.stub.ListFrontends(pb.ListFrontendsRequest(), timeout=10))
            again = replica.stub.WatchPools(pb.WatchPoolsRequest())
            await refused_unavailable(again.read())
            keepalive = replica.stub.KeepAlivePools()
            await keepalive.write(pb.KeepAlivePoolsRequest(register=registration("before"), sequence=1))
            await refused_unavailable(keepalive.read())
        finally:
            if cut == "stopped":
                cluster.restart(0)
            else:
                os.kill(member.proc.pid, signal.SIGCONT)
        cluster.wait_healthy()

        await replica.wait_serving(True)
        # The mirror follows etcd again: a pool another replica registers now is listed here.
        other = EtcdStore(SystemClock(), endpoint=member.endpoint, heartbeat_interval=0.5, lease_duration=3.0)
        await other.start()
        try:
            await other.register_pool(reg("after", relay="r9", frontends=("http://after:80",)))
        finally:
            await other.close()
        deadline = time.monotonic() + WAIT
        while "after" not in [p.pool_id for p in (await replica.stub.ListPools(pb.ListPoolsRequest())).pools]:
            assert time.monotonic() < deadline, "the re-synced mirror never showed the new pool"
            await asyncio.sleep(0.05)  # poll interval of a wait on state
        # A watch resumes exactly from the revision it had seen before the cut.
        resumed, opening = await watch_opening(replica.stub, start_revision=revision)
        try:
            assert opening[-1].resumed and len(opening) == 1
            added = (await events_until(resumed, "after"))[-1]
            assert added.type == pb.WATCH_EVENT_TYPE_ADDED
        finally:
            resumed.cancel()
    cluster.remove_data()


# ----- relays and frontends move to another replica -----


@pytest.mark.e2e
def test_relays_and_frontends_move_off_a_replica_cut_off_from_etcd(procs):
    """Replica A knows only one etcd member (not the leader: B must not see an election), replica
    B the other two. The relay's keep-alive stream and the frontend's watch are on A (B starts
    after them); A's member is killed: A stops serving and ends them, and they move to B, so the
    pool never leaves B's listing nor the frontend's, and a pool started afterwards reaches the
    frontend. A serves again once its member is back."""
    from meshlaunch import Mesh, command, free_port, wait_healthy, wait_until
    from tests.resilience.test_e2e_replicated import Watchdog, listed_at

    require_etcd()
    heartbeat, lease = 0.5, 5.0
    cluster = EtcdCluster(procs, 3).start()
    leader = wait_until(lambda: cluster.leader() is not None and cluster.leader() + 1, timeout=10) - 1
    cut = (leader + 1) % 3
    a, b = (f"127.0.0.1:{free_port()}" for _ in range(2))

    def replica(address: str, endpoints: list[str]):
        flags = ["--store", "etcd", "--etcd-endpoints", ",".join(endpoints)]
        timing = ["--heartbeat-interval", str(heartbeat), "--lease-duration", str(lease)]
        argv = [command("globaldiscovery"), "serve", "--listen", address, *flags, *timing]
        proc = procs.start("discovery", [*argv, "--etcd-isolation-timeout", str(ISOLATION)])
        wait_healthy(address, proc=proc)

    replica(a, [cluster.endpoints[cut]])
    mesh = Mesh(procs)
    mesh.discovery = f"{a},{b}"  # the relays and the frontend know both replicas
    mesh.start_pool("pool-a", "eu", "--speedup", "50")
    router = mesh.start_router()
    mesh.wait_routable(router, ["pool-a"])
    replica(b, [e for i, e in enumerate(cluster.endpoints) if i != cut])

    def b_lists_the_pool() -> str | None:
        return None if "pool-a" in listed_at(b) else "pool-a not listed at replica B"

    def router_lists_the_pool() -> str | None:
        view = router.pools().get("pool-a")
        return None if view is not None and view.listed else "pool-a not listed at the frontend"

    def a_serves() -> bool:
        with grpc.insecure_channel(a) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    with Watchdog(b_lists_the_pool) as at_b, Watchdog(router_lists_the_pool) as at_router:
        cluster.kill9(cut)
        wait_until(lambda: not a_serves(), timeout=WAIT, message="replica A to turn NOT_SERVING")
        time.sleep(2 * lease)  # the relay's lease would have lapsed twice had it stayed on A
    assert at_b.misses == [] and at_router.misses == [], (at_b.misses[:3], at_router.misses[:3])
    # The frontend's directory follows a live replica: a pool that starts now reaches it.
    mesh.start_pool("pool-b", "eu", "--speedup", "50")
    mesh.wait_routable(router, ["pool-b"], timeout=WAIT)

    cluster.restart(cut)
    wait_until(a_serves, timeout=WAIT, message="replica A to serve again")
    assert {"pool-a", "pool-b"} <= listed_at(a)  # its mirror re-synced
    cluster.remove_data()

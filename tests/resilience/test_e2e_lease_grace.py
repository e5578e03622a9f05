"""End to end on real processes and a real etcd: a discovery outage longer than a lease does not
drop, even for a moment, a pool whose relay is alive and streams telemetry to the frontend (the
lease grace), while a pool whose relay was killed still leaves as before."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch import MODEL, Mesh, free_port, wait_healthy, wait_until
from meshlaunch.mesh import etcd_discovery_argv
from meshlaunch.process import Proc, ProcessGroup
from tests.discovery.etcd_support import running_etcd

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
HEARTBEAT, LEASE = 1.0, 10.0
"""Short leases, so that an outage longer than one is quick; long enough that the relays' replica
restarts, and the relay registers again, well within the grace on a loaded machine."""
PROMPT = [(11 * i + 3) % 30_000 for i in range(40)]
LAPSED = router_pb2.DIRECTORY_STATE_LEASE_LAPSED


def start_replica(procs: ProcessGroup, address: str, etcd: str) -> Proc:
    """A `globaldiscovery serve --store etcd` replica on `address`, serving."""
    proc = procs.start("discovery", etcd_discovery_argv(address, etcd, HEARTBEAT, LEASE))
    wait_healthy(address, 30, proc=proc)
    return proc


class Watch:
    """A thread that keeps asking the frontend: Generate requests one after another (each outcome
    recorded), and every 0.1 s its ListPools, noting any moment a pool was not listed."""

    def __init__(self, address: str, pool_ids: list[str]) -> None:
        self.address = address
        self.outcomes: list[str] = []
        self.unlisted: dict[str, int] = dict.fromkeys(pool_ids, 0)
        self.lapsed_seen: set[str] = set()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._generate, daemon=True),
            threading.Thread(target=self._list, daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _generate(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            i = 0
            while not self.stop.is_set():
                i += 1
                request = router_pb2.GenerateRequest(
                    model=MODEL,
                    prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=[*PROMPT, i])),
                    max_tokens=3,
                )
                try:
                    for _ in stub.Generate(request, timeout=20):
                        pass
                    self.outcomes.append("OK")
                except grpc.RpcError as exc:
                    self.outcomes.append(f"{exc.code().name}: {exc.details()}")
                    time.sleep(0.05)

    def _list(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            while not self.stop.wait(0.1):
                try:
                    views = {
                        p.pool_id: p for p in stub.ListPools(router_pb2.ListPoolsRequest(), timeout=5).pools
                    }
                except grpc.RpcError:
                    continue
                for pool_id in self.unlisted:
                    view = views.get(pool_id)
                    if view is None or not view.listed:
                        self.unlisted[pool_id] += 1
                    elif view.directory_state == LAPSED:
                        self.lapsed_seen.add(pool_id)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def test_a_discovery_outage_longer_than_a_lease_drops_no_live_pool_and_a_dead_relays_pool_leaves(procs):
    with running_etcd() as etcd:
        # The relays know one discovery replica, the frontend another (same etcd), so the test
        # decides who hears discovery first after the outage: the frontend, while the relays still
        # cannot renew (in a real outage either may come first).
        relays_replica, frontend_replica = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        d1 = start_replica(procs, relays_replica, etcd)
        d2 = start_replica(procs, frontend_replica, etcd)
        mesh = Mesh(procs, discovery=relays_replica)
        mesh.start_pool("pool-a", "eu", "--speedup", "10")
        mesh.start_pool("pool-b", "eu", "--speedup", "10")
        mesh.discovery = frontend_replica
        router = mesh.start_router()
        mesh.wait_routable(router, ["pool-a", "pool-b"], timeout=30)
        watch = Watch(router.address, ["pool-a"])
        try:
            wait_until(lambda: len(watch.outcomes) >= 5, 20, message="requests served before the outage")
            d1.kill9()
            d2.kill9()
            relay_b = mesh.pools["pool-b"].relay
            assert relay_b is not None
            relay_b.kill9()  # pool-b's relay dies in the outage: its telemetry stream ends
            time.sleep(LEASE + 2.0)  # every lease lapses in etcd meanwhile
            d2 = start_replica(procs, frontend_replica, etcd)  # the frontend hears discovery again
            wait_until(
                lambda: router.metric("globalrouter_pool_lease_grace_total", outcome="kept") >= 1,
                20,
                message="the frontend learnt that pool-a's lease lapsed, and kept it",
            )
            views = router.pools()
            assert views["pool-a"].listed and views["pool-a"].directory_state == LAPSED
            assert views["pool-a"].lease_grace_left.ToTimedelta().total_seconds() > 0
            # pool-b's relay is dead: it leaves at once, as before the grace.
            wait_until(
                lambda: "pool-b" not in (v := router.pools()) or not v["pool-b"].listed,
                10,
                message="pool-b leaves the directory",
            )
            assert router.metric("globalrouter_pool_lease_grace_total", outcome="dropped") >= 1
            d1 = start_replica(procs, relays_replica, etcd)  # the relays' replica is back
            wait_until(
                lambda: router.pools()["pool-a"].directory_state == router_pb2.DIRECTORY_STATE_LISTED,
                LEASE,
                message="pool-a's relay registered again within the grace",
            )
            assert router.metric("globalrouter_pool_lease_grace_total", outcome="reregistered") >= 1
            assert router.metric("globalrouter_pool_lease_grace_total", outcome="expired") == 0
            served = len(watch.outcomes)
            wait_until(lambda: len(watch.outcomes) >= served + 5, 20, message="requests served after")
        finally:
            watch.finish()
        failed = [o for o in watch.outcomes if o != "OK"]
        assert not failed, f"{len(failed)} of {len(watch.outcomes)} requests failed: {sorted(set(failed))}"
        assert watch.unlisted == {"pool-a": 0}, "pool-a was never unlisted, not even for a moment"
        assert watch.lapsed_seen == {"pool-a"}
        assert d1.alive() and d2.alive()

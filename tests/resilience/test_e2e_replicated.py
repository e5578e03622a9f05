"""Replicated discovery on a real 3-member etcd cluster: relays and a frontend that know both
discovery replicas keep the pool listed and routable while a replica is killed, while an etcd
member (the leader) is killed, and re-sync after the whole etcd cluster restarts."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from globalrouter.client import FailoverClient
from meshkit import discovery_endpoints
from meshlaunch import MODEL, Mesh, free_port, wait_healthy, wait_until
from meshlaunch.etcd_cluster import EtcdCluster, etcd_binary
from meshlaunch.mesh import etcd_discovery_argv
from mocker.tokens import continue_sequence

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
HEARTBEAT, LEASE = 0.5, 3.0
PROMPT = [(7 * i + 1) % 30_000 for i in range(40)]


def test_endpoints_parse_and_resolve():
    assert discovery_endpoints.parse_endpoints("127.0.0.1:1, 127.0.0.1:2") == ("127.0.0.1:1", "127.0.0.1:2")
    for bad in ("", "a:1,a:1", "nohost", "a:0"):
        with pytest.raises(ValueError):
            discovery_endpoints.parse_endpoints(bad)
    assert discovery_endpoints.channel_target(["127.0.0.1:1", "localhost:2"]) == (
        "ipv4:127.0.0.1:1,127.0.0.1:2",
        False,
    )
    assert discovery_endpoints.channel_target(["h:5"]) == ("h:5", False), "one address is dialled as it is"
    assert ("grpc.lb_policy_name", "round_robin") in discovery_endpoints.channel_options(["a:1", "b:2"])


def start_replica(procs, address: str, cluster: EtcdCluster):
    """A `globaldiscovery serve --store etcd` replica on every member of `cluster`, serving."""
    proc = procs.start("discovery", etcd_discovery_argv(address, cluster.endpoints_flag, HEARTBEAT, LEASE))
    wait_healthy(address, proc=proc)
    return proc


def listed_at(address: str) -> set[str]:
    # 10 s: the Watchdog records a slow reply on a loaded machine as a miss, which is no evidence
    # that the pool was unlisted (an unlisted pool still shows as one).
    with grpc.insecure_channel(address) as ch:
        reply = dpb_grpc.DiscoveryServiceStub(ch).ListPools(dpb.ListPoolsRequest(), timeout=10)
    return {p.pool_id for p in reply.pools}


class Watchdog:
    """Polls a condition in the background and records every moment it did not hold."""

    def __init__(self, check, interval: float = 0.1) -> None:
        self._check = check
        self._interval = interval
        self.misses: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                problem = self._check()
            except Exception as exc:
                problem = repr(exc)
            if problem:
                self.misses.append(problem)
            self._stop.wait(self._interval)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_losing_a_replica_or_an_etcd_member_drops_no_pool_and_an_etcd_restart_resyncs(procs):
    pytest.importorskip("aetcd")
    etcd_binary()
    cluster = EtcdCluster(procs, 3).start()
    replicas = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    disco_procs = []
    for address in replicas:
        disco_procs.append(start_replica(procs, address, cluster))
    mesh = Mesh(procs)
    mesh.discovery = ",".join(replicas)  # relays and the frontend know both replicas
    mesh.start_pool("pool-a", "eu", "--speedup", "50")
    router = mesh.start_router()
    mesh.wait_routable(router, ["pool-a"])

    def survivor_lists_the_pool() -> str | None:
        return None if "pool-a" in listed_at(replicas[1]) else "pool-a not listed at the surviving replica"

    def router_lists_the_pool() -> str | None:
        view = router.pools().get("pool-a")
        return None if view is not None and view.listed else "pool-a not listed at the frontend"

    # 1. A discovery replica dies: nothing leaves, the relay and the frontend move to the other.
    with Watchdog(survivor_lists_the_pool) as at_replica, Watchdog(router_lists_the_pool) as at_router:
        disco_procs[0].kill9()
        time.sleep(3 * LEASE)
    assert at_replica.misses == [] and at_router.misses == [], (at_replica.misses[:3], at_router.misses[:3])
    with FailoverClient([router.address]) as client:
        assert client.generate(MODEL, PROMPT, 8).tokens == continue_sequence(PROMPT, 8)

    # 2. The etcd leader dies (then comes back): no lease expires early, the pool stays listed.
    leader = wait_until(lambda: cluster.leader() is not None and cluster.leader() + 1, timeout=10) - 1
    with Watchdog(survivor_lists_the_pool) as at_replica, Watchdog(router_lists_the_pool) as at_router:
        cluster.kill9(leader)
        time.sleep(3 * LEASE)
        cluster.restart(leader)
        time.sleep(LEASE)
    assert at_replica.misses == [] and at_router.misses == [], (at_replica.misses[:3], at_router.misses[:3])

    # 3. The whole etcd cluster restarts: the replica re-syncs and the pool is routable again.
    cluster.kill_all()
    cluster.restart_all()
    wait_until(
        lambda: "pool-a" in listed_at(replicas[1]), timeout=30, message="pool-a listed after etcd restart"
    )
    mesh.wait_routable(router, ["pool-a"], timeout=30)
    with FailoverClient([router.address]) as client:
        assert client.generate(MODEL, PROMPT, 8).tokens == continue_sequence(PROMPT, 8)
    # And a restarted replica catches up from etcd at once.
    start_replica(procs, replicas[0], cluster)
    assert "pool-a" in listed_at(replicas[0])
    cluster.remove_data()

"""End to end, real processes: a frontend started before its listed pools' KV state has arrived says
NOT_SERVING (gRPC health) and 503 (/readyz) while /livez says alive, then SERVING and 200 once a
relay's snapshot arrives."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from globaldiscovery.v1 import discovery_pb2, discovery_pb2_grpc
from meshlaunch import free_port, local_mesh, wait_until
from meshlaunch.mesh import router_argv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str) -> int | None:
    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return None  # not up yet
        return int(reply.status)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def listed(discovery: str) -> list[str]:
    with grpc.insecure_channel(discovery) as ch:
        reply = discovery_pb2_grpc.DiscoveryServiceStub(ch).ListPools(
            discovery_pb2.ListPoolsRequest(), timeout=5
        )
        return sorted(p.pool_id for p in reply.pools)


def test_a_frontend_is_not_ready_until_its_listed_pools_kv_state_arrived():
    with local_mesh() as mesh:
        # Leases long enough that the pool stays listed while its relay is paused.
        mesh.start_discovery(None, "--lease-duration", "60")
        procs = mesh.start_pool("p1")
        assert procs.relay is not None
        wait_until(lambda: listed(mesh.discovery) == ["p1"], 30, message="p1 listed")
        # The relay is the natural dependency: paused, it cannot stream p1's KV state to a new frontend.
        procs.relay.signal(signal.SIGSTOP)
        try:
            address, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            proc = mesh.group.start(
                "router", router_argv(address, mesh.discovery, "--http-listen", http, "--grace", "1")
            )
            first = wait_until(lambda: health(address), 30, message="the frontend answers health")
            assert first == NOT_SERVING, "SERVING before it can route"

            def synced() -> tuple[int, dict] | None:
                reply = get(f"http://{http}/readyz")
                return reply if reply[1].get("directory_synced") else None

            reply = wait_until(
                synced,
                30,
                message="the directory synced",
            )
            assert reply is not None
            status, body = reply
            assert status == 503 and body["pools_without_kv"] == 1 and body["status"] == "not ready"
            assert get(f"http://{http}/livez") == (200, {"status": "ok"}), "alive meanwhile"
            for _ in range(10):  # held while the relay cannot stream (well inside --ready-timeout)
                assert health(address) == NOT_SERVING
                proc.check_alive()
        finally:
            procs.relay.signal(signal.SIGCONT)
        wait_until(lambda: health(address) == SERVING, 30, message="SERVING once p1's snapshot arrived")
        status, body = get(f"http://{http}/readyz")
        assert status == 200 and body["status"] == "ready" and body["ready_after_s"] < 30
        assert "directory synced; every listed pool's KV state arrived" in proc.output()

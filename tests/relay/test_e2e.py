"""End to end with real processes: globaldiscovery + mocker + poolrelay (+ an in-process telemetry receiver)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from globalrouter.v1 import pool_frontend_pb2 as pf
from globalrouter.v1 import pool_frontend_pb2_grpc as pf_grpc
from meshkit.timeconv import duration
from meshlaunch import command, free_port, wait_healthy, wait_until
from mocker.v1 import admin_pb2, admin_pb2_grpc
from poolrelay.v1 import status_pb2, status_pb2_grpc
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc
from tests.relay.fakes import TelemetryReceiver, start_server, wait_for

pytestmark = pytest.mark.e2e

HEARTBEAT, LEASE = 0.5, 1.5
# How long after a lease's end the pool may still be listed (discovery's expiry sweep, a slow box).
EXPIRY_BOUND = 2.0


def start_discovery(procs) -> str:
    addr = f"127.0.0.1:{free_port()}"
    p = procs.start(
        "discovery",
        [
            command("globaldiscovery"),
            "serve",
            "--listen",
            addr,
            "--heartbeat-interval",
            str(HEARTBEAT),
            "--lease-duration",
            str(LEASE),
        ],
    )
    wait_healthy(addr, proc=p)
    return addr


def start_mocker(procs, *extra: str) -> str:
    addr = f"127.0.0.1:{free_port()}"
    p = procs.start(
        "mocker",
        [
            command("mocker"),
            "serve",
            "--listen",
            addr,
            "--pool-id",
            "pool-a",
            "--model",
            "m1",
            "--speedup",
            "100",
            *extra,
        ],
    )
    wait_healthy(addr, proc=p)
    return addr


def start_relay(procs, pool: str, discovery: str, *extra: str):
    status = f"127.0.0.1:{free_port()}"
    p = procs.start(
        "relay",
        [
            command("poolrelay"),
            "serve",
            "--pool",
            pool,
            "--discovery",
            discovery,
            "--routing-pool",
            "pool-a",
            "--routing-pool-region",
            "eu-west",
            "--routing-pool-frontends",
            f"http://{pool}",
            "--status-listen",
            status,
            "--report-interval",
            "0.2",
            *extra,
        ],
    )
    wait_healthy(status, proc=p)
    return p, status


def listed(discovery: str) -> dpb.Pool | None:
    with grpc.insecure_channel(discovery) as ch:
        reply = dpb_grpc.DiscoveryServiceStub(ch).ListPools(dpb.ListPoolsRequest(), timeout=5)
    return next((p for p in reply.pools if p.pool_id == "pool-a"), None)


def relay_status(addr: str) -> status_pb2.GetRelayStatusResponse:
    with grpc.insecure_channel(addr) as ch:
        return status_pb2_grpc.RelayStatusServiceStub(ch).GetRelayStatus(
            status_pb2.GetRelayStatusRequest(), timeout=5
        )


@pytest.mark.timeout(90)
def test_pool_listed_then_leaves_one_lease_after_a_crash_and_at_once_on_sigterm(procs):
    discovery = start_discovery(procs)
    pool = start_mocker(procs)
    relay, status = start_relay(procs, pool, discovery)
    found = wait_until(lambda: listed(discovery), timeout=15, message="pool listed")
    assert (found.model, found.region, list(found.frontends)) == ("m1", "eu-west", [f"http://{pool}"])
    assert found.capacity.max_running_requests > 0 and found.capacity.kv_cache_blocks > 0
    st = relay_status(status)
    assert st.healthy and st.registered_model == "m1" and st.HasField("lease_expire_time")

    relay.kill9()
    killed = time.monotonic()
    wait_until(lambda: listed(discovery) is None, timeout=LEASE + EXPIRY_BOUND + 5, message="pool gone")
    gone_after = time.monotonic() - killed
    assert gone_after <= LEASE + EXPIRY_BOUND, f"pool left {gone_after:.2f}s after the crash"

    relay, status = start_relay(procs, pool, discovery, "--unregister-on-exit")
    wait_until(lambda: listed(discovery), timeout=15, message="pool listed again")
    assert relay.terminate() == 0
    assert listed(discovery) is None, "--unregister-on-exit: the pool leaves at once"


@pytest.mark.timeout(90)
async def test_telemetry_receiver_holds_the_workers_block_set_after_traffic(procs):
    recv = TelemetryReceiver()
    server, recv_addr = await start_server((tm_grpc.add_TelemetryServiceServicer_to_server, recv))
    try:
        discovery = await asyncio.to_thread(start_discovery, procs)
        pool = await asyncio.to_thread(
            start_mocker, procs, "--workers", "2", "--worker-capacity-blocks", "24"
        )
        _, status = await asyncio.to_thread(
            start_relay, procs, pool, discovery, "--global-frontends", f"http://{recv_addr}"
        )
        await wait_for(lambda: recv.hellos and recv.snapshots, within=20, message="telemetry stream open")
        async with grpc.aio.insecure_channel(pool) as ch:
            gen = pf_grpc.PoolFrontendServiceStub(ch)
            admin = admin_pb2_grpc.MockerAdminServiceStub(ch)
            for i in range(24):
                # Shared prefixes (so workers share blocks) and enough distinct blocks to evict.
                prompt = [i % 3] * 64 + list(range(i * 40, i * 40 + 40))
                req = pf.PoolFrontendServiceGenerateRequest(
                    request_id=f"r{i}", model="m1", token_ids=prompt, max_tokens=4
                )
                async for _ in gen.Generate(req, timeout=30):
                    pass

            async def expected() -> set[int]:
                reply = await admin.GetWorkerBlocks(admin_pb2.GetWorkerBlocksRequest(), timeout=5)
                return set().union(*(set(w.block_hashes) for w in reply.workers))

            want = await expected()
            assert len(want) > 10
            await wait_for(
                lambda: recv.blocks == want, within=20, message="receiver holds the workers' blocks"
            )
            assert recv.errors == [] and recv.deltas > 0
            assert want == await expected(), "the pool was idle while comparing"
        hello = recv.hellos[-1]
        assert (hello.pool_id, hello.model, hello.region) == ("pool-a", "m1", "eu-west")
        st = await asyncio.to_thread(relay_status, status)
        assert st.pool_blocks == len(want)
        assert [s.state for s in st.telemetry_streams] == [status_pb2.TELEMETRY_STREAM_STATE_STREAMING]
    finally:
        await server.stop(0)


@pytest.mark.timeout(90)
async def test_discovery_drain_reaches_the_pool_and_the_drained_pool_stays_out(procs):
    recv = TelemetryReceiver()  # its heartbeats show the relay's clock moving on
    server, recv_addr = await start_server((tm_grpc.add_TelemetryServiceServicer_to_server, recv))
    try:
        discovery = await asyncio.to_thread(start_discovery, procs)
        pool = await asyncio.to_thread(start_mocker, procs)
        _, status = await asyncio.to_thread(
            start_relay, procs, pool, discovery, "--global-frontends", f"http://{recv_addr}"
        )
        await asyncio.to_thread(_drain_until_drained, discovery, status)
        assert await asyncio.to_thread(listed, discovery) is None
        # Nine telemetry heartbeats at the 0.2 s report interval: 1.6 s of the relay's own clock,
        # over three discovery heartbeat intervals, in which nothing registers the pool again.
        beats = recv.heartbeats
        await wait_for(
            lambda: recv.heartbeats >= beats + 9, within=30, message="nine more telemetry heartbeats"
        )
        assert await asyncio.to_thread(listed, discovery) is None, "a drained pool is not registered again"
    finally:
        await server.stop(0)


def _drain_until_drained(discovery: str, status: str) -> None:
    wait_until(lambda: listed(discovery), timeout=15, message="pool listed")
    with grpc.insecure_channel(discovery) as ch:
        dpb_grpc.DiscoveryServiceStub(ch).DrainPool(
            dpb.DrainPoolRequest(pool_id="pool-a", timeout=duration(2.0)), timeout=5
        )
    wait_until(lambda: relay_status(status).draining, timeout=10, message="relay reports the drain")
    wait_until(
        lambda: (
            relay_status(status).routing_pool_unregistered_reason
            == status_pb2.UNREGISTERED_REASON_POOL_DRAINED
        ),
        timeout=15,
        message="pool drained",
    )

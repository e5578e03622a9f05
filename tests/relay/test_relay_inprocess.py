"""The relay against in-process fakes: registration, telemetry content, drain both ways, graceful stop."""

from __future__ import annotations

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from poolrelay.model_choice import Reason
from poolrelay.relay import Relay, RelayConfig
from poolrelay.status import relay_status
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import pool_events_pb2_grpc as pe_grpc
from poolrelay.v1 import status_pb2
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc
from tests.relay.fakes import FakeDiscovery, FakePool, TelemetryReceiver, start_server, wait_for


@pytest.fixture
async def mesh():
    pool = FakePool({"m1": True})
    disco = FakeDiscovery()
    recv = TelemetryReceiver()
    servers = []
    addrs = {}
    for name, add, servicer in [
        ("pool", pe_grpc.add_PoolEventsServiceServicer_to_server, pool),
        ("disco", dpb_grpc.add_DiscoveryServiceServicer_to_server, disco),
        ("recv", tm_grpc.add_TelemetryServiceServicer_to_server, recv),
    ]:
        server, addr = await start_server((add, servicer))
        servers.append(server)
        addrs[name] = addr
    recv.server = servers[-1]
    relay = Relay(
        RelayConfig(
            pool=addrs["pool"],
            discovery=addrs["disco"],
            pool_id="pool-a",
            region="eu",
            frontends=("http://127.0.0.1:9000",),
            relay_id="relay-1",
            incarnation=7,
            global_frontends=(f"http://{addrs['recv']}",),
            report_interval=0.2,
        )
    )
    await relay.start()
    yield pool, disco, recv, relay
    if not relay.stopped:
        await relay.stop()
    for s in servers:
        await s.stop(0)


@pytest.mark.timeout(30)
async def test_registers_the_ready_model_with_capacity_and_renews(mesh):
    pool, disco, _, relay = mesh
    await wait_for(lambda: len(disco.registers) >= 2, message="a registration and a renewal")
    req = disco.registers[0]
    assert (req.pool_id, req.model, req.region, list(req.frontends)) == (
        "pool-a",
        "m1",
        "eu",
        ["http://127.0.0.1:9000"],
    )
    assert (req.relay_id, req.incarnation) == ("relay-1", 7)
    assert (req.capacity.max_running_requests, req.capacity.kv_cache_blocks) == (8, 1000)
    assert req.capacity.prefill_tokens_per_second == 5000
    status = relay_status(relay)
    assert status.healthy and status.registered_model == "m1"
    assert status.routing_pool_unregistered_reason == status_pb2.UNREGISTERED_REASON_UNSPECIFIED
    # A second Ready model does not move the relay off the one it registered.
    pool.models["m2"] = True
    pool.changed()
    n = len(disco.registers)
    await wait_for(lambda: len(disco.registers) > n + 1)
    assert {r.model for r in disco.registers[n:]} == {"m1"}


@pytest.mark.timeout(30)
async def test_no_registration_while_several_models_then_at_once(mesh):
    pool, disco, _, relay = mesh
    await relay.stop()  # restart with a pool that has two Ready models
    disco.registers.clear()
    pool.models = {"a": True, "b": True}
    relay2 = Relay(relay.config)
    await relay2.start()
    try:
        await wait_for(lambda: relay2.status is not None and relay2.unregistered[0] == Reason.SEVERAL_MODELS)
        status = relay_status(relay2)
        assert status.healthy, "an unregistered pool does not make the relay unhealthy"
        assert "a, b" in status.routing_pool_unregistered_detail
        assert disco.registers == []
        pool.models["b"] = False
        pool.changed()
        await wait_for(lambda: disco.registers, message="registration once one model is Ready")
        assert disco.registers[0].model == "a"
    finally:
        await relay2.stop()


@pytest.mark.timeout(30)
async def test_telemetry_receiver_holds_the_pool_block_set(mesh):
    pool, _, recv, relay = mesh
    await wait_for(lambda: recv.snapshots, message="telemetry stream open")
    await wait_for(lambda: pool.kv_subscribers, message="the relay watches the pool's KV events")
    pool.kv_event("w1", stored=[1, 2, 3])
    pool.kv_event("w2", stored=[3, 4])
    await wait_for(lambda: recv.blocks == {1, 2, 3, 4}, message="blocks at the receiver")
    pool.kv_event("w1", removed=[3])
    pool.kv_event("w2", removed=[4], stored=[5])
    pool.kv_event("w1", cleared=True, stored=[6])
    await wait_for(lambda: recv.blocks == pool.pool_blocks() == {3, 5, 6})
    await wait_for(lambda: recv.loads and recv.readiness and recv.heartbeats)
    hello = recv.hellos[-1]
    assert (hello.pool_id, hello.relay_id, hello.incarnation, hello.protocol_version) == (
        "pool-a",
        "relay-1",
        7,
        1,
    )
    assert hello.block_size == 16 and hello.hash_scheme == 1 and hello.region == "eu"
    assert recv.errors == []
    # A frontend that asks for a snapshot gets a fresh one.
    before = recv.snapshots
    recv.snapshot_requests.put_nowait("test")
    await wait_for(lambda: recv.snapshots > before, message="a fresh snapshot on request")
    assert recv.blocks == {3, 5, 6} and recv.errors == []
    stream = relay_status(relay).telemetry_streams[0]
    assert stream.state == status_pb2.TELEMETRY_STREAM_STATE_STREAMING and stream.snapshots_sent >= 2


@pytest.mark.timeout(30)
async def test_discovery_drain_is_passed_to_the_pool_and_drained_pool_unregisters(mesh):
    pool, disco, recv, relay = mesh
    await wait_for(lambda: disco.registers)
    disco.drain_requested = True
    await wait_for(lambda: pool.drain_calls, message="StartDrain at the pool")
    assert pool.drain_calls[0].reason == "discovery"
    await wait_for(lambda: disco.registers[-1].draining, message="registration says draining")
    assert disco.registers[-1].HasField("drain_deadline")
    await wait_for(lambda: any(d.drain.state == pe.DRAIN_STATE_DRAINING for d in recv.drains))
    pool.drain = pe.DrainStatus(state=pe.DRAIN_STATE_DRAINED)
    pool.changed()
    await wait_for(lambda: disco.unregisters, message="UnregisterPool after the drain")
    assert disco.unregisters[0].reason == dpb.REMOVAL_REASON_DRAINED
    n = len(disco.registers)
    await wait_for(lambda: relay.unregistered[0] == Reason.POOL_DRAINED)
    await _report_intervals_pass(
        recv, 4
    )  # 0.6 s of the relay's clock: three heartbeats of the fake discovery
    assert len(disco.registers) == n, "nothing registered while the pool stays drained"


@pytest.mark.timeout(30)
async def test_graceful_stop_stops_renewing_and_leaves_the_lease_to_run_out(mesh):
    _, disco, _, relay = mesh
    await wait_for(lambda: disco.registers)
    await relay.stop()
    assert relay.heartbeat_stopped, "the heartbeat ended with the stop: nothing renews the lease"
    assert disco.unregisters == [], "PR #18077: the pool leaves one lease later, not at once"
    status = relay_status(relay)
    assert status.routing_pool_unregistered_reason == status_pb2.UNREGISTERED_REASON_RELAY_STOPPED
    assert "lease ends" in status.routing_pool_unregistered_detail
    assert all(s.state == status_pb2.TELEMETRY_STREAM_STATE_CLOSED for s in status.telemetry_streams)


@pytest.mark.timeout(30)
async def test_graceful_stop_with_unregister_on_exit_unregisters():
    pool, disco = FakePool({"m1": True}), FakeDiscovery()
    pool_server, pool_addr = await start_server((pe_grpc.add_PoolEventsServiceServicer_to_server, pool))
    disco_server, disco_addr = await start_server((dpb_grpc.add_DiscoveryServiceServicer_to_server, disco))
    relay = Relay(
        RelayConfig(
            pool_addr,
            disco_addr,
            "pool-a",
            "eu",
            ("http://127.0.0.1:9000",),
            "relay-1",
            7,
            unregister_on_exit=True,
        )
    )
    await relay.start()
    try:
        await wait_for(lambda: disco.registers)
    finally:
        await relay.stop()
        await pool_server.stop(0)
        await disco_server.stop(0)
    assert [u.reason for u in disco.unregisters] == [dpb.REMOVAL_REASON_UNREGISTERED]
    assert (disco.unregisters[0].relay_id, disco.unregisters[0].incarnation) == ("relay-1", 7)
    assert "unregistered" in relay.unregistered[1]


@pytest.mark.timeout(30)
async def test_failed_calls_are_reported_and_retried(mesh):
    _, disco, _, relay = mesh
    await wait_for(lambda: disco.registers)
    disco.fail = True
    await wait_for(lambda: relay.unregistered[0] == Reason.CALL_FAILED, message="CALL_FAILED")
    assert "UNAVAILABLE" in relay.unregistered[1]
    disco.fail = False
    n = len(disco.registers)
    await wait_for(lambda: len(disco.registers) > n and relay.unregistered[0] == Reason.NONE, within=15)


@pytest.mark.timeout(30)
async def test_lost_pool_means_nothing_registered():
    pool, disco = FakePool({"m1": True}), FakeDiscovery()
    pool_server, pool_addr = await start_server((pe_grpc.add_PoolEventsServiceServicer_to_server, pool))
    disco_server, disco_addr = await start_server((dpb_grpc.add_DiscoveryServiceServicer_to_server, disco))
    recv = TelemetryReceiver()
    recv_server, recv_addr = await start_server((tm_grpc.add_TelemetryServiceServicer_to_server, recv))
    relay = Relay(
        RelayConfig(
            pool_addr,
            disco_addr,
            "pool-a",
            "eu",
            ("http://127.0.0.1:9000",),
            "relay-1",
            1,
            global_frontends=(f"http://{recv_addr}",),
            report_interval=0.2,
        )
    )
    await relay.start()
    try:
        await wait_for(lambda: disco.registers, message="registered")
        await pool_server.stop(0)
        await wait_for(lambda: relay.unregistered[0] == Reason.POOL_UNREACHABLE, message="POOL_UNREACHABLE")
        n = len(disco.registers)
        await _report_intervals_pass(
            recv, 5
        )  # 0.8 s of the relay's clock: four heartbeats of the fake discovery
        assert len(disco.registers) == n, "no renewals for a pool the relay cannot see"
        assert disco.unregisters == [], "a lost pool is not unregistered: its lease runs out"
        assert "load" not in relay.hub.current_reports(), "its last load is not repeated as if fresh"
    finally:
        await relay.stop()
        await disco_server.stop(0)
        await recv_server.stop(0)


@pytest.mark.timeout(30)
async def test_streams_follow_the_frontends_discovery_lists(mesh):
    pool, disco, _, relay = mesh
    extra = TelemetryReceiver()
    server, addr = await start_server((tm_grpc.add_TelemetryServiceServicer_to_server, extra))
    try:
        disco.frontends = [f"http://{addr}"]
        await wait_for(lambda: extra.snapshots, message="a stream to the frontend discovery listed")
        pool.kv_event("w1", stored=[42])
        await wait_for(lambda: extra.blocks == {42})
        assert len(relay.hub.publishers) == 2, "the --global-frontends stream stays"
        disco.frontends = []
        await wait_for(lambda: f"http://{addr}" not in relay.hub.publishers, message="stream closed")
        assert len(relay.hub.publishers) == 1
    finally:
        await server.stop(0)


@pytest.mark.timeout(30)
async def test_kv_gap_resubscribes_and_the_set_is_right_again(mesh):
    pool, _, recv, _ = mesh
    await wait_for(lambda: recv.snapshots, message="telemetry stream open")
    pool.kv_event("w1", stored=[1, 2])
    await wait_for(lambda: recv.blocks == {1, 2})
    pool.event_ids["w1"] += 1  # the relay misses event 2 of w1 (block 3 stored, 1 removed)
    pool.workers["w1"] = {2, 3}
    pool.kv_event("w1", stored=[4])
    await wait_for(lambda: recv.blocks == {2, 3, 4}, message="fresh worker snapshots after the gap")
    assert recv.errors == []


@pytest.mark.timeout(30)
async def test_telemetry_reconnects_to_a_restarted_frontend_with_a_fresh_snapshot(mesh):
    pool, _, recv, relay = mesh
    url = next(iter(relay.hub.publishers))
    port = int(url.rsplit(":", 1)[1])
    pool.kv_event("w1", stored=[1, 2])
    await wait_for(lambda: recv.blocks == {1, 2})
    publisher = relay.hub.publishers[url]
    connects = publisher.connects
    # The frontend restarts: every stream ends; a new one (empty state) listens on the same port.
    await recv.server.stop(0)
    await wait_for(
        lambda: publisher.state != status_pb2.TELEMETRY_STREAM_STATE_STREAMING, message="stream broken"
    )
    fresh = TelemetryReceiver()
    server = grpc.aio.server()
    tm_grpc.add_TelemetryServiceServicer_to_server(fresh, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        pool.kv_event("w2", stored=[3])
        await wait_for(
            lambda: fresh.blocks == {1, 2, 3}, within=15, message="state rebuilt at the new frontend"
        )
        assert publisher.connects > connects and fresh.snapshots >= 1 and fresh.errors == []
    finally:
        await server.stop(0)


async def _report_intervals_pass(recv: TelemetryReceiver, n: int) -> None:
    """Waits until `n` more telemetry heartbeats arrived: the relay sends one per report interval on
    its own clock, so at least n - 1 intervals of the relay's time passed (however loaded the machine)."""
    start = recv.heartbeats
    await wait_for(lambda: recv.heartbeats >= start + n, message=f"{n} more telemetry heartbeats")


@pytest.mark.timeout(30)
async def test_a_background_task_that_dies_stops_the_relay(mesh, monkeypatch):
    """A bug in the heartbeat (not a failed call, which it retries) used to end the task silently:
    the pool then left the mesh one lease later while the relay said it was healthy."""
    _pool, _disco, _recv, relay = mesh
    await wait_for(lambda: relay.registered_model == "m1")
    assert not relay.stop_requested.is_set()

    def broken() -> None:
        raise KeyError("injected fault")

    monkeypatch.setattr(relay.heartbeat, "_wanted", broken)
    relay.heartbeat.poke()
    await wait_for(relay.stop_requested.is_set)
    assert relay.supervisor.failure is not None
    assert (relay.supervisor.failure.task, relay.supervisor.failure.cause) == (
        "heartbeat",
        "KeyError: 'injected fault'",
    )


@pytest.mark.timeout(30)
async def test_a_telemetry_publisher_that_dies_stops_the_relay(mesh):
    _pool, _disco, _recv, relay = mesh
    await wait_for(lambda: any(p.snapshots_sent for p in relay.hub.publishers.values()))
    (publisher,) = relay.hub.publishers.values()

    class Fault(BaseException):
        """Not an Exception: the session's own retries do not catch it, so the task dies."""

    async def broken(call) -> None:
        raise Fault("injected fault")

    publisher._send_snapshot = broken
    publisher.request_snapshot()
    await wait_for(relay.stop_requested.is_set)
    assert relay.supervisor.failure is not None
    assert relay.supervisor.failure.task.startswith("telemetry ")

"""A global frontend's life cycle in-process: health NOT_SERVING until ready (directory synced, listed
pools' KV state or the bounded wait), and a background task that dies stops the frontend with
NOT_SERVING and a non-zero exit instead of routing on a frozen table."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from globaldiscovery.v1 import discovery_pb2_grpc
from globalrouter.config import RouterConfig
from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import DirectoryWatcher, PoolTable
from globalrouter.readiness import Readiness
from globalrouter.server import create_server
from globalrouter.telemetry_ingest import TelemetryIngest
from meshkit.clock import FakeClock
from meshkit.server import create_server as create_grpc_server
from meshkit.supervision import EXIT_TASK_FAILED, BackgroundTaskFailed
from meshlaunch import free_port
from poolrelay.v1 import telemetry_pb2
from tests.router.fakes import eventually, pool_msg
from tests.router.test_directory import Ev, FakeDiscovery, T

pytestmark = pytest.mark.timeout(30)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# ---- readiness, pure, on a FakeClock ---------------------------------------------------------------
def readiness(table: PoolTable, clock: FakeClock, **kw) -> tuple[Readiness, CollectorRegistry]:
    registry = CollectorRegistry()
    return Readiness(table, clock, directory=True, timeout=30.0, registry=registry, **kw), registry


def test_not_ready_until_the_directory_is_synced_and_every_listed_pools_kv_arrived():
    table, clock = PoolTable(), FakeClock()
    ready, registry = readiness(table, clock)
    assert not ready.check() and registry.get_sample_value("globalrouter_ready") == 0
    assert ready.status() == {
        "status": "not ready",
        "directory_synced": False,
        "pools_without_kv": 0,
        "waited_s": 0.0,
        "ready_timeout_s": 30.0,
    }
    table.replace_directory([pool_msg("p1", "http://a:1"), pool_msg("p2", "http://b:1")], complete=True)
    clock.set(1010.0)
    assert not ready.check()
    assert ready.status()["pools_without_kv"] == 2 and ready.pools_waiting() == ["p1", "p2"]
    table.get("p1").kv_sources.add("p1/r1/1#1")  # a relay stream's snapshot applied
    assert not ready.check() and ready.pools_waiting() == ["p2"]
    table.get("p2").kv_sources.add("p2/r1/1#2")
    assert ready.check() and ready.ready_after == 10.0
    assert registry.get_sample_value("globalrouter_ready") == 1
    assert ready.status() == {"status": "ready", "ready_after_s": 10.0}
    # Latched: a pool listed later (or a stream lost) does not make a ready frontend unready.
    table.apply_listed(pool_msg("p3", "http://c:1"))
    table.get("p1").kv_sources.clear()
    assert ready.check()


def test_a_relays_snapshot_through_the_real_ingest_makes_its_pool_ready():
    table, clock = PoolTable(), FakeClock()
    ready, _ = readiness(table, clock)
    ingest = TelemetryIngest(table, KvIndex(), clock, RouterMetrics())
    table.replace_directory([pool_msg("p1", "http://a:1")], complete=True)
    stream = ingest.open(
        telemetry_pb2.TelemetryHello(
            pool_id="p1",
            relay_id="r1",
            incarnation=1,
            protocol_version=1,
            block_size=16,
            hash_scheme=telemetry_pb2.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
        )
    )
    ingest.receive(
        stream, telemetry_pb2.PublishPoolTelemetryRequest(heartbeat=telemetry_pb2.TelemetryHeartbeat())
    )
    assert not ready.check(), "a stream that has not sent its snapshot yet"
    snapshot = telemetry_pb2.KvSnapshot(
        snapshot_id=1, sequence=0, chunk_index=0, last=False, block_hashes=[1]
    )
    ingest.receive(stream, telemetry_pb2.PublishPoolTelemetryRequest(kv_snapshot=snapshot))
    assert not ready.check(), "half a snapshot"
    snapshot = telemetry_pb2.KvSnapshot(snapshot_id=1, sequence=0, chunk_index=1, last=True, block_hashes=[2])
    ingest.receive(stream, telemetry_pb2.PublishPoolTelemetryRequest(kv_snapshot=snapshot))
    assert ready.check()


def test_the_bounded_wait_ends_a_kv_wait_but_never_the_directory_wait():
    table, clock = PoolTable(), FakeClock()
    ready, _ = readiness(table, clock)
    clock.set(1000.0 + 31)
    assert not ready.check(), "no directory yet: routing would refuse every model"
    table.replace_directory([pool_msg("p1", "http://a:1")], complete=True)
    assert ready.check() and ready.ready_after == 31.0, "p1's KV never came; the wait is over"


def test_an_empty_directory_is_ready_at_once_and_no_discovery_is_ready_at_once():
    table, clock = PoolTable(), FakeClock()
    ready, _ = readiness(table, clock)
    table.replace_directory([], complete=True)
    assert ready.check() and ready.ready_after == 0.0
    alone = Readiness(PoolTable(), clock, directory=False, timeout=30, registry=CollectorRegistry())
    assert alone.ready
    with pytest.raises(ValueError, match="ready timeout"):
        Readiness(PoolTable(), clock, directory=True, timeout=-1, registry=CollectorRegistry())


async def test_wait_returns_on_the_clock_once_ready():
    table, clock = PoolTable(), FakeClock()
    ready, _ = readiness(table, clock)
    waiter = asyncio.create_task(ready.wait())
    await clock.advance(5)
    assert not waiter.done()
    table.replace_directory([], complete=True)
    await clock.advance(0.2)
    assert waiter.done()


# ---- the real frontend object, a fake discovery ----------------------------------------------------
@pytest.fixture
async def discovery():
    """A fake discovery (scripted watches) and its address."""
    fake = FakeDiscovery()

    def register(server):
        discovery_pb2_grpc.add_DiscoveryServiceServicer_to_server(fake, server)
        return ["globaldiscovery.v1.DiscoveryService"]

    handle = create_grpc_server("127.0.0.1:0", register)
    await handle.server.start()
    yield fake, f"127.0.0.1:{handle.port}"
    for q in fake.live:
        q.put_nowait(None)
    await handle.server.stop(0)


async def health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


async def test_health_waits_for_the_directory_then_a_crashed_watcher_stops_the_frontend(discovery):
    fake, address = discovery
    router = create_server(RouterConfig(listen="127.0.0.1:0", discovery=address, grace=0.2))
    running = asyncio.create_task(router.run())
    try:
        await eventually(lambda: fake.starts)  # the directory watch started
        assert await health(router.port) == NOT_SERVING, "no directory yet: not ready"
        await fake.watches.put([Ev(type=T.WATCH_EVENT_TYPE_SNAPSHOT_DONE, revision=1, complete=True)])
        for _ in range(100):
            if await health(router.port) == SERVING:
                break
            await asyncio.sleep(0.05)
        assert await health(router.port) == SERVING, "an empty directory synced: ready"

        # The fault: applying a directory change raises inside the watcher (a bug, not an outage).
        def broken(msg):
            raise KeyError("injected fault")

        router.core.table.apply_listed = broken  # type: ignore[method-assign]
        fake.live[-1].put_nowait(
            Ev(type=T.WATCH_EVENT_TYPE_ADDED, revision=2, pool=pool_msg("p1", "http://127.0.0.1:1"))
        )
        with pytest.raises(BackgroundTaskFailed, match="'directory-watch' failed: KeyError") as info:
            await asyncio.wait_for(running, 10)
        assert info.value.exit_code == EXIT_TASK_FAILED
        assert fake.unregistrations == 1, "it left discovery on the way out"
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


def test_the_serve_command_exits_non_zero_when_the_watcher_dies(monkeypatch):
    from globalrouter.cli import main

    async def crash(self) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(DirectoryWatcher, "run", crash)
    # Nothing listens at the discovery address: registration retries (no failure), the watch crashes.
    code = main(
        ["serve", "--listen", "127.0.0.1:0", "--discovery", f"127.0.0.1:{free_port()}", "--grace", "0.1"]
    )
    assert code == EXIT_TASK_FAILED


async def test_link_pruning_is_folded_into_one_pass_and_restarted_when_it_fails():
    clock = FakeClock()
    router = create_server(RouterConfig(listen="127.0.0.1:0"), clock=clock)
    calls: list[set[str]] = []
    outcomes = iter([OSError("close failed"), OSError("close failed"), None])

    async def prune(urls: set[str]) -> None:
        calls.append(urls)
        await asyncio.sleep(0)  # a change arriving meanwhile is folded in, not a second task
        error = next(outcomes)
        if error is not None:
            raise error

    router.links.prune = prune  # type: ignore[method-assign,assignment]
    router.core.table.apply_listed(pool_msg("p1", "http://a:1"))
    router._directory_changed()
    router._directory_changed()
    router.core.table.apply_listed(pool_msg("p2", "http://b:1"))
    router._directory_changed()
    assert router.supervisor.running == 1
    await clock.advance(10)  # back-offs of 0.5 s, then 1 s
    assert calls[-1] == {"http://a:1", "http://b:1"} and len(calls) == 3
    assert router.supervisor.restarts == 2 and router.supervisor.failure is None
    assert router.supervisor.running == 0
    await router.handle.server.stop(0)


async def test_a_telemetry_index_worker_that_dies_fails_the_frontend():
    router = create_server(RouterConfig(listen="127.0.0.1:0"))

    def broken() -> bool:
        raise MemoryError("injected fault")

    router.ingest.has_work = lambda: True  # type: ignore[method-assign]
    router.ingest.step = broken  # type: ignore[method-assign]
    router.telemetry._kick()
    await eventually(router.stop_requested.is_set)
    assert router.supervisor.failure is not None
    assert (router.supervisor.failure.task, router.supervisor.failure.cause) == (
        "telemetry-index-work",
        "MemoryError: injected fault",
    )
    await router.handle.server.stop(0)

"""Fixtures: an in-process discovery server (real aio gRPC on 127.0.0.1) and its client stub."""

from __future__ import annotations

import grpc
import pytest

from globaldiscovery.config import DiscoveryConfig
from globaldiscovery.server import DiscoveryServicer, build_server, make_store
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshkit.clock import Clock, SystemClock
from tests.discovery.etcd_support import running_etcd


@pytest.fixture
def watch_queue_limit() -> int:
    """Overridden by tests that need a small watcher bound."""
    return 10_000


@pytest.fixture
def discovery_clock() -> Clock:
    """The server's clock: the system's; a test may parametrize it with a FakeClock."""
    return SystemClock()


@pytest.fixture
async def discovery_servicer(watch_queue_limit, discovery_clock):
    """(stub, address, handle, store, servicer) of a started in-process server; stopped at the end."""
    config = DiscoveryConfig(
        listen="127.0.0.1:0", heartbeat_interval=1.0, lease_duration=3.0, watch_queue_limit=watch_queue_limit
    )
    store = make_store(config, discovery_clock)
    servicer = DiscoveryServicer(store)
    handle = build_server(config, store, servicer)
    await store.start()
    await handle.server.start()
    await handle.set_serving(True)
    address = f"127.0.0.1:{handle.port}"
    channel = grpc.aio.insecure_channel(address)
    try:
        yield pb_grpc.DiscoveryServiceStub(channel), address, handle, store, servicer
    finally:
        await channel.close()
        await store.close()
        await handle.server.stop(0)


@pytest.fixture
def discovery(discovery_servicer):
    """(stub, address, handle, store) of a started in-process server; stopped at the end."""
    return discovery_servicer[:4]


@pytest.fixture(scope="session")
def etcd():
    """HOST:PORT of one etcd for every test that asks (skipped without etcd, failed when CI is set).

    Tests that use it wipe the discovery keys first (etcd_support.wipe_discovery_keys).
    """
    with running_etcd() as address:
        yield address

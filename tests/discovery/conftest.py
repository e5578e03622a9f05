"""Fixtures: an in-process discovery server (real aio gRPC on 127.0.0.1) and its client stub."""

from __future__ import annotations

import grpc
import pytest

from globaldiscovery.config import DiscoveryConfig
from globaldiscovery.server import DiscoveryServicer, build_server, make_store
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshkit.clock import SystemClock


@pytest.fixture
def watch_queue_limit() -> int:
    """Overridden by tests that need a small watcher bound."""
    return 10_000


@pytest.fixture
async def discovery_servicer(watch_queue_limit):
    """(stub, address, handle, store, servicer) of a started in-process server; stopped at the end."""
    config = DiscoveryConfig(
        listen="127.0.0.1:0", heartbeat_interval=1.0, lease_duration=3.0, watch_queue_limit=watch_queue_limit
    )
    store = make_store(config, SystemClock())
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

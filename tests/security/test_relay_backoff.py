"""A relay whose telemetry stream is refused after its snapshot waits out the back-off before redialling."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from meshkit.clock import SystemClock
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.telemetry_publisher import TelemetryConfig, TelemetryHub
from poolrelay.v1 import telemetry_pb2 as tm
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc
from tests.relay.fakes import start_server, wait_for


class RefusingFrontend(tm_grpc.TelemetryServiceServicer):
    """Acks the hello, reads the whole snapshot, then refuses the stream (as an unauthorized one would be)."""

    def __init__(self) -> None:
        self.opened: list[float] = []

    async def PublishPoolTelemetry(self, request_iterator, context):
        self.opened.append(time.monotonic())
        async for req in request_iterator:
            if req.HasField("hello"):
                yield tm.PublishPoolTelemetryResponse(hello_ack=tm.TelemetryHelloAck(frontend_id="f"))
            elif req.HasField("kv_snapshot") and req.kv_snapshot.last:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not this pool's relay")


@pytest.mark.timeout(60)
async def test_a_stream_refused_after_its_snapshot_backs_off():
    frontend = RefusingFrontend()
    server, address = await start_server((tm_grpc.add_TelemetryServiceServicer_to_server, frontend))
    config = TelemetryConfig(pool_id="p", relay_id="r", incarnation=1, region="x", report_interval=30)
    hub = TelemetryHub(config, PoolBlocks(), SystemClock())
    hub.set_frontends(static=[f"http://{address}"])
    try:
        await wait_for(lambda: len(frontend.opened) >= 4, within=30, message="four attempts")
        gaps = [b - a for a, b in zip(frontend.opened, frontend.opened[1:], strict=False)]
        # Each redial waited out a back-off (it grows); with none, the relay redialled in milliseconds.
        assert min(gaps) >= 0.1, gaps
        # The refusal is reported while the relay waits to redial (a new attempt clears it): wait on it.
        publisher = hub.publishers[f"http://{address}"]
        await wait_for(lambda: "PERMISSION_DENIED" in publisher.last_error, within=30, message="the refusal")
    finally:
        await hub.close()
        await server.stop(0)
        await asyncio.sleep(0)

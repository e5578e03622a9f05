"""Calls that wait for a busy frontend's loop longer than 30 s are served, not cancelled by gRPC."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshkit.server import create_server

BLOCKED = 33.0
"""Seconds the server's loop is held: past gRPC's default 30 s for a call nobody picked up."""


@pytest.mark.timeout(120)
async def test_calls_queued_behind_a_loop_held_past_30_s_are_served_when_it_frees():
    """A frontend after a restart or a mass redial takes 2,000 new telemetry streams while its loop
    is busy; gRPC's asyncio server picks up one new call per loop turn or so, and C-core cancelled
    a call not picked up within 30 s (grpc.server_max_unrequested_time_in_server): the relays
    redialled and sent their whole snapshots again, and at 1,000 pools the storm never ended. Here
    the loop is held 33 s while 4 health checks arrive: all 4 must be answered once it frees."""
    handle = create_server("127.0.0.1:0", lambda server: [])
    await handle.server.start()
    await handle.set_serving(True)
    arrived = threading.Event()

    def check() -> str:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
            arrived.set()
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=90)
            except grpc.RpcError as exc:
                return exc.code().name
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    try:
        with ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(check) for _ in range(4)]
            await asyncio.get_running_loop().run_in_executor(None, arrived.wait, 10)
            time.sleep(BLOCKED)  # noqa: ASYNC251 (the point: the loop held, calls queue in gRPC meanwhile)
            await asyncio.sleep(0)
            results = await asyncio.wait_for(
                asyncio.gather(*(asyncio.wrap_future(c) for c in calls)), timeout=60
            )
    finally:
        await handle.server.stop(None)
    assert results == ["SERVING"] * 4, results

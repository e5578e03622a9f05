"""A slow telemetry receiver does not delay a fast one; its queue stays bounded; it recovers by a snapshot."""

from __future__ import annotations

import asyncio

import pytest

from meshkit.clock import SystemClock
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.telemetry_publisher import TelemetryConfig, TelemetryHub
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc
from tests.relay.fakes import TelemetryReceiver, start_server, wait_for

QUEUE_LIMIT = 16
PER_DELTA = 2000  # hashes stored and removed per delta: ~32 KiB on the wire, so flow control bites
DELTAS = 300


@pytest.mark.timeout(60)
async def test_slow_receiver_does_not_delay_fast_one():
    fast, slow = TelemetryReceiver(), TelemetryReceiver()
    servers, urls = [], []
    for recv in (fast, slow):
        server, addr = await start_server((tm_grpc.add_TelemetryServiceServicer_to_server, recv))
        servers.append(server)
        urls.append(f"http://{addr}")
    blocks = PoolBlocks()
    config = TelemetryConfig(
        pool_id="p", relay_id="r", incarnation=1, region="x", report_interval=30, queue_limit=QUEUE_LIMIT
    )
    hub = TelemetryHub(config, blocks, SystemClock())
    hub.set_frontends(static=urls)
    try:
        await wait_for(lambda: fast.snapshots and slow.snapshots, message="first snapshots")
        slow.stall()
        slow_pub = hub.publishers[urls[1]]
        max_depth = 0
        for i in range(DELTAS):
            new = range((i + 1) * PER_DELTA, (i + 2) * PER_DELTA)
            old = range(i * PER_DELTA, (i + 1) * PER_DELTA)
            blocks.apply_event("w", stored=new, removed=old if i else ())
            hub.flush()
            # The fast receiver gets each delta while the slow one reads nothing at all.
            await wait_for(lambda: fast.sequence == blocks.sequence, within=10, message=f"delta {i} at fast")
            max_depth = max(max_depth, slow_pub.queue_depth)
        assert fast.deltas == DELTAS and fast.errors == []
        assert fast.blocks == set(range(DELTAS * PER_DELTA, (DELTAS + 1) * PER_DELTA))
        assert max_depth <= QUEUE_LIMIT + 4, "the slow frontend's queue stays bounded"
        assert slow_pub.messages_dropped > 0, "the stalled frontend's queue overflowed"
        assert hub.publishers[urls[0]].messages_dropped == 0
        slow.resume()
        await wait_for(lambda: slow.blocks == fast.blocks, within=20, message="slow receiver recovered")
        assert slow.snapshots >= 2 and slow.errors == [], "recovered by a fresh snapshot, no gap"
    finally:
        await hub.close()
        for s in servers:
            await s.stop(0)
        await asyncio.sleep(0)

"""A watch resumed over gRPC: the resumed marker, the changes after it; a negative start is named."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2 as pb
from meshkit.validation import bad_request_fields

pytestmark = pytest.mark.timeout(60)

WAIT = 20.0  # the longest any awaited event may take, never slept for


async def test_over_grpc_a_resume_is_marked_and_a_negative_start_is_named(discovery):
    stub, _, _, _ = discovery
    bad = stub.WatchPools(pb.WatchPoolsRequest(start_revision=-1))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await bad.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(info.value) == ["start_revision"]

    first = stub.WatchPools(pb.WatchPoolsRequest())
    done = await asyncio.wait_for(first.read(), WAIT)
    assert done.type == pb.WATCH_EVENT_TYPE_SNAPSHOT_DONE and not done.resumed
    first.cancel()
    await stub.RegisterPool(
        pb.RegisterPoolRequest(
            pool_id="p1", model="m", region="eu", frontends=["http://h:1"], relay_id="r1", incarnation=1
        )
    )
    again = stub.WatchPools(pb.WatchPoolsRequest(start_revision=done.revision))
    marker, change = [await asyncio.wait_for(again.read(), WAIT) for _ in range(2)]
    assert (marker.type, marker.resumed, marker.revision) == (
        pb.WATCH_EVENT_TYPE_SNAPSHOT_DONE,
        True,
        done.revision,
    )
    assert (change.type, change.pool.pool_id) == (pb.WATCH_EVENT_TYPE_ADDED, "p1")
    assert change.revision > done.revision
    again.cancel()

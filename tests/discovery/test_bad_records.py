"""Issue 8: times the protobuf runtime cannot hold are refused on the way in, and one bad record
already stored can never make the directory unreadable (real gRPC, in-process server)."""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from globaldiscovery import convert
from globaldiscovery.v1 import discovery_pb2 as pb
from meshkit import timeconv
from meshkit.validation import bad_request_fields
from tests.discovery.helpers import reg
from tests.discovery.test_server import expect_code, read, register_request

pytestmark = pytest.mark.timeout(60)

YEAR_10000 = 253402300800  # one second past the last Timestamp: the probe that broke the directory


async def listed(stub) -> list[str]:
    reply = await stub.ListPools(pb.ListPoolsRequest())
    return [p.pool_id for p in reply.pools]


async def snapshot(stub) -> list[str]:
    """The pool ids of a fresh WatchPools snapshot (read up to SNAPSHOT_DONE)."""
    call = stub.WatchPools(pb.WatchPoolsRequest())
    ids: list[str] = []
    while True:
        [event] = await read(call, 1)
        if event.type == pb.WATCH_EVENT_TYPE_SNAPSHOT_DONE:
            call.cancel()
            return ids
        ids.append(event.pool.pool_id)


async def test_a_drain_deadline_past_year_9999_is_refused_and_stores_nothing(discovery):
    stub, _, _, _ = discovery
    await stub.RegisterPool(register_request(pool_id="good"))
    far = register_request(draining=True, drain_deadline=timestamp_pb2.Timestamp(seconds=YEAR_10000))
    error = await expect_code(stub.RegisterPool(far), grpc.StatusCode.INVALID_ARGUMENT)
    assert bad_request_fields(error) == ["drain_deadline"]
    [reply] = [
        r async for r in stub.KeepAlivePools(iter([pb.KeepAlivePoolsRequest(register=far, sequence=1)]))
    ]
    assert reply.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # Nothing was stored, and every unfiltered listing and watch still works.
    assert await listed(stub) == ["good"]
    assert await snapshot(stub) == ["good"]
    # The last representable second is a valid deadline and round-trips (to float precision).
    last = register_request(
        pool_id="last", draining=True, drain_deadline=timestamp_pb2.Timestamp(seconds=YEAR_10000 - 1)
    )
    deadline = (await stub.RegisterPool(last)).pool.drain_deadline
    assert timeconv.wall_seconds(deadline) == pytest.approx(YEAR_10000 - 1, abs=1e-3)
    assert await listed(stub) == ["good", "last"]


@pytest.mark.parametrize(
    "bad_wall", [1e13, -1e13, math.inf, math.nan], ids=["far", "before-year-1", "inf", "nan"]
)
async def test_a_stored_record_with_an_unrepresentable_time_is_still_listed(discovery, bad_wall):
    stub, _, _, store = discovery
    # Straight into the store, past the request checks: as an older server or a hand-edited etcd might.
    await store.register_pool(reg("bad", draining=True, drain_deadline_wall=bad_wall))
    await stub.RegisterPool(register_request(pool_id="good"))
    reply = await stub.ListPools(pb.ListPoolsRequest())
    assert [p.pool_id for p in reply.pools] == ["bad", "good"]
    seconds = reply.pools[0].drain_deadline.seconds
    assert timeconv.MIN_TIMESTAMP_SECONDS <= seconds <= timeconv.MAX_TIMESTAMP_SECONDS
    assert await snapshot(stub) == ["bad", "good"]


async def test_a_record_that_cannot_be_converted_is_left_out_not_fatal(discovery, monkeypatch):
    stub, _, _, store = discovery
    for pool_id in ("a", "broken", "c"):
        await store.register_pool(reg(pool_id))
    real = convert.pool

    def pool(view):
        if view.pool_id == "broken":
            raise ValueError("cannot convert")
        return real(view)

    monkeypatch.setattr(convert, "pool", pool)
    assert await listed(stub) == ["a", "c"]  # the listing goes on without it
    assert await snapshot(stub) == ["a", "c"]
    await store.register_pool(reg("d"))
    assert await listed(stub) == ["a", "c", "d"]


@pytest.mark.parametrize(
    "value,problem",
    [
        (timestamp_pb2.Timestamp(seconds=0), False),
        (timestamp_pb2.Timestamp(seconds=YEAR_10000 - 1, nanos=999_999_999), False),
        (timestamp_pb2.Timestamp(seconds=-62135596800), False),
        (timestamp_pb2.Timestamp(seconds=YEAR_10000), True),
        (timestamp_pb2.Timestamp(seconds=-62135596801), True),
        (timestamp_pb2.Timestamp(nanos=-1), True),
        (timestamp_pb2.Timestamp(nanos=1_000_000_000), True),
    ],
)
def test_timestamp_range(value, problem):
    assert (timeconv.timestamp_problem(value) is not None) == problem


@pytest.mark.parametrize(
    "value,problem",
    [
        (duration_pb2.Duration(seconds=5, nanos=1), False),
        (duration_pb2.Duration(seconds=-5, nanos=-1), False),
        (duration_pb2.Duration(seconds=315_576_000_000), False),
        (duration_pb2.Duration(seconds=315_576_000_001), True),
        (duration_pb2.Duration(seconds=-315_576_000_001), True),
        (duration_pb2.Duration(seconds=5, nanos=-1), True),
        (duration_pb2.Duration(seconds=-5, nanos=1), True),
        (duration_pb2.Duration(nanos=1_000_000_000), True),
    ],
)
def test_duration_range(value, problem):
    assert (timeconv.duration_problem(value) is not None) == problem


def test_clamped_timestamp_never_raises_and_keeps_what_fits():
    assert timeconv.clamped_timestamp(1.5) == timeconv.timestamp(1.5)
    top = timeconv.clamped_timestamp(1e30)
    assert (top.seconds, top.nanos) == (timeconv.MAX_TIMESTAMP_SECONDS, timeconv.MAX_NANOS)
    assert timeconv.clamped_timestamp(-1e30).seconds == timeconv.MIN_TIMESTAMP_SECONDS
    assert timeconv.clamped_timestamp(math.inf).seconds == timeconv.MAX_TIMESTAMP_SECONDS
    assert timeconv.clamped_timestamp(math.nan).seconds == 0
    with pytest.raises((ValueError, OverflowError)):
        timeconv.timestamp(1e13)  # why the clamp exists: the plain conversion refuses it

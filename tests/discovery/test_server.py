"""DiscoveryService through a real in-process aio server: validation, errors, pagination, watch, drain."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshkit import timeconv
from meshkit.clock import FakeClock
from meshkit.errors import Reason, reason_of
from meshkit.validation import bad_request_fields

pytestmark = pytest.mark.timeout(60)


def register_request(**overrides) -> pb.RegisterPoolRequest:
    fields: dict[str, Any] = dict(
        pool_id="pool-a",
        model="llama",
        region="eu-west",
        frontends=["http://10.0.0.1:8000"],
        relay_id="relay-1",
        incarnation=1,
    )
    fields.update(overrides)
    return pb.RegisterPoolRequest(**fields)


async def expect_code(call, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value


BAD_REGISTRATIONS: list[tuple[str, dict[str, Any]]] = [
    ("pool_id", {"pool_id": ""}),
    ("pool_id", {"pool_id": " padded"}),
    ("pool_id", {"pool_id": "x" * 129}),
    ("pool_id", {"pool_id": "tab\tinside"}),
    ("model", {"model": ""}),
    ("model", {"model": "bell\x07"}),
    ("region", {"region": "eu "}),
    ("relay_id", {"relay_id": ""}),
    ("incarnation", {"incarnation": 0}),
    ("frontends", {"frontends": [f"http://h{i}:1" for i in range(65)]}),
    ("frontends[0]", {"frontends": ["ftp://h:1"]}),
    ("frontends[0]", {"frontends": ["http://h:99999"]}),
    ("frontends[0]", {"frontends": ["http://h:1/path"]}),
    ("frontends[0]", {"frontends": ["http://h:1?q=1"]}),
    ("frontends[0]", {"frontends": ["http://user:pw@h:1"]}),
    ("frontends[0]", {"frontends": ["http://h:0"]}),  # issue 18: relays dialled port 0 and backed off
    ("frontends[1]", {"frontends": ["http://h:1", "https://h:00"]}),
    ("frontends[1]", {"frontends": ["http://h:1", "http://h:1"]}),
    ("capabilities", {"capabilities": [f"c{i}" for i in range(65)]}),
    ("capabilities[0]", {"capabilities": [""]}),
    # Times the protobuf runtime cannot hold (issue 8: this one was once stored, then broke every listing).
    ("drain_deadline", {"draining": True, "drain_deadline": timestamp_pb2.Timestamp(seconds=253402300800)}),
    ("drain_deadline", {"draining": True, "drain_deadline": timestamp_pb2.Timestamp(seconds=-62135596801)}),
    ("drain_deadline", {"draining": True, "drain_deadline": timestamp_pb2.Timestamp(seconds=1, nanos=-1)}),
    ("drain_deadline", {"drain_deadline": timestamp_pb2.Timestamp(seconds=1, nanos=1_000_000_000)}),
]


@pytest.mark.parametrize(
    "field,overrides", BAD_REGISTRATIONS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_REGISTRATIONS)]
)
async def test_each_invalid_registration_field_is_named(discovery, field, overrides):
    stub, address, _, _ = discovery
    error = await expect_code(
        stub.RegisterPool(register_request(**overrides)), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert bad_request_fields(error) == [field]
    assert field.split("[")[0] in error.details()
    # The server stays healthy and keeps answering.
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await stub.RegisterPool(register_request())


BAD_OTHER = [
    ("UnregisterPool", pb.UnregisterPoolRequest(pool_id="", relay_id="r", incarnation=1), ["pool_id"]),
    ("UnregisterPool", pb.UnregisterPoolRequest(pool_id="p", relay_id="r", incarnation=0), ["incarnation"]),
    ("UnregisterPool", pb.UnregisterPoolRequest(pool_id="p", relay_id=" r", incarnation=1), ["relay_id"]),
    ("ListPools", pb.ListPoolsRequest(page_size=-1), ["page_size"]),
    ("ListPools", pb.ListPoolsRequest(page_token="garbage!"), ["page_token"]),
    ("ListPools", pb.ListPoolsRequest(model=" m"), ["model"]),
    ("ListPools", pb.ListPoolsRequest(region="\x01"), ["region"]),
    ("DrainPool", pb.DrainPoolRequest(pool_id="p"), ["timeout"]),
    ("DrainPool", pb.DrainPoolRequest(pool_id="p", timeout=timeconv.duration(0)), ["timeout"]),
    ("DrainPool", pb.DrainPoolRequest(pool_id="p", timeout=timeconv.duration(86_401)), ["timeout"]),
    ("DrainPool", pb.DrainPoolRequest(pool_id="", timeout=timeconv.duration(5)), ["pool_id"]),
    (
        "DrainPool",
        pb.DrainPoolRequest(pool_id="p", timeout=duration_pb2.Duration(seconds=315_576_000_001)),
        ["timeout"],
    ),
    (
        "DrainPool",
        pb.DrainPoolRequest(pool_id="p", timeout=duration_pb2.Duration(seconds=5, nanos=-1)),
        ["timeout"],
    ),
    (
        "DrainPool",
        pb.DrainPoolRequest(pool_id="p", timeout=duration_pb2.Duration(seconds=5, nanos=1_000_000_000)),
        ["timeout"],
    ),
    ("RemovePool", pb.RemovePoolRequest(pool_id=""), ["pool_id"]),
    (
        "RegisterFrontend",
        pb.RegisterFrontendRequest(frontend_id="", url="http://h:1", incarnation=1),
        ["frontend_id"],
    ),
    ("RegisterFrontend", pb.RegisterFrontendRequest(frontend_id="f", url="h:1", incarnation=1), ["url"]),
    (
        "RegisterFrontend",
        pb.RegisterFrontendRequest(frontend_id="f", url="http://h:0", incarnation=1),
        ["url"],
    ),
    (
        "RegisterFrontend",
        pb.RegisterFrontendRequest(frontend_id="f", url="http://h:1", incarnation=0),
        ["incarnation"],
    ),
    (
        "RegisterFrontend",
        pb.RegisterFrontendRequest(frontend_id="f", url="http://h:1", region=" r", incarnation=1),
        ["region"],
    ),
    ("UnregisterFrontend", pb.UnregisterFrontendRequest(frontend_id="", incarnation=1), ["frontend_id"]),
    ("ListFrontends", pb.ListFrontendsRequest(page_size=-5), ["page_size"]),
]


@pytest.mark.parametrize(
    "method,request_,fields", BAD_OTHER, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(BAD_OTHER)]
)
async def test_each_invalid_field_of_other_calls_is_named(discovery, method, request_, fields):
    stub, _, _, _ = discovery
    error = await expect_code(getattr(stub, method)(request_), grpc.StatusCode.INVALID_ARGUMENT)
    assert bad_request_fields(error) == fields


async def test_invalid_watch_filter_is_named(discovery):
    stub, _, _, _ = discovery
    call = stub.WatchPools(pb.WatchPoolsRequest(model="b\x01d"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(info.value) == ["model"]


async def test_oversized_message_is_refused_and_server_stays_up(discovery):
    stub, _, _, _ = discovery
    huge = register_request(capabilities=["x" * 100] * 90_000)  # ~9 MB, above the 8 MB cap
    await expect_code(stub.RegisterPool(huge), grpc.StatusCode.RESOURCE_EXHAUSTED)
    await stub.RegisterPool(register_request())


async def test_register_reply_carries_timing_expiry_and_frontends(discovery):
    stub, _, _, _ = discovery
    await stub.RegisterFrontend(
        pb.RegisterFrontendRequest(frontend_id="gf-1", url="http://127.0.0.1:9", incarnation=1)
    )
    reply = await stub.RegisterPool(register_request(capacity=pb.PoolCapacity(max_running_requests=8)))
    assert timeconv.seconds(reply.heartbeat_interval) == 1.0
    assert timeconv.seconds(reply.lease_duration) == 3.0
    assert reply.lease_expire_time == reply.pool.leases[0].expire_time
    assert [f.frontend_id for f in reply.frontends] == ["gf-1"]
    assert reply.pool.capacity.max_running_requests == 8 and reply.pool.revision == 1
    assert not reply.drain_requested
    # Idempotent: the same request again leaves one lease with a later expiry.
    again = await stub.RegisterPool(register_request())
    assert len(again.pool.leases) == 1
    assert timeconv.wall_seconds(again.lease_expire_time) >= timeconv.wall_seconds(reply.lease_expire_time)
    assert again.pool.capacity.max_running_requests == 8  # kept from the last registration that stated one


async def expect_refusal(call, code: grpc.StatusCode, reason: Reason) -> grpc.aio.AioRpcError:
    """The call fails with `code` and an ErrorInfo naming `reason` (what callers decide on)."""
    error = await expect_code(call, code)
    assert reason_of(error) == reason, error.details()
    return error


async def test_errors_map_to_contract_codes_and_reasons(discovery):
    stub, _, _, _ = discovery
    await stub.RegisterPool(register_request(incarnation=5))
    await expect_refusal(
        stub.RegisterPool(register_request(incarnation=4)),
        grpc.StatusCode.PERMISSION_DENIED,
        Reason.STALE_INCARNATION,
    )
    await expect_refusal(
        stub.UnregisterPool(pb.UnregisterPoolRequest(pool_id="pool-a", relay_id="relay-1", incarnation=4)),
        grpc.StatusCode.PERMISSION_DENIED,
        Reason.STALE_INCARNATION,
    )
    await expect_refusal(
        stub.RegisterPool(register_request(relay_id="relay-2", model="other")),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.MODEL_CONFLICT,
    )
    await expect_refusal(
        stub.DrainPool(pb.DrainPoolRequest(pool_id="nope", timeout=timeconv.duration(1))),
        grpc.StatusCode.NOT_FOUND,
        Reason.POOL_NOT_FOUND,
    )
    await expect_refusal(
        stub.RemovePool(pb.RemovePoolRequest(pool_id="nope")),
        grpc.StatusCode.NOT_FOUND,
        Reason.POOL_NOT_FOUND,
    )
    await stub.RegisterFrontend(pb.RegisterFrontendRequest(frontend_id="f", url="http://f:1", incarnation=3))
    for call in (
        stub.RegisterFrontend(pb.RegisterFrontendRequest(frontend_id="f", url="http://f:1", incarnation=2)),
        stub.UnregisterFrontend(pb.UnregisterFrontendRequest(frontend_id="f", incarnation=2)),
    ):
        await expect_refusal(call, grpc.StatusCode.PERMISSION_DENIED, Reason.STALE_INCARNATION)
    reply = await stub.UnregisterPool(
        pb.UnregisterPoolRequest(pool_id="pool-a", relay_id="relay-1", incarnation=5)
    )
    assert reply.pool_removed
    reply = await stub.UnregisterPool(
        pb.UnregisterPoolRequest(pool_id="pool-a", relay_id="relay-1", incarnation=5)
    )
    assert not reply.pool_removed


async def test_pagination_walks_every_pool_once_in_order(discovery):
    stub, _, _, _ = discovery
    for i in range(57):
        await stub.RegisterPool(register_request(pool_id=f"pool-{i:03d}", model="a" if i % 3 else "b"))
    seen, token, pages = [], "", 0
    while True:
        reply = await stub.ListPools(pb.ListPoolsRequest(model="a", page_size=10, page_token=token))
        seen += [p.pool_id for p in reply.pools]
        pages += 1
        token = reply.next_page_token
        if not token:
            break
    expected = [f"pool-{i:03d}" for i in range(57) if i % 3]
    assert seen == expected and pages == 4
    # A token issued for other filters is refused, naming page_token.
    first = await stub.ListPools(pb.ListPoolsRequest(model="a", page_size=10))
    error = await expect_code(
        stub.ListPools(pb.ListPoolsRequest(model="b", page_token=first.next_page_token)),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert bad_request_fields(error) == ["page_token"]
    # page_size 0 means 100; above 1000 is coerced, not refused.
    assert len((await stub.ListPools(pb.ListPoolsRequest())).pools) == 57
    assert len((await stub.ListPools(pb.ListPoolsRequest(page_size=5000))).pools) == 57
    assert not (await stub.ListPools(pb.ListPoolsRequest())).complete  # started less than a lease ago


async def test_frontends_list_and_unregister(discovery):
    stub, _, _, _ = discovery
    for name in ("gf-b", "gf-a", "gf-c"):
        await stub.RegisterFrontend(
            pb.RegisterFrontendRequest(frontend_id=name, url="http://h:1", incarnation=2)
        )
    page = await stub.ListFrontends(pb.ListFrontendsRequest(page_size=2))
    assert [f.frontend_id for f in page.frontends] == ["gf-a", "gf-b"] and page.next_page_token
    rest = await stub.ListFrontends(pb.ListFrontendsRequest(page_size=2, page_token=page.next_page_token))
    assert [f.frontend_id for f in rest.frontends] == ["gf-c"] and not rest.next_page_token
    await expect_code(
        stub.UnregisterFrontend(pb.UnregisterFrontendRequest(frontend_id="gf-a", incarnation=1)),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    await stub.UnregisterFrontend(pb.UnregisterFrontendRequest(frontend_id="gf-a", incarnation=2))
    assert [f.frontend_id for f in (await stub.ListFrontends(pb.ListFrontendsRequest())).frontends] == [
        "gf-b",
        "gf-c",
    ]


async def read(call, n: int) -> list[pb.WatchPoolsResponse]:
    return [await asyncio.wait_for(call.read(), 10) for _ in range(n)]


async def test_watch_snapshot_then_done_then_changes(discovery):
    stub, _, _, _ = discovery
    await stub.RegisterPool(register_request(pool_id="p1"))
    await stub.RegisterPool(register_request(pool_id="p2", model="other"))
    call = stub.WatchPools(pb.WatchPoolsRequest(model="llama"))
    events = await read(call, 2)
    assert [(e.type, e.pool.pool_id) for e in events] == [
        (pb.WATCH_EVENT_TYPE_ADDED, "p1"),
        (pb.WATCH_EVENT_TYPE_SNAPSHOT_DONE, ""),
    ]
    assert events[1].complete is False
    await stub.RegisterPool(register_request(pool_id="p3"))
    await stub.RegisterPool(
        register_request(pool_id="p3", relay_id="relay-2", frontends=["http://10.0.0.2:8000"])
    )
    await stub.RegisterPool(register_request(pool_id="p2", model="other"))  # filtered out
    await stub.RemovePool(pb.RemovePoolRequest(pool_id="p1"))
    events = await read(call, 3)
    assert [(e.type, e.pool.pool_id) for e in events] == [
        (pb.WATCH_EVENT_TYPE_ADDED, "p3"),
        (pb.WATCH_EVENT_TYPE_UPDATED, "p3"),
        (pb.WATCH_EVENT_TYPE_REMOVED, "p1"),
    ]
    assert list(events[1].pool.frontends) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert events[1].pool.revision == 2
    assert events[2].removal_reason == pb.REMOVAL_REASON_REMOVED
    call.cancel()


async def test_lease_lapse_reaches_watcher_after_expire_time(discovery):
    stub, _, _, _ = discovery
    call = stub.WatchPools(pb.WatchPoolsRequest())
    await read(call, 1)
    reply = await stub.RegisterPool(register_request())
    added, removed = await read(call, 2)
    assert added.type == pb.WATCH_EVENT_TYPE_ADDED
    assert removed.type == pb.WATCH_EVENT_TYPE_REMOVED
    assert removed.removal_reason == pb.REMOVAL_REASON_LEASE_EXPIRED
    # Never early: the removal was seen after the expiry the server announced.
    assert time.time() >= timeconv.wall_seconds(reply.lease_expire_time)
    call.cancel()


async def test_drain_marks_then_removes_and_refuses_that_incarnation(discovery):
    stub, _, _, _ = discovery
    await stub.RegisterPool(register_request(incarnation=7))
    call = stub.WatchPools(pb.WatchPoolsRequest())
    await read(call, 2)
    drained = await stub.DrainPool(pb.DrainPoolRequest(pool_id="pool-a", timeout=timeconv.duration(0.5)))
    assert drained.pool.draining and drained.pool.HasField("drain_deadline")
    renewal = await stub.RegisterPool(register_request(incarnation=7))
    assert renewal.drain_requested and renewal.drain_deadline == drained.pool.drain_deadline
    updated, removed = await read(call, 2)
    assert updated.type == pb.WATCH_EVENT_TYPE_UPDATED and updated.pool.draining
    assert removed.type == pb.WATCH_EVENT_TYPE_REMOVED
    assert removed.removal_reason == pb.REMOVAL_REASON_DRAINED
    await expect_refusal(
        stub.RegisterPool(register_request(incarnation=7)),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.DRAIN_COMPLETED,
    )
    await stub.RegisterPool(register_request(incarnation=8))
    call.cancel()


async def test_shutdown_ends_watch_with_unavailable(discovery):
    stub, _, _, store = discovery
    call = stub.WatchPools(pb.WatchPoolsRequest())
    await read(call, 1)
    await store.close()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call.read(), 10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert reason_of(info.value) == Reason.SHUTTING_DOWN


@pytest.mark.parametrize("watch_queue_limit", [5])
# On a FakeClock no lease lapses while the loop runs (on a loaded machine it can outlast the 3 s
# lease, and a burst of expiries would then overflow the reader that keeps up too).
@pytest.mark.parametrize("discovery_clock", [FakeClock()], ids=["fake_clock"])
async def test_watcher_that_does_not_read_is_ended_with_resource_exhausted(discovery):
    stub, address, _, store = discovery
    # No BDP probing: the flow-control window stays small, so a reader that stops reading soon
    # stops the server's writes and the events pile up in its bounded queue.
    slow_channel = grpc.aio.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
    slow = pb_grpc.DiscoveryServiceStub(slow_channel).WatchPools(pb.WatchPoolsRequest())
    await read(slow, 1)  # SNAPSHOT_DONE; then it stops reading
    fast = stub.WatchPools(pb.WatchPoolsRequest())
    await read(fast, 1)
    big = ["x" * 120] * 64  # large events fill the transport's buffers quickly
    for i in range(3000):
        await stub.RegisterPool(
            register_request(pool_id=f"pool-{i:04d}", capabilities=[f"{c}{i}" for c in big])
        )
        # A reader that keeps up is never ended: it reads up to this registration's event each
        # time, so a lag from a slow moment on a loaded machine never accumulates.
        while (await read(fast, 1))[0].pool.pool_id != f"pool-{i:04d}":
            pass
        if len(tuple(store.directory.watchers)) == 1:
            break  # the server ended the slow watcher
    assert len(tuple(store.directory.watchers)) == 1, "the watcher that never read was not ended"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        for _ in range(10_000):  # what was already in flight, then the status
            await asyncio.wait_for(slow.read(), 10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason_of(info.value) == Reason.SLOW_CONSUMER
    # The server is unaffected: the fast watcher keeps receiving.
    await stub.RegisterPool(register_request(pool_id="after"))
    assert not fast.done()
    fast.cancel()
    await slow_channel.close()

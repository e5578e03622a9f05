"""KeepAlivePools: the streaming form of RegisterPool, through a real in-process aio server."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from globaldiscovery.v1 import discovery_pb2 as pb
from meshkit import timeconv
from meshkit.clock import FakeClock
from meshkit.errors import Reason, reason_of, reason_of_status
from meshkit.validation import bad_request_fields
from tests.discovery.test_server import BAD_REGISTRATIONS, expect_code, register_request

pytestmark = pytest.mark.timeout(60)


def keepalive(sequence: int, **overrides) -> pb.KeepAlivePoolsRequest:
    return pb.KeepAlivePoolsRequest(register=register_request(**overrides), sequence=sequence)


def error_fields(error: pb.KeepAliveError | status_pb2.Status) -> list[str]:
    """The BadRequest field names of a stream error (the deprecated KeepAliveError read as the Status it mirrors)."""
    status = status_pb2.Status.FromString(error.SerializeToString())
    names: list[str] = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            names.extend(v.field for v in bad.field_violations)
    return names


async def exchange(stub, requests: list[pb.KeepAlivePoolsRequest]) -> list[pb.KeepAlivePoolsResponse]:
    """Sends every request on one stream (pipelined), half-closes, and returns every response."""
    call = stub.KeepAlivePools(iter(requests))
    replies = [r async for r in call]
    assert await call.code() == grpc.StatusCode.OK
    return replies


@pytest.mark.parametrize("discovery_clock", [FakeClock()], ids=["fake_clock"])
async def test_each_message_renews_like_register_pool(discovery, discovery_clock):
    stub, _, _, store = discovery
    call = stub.KeepAlivePools()
    await call.write(keepalive(1))
    first = await call.read()
    await discovery_clock.advance(0.05)  # so the renewal's expiry is visibly later
    await call.write(keepalive(2))
    second = await call.read()
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert [first.sequence, second.sequence] == [1, 2]
    assert first.WhichOneof("result") == second.WhichOneof("result") == "register"
    reply = second.register
    assert timeconv.seconds(reply.heartbeat_interval) == store.heartbeat_interval
    assert timeconv.seconds(reply.lease_duration) == store.lease_duration
    # The renewal moved the lease's expiry, exactly as a unary renewal does.
    assert timeconv.wall_seconds(reply.lease_expire_time) > timeconv.wall_seconds(
        first.register.lease_expire_time
    )
    assert (reply.pool.pool_id, reply.pool.model, list(reply.pool.frontends)) == (
        "pool-a",
        "llama",
        ["http://10.0.0.1:8000"],
    )
    listed = await stub.ListPools(pb.ListPoolsRequest())
    assert [p.pool_id for p in listed.pools] == ["pool-a"]
    assert listed.pools[0].leases[0].expire_time == reply.lease_expire_time
    unary = await stub.RegisterPool(register_request())
    assert (unary.heartbeat_interval, unary.lease_duration, unary.pool.pool_id) == (
        reply.heartbeat_interval,
        reply.lease_duration,
        reply.pool.pool_id,
    )


async def test_invalid_messages_get_the_unary_error_and_the_stream_goes_on(discovery):
    stub, _, _, _ = discovery
    requests = [keepalive(10)]
    requests += [keepalive(11 + i, **overrides) for i, (_, overrides) in enumerate(BAD_REGISTRATIONS)]
    requests.append(keepalive(99))
    replies = await exchange(stub, requests)
    assert [r.sequence for r in replies] == [r.sequence for r in requests]
    assert replies[0].WhichOneof("result") == replies[-1].WhichOneof("result") == "register"
    for (field, overrides), reply in zip(BAD_REGISTRATIONS, replies[1:-1], strict=True):
        assert reply.WhichOneof("result") == "error", field
        unary = await expect_code(
            stub.RegisterPool(register_request(**overrides)), grpc.StatusCode.INVALID_ARGUMENT
        )
        assert reply.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert reply.status.message == unary.details()
        assert error_fields(reply.status) == error_fields(reply.error) == bad_request_fields(unary) == [field]


async def test_a_message_without_a_registration_is_refused_naming_the_fields(discovery):
    stub, _, _, _ = discovery
    [reply] = await exchange(stub, [pb.KeepAlivePoolsRequest(sequence=5)])
    assert reply.sequence == 5 and reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert {"pool_id", "model", "region", "relay_id", "incarnation"} <= set(error_fields(reply.error))


async def test_stale_incarnation_is_refused_per_message(discovery):
    stub, _, _, _ = discovery
    await stub.RegisterPool(register_request(incarnation=5))
    replies = await exchange(
        stub, [keepalive(1, incarnation=4), keepalive(2, incarnation=5), keepalive(3, incarnation=3)]
    )
    assert [r.sequence for r in replies] == [1, 2, 3]
    assert [r.WhichOneof("result") for r in replies] == ["error", "register", "error"]
    assert [r.HasField("status") for r in replies] == [True, False, True]
    unary = await expect_code(
        stub.RegisterPool(register_request(incarnation=4)), grpc.StatusCode.PERMISSION_DENIED
    )
    assert replies[0].status.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert replies[0].status.message == unary.details()
    assert reason_of_status(replies[0].status) == reason_of(unary) == Reason.STALE_INCARNATION
    # The deprecated field still carries the same status, byte for byte, for older clients.
    assert replies[0].error.SerializeToString() == replies[0].status.SerializeToString()
    assert replies[1].register.pool.leases[0].incarnation == 5


async def test_model_conflict_is_refused_per_message(discovery):
    stub, _, _, _ = discovery
    await stub.RegisterPool(register_request(relay_id="relay-2"))
    [reply] = await exchange(stub, [keepalive(1, model="other")])
    assert reply.status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert reason_of_status(reply.status) == Reason.MODEL_CONFLICT
    assert reply.error.SerializeToString() == reply.status.SerializeToString()


async def test_responses_keep_request_order_and_echo_any_sequence(discovery):
    stub, _, _, _ = discovery
    sequences = [(i * 7919) % 1009 for i in range(300)]  # not monotonic, with no meaning to the server
    requests = [keepalive(s, pool_id=f"pool-{i % 30}") for i, s in enumerate(sequences)]
    replies = await exchange(stub, requests)
    assert [r.sequence for r in replies] == sequences
    assert [r.register.pool.pool_id for r in replies] == [f"pool-{i % 30}" for i in range(300)]


async def test_closing_the_streams_ends_them_with_unavailable(discovery_servicer):
    stub, _, _, _, servicer = discovery_servicer
    call = stub.KeepAlivePools()
    await call.write(keepalive(1))
    assert (await call.read()).WhichOneof("result") == "register"
    await servicer.close_streams()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call.read(), 10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # A stream opened while the server stops is refused at once.
    late = stub.KeepAlivePools()
    await late.write(keepalive(2))
    await expect_code(late.read(), grpc.StatusCode.UNAVAILABLE)
    # Unary calls are still answered until the server stops.
    await stub.RegisterPool(register_request())


async def test_closing_busy_streams_ends_every_one(discovery_servicer):
    """Streams stopped at any point of their work (reading, renewing, writing) all end at once with an error."""
    stub, _, _, _, servicer = discovery_servicer
    streams_busy = [asyncio.Event() for _ in range(8)]

    async def busy(n: int) -> grpc.StatusCode:
        """Sends renewals from a writer task and reads replies until the stream ends."""
        call = stub.KeepAlivePools()

        async def writer() -> None:
            # A write racing the end of the call fails on the client; the reader sees the
            # status the server ended the call with.
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                for i in range(3000):
                    await call.write(keepalive(i, pool_id=f"p{n}"))

        writing = asyncio.create_task(writer())
        try:
            while await call.read() is not grpc.aio.EOF:
                streams_busy[n].set()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await writing
        return grpc.StatusCode.OK

    streams = [asyncio.create_task(busy(n)) for n in range(len(streams_busy))]
    # Close only once every stream is under way (answered at least once), not after a guessed delay.
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streams_busy)), 20)
    await servicer.close_streams()
    codes = await asyncio.wait_for(asyncio.gather(*streams), 20)
    # A stream whose client was sending while the server ended it may see INTERNAL ("Internal
    # error from Core") instead of the UNAVAILABLE the server sent; either way it ends at once.
    assert set(codes) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL}, codes


async def test_the_relays_stream_client_surfaces_the_refusal_reason(discovery):
    """poolrelay's KeepAliveClient raises what a unary refusal would: code, message and ErrorInfo."""
    from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
    from poolrelay.lease_stream import KeepAliveClient

    stub, address, _, _ = discovery
    await stub.RegisterPool(register_request(incarnation=5))
    async with grpc.aio.insecure_channel(address) as channel:
        client = KeepAliveClient(pb_grpc.DiscoveryServiceStub(channel), unary_timeout=10)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.register(register_request(incarnation=4), within=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert reason_of(info.value) == Reason.STALE_INCARNATION
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.register(register_request(pool_id=" bad"), within=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert bad_request_fields(info.value) == ["pool_id"]
            ok = await client.register(register_request(incarnation=5), within=10)
            assert ok.pool.leases[0].incarnation == 5
        finally:
            await client.close()

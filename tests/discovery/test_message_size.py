"""Discovery requests are measured by the bytes received (meshkit.limits.add_sized_servicer), not
by ByteSize() after decoding: lease renewals and unary calls alike, with the same refusals."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from globaldiscovery.config import DiscoveryConfig
from globaldiscovery.server import DiscoveryServicer, build_server, make_store
from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshkit.clock import SystemClock
from meshkit.errors import Reason, reason_of, reason_of_status
from meshkit.limits import message_cap
from meshkit.tls import channel_credentials
from poolrelay.telemetry_publisher import varint
from tests.discovery.test_keepalive import exchange, keepalive
from tests.discovery.test_server import expect_code, register_request
from tests.security.pki import make_pki

pytestmark = pytest.mark.timeout(60)

KEEPALIVE = "/globaldiscovery.v1.DiscoveryService/KeepAlivePools"
REGISTER = "/globaldiscovery.v1.DiscoveryService/RegisterPool"
CAP = message_cap(KEEPALIVE)
assert CAP == message_cap(REGISTER) == 256 * 1024


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire) + payload


def _string(number: int, value: bytes) -> bytes:
    return _field(number, 2, varint(len(value)) + value)


def oversized_registration() -> pb.RegisterPoolRequest:
    """Valid but for its size: one 300,000-character frontend URL."""
    return register_request(frontends=["http://h:1/" + "x" * 300_000])


def repeated_pool_id() -> bytes:
    """A registration whose pool_id comes 40,000 times (protobuf keeps the last): it arrives over
    the cap and decodes to a small, valid registration (ByteSize() about 60 bytes)."""
    body = register_request().SerializeToString() + _string(1, b"pool-a") * 40_000
    assert len(body) > CAP > 100 * pb.RegisterPoolRequest.FromString(body).ByteSize()
    return body


def raw_keepalive(register: bytes, sequence: int) -> bytes:
    return _string(1, register) + _field(2, 0, varint(sequence))


def _raising(self):
    raise AssertionError(f"{type(self).__name__}.ByteSize() called on a received message")


@pytest.fixture
def no_byte_size(monkeypatch):
    """Every request type of the service but RegisterPoolRequest (whose ByteSize sizes the
    remembered-registrations cache on a miss, not the request) fails when measured."""
    for name in (
        "KeepAlivePoolsRequest",
        "ListPoolsRequest",
        "RegisterFrontendRequest",
        "ListFrontendsRequest",
        "WatchPoolsRequest",
    ):
        monkeypatch.setattr(getattr(pb, name), "ByteSize", _raising)


def _raw_stream(address: str, path: str = KEEPALIVE, credentials=None):
    """A KeepAlivePools call that writes bytes as given."""
    if credentials is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        channel = grpc.aio.secure_channel(address, credentials)
    call: Any = channel.stream_stream(
        path, request_serializer=None, response_deserializer=pb.KeepAlivePoolsResponse.FromString
    )()
    return channel, call


async def test_renewals_and_calls_are_not_measured_again_with_byte_size(discovery, no_byte_size):
    stub, _, _, _ = discovery
    replies = await exchange(stub, [keepalive(1), keepalive(2)])
    assert [(r.sequence, r.WhichOneof("result")) for r in replies] == [(1, "register"), (2, "register")]
    await stub.RegisterFrontend(
        pb.RegisterFrontendRequest(frontend_id="gf-1", url="http://h:1", incarnation=1)
    )
    assert [p.pool_id for p in (await stub.ListPools(pb.ListPoolsRequest())).pools] == ["pool-a"]
    assert [f.frontend_id for f in (await stub.ListFrontends(pb.ListFrontendsRequest())).frontends] == [
        "gf-1"
    ]


@pytest.mark.parametrize("measured", ["byte_size_works", "byte_size_raises"])
async def test_an_oversized_renewal_is_refused_as_before_and_the_stream_goes_on(
    discovery, monkeypatch, measured
):
    stub, _, _, _ = discovery
    big = keepalive(7, frontends=oversized_registration().frontends)
    size = big.ByteSize()
    assert size == len(big.SerializeToString()) > CAP
    if measured == "byte_size_raises":
        monkeypatch.setattr(pb.KeepAlivePoolsRequest, "ByteSize", _raising)
    replies = await exchange(stub, [keepalive(6), big, keepalive(8)])
    assert [r.sequence for r in replies] == [6, 7, 8]
    assert [r.WhichOneof("result") for r in replies] == ["register", "error", "register"]
    refused = replies[1]
    assert refused.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert reason_of_status(refused.status) == Reason.LIMIT_EXCEEDED
    assert refused.status.message == f"the request is {size} bytes; {KEEPALIVE} accepts at most {CAP}"
    assert refused.error.SerializeToString() == refused.status.SerializeToString()


async def test_a_renewal_over_the_cap_as_received_is_refused_though_it_decodes_small(discovery):
    _, address, _, _ = discovery
    channel, call = _raw_stream(address)
    try:
        small = raw_keepalive(register_request().SerializeToString(), 3)
        big = raw_keepalive(repeated_pool_id(), 4)
        for data in (small, big, small):
            await call.write(data)
        await call.done_writing()
        replies = [r async for r in call]
    finally:
        await channel.close()
    assert [(r.sequence, r.WhichOneof("result")) for r in replies] == [
        (3, "register"),
        (4, "error"),
        (3, "register"),
    ]
    assert reason_of_status(replies[1].status) == Reason.LIMIT_EXCEEDED
    assert replies[1].status.message == f"the request is {len(big)} bytes; {KEEPALIVE} accepts at most {CAP}"


@pytest.mark.parametrize("measured", ["byte_size_works", "byte_size_raises"])
async def test_an_oversized_unary_call_is_refused_as_before(discovery, monkeypatch, measured):
    stub, _, _, _ = discovery
    big = oversized_registration()
    size = big.ByteSize()
    if measured == "byte_size_raises":
        monkeypatch.setattr(pb.RegisterPoolRequest, "ByteSize", _raising)
    err = await expect_code(stub.RegisterPool(big), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert reason_of(err) == Reason.LIMIT_EXCEEDED
    assert err.details() == f"the request is {size} bytes; {REGISTER} accepts at most {CAP}"
    assert not (await stub.ListPools(pb.ListPoolsRequest())).pools


async def test_a_unary_call_over_the_cap_as_received_is_refused_though_it_decodes_small(discovery):
    stub, address, _, _ = discovery
    body = repeated_pool_id()
    async with grpc.aio.insecure_channel(address) as channel:
        unary: Any = channel.unary_unary(
            REGISTER, request_serializer=None, response_deserializer=pb.RegisterPoolResponse.FromString
        )
        err = await expect_code(unary(body), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert reason_of(err) == Reason.LIMIT_EXCEEDED
    assert err.details() == f"the request is {len(body)} bytes; {REGISTER} accepts at most {CAP}"
    assert not (await stub.ListPools(pb.ListPoolsRequest())).pools


async def test_a_servicer_registered_by_the_generated_code_still_measures_with_byte_size():
    """The refusals hold whichever way the servicer is registered (tests and tools use pb_grpc)."""
    config = DiscoveryConfig(listen="127.0.0.1:0")
    store = make_store(config, SystemClock())
    servicer = DiscoveryServicer(store)
    server = grpc.aio.server()
    pb_grpc.add_DiscoveryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await store.start()
    try:
        assert not servicer.sized_on_receipt
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            big = keepalive(7, frontends=oversized_registration().frontends)
            replies = await exchange(pb_grpc.DiscoveryServiceStub(channel), [big, keepalive(8)])
        assert [(r.sequence, r.WhichOneof("result")) for r in replies] == [(7, "error"), (8, "register")]
        assert reason_of_status(replies[0].status) == Reason.LIMIT_EXCEEDED
    finally:
        await store.close()
        await server.stop(0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


async def test_with_authorization_enforced_an_oversized_request_is_refused_for_its_size(pki):
    """The authorizer runs first and cannot read the fields of a request that was not decoded: it
    still checks the caller and its role, and the size check refuses the request."""
    config = DiscoveryConfig(listen="127.0.0.1:0", security=pki.config("discovery"))
    store = make_store(config, SystemClock())
    handle = build_server(config, store)
    await store.start()
    await handle.server.start()
    address = f"127.0.0.1:{handle.port}"
    relay = channel_credentials(pki.config("relay-a"))
    try:
        async with grpc.aio.secure_channel(address, relay) as channel:
            stub = pb_grpc.DiscoveryServiceStub(channel)
            big = oversized_registration()
            err = await expect_code(stub.RegisterPool(big), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert reason_of(err) == Reason.LIMIT_EXCEEDED
            # Not its pool, small: refused by the authorizer as before.
            err = await expect_code(
                stub.RegisterPool(register_request(pool_id="pool-b")), grpc.StatusCode.PERMISSION_DENIED
            )
            assert reason_of(err) == Reason.NOT_AUTHORIZED
            replies = await exchange(
                stub, [keepalive(1), keepalive(2, frontends=big.frontends), keepalive(3)]
            )
            assert [(r.sequence, r.WhichOneof("result")) for r in replies] == [
                (1, "register"),
                (2, "error"),
                (3, "register"),
            ]
            assert reason_of_status(replies[1].status) == Reason.LIMIT_EXCEEDED
        # A client may not register at all: refused for its role, whatever the size.
        async with grpc.aio.secure_channel(address, channel_credentials(pki.config("client"))) as channel:
            stub = pb_grpc.DiscoveryServiceStub(channel)
            err = await expect_code(stub.RegisterPool(big), grpc.StatusCode.PERMISSION_DENIED)
            assert reason_of(err) == Reason.NOT_AUTHORIZED
    finally:
        await store.close()
        await handle.server.stop(0)


def test_varint_field_reads_one_top_level_field_without_decoding_the_rest():
    from meshkit.wire import varint_field  # here: the rest of the file runs against older code too

    message = pb.KeepAlivePoolsRequest(register=oversized_registration(), sequence=2**63 + 5)
    assert varint_field(message.SerializeToString(), 2) == 2**63 + 5
    assert varint_field(keepalive(0).SerializeToString(), 2) == 0  # absent
    assert varint_field(raw_keepalive(b"", 3) + _field(2, 0, varint(9)), 2) == 9  # the last wins
    assert varint_field(raw_keepalive(b"abc", 3)[:-1], 2) == 0  # truncated
    assert varint_field(_string(1, b"x" * 10)[:-1] + _field(2, 0, varint(4)), 2) == 0  # malformed
    many = _field(3, 0, varint(1)) * 64 + _field(2, 0, varint(4))
    assert varint_field(many, 2) == 0  # past the bound of fields walked
    assert varint_field(many, 2, max_fields=65) == 4

"""Telemetry messages are measured by the bytes received (not ByteSize() after decoding): the
1 MiB cap holds for every message of a stream, its hello too, and for encodings that decode smaller."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from meshkit.errors import Reason, reason_of
from meshkit.limits import message_cap
from poolrelay.telemetry_publisher import PUBLISH_METHOD, varint
from poolrelay.v1 import telemetry_pb2 as tm
from tests.router.fakes import start_router

pytestmark = pytest.mark.timeout(60)

Req = tm.PublishPoolTelemetryRequest
CAP = message_cap(PUBLISH_METHOD)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire) + payload


def unpacked_delta(sequence: int, stored: list[int]) -> bytes:
    """A kv_delta whose `stored` is encoded unpacked (a tag per value; decoders must accept it):
    it arrives 9/8 of what ByteSize() says once decoded (which counts it packed)."""
    body = _field(1, 0, varint(sequence)) + b"".join(_field(2, 1, h.to_bytes(8, "little")) for h in stored)
    return _field(3, 2, varint(len(body)) + body)


def hello(pool_id: str = "p") -> Req:
    return Req(
        hello=tm.TelemetryHello(
            pool_id=pool_id,
            relay_id="r",
            incarnation=1,
            protocol_version=1,
            block_size=16,
            hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
        )
    )


def test_the_sized_deserializer_measures_the_bytes_received():
    from meshkit.limits import LimitExceeded, Oversized, check_size, sized_deserializer

    deserialize = sized_deserializer(PUBLISH_METHOD, Req)
    small = hello().SerializeToString()
    assert deserialize(small) == hello()
    big = unpacked_delta(2, list(range(120_000)))
    assert len(big) > CAP >= Req.FromString(big).ByteSize()  # decoded, it looks under the cap
    got = deserialize(big)
    assert got == Oversized(len(big))
    with pytest.raises(LimitExceeded, match=f"the request is {len(big)} bytes; .* accepts at most {CAP}"):
        check_size(PUBLISH_METHOD, got)
    check_size(PUBLISH_METHOD, Req.FromString(small))  # a decoded message: ByteSize, as before


async def _call(port: int) -> grpc.aio.StreamStreamCall:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return channel.stream_stream(
        PUBLISH_METHOD,
        request_serializer=None,
        response_deserializer=tm.PublishPoolTelemetryResponse.FromString,
    )()


@pytest.mark.parametrize("oversized", ["hello", "delta"])
async def test_a_message_over_the_cap_as_received_ends_the_stream_with_limit_exceeded(oversized):
    router, _stub, channel = await start_router()
    try:
        call = await _call(router.port)
        if oversized == "hello":
            # Decoded, this hello is well under the cap too (its extra field is unknown: it
            # counts; but the one below is a repeated varint field of an unknown number).
            big = hello().SerializeToString() + b"".join(
                _field(99, 0, varint(1 << 63)) for _ in range(100_000)
            )
            await call.write(big)
        else:
            await call.write(hello().SerializeToString())
            ack: Any = await call.read()
            assert ack.HasField("hello_ack")
            big = unpacked_delta(1, list(range(120_000)))
            await call.write(big)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                answer = await call.read()
                assert answer is not grpc.aio.EOF
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reason_of(err.value) == Reason.LIMIT_EXCEEDED
        assert f"the request is {len(big)} bytes" in (err.value.details() or "")
    finally:
        await channel.close()
        await router.handle.server.stop(None)

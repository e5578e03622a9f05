"""RouterService requests are measured by the bytes received (meshkit.limits.add_sized_servicer),
not by ByteSize() after decoding, which for a 16k-token prompt costs more than decoding it."""

from __future__ import annotations

import grpc
import pytest

from globalrouter.v1 import router_pb2
from tests.router.fakes import gen_request, pool_msg, start_router

pytestmark = pytest.mark.timeout(60)

TOKENS = list(range(1, 16_385))


def _raising(self):
    raise AssertionError(f"{type(self).__name__}.ByteSize() called on a received message")


@pytest.fixture
def no_byte_size(monkeypatch):
    for message in (router_pb2.RouteRequest, router_pb2.GenerateRequest, router_pb2.ListPoolsRequest):
        monkeypatch.setattr(message, "ByteSize", _raising)


async def test_route_generate_and_list_pools_are_not_measured_again_with_byte_size(no_byte_size):
    """Fails on the code that registered RouterService with its generated deserializers (the
    size-cap interceptor then measured each request: UNKNOWN here)."""
    router, stub, channel = await start_router()
    try:
        router.core.table.apply_listed(pool_msg("p1", "http://127.0.0.1:1"))
        route = router_pb2.RouteRequest(model="m", prompt=router_pb2.Prompt(token_ids={"ids": TOKENS}))
        reply = await stub.Route(route)
        assert [c.pool_id for c in reply.candidates] == ["p1"]
        assert [p.pool_id for p in (await stub.ListPools(router_pb2.ListPoolsRequest())).pools] == ["p1"]
        # Nothing listens at the pool's address: the call fails for that, not for its size.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(gen_request(TOKENS[:64], 4), timeout=20):
                pass
        assert err.value.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        await channel.close()
        await router.handle.server.stop(0)


async def test_a_request_over_the_8_mib_limit_is_still_refused():
    router, stub, channel = await start_router()
    try:
        huge = router_pb2.RouteRequest(model="m", prompt=router_pb2.Prompt(text="x" * (9 << 20)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Route(huge)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        router.core.table.apply_listed(pool_msg("p1", "http://127.0.0.1:1"))
        small = router_pb2.RouteRequest(model="m", prompt=router_pb2.Prompt(token_ids={"ids": [1]}))
        assert [c.pool_id for c in (await stub.Route(small)).candidates] == ["p1"]  # still serving
    finally:
        await channel.close()
        await router.handle.server.stop(0)

"""Concurrent Generate streams are bounded per client identity: one client's flood leaves others served."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from globalrouter.config import RouterConfig
from globalrouter.server import create_server
from globalrouter.v1 import router_pb2_grpc
from meshkit.errors import Reason, reason_of
from meshkit.identity import Role
from meshkit.tls import channel_credentials
from tests.router.fakes import gen_request, pool_msg, start_fake_pool

pytestmark = pytest.mark.timeout(60)


async def test_a_client_at_its_stream_cap_is_refused_while_another_is_served(pki):
    pki.issue("client-bob", Role.CLIENT, "bob")
    _fake, pool_server, url = await start_fake_pool()
    router = create_server(
        RouterConfig(listen="127.0.0.1:0", security=pki.config("frontend"), max_streams_per_client=1)
    )
    await router.handle.server.start()
    router.core.table.apply_listed(pool_msg("p1", url))
    target = f"127.0.0.1:{router.port}"
    alice = grpc.aio.secure_channel(target, channel_credentials(pki.config("client")))
    bob = grpc.aio.secure_channel(target, channel_credentials(pki.config("client-bob")))
    try:
        # Alice holds one stream open (never read past its first message).
        held = router_pb2_grpc.RouterServiceStub(alice).Generate(
            gen_request(list(range(64)), 200_000), timeout=30
        )
        await held.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            second = router_pb2_grpc.RouterServiceStub(alice).Generate(
                gen_request(list(range(64)), 4), timeout=10
            )
            async for _ in second:
                pass
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reason_of(err.value) == Reason.LIMIT_EXCEEDED
        served = [
            m
            async for m in router_pb2_grpc.RouterServiceStub(bob).Generate(
                gen_request(list(range(64)), 4), timeout=10
            )
        ]
        assert served[-1].HasField("summary")
        held.cancel()
        # Alice's slot comes back once her stream ends.
        for _ in range(100):
            try:
                again = [
                    m
                    async for m in router_pb2_grpc.RouterServiceStub(alice).Generate(
                        gen_request(list(range(64)), 4), timeout=10
                    )
                ]
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(0.05)
        assert again[-1].HasField("summary")
    finally:
        await alice.close()
        await bob.close()
        await router.handle.server.stop(0)
        await pool_server.stop(0)

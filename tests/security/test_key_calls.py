"""Calls admitted by an API key are held only while open, a reload that revokes the key ends them, and a
relay sends its key in clear only to loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshkit.authz import Authorizer
from meshkit.channels import use_security
from meshkit.identity import hash_api_key, new_api_key
from meshkit.server import create_server
from meshkit.tls import SecurityConfig
from poolrelay.telemetry_publisher import bearer_metadata

pytestmark = pytest.mark.timeout(60)


async def test_open_calls_of_a_key_are_held_until_they_end_and_ended_when_it_is_revoked(tmp_path):
    alice, bob = new_api_key(), new_api_key()
    keys = tmp_path / "keys"
    keys.write_text(f"alice {hash_api_key(alice)}\nbob {hash_api_key(bob)}\n")
    security = SecurityConfig(api_keys=str(keys))
    authorizer = Authorizer(security, service="t")
    handle = create_server("127.0.0.1:0", lambda _server: [], security=security, authorizer=authorizer)
    await handle.server.start()
    await handle.set_serving(True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for key in (alice, bob) * 10:
                metadata = (("authorization", f"Bearer {key}"),)
                reply = await stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(0.1)  # done callbacks run after the reply is sent
            assert authorizer._keyed == {}  # unary calls are released when they end

            watches = {
                key: stub.Watch(
                    health_pb2.HealthCheckRequest(), metadata=(("authorization", f"Bearer {key}"),)
                )
                for key in (alice, bob)
            }
            for watch in watches.values():
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            assert len(authorizer._keyed) == 2

            keys.write_text(f"alice {hash_api_key(alice)}\n")
            assert authorizer.reload_api_keys()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(watches[bob].read(), 10)
            assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ended.value.details() == "the API key was revoked"
            assert authorizer.refused[("/grpc.health.v1.Health/Watch", "UNAUTHENTICATED")] == 1
            # alice's watch goes on; once it ends nothing is held.
            assert not watches[alice].done()
            watches[alice].cancel()
            await asyncio.sleep(0.2)
            assert authorizer._keyed == {}
    finally:
        await handle.server.stop(0)


def test_a_relay_sends_its_key_in_clear_only_to_loopback(tmp_path):
    key_file = tmp_path / "relay.apikey"
    key_file.write_text("mk_secret\n")
    try:
        use_security(SecurityConfig(api_key=str(key_file)))
        assert bearer_metadata("http://127.0.0.1:5") == (("authorization", "Bearer mk_secret"),)
        assert bearer_metadata("http://[::1]:5") == (("authorization", "Bearer mk_secret"),)
        assert bearer_metadata("https://router.example:443") == ()  # TLS: the channel carries it
        with pytest.raises(ValueError, match=r"not sending the API key in clear to 10\.0\.0\.7:5"):
            bearer_metadata("http://10.0.0.7:5")
        key_file.write_text("\n")
        with pytest.raises(ValueError, match="is empty"):
            bearer_metadata("http://127.0.0.1:5")
        use_security(SecurityConfig())
        assert bearer_metadata("http://127.0.0.1:5") == ()  # no key: nothing sent
    finally:
        use_security(SecurityConfig())

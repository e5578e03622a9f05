"""Mutual TLS and authorization over real connections: who gets in, who is refused, and rotation."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from meshkit import devcerts
from meshkit.errors import Reason, reason_of
from meshkit.identity import Role, hash_api_key, new_api_key, spiffe_id
from meshkit.server import create_server
from meshkit.tls import DEFAULT_TRUST_DOMAIN, SecurityConfig, channel_credentials, peer_identity
from meshlaunch.mesh import relay_argv

pytestmark = pytest.mark.timeout(60)


class RecordingDiscovery(dpb_grpc.DiscoveryServiceServicer):
    """Remembers what reached it: a refused call must not."""

    def __init__(self) -> None:
        self.registered: list[str] = []

    async def RegisterPool(self, request, context):
        self.registered.append(request.pool_id)
        return dpb.RegisterPoolResponse()

    async def ListPools(self, request, context):
        return dpb.ListPoolsResponse()


async def serve(security: SecurityConfig):
    servicer = RecordingDiscovery()

    def register(server):
        dpb_grpc.add_DiscoveryServiceServicer_to_server(servicer, server)
        return ["globaldiscovery.v1.DiscoveryService"]

    handle = create_server("127.0.0.1:0", register, security=security)
    await handle.server.start()
    return handle, servicer


def channel(port: int, config: SecurityConfig, call_creds=None) -> grpc.aio.Channel:
    creds = channel_credentials(config)
    if call_creds is not None:
        creds = grpc.composite_channel_credentials(creds, call_creds)
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds)


async def register(port, config, pool="pool-a", relay="relay-1", call_creds=None):
    async with channel(port, config, call_creds) as ch:
        return await dpb_grpc.DiscoveryServiceStub(ch).RegisterPool(
            dpb.RegisterPoolRequest(pool_id=pool, relay_id=relay), timeout=5
        )


@pytest.fixture
async def discovery(pki):
    handle, servicer = await serve(pki.config("discovery"))
    yield handle, servicer
    await handle.server.stop(0)


async def test_a_relay_registers_its_own_pool_and_no_other(pki, discovery):
    handle, servicer = discovery
    await register(handle.port, pki.config("relay-a"))
    assert servicer.registered == ["pool-a"]
    for pool, relay in (("pool-b", "relay-1"), ("pool-a", "relay-2")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await register(handle.port, pki.config("relay-a"), pool=pool, relay=relay)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert reason_of(err.value) == Reason.NOT_AUTHORIZED
    assert servicer.registered == ["pool-a"]  # the refused calls never reached the servicer
    method = "/globaldiscovery.v1.DiscoveryService/RegisterPool"
    assert handle.authorizer.refused[(method, "NOT_AUTHORIZED")] == 2


@pytest.mark.parametrize(
    ("who", "code"),
    [
        ("frontend", grpc.StatusCode.PERMISSION_DENIED),  # a mesh identity, but not a relay
        ("admin", grpc.StatusCode.PERMISSION_DENIED),
        ("client", grpc.StatusCode.PERMISSION_DENIED),
        ("expired", grpc.StatusCode.UNAVAILABLE),  # valid chain, out of date: no handshake
        ("other-ca", grpc.StatusCode.UNAVAILABLE),  # a CA this mesh does not trust: no handshake
        ("no-id", grpc.StatusCode.UNAUTHENTICATED),  # trusted, but names no mesh identity
        ("other-domain", grpc.StatusCode.UNAUTHENTICATED),  # trusted, another trust domain
    ],
)
async def test_anyone_but_a_relay_of_the_pool_is_refused_and_nothing_is_registered(pki, discovery, who, code):
    handle, servicer = discovery
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await register(handle.port, pki.config(who))
    assert err.value.code() is code
    if code is not grpc.StatusCode.UNAVAILABLE:  # refused by the mesh, not by the TLS stack
        assert reason_of(err.value) in (Reason.NOT_AUTHORIZED, Reason.UNAUTHENTICATED)
    assert servicer.registered == []


async def test_no_certificate_never_completes_a_handshake(pki, discovery):
    handle, servicer = discovery
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await register(handle.port, SecurityConfig(tls_ca=pki.ca_path))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert servicer.registered == []


async def test_api_keys_identify_clients_over_server_tls(pki, tmp_path):
    key = new_api_key()
    keys = tmp_path / "keys"
    keys.write_text(f"alice {hash_api_key(key)}\n")
    server_tls = pki.config("discovery")
    handle, servicer = await serve(
        SecurityConfig(tls_cert=server_tls.tls_cert, tls_key=server_tls.tls_key, api_keys=str(keys))
    )
    try:
        client = SecurityConfig(tls_ca=pki.ca_path)
        async with channel(handle.port, client, grpc.access_token_call_credentials(key)) as ch:
            await dpb_grpc.DiscoveryServiceStub(ch).ListPools(dpb.ListPoolsRequest(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await register(handle.port, client, call_creds=grpc.access_token_call_credentials(key))
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED  # a client, not a relay
        for bad in ("mk_wrong", key[:-1]):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await register(handle.port, client, call_creds=grpc.access_token_call_credentials(bad))
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await register(handle.port, client)  # no key at all
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert servicer.registered == []
    finally:
        await handle.server.stop(0)


async def test_a_rotated_certificate_is_served_to_new_connections_while_open_streams_survive(pki, tmp_path):
    ca = pki.ca
    devcerts.issue(ca, spiffe_id(DEFAULT_TRUST_DOMAIN, Role.FRONTEND, "before")).write(tmp_path, "server")
    server = SecurityConfig(
        tls_cert=str(tmp_path / "server.crt"), tls_key=str(tmp_path / "server.key"), tls_ca=pki.ca_path
    )
    handle, _ = await serve(server)
    try:
        client = pki.config("relay-a")
        assert (await peer_identity("127.0.0.1", handle.port, client)).name == "before"
        await handle.set_serving(True)
        async with channel(handle.port, client) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=30
            )
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

            devcerts.issue(ca, spiffe_id(DEFAULT_TRUST_DOMAIN, Role.FRONTEND, "after")).write(
                tmp_path, "server"
            )
            assert (await peer_identity("127.0.0.1", handle.port, client)).name == "after"
            assert handle.certificates.reloads == 1

            # The stream opened before the rotation still delivers.
            await handle.set_serving(False)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
    finally:
        await handle.server.stop(0)


async def test_a_half_written_rotation_keeps_the_current_certificate(pki, tmp_path):
    devcerts.issue(pki.ca, spiffe_id(DEFAULT_TRUST_DOMAIN, Role.FRONTEND, "before")).write(tmp_path, "server")
    server = SecurityConfig(
        tls_cert=str(tmp_path / "server.crt"), tls_key=str(tmp_path / "server.key"), tls_ca=pki.ca_path
    )
    handle, _ = await serve(server)
    try:
        new = devcerts.issue(pki.ca, spiffe_id(DEFAULT_TRUST_DOMAIN, Role.FRONTEND, "after"))
        (tmp_path / "server.crt").write_bytes(new.cert_pem)  # the key is not written yet
        client = pki.config("relay-a")
        assert (await peer_identity("127.0.0.1", handle.port, client)).name == "before"
        (tmp_path / "server.key").write_bytes(new.key_pem)
        assert (await peer_identity("127.0.0.1", handle.port, client)).name == "after"
    finally:
        await handle.server.stop(0)


async def test_without_tls_a_server_binds_loopback_only_unless_insecure():
    def register(_server):
        return []

    with pytest.raises(RuntimeError, match="without TLS"):
        create_server("0.0.0.0:0", register)
    handle = create_server("0.0.0.0:0", register, security=SecurityConfig(insecure=True))
    await handle.server.stop(0)


async def test_a_refused_listen_address_names_the_flag_it_came_from():
    with pytest.raises(RuntimeError, match="--status-listen"):
        create_server("0.0.0.0:0", lambda _server: [], listen_flag="--status-listen")


def test_the_relay_refuses_a_plain_text_status_listen_naming_that_flag():
    argv = relay_argv("127.0.0.1:1", "127.0.0.1:2", "pool-a", "r1", "relay-1", "--status-listen", "0.0.0.0:0")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "(--status-listen) without TLS" in done.stderr

"""A mesh over mutual TLS: it serves its clients, and every refused identity changes nothing."""

from __future__ import annotations

import http.client
import socket
import ssl
import urllib.error
import urllib.request

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from globalrouter.v1 import router_pb2 as rpb
from globalrouter.v1 import router_pb2_grpc as rpb_grpc
from meshkit import devcerts
from meshkit.errors import Reason, reason_of, reason_of_status
from meshkit.identity import Role, spiffe_id
from meshkit.timeconv import duration
from meshkit.tls import DEFAULT_TRUST_DOMAIN, SecurityConfig
from meshlaunch import command, free_port, process_group, wait_until
from poolrelay.v1 import status_pb2, status_pb2_grpc
from poolrelay.v1 import telemetry_pb2 as tpb
from poolrelay.v1 import telemetry_pb2_grpc as tpb_grpc
from tests.security.pki import make_pki
from tests.security.secure_mesh import MODEL, SecureMesh, secure_channel

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    with process_group(tmp_path_factory.mktemp("logs")) as group:
        yield SecureMesh(pki, group).start_all()


def _register(pool="pool-a", relay="relay-1"):
    return dpb.RegisterPoolRequest(
        pool_id=pool,
        model=MODEL,
        region="r1",
        frontends=["http://127.0.0.1:1"],
        relay_id=relay,
        incarnation=2**64 - 1,
    )


def _hello(pool="pool-a", relay="relay-1"):
    return tpb.PublishPoolTelemetryRequest(
        hello=tpb.TelemetryHello(
            pool_id=pool,
            relay_id=relay,
            incarnation=2**63,
            protocol_version=1,
            block_size=1,
            hash_scheme=tpb.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
        )
    )


def _router(mesh, cert, call):
    with secure_channel(mesh.router, mesh.pki.config(cert)) as ch:
        return call(rpb_grpc.RouterServiceStub(ch))


def _frontend(frontend_id):
    return dpb.RegisterFrontendRequest(
        frontend_id=frontend_id, url="http://127.0.0.1:1", incarnation=2**64 - 1
    )


D, T, R = dpb_grpc.DiscoveryServiceStub, tpb_grpc.TelemetryServiceStub, rpb_grpc.RouterServiceStub
_STREAMS = {"KeepAlivePools", "PublishPoolTelemetry"}

# attack → (certificate used, stub, method, request)
ATTACKS = {
    # Another pool's relay takes pool-a's lease over with the highest incarnation.
    "relay of pool-b registers pool-a": ("relay-b", D, "RegisterPool", _register()),
    "relay of pool-b renews pool-a on a stream": (
        "relay-b",
        D,
        "KeepAlivePools",
        dpb.KeepAlivePoolsRequest(sequence=1, register=_register()),
    ),
    "relay of pool-b unregisters pool-a": (
        "relay-b",
        D,
        "UnregisterPool",
        dpb.UnregisterPoolRequest(pool_id="pool-a", relay_id="relay-1", incarnation=1),
    ),
    "relay of pool-a registers as another relay id": (
        "relay-a",
        D,
        "RegisterPool",
        _register(relay="relay-9"),
    ),
    "relay of pool-b streams telemetry for pool-a": ("relay-b", T, "PublishPoolTelemetry", _hello()),
    "frontend drains pool-a": (
        "frontend",
        D,
        "DrainPool",
        dpb.DrainPoolRequest(pool_id="pool-a", timeout=duration(0.001)),
    ),
    "frontend removes pool-a": ("frontend", D, "RemovePool", dpb.RemovePoolRequest(pool_id="pool-a")),
    "frontend registers as router-2": ("frontend", D, "RegisterFrontend", _frontend("router-2")),
    "client registers a pool": ("client", D, "RegisterPool", _register()),
    "client registers a frontend": ("client", D, "RegisterFrontend", _frontend("router-1")),
    "client streams telemetry": ("client", T, "PublishPoolTelemetry", _hello()),
    "relay asks for a route": (
        "relay-a",
        R,
        "Route",
        rpb.RouteRequest(model=MODEL, prompt=rpb.Prompt(text="hi")),
    ),
    "certificate without a mesh identity": ("no-id", D, "ListPools", dpb.ListPoolsRequest()),
}


def _attack(mesh, name):
    cert, stub_class, method, request = ATTACKS[name]
    address = mesh.discovery if stub_class is D else mesh.router
    with secure_channel(address, mesh.pki.config(cert)) as ch:
        call = getattr(stub_class(ch), method)
        if method in _STREAMS:
            return list(call(iter([request]), timeout=5))
        return call(request, timeout=5)


def test_a_client_generates_over_mutual_tls(mesh):
    def generate(stub):
        request = rpb.GenerateRequest(
            model=MODEL, prompt=rpb.Prompt(token_ids=rpb.TokenIds(ids=list(range(40)))), max_tokens=8
        )
        return list(stub.Generate(request, timeout=30))

    replies = _router(mesh, "client", generate)
    tokens = [t for r in replies if r.HasField("tokens") for t in r.tokens.token_ids]
    assert len(tokens) == 8
    assert replies[-1].summary.pools == ["pool-a"]


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_each_attack_is_refused_and_changes_nothing(mesh, attack):
    before = mesh.state()
    try:
        outcome = _attack(mesh, attack)
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), exc
        assert reason_of(exc) in (Reason.NOT_AUTHORIZED, Reason.UNAUTHENTICATED)
    else:
        # A renewal on a stream is refused in its reply; the stream itself stays usable.
        assert attack.endswith("on a stream"), outcome
        assert outcome[0].status.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert reason_of_status(outcome[0].status) == Reason.NOT_AUTHORIZED
    assert mesh.state() == before
    assert all(p.alive() for p in mesh.procs.values())


@pytest.mark.parametrize("cert", ["expired", "other-ca", None])
def test_untrusted_peers_do_not_get_past_the_handshake(mesh, cert):
    config = mesh.pki.config(cert) if cert else SecurityConfig(tls_ca=mesh.pki.ca_path)
    before = mesh.state()
    for address in (mesh.discovery, mesh.router, mesh.pool):
        with secure_channel(address, config) as ch, pytest.raises(grpc.RpcError) as err:
            dpb_grpc.DiscoveryServiceStub(ch).ListPools(dpb.ListPoolsRequest(), timeout=5)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert mesh.state() == before


def test_refusals_are_counted_in_metrics(mesh):
    def refused() -> float:
        return mesh.router_metric("mesh_auth_refusals_total", code="PERMISSION_DENIED", method="ListPools")

    before = refused()
    with pytest.raises(grpc.RpcError):
        _router(mesh, "relay-a", lambda s: s.ListPools(rpb.ListPoolsRequest(), timeout=5))
    assert refused() == before + 1


def test_the_metrics_port_serves_https_to_certificates_of_the_ca_only(mesh):
    """--metrics-listen follows the router's TLS flags: plain HTTP and a scraper without a
    certificate (or with one of another CA) are refused in the handshake."""
    url = mesh.metrics_url
    assert url.startswith("https://")
    with urllib.request.urlopen(url, context=mesh.scraper_tls("admin"), timeout=5) as reply:
        assert reply.status == 200 and b"mesh_auth_refusals_total" in reply.read()
    for context in (mesh.scraper_tls(None), mesh.scraper_tls("other-ca")):
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, context=context, timeout=5).read()
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(url.replace("https://", "http://"), timeout=5).read()


def test_a_relay_sends_no_telemetry_to_a_peer_that_is_not_a_frontend(mesh):
    """A relay told to stream to the pool's own address (no frontend identity) never opens a stream there.

    Its discovery is unreachable, so that it registers nothing and the mesh's state stays as it is."""
    status = f"127.0.0.1:{free_port()}"
    proc = mesh.start(
        "relay-misdirected",
        [
            command("poolrelay"),
            "serve",
            "--pool",
            mesh.pool,
            "--discovery",
            f"127.0.0.1:{free_port()}",
            "--routing-pool",
            "pool-a",
            "--routing-pool-region",
            "r1",
            "--routing-pool-frontends",
            f"http://{mesh.pool}",
            "--relay-id",
            "relay-1",
            "--global-frontends",
            f"http://{mesh.pool}",
            "--status-listen",
            status,
        ],
        "relay-a",
    )

    def refused() -> bool:
        with secure_channel(status, mesh.pki.config("admin")) as ch:
            try:
                reply = status_pb2_grpc.RelayStatusServiceStub(ch).GetRelayStatus(
                    status_pb2.GetRelayStatusRequest(), timeout=2
                )
            except grpc.RpcError:
                return False
        streams = {s.frontend_url: s for s in reply.telemetry_streams}
        s = streams.get(f"http://{mesh.pool}")
        return s is not None and "no mesh identity" in s.last_error and s.messages_sent == 0

    try:
        wait_until(refused, 30, message="the relay refusing a non-frontend peer")
    finally:
        proc.stop()


def test_a_rotated_router_certificate_is_served_and_open_streams_survive(mesh):
    """The router's certificate is replaced on disk and SIGHUP sent: new handshakes get the new one,
    while the relay's telemetry stream, opened before, keeps streaming (no reconnect)."""
    router = mesh.procs["router"]
    cert_path = mesh.pki.root / "frontend.crt"

    def served_cert(address: str = mesh.router) -> bytes:
        ctx = ssl.create_default_context(cafile=mesh.pki.ca_path)
        ctx.load_cert_chain(mesh.pki.root / "relay-a.crt", mesh.pki.root / "relay-a.key")
        ctx.set_alpn_protocols(["h2"])
        host, port = address.rsplit(":", 1)
        with (
            socket.create_connection((host, int(port)), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname=host) as tls,
        ):
            der = tls.getpeercert(binary_form=True)
        assert der is not None
        return der

    before_view = mesh.router_view()["pool-a"]
    old = served_cert()
    leaf = devcerts.issue(
        mesh.pki.ca, spiffe_id(DEFAULT_TRUST_DOMAIN, Role.FRONTEND, "router-1"), common_name="rotated"
    )
    cert_path.write_bytes(leaf.cert_pem)
    (mesh.pki.root / "frontend.key").write_bytes(leaf.key_pem)
    router.signal(1)  # SIGHUP
    wait_until(lambda: served_cert() != old, 15, message="the rotated certificate being served")
    # The metrics port shares the gRPC listener's reloader: it serves the new certificate too.
    assert served_cert(f"127.0.0.1:{mesh.metrics_port}") == served_cert()
    after_view = mesh.router_view()["pool-a"]
    assert after_view.telemetry_streams == before_view.telemetry_streams == 1
    assert mesh.routable()
    with secure_channel(mesh.relay_status, mesh.pki.config("admin")) as ch:
        reply = status_pb2_grpc.RelayStatusServiceStub(ch).GetRelayStatus(
            status_pb2.GetRelayStatusRequest(), timeout=5
        )
    assert [s.connects for s in reply.telemetry_streams] == [1]  # the stream was never redialled

"""The authorization table decides by role and by the resource a request names (pure, no transport)."""

from __future__ import annotations

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2 as dpb
from meshkit.authz import TABLE, decide, rule_for
from meshkit.errors import Reason
from meshkit.identity import Identity, Role
from poolrelay.v1 import telemetry_pb2 as tpb

D = "/globaldiscovery.v1.DiscoveryService/"
RELAY_A = Identity(Role.RELAY, "relay-1", pool="pool-a")
FRONTEND = Identity(Role.FRONTEND, "router-1")
ADMIN = Identity(Role.ADMIN, "ops")
CLIENT = Identity(Role.CLIENT, "alice")


def allowed(identity, method, request=None) -> bool:
    return decide(identity, method, request) is None


def test_only_a_relay_of_the_pool_registers_it_as_itself():
    own = dpb.RegisterPoolRequest(pool_id="pool-a", relay_id="relay-1")
    assert allowed(RELAY_A, D + "RegisterPool", own)
    assert not allowed(
        RELAY_A, D + "RegisterPool", dpb.RegisterPoolRequest(pool_id="pool-b", relay_id="relay-1")
    )
    assert not allowed(
        RELAY_A, D + "RegisterPool", dpb.RegisterPoolRequest(pool_id="pool-a", relay_id="relay-2")
    )
    for other in (FRONTEND, ADMIN, CLIENT):
        assert not allowed(other, D + "RegisterPool", own)


def test_each_renewal_on_a_stream_names_the_callers_pool():
    renew_b = dpb.KeepAlivePoolsRequest(
        register=dpb.RegisterPoolRequest(pool_id="pool-b", relay_id="relay-1")
    )
    refusal = decide(RELAY_A, D + "KeepAlivePools", renew_b)
    assert refusal is not None and refusal.code is grpc.StatusCode.PERMISSION_DENIED
    assert refusal.reason is Reason.NOT_AUTHORIZED and "register.pool_id" in str(refusal)
    assert allowed(RELAY_A, D + "KeepAlivePools")  # opening the stream: role only


def test_frontends_register_only_as_themselves_and_admins_alone_drain():
    assert allowed(FRONTEND, D + "RegisterFrontend", dpb.RegisterFrontendRequest(frontend_id="router-1"))
    assert not allowed(FRONTEND, D + "RegisterFrontend", dpb.RegisterFrontendRequest(frontend_id="router-2"))
    assert not allowed(RELAY_A, D + "RegisterFrontend", dpb.RegisterFrontendRequest(frontend_id="relay-1"))
    for method in ("DrainPool", "RemovePool"):
        assert allowed(ADMIN, D + method)
        assert not allowed(FRONTEND, D + method)
        assert not allowed(RELAY_A, D + method)
        assert not allowed(CLIENT, D + method)


def test_telemetry_hello_must_name_the_relays_own_pool():
    hello = tpb.PublishPoolTelemetryRequest(hello=tpb.TelemetryHello(pool_id="pool-b", relay_id="relay-1"))
    assert not allowed(RELAY_A, "/poolrelay.v1.TelemetryService/PublishPoolTelemetry", hello)
    hello.hello.pool_id = "pool-a"
    assert allowed(RELAY_A, "/poolrelay.v1.TelemetryService/PublishPoolTelemetry", hello)
    # Messages after the hello carry no pool: the stream's accepted hello binds them.
    later = tpb.PublishPoolTelemetryRequest(heartbeat=tpb.TelemetryHeartbeat())
    assert allowed(RELAY_A, "/poolrelay.v1.TelemetryService/PublishPoolTelemetry", later)
    assert not allowed(CLIENT, "/poolrelay.v1.TelemetryService/PublishPoolTelemetry", later)


def test_clients_alone_generate_and_everyone_may_ask_health():
    for method in ("Generate", "Route", "ListPools"):
        assert allowed(CLIENT, f"/globalrouter.v1.RouterService/{method}")
        assert not allowed(RELAY_A, f"/globalrouter.v1.RouterService/{method}")
    for who in (RELAY_A, FRONTEND, ADMIN, CLIENT):
        assert allowed(who, "/grpc.health.v1.Health/Check")


def test_a_method_not_in_the_table_is_refused_to_everyone():
    assert rule_for("/evil.v1.Backdoor/Open") is None
    assert not allowed(ADMIN, "/evil.v1.Backdoor/Open")


@pytest.mark.parametrize("method", sorted(TABLE))
def test_every_rule_names_roles_and_why(method):
    rule = TABLE[method]
    assert rule.roles and rule.note


def test_pool_events_are_for_the_servers_own_pool_only():
    e = "/poolrelay.v1.PoolEventsService/"
    relay_b = Identity(Role.RELAY, "relay-1", pool="pool-b")
    for method in ("WatchPoolStatus", "WatchKvEvents", "StartDrain"):
        assert decide(RELAY_A, e + method, server_pool="pool-a") is None
        refusal = decide(relay_b, e + method, server_pool="pool-a")
        assert refusal is not None
        assert (refusal.code, refusal.reason) == (grpc.StatusCode.PERMISSION_DENIED, Reason.NOT_AUTHORIZED)
        # A server that does not know its pool refuses every relay (fail closed).
        assert decide(RELAY_A, e + method, server_pool="") is not None
    # Operators are not relays of a pool: they may still drain it.
    assert decide(ADMIN, e + "StartDrain", server_pool="pool-a") is None

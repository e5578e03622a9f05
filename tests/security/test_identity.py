"""Identities: SPIFFE ids parsed strictly within the trust domain, certificates read, API keys kept hashed."""

from __future__ import annotations

import pytest

from meshkit import devcerts
from meshkit.authz import KEYS_CHECK_SECONDS, Authorizer, Refusal
from meshkit.clock import FakeClock
from meshkit.identity import (
    ApiKeys,
    Identity,
    IdentityError,
    Role,
    bearer_token,
    hash_api_key,
    identity_from_certificate,
    new_api_key,
    parse_spiffe,
)
from meshkit.tls import SecurityConfig

TD = "mesh.local"


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("spiffe://mesh.local/relay/pool-a/r1", Identity(Role.RELAY, "r1", pool="pool-a")),
        ("spiffe://mesh.local/frontend/router-1", Identity(Role.FRONTEND, "router-1")),
        ("spiffe://mesh.local/admin/ops", Identity(Role.ADMIN, "ops")),
        ("spiffe://mesh.local/client/alice", Identity(Role.CLIENT, "alice")),
    ],
)
def test_spiffe_ids_name_role_pool_and_name(uri, expected):
    assert parse_spiffe(uri, TD) == expected


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("https://mesh.local/admin/ops", "not a spiffe"),
        ("spiffe://other.example/admin/ops", "outside trust domain"),
        ("spiffe://mesh.local/root/ops", "unknown role"),
        ("spiffe://mesh.local/relay/pool-a", "must have the form"),
        ("spiffe://mesh.local/relay/pool-a/r1/extra", "must have the form"),
        ("spiffe://mesh.local/admin", "must have the form"),
        ("spiffe://mesh.local/admin/", "must not be empty"),
        ("spiffe://mesh.local/admin/ops?x=1", "query"),
        ("spiffe://mesh.local", "names no role"),
    ],
)
def test_bad_spiffe_ids_are_refused_saying_why(uri, why):
    with pytest.raises(IdentityError, match=why):
        parse_spiffe(uri, TD)


def test_identity_comes_from_the_certificates_uri_san():
    ca = devcerts.new_authority()
    leaf = devcerts.issue(ca, "spiffe://mesh.local/relay/p/r")
    assert identity_from_certificate(leaf.cert_pem, TD) == Identity(Role.RELAY, "r", pool="p")
    with pytest.raises(IdentityError, match="exactly one spiffe"):
        identity_from_certificate(devcerts.issue(ca, None).cert_pem, TD)
    with pytest.raises(IdentityError, match="cannot be read"):
        identity_from_certificate(b"not a certificate", TD)


def test_api_keys_are_matched_by_hash_only(tmp_path):
    key = new_api_key()
    path = tmp_path / "keys"
    path.write_text(f"# clients\nalice {hash_api_key(key)}\n\n")
    keys = ApiKeys.load(path)
    assert key not in path.read_text()
    assert keys.identify(key) == Identity(Role.CLIENT, "alice", source="api-key")
    assert keys.identify(key + "x") is None
    assert keys.identify("") is None
    assert keys.identify("k" * 10_000) is None


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("alice", "expected `NAME sha256:HEX`"),
        ("alice mk_plaintextkey", "never in clear"),
        ("alice sha256:abcd", "never in clear"),
        ("alice sha256:" + "g" * 64, "never in clear"),
        ("alice sha256:" + "a" * 64 + " extra", "expected"),
    ],
)
def test_a_bad_keys_file_names_its_line(tmp_path, line, why):
    path = tmp_path / "keys"
    path.write_text("# header\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"keys:2: .*{why}"):
        ApiKeys.load(path)


@pytest.mark.parametrize(
    ("header", "token"),
    [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer", None), ("", None)],
)
def test_bearer_tokens(header, token):
    assert bearer_token(header) == token


def test_a_key_may_stand_for_a_relay_or_an_operator_by_its_name(tmp_path):
    relay, admin, client = new_api_key(), new_api_key(), new_api_key()
    path = tmp_path / "keys"
    path.write_text(
        f"relay/pool-a/r1 {hash_api_key(relay)}\nadmin/ops {hash_api_key(admin)}\nclient/c {hash_api_key(client)}\n"
    )
    keys = ApiKeys.load(path)
    assert keys.identify(relay) == Identity(Role.RELAY, "r1", pool="pool-a", source="api-key")
    assert keys.identify(admin) == Identity(Role.ADMIN, "ops", source="api-key")
    assert keys.identify(client) == Identity(Role.CLIENT, "c", source="api-key")
    assert keys.identities() == {
        "relay/pool-a/r1": frozenset({hash_api_key(relay)}),
        "admin/ops": frozenset({hash_api_key(admin)}),
        "client/c": frozenset({hash_api_key(client)}),
    }


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("relay/pool-a", "must have the form relay/POOL/RELAY"),
        ("robot/x", "unknown role 'robot'"),
        ("client/a/b", "must have the form client/NAME"),
    ],
)
def test_a_key_name_that_is_no_identity_names_its_line(tmp_path, name, why):
    path = tmp_path / "keys"
    path.write_text(f"{name} {hash_api_key(new_api_key())}\n")
    with pytest.raises(ValueError, match=rf"keys:1: '{name}' .*{why} \(a key stands for NAME or client/NAME"):
        ApiKeys.load(path)


def test_reloading_keys_swaps_the_set_and_a_bad_file_keeps_it(tmp_path):
    old, new = new_api_key(), new_api_key()
    path = tmp_path / "keys"
    path.write_text(f"alice {hash_api_key(old)}\n")
    authorizer = Authorizer(SecurityConfig(api_keys=str(path)), service="t")
    assert authorizer.identify_peer([], f"Bearer {old}").name == "alice"
    path.write_text(f"bob {hash_api_key(new)}\n")
    assert authorizer.reload_api_keys()
    with pytest.raises(Refusal, match="not valid"):
        authorizer.identify_peer([], f"Bearer {old}")
    assert authorizer.identify_peer([], f"Bearer {new}").name == "bob"
    for bad in ("bob\n", "bob sha256:00\n", "\xff"):
        path.write_text(bad, encoding="latin-1")
        assert not authorizer.reload_api_keys()
        assert authorizer.identify_peer([], f"Bearer {new}").name == "bob"
    path.unlink()
    assert not authorizer.reload_api_keys()
    assert authorizer.identify_peer([], f"Bearer {new}").name == "bob"
    assert not Authorizer(SecurityConfig(), service="t").reload_api_keys()  # no --api-keys: nothing to do


def test_a_bad_keys_file_is_a_configuration_problem_naming_its_line(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"ok {hash_api_key(new_api_key())}\nrobot/x {hash_api_key(new_api_key())}\n")
    assert SecurityConfig(api_keys=str(path)).problems() == [
        f"--api-keys {path}:2: 'robot/x' names unknown role 'robot' (a key stands for NAME or client/NAME, "
        "admin/NAME, frontend/NAME, relay/POOL/RELAY)"
    ]


async def test_a_changed_keys_file_is_reloaded_within_a_second_without_sighup(tmp_path):
    alice, bob = new_api_key(), new_api_key()
    path = tmp_path / "keys"
    path.write_text(f"alice {hash_api_key(alice)}\nbob {hash_api_key(bob)}\n")
    clock = FakeClock()
    authorizer = Authorizer(SecurityConfig(api_keys=str(path)), service="t", clock=clock)
    path.write_text(f"alice {hash_api_key(alice)}\n")
    assert authorizer.identify_peer([], f"Bearer {bob}").name == "bob"  # not looked at yet
    await clock.advance(KEYS_CHECK_SECONDS)
    with pytest.raises(Refusal, match="not valid"):
        authorizer.identify_peer([], f"Bearer {bob}")
    # A bad rewrite is refused: the keys in force stay.
    path.write_text("alice\n")
    await clock.advance(KEYS_CHECK_SECONDS)
    assert authorizer.identify_peer([], f"Bearer {alice}").name == "alice"
    assert len(authorizer.api_keys) == 1

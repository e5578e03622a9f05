"""`make certs` writes a CA, a certificate naming each role's identity, and a hashed API key that works."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshkit.identity import ApiKeys, Identity, IdentityError, Role, identity_from_certificate
from tests.support import REPO


def test_make_certs_writes_a_usable_dev_pki(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_certs.py"), "--out", str(tmp_path), "--pools", "p1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr

    def who(name: str) -> Identity:
        return identity_from_certificate((tmp_path / f"{name}.crt").read_bytes(), "mesh.local")

    assert who("relay-p1") == Identity(Role.RELAY, "relay-p1", pool="p1")
    assert who("router-1") == Identity(Role.FRONTEND, "router-1")
    assert who("admin").role is Role.ADMIN and who("client").role is Role.CLIENT
    for server_only in ("discovery", "pool"):
        with pytest.raises(IdentityError):
            who(server_only)
    key = (tmp_path / "client.apikey").read_text().strip()
    assert key not in (tmp_path / "api-keys").read_text()
    assert ApiKeys.load(tmp_path / "api-keys").identify(key) == Identity(
        Role.CLIENT, "demo", source="api-key"
    )
    assert (tmp_path / "admin.key").stat().st_mode & 0o077 == 0

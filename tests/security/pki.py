"""Certificates made at test time: a CA, a certificate per role, and the bad ones (expired, other CA, no id)."""

from __future__ import annotations

import datetime as dt
import ssl
from dataclasses import dataclass
from pathlib import Path

from meshkit import devcerts
from meshkit.identity import Role, spiffe_id
from meshkit.tls import DEFAULT_TRUST_DOMAIN, SecurityConfig


@dataclass(frozen=True)
class Pki:
    """Files of a test PKI under `root`; `config(name)` is a SecurityConfig presenting NAME.crt."""

    root: Path
    ca: devcerts.Authority

    @property
    def ca_path(self) -> str:
        return str(self.root / "ca.crt")

    def config(self, name: str, **extra) -> SecurityConfig:
        return SecurityConfig(
            tls_cert=str(self.root / f"{name}.crt"),
            tls_key=str(self.root / f"{name}.key"),
            tls_ca=self.ca_path,
            **extra,
        )

    def client_context(self, cert: str | None) -> ssl.SSLContext:
        """An HTTPS client's context: trusts this CA, presents NAME.crt (`cert`), or nothing when None."""
        ctx = ssl.create_default_context(cafile=self.ca_path)
        if cert is not None:
            ctx.load_cert_chain(str(self.root / f"{cert}.crt"), str(self.root / f"{cert}.key"))
        return ctx

    def issue(self, name: str, role: Role | None, *names: str, ca: devcerts.Authority | None = None, **kw):
        """Writes NAME.crt / NAME.key for spiffe://mesh.local/ROLE/NAMES (no URI SAN when role is None)."""
        uri = spiffe_id(DEFAULT_TRUST_DOMAIN, role, *names) if role is not None else None
        return devcerts.issue(ca or self.ca, uri, **kw).write(self.root, name)

    def flags(self, name: str) -> list[str]:
        """The command-line flags that make a process present NAME.crt under this CA."""
        return [
            "--tls-cert",
            str(self.root / f"{name}.crt"),
            "--tls-key",
            str(self.root / f"{name}.key"),
            "--tls-ca",
            self.ca_path,
        ]


def make_pki(root: Path) -> Pki:
    """A CA with certificates for every role, plus: expired, other-CA and no-SPIFFE-id clients."""
    ca = devcerts.new_authority()
    root.mkdir(parents=True, exist_ok=True)
    (root / "ca.crt").write_bytes(ca.cert_pem)
    pki = Pki(root=root, ca=ca)
    pki.issue("discovery", Role.ADMIN, "discovery")
    pki.issue("relay-a", Role.RELAY, "pool-a", "relay-1")
    pki.issue("relay-b", Role.RELAY, "pool-b", "relay-1")
    pki.issue("frontend", Role.FRONTEND, "router-1")
    pki.issue("admin", Role.ADMIN, "ops")
    pki.issue("client", Role.CLIENT, "alice")
    pki.issue("pool", None)  # a server that never dials: no identity to grant anything
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=2)
    pki.issue("expired", Role.CLIENT, "late", not_before=past, not_after=past + dt.timedelta(days=1))
    pki.issue("other-ca", Role.ADMIN, "intruder", ca=devcerts.new_authority("another CA"))
    pki.issue("no-id", None)
    devcerts.issue(ca, "spiffe://elsewhere.example/admin/ops").write(root, "other-domain")
    return pki

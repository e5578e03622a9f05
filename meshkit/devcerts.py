"""Development certificates: a CA and one SPIFFE-named certificate per mesh role (for `make certs` and tests)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshkit.identity import Role, hash_api_key, new_api_key, spiffe_id

# Every mesh process listens on loopback in development, and dials peers by these names.
_LOCAL_NAMES: tuple[x509.GeneralName, ...] = (
    x509.DNSName("localhost"),
    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    x509.IPAddress(ipaddress.ip_address("::1")),
)


@dataclass(frozen=True)
class Authority:
    """A certificate authority able to issue leaf certificates."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Leaf:
    """An issued certificate and its private key, as PEM."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path, name: str) -> tuple[Path, Path]:
        """Writes NAME.crt and NAME.key (key readable by the owner only); returns their paths."""
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / f"{name}.crt", directory / f"{name}.key"
        cert.write_bytes(self.cert_pem)
        key.touch(mode=0o600, exist_ok=True)
        key.write_bytes(self.key_pem)
        return cert, key


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_authority(name: str = "mesh dev CA", *, days: int = 365) -> Authority:
    """A self-signed CA (P-256) valid from a minute ago for `days`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Authority(key=key, cert=cert)


def issue(
    ca: Authority,
    spiffe_id: str | None,
    *,
    common_name: str = "mesh peer",
    days: float = 90,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> Leaf:
    """A leaf certificate for server and client use, naming `spiffe_id` as its URI SAN.

    It is valid for localhost and the loopback addresses, so any role can also serve.
    `not_before` / `not_after` override the validity (tests make expired certificates with them).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    start = not_before or now - dt.timedelta(minutes=1)
    end = not_after or now + dt.timedelta(days=days)
    names: list[x509.GeneralName] = list(_LOCAL_NAMES)
    if spiffe_id:
        names.append(x509.UniformResourceIdentifier(spiffe_id))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return Leaf(cert_pem=cert.public_bytes(serialization.Encoding.PEM), key_pem=key_pem)


def relay_cert_name(pool_id: str) -> str:
    """The file name of pool `pool_id`'s relay certificate in a dev PKI (its relay id is the same)."""
    return f"relay-{pool_id}"


def write_dev_pki(
    out: Path, *, trust_domain: str, pools: list[str], frontends: list[str]
) -> dict[str, str | None]:
    """A development CA (ca.crt) and a certificate per role under `out`; returns name → SPIFFE id.

    Servers that never dial a mesh peer (discovery, pool frontends) get no SPIFFE id: they only
    prove they are the host a peer dialled, so their certificate grants nothing if it leaks. Each
    pool's relay is `relay-POOL` (file and relay id); each frontend ID is `ID` (file and frontend id).
    Also writes a client API key (client.apikey) and its hash (api-keys).
    """
    roles: dict[str, tuple[Role | None, tuple[str, ...]]] = {
        "discovery": (None, ()),
        "pool": (None, ()),
        "admin": (Role.ADMIN, ("ops",)),
        "client": (Role.CLIENT, ("demo",)),
    }
    roles.update({f: (Role.FRONTEND, (f,)) for f in frontends})
    roles.update({relay_cert_name(p): (Role.RELAY, (p, relay_cert_name(p))) for p in pools})
    out.mkdir(parents=True, exist_ok=True)
    ca = new_authority(f"{trust_domain} dev CA")
    (out / "ca.crt").write_bytes(ca.cert_pem)
    ids: dict[str, str | None] = {}
    for name, (role, names) in roles.items():
        uri = spiffe_id(trust_domain, role, *names) if role is not None else None
        issue(ca, uri).write(out, name)
        ids[name] = uri
    key = new_api_key()
    key_file = out / "client.apikey"
    key_file.touch(mode=0o600, exist_ok=True)
    key_file.write_text(key + "\n")
    (out / "api-keys").write_text(
        f"# NAME sha256:HEX (hashes only; the key is in client.apikey)\ndemo {hash_api_key(key)}\n"
    )
    return ids

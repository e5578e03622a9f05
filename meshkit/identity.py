"""Who is calling: SPIFFE identities from peer certificates' URI SANs, or client API keys (stored hashed)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit

from meshkit.validation import MAX_ID_LENGTH, Violations, check_identifier


class Role(StrEnum):
    """What a caller is to the mesh (the first path segment of its SPIFFE id)."""

    RELAY = "relay"
    FRONTEND = "frontend"
    ADMIN = "admin"
    CLIENT = "client"


@dataclass(frozen=True)
class Identity:
    """An authenticated caller. `pool` is set for relays only; `name` is the relay, frontend, admin or client name."""

    role: Role
    name: str
    pool: str = ""
    source: str = "certificate"
    """How it was established: "certificate" or "api-key"."""
    key: str = field(default="", compare=False, repr=False)
    """The sha256:HEX of the API key that established it ("" for a certificate): a revoked key's
    open calls are found by it. Not part of equality: the identity is the same whichever key."""

    def __str__(self) -> str:
        if self.role is Role.RELAY:
            return f"relay/{self.pool}/{self.name}"
        return f"{self.role}/{self.name}"


class IdentityError(ValueError):
    """A peer presented no usable identity; the message says why (for logs and the refusal)."""


_SEGMENTS = {Role.RELAY: 2, Role.FRONTEND: 1, Role.ADMIN: 1, Role.CLIENT: 1}


def spiffe_id(trust_domain: str, role: Role, *names: str) -> str:
    """spiffe://TRUST_DOMAIN/ROLE/NAMES... (the inverse of parse_spiffe)."""
    return "spiffe://" + "/".join([trust_domain, str(role), *names])


def parse_spiffe(uri: str, trust_domain: str) -> Identity:
    """The Identity a SPIFFE id names, within `trust_domain`. Raises IdentityError saying what is wrong."""
    try:
        parts = urlsplit(uri)
    except ValueError as exc:
        raise IdentityError(f"{uri!r} is not a URI") from exc
    if parts.scheme != "spiffe":
        raise IdentityError(f"{uri!r} is not a spiffe:// id")
    if parts.netloc != trust_domain:
        raise IdentityError(f"{uri!r} is outside trust domain {trust_domain!r}")
    if parts.query or parts.fragment:
        raise IdentityError(f"{uri!r} must not have a query or fragment")
    segments = parts.path.split("/")[1:] if parts.path.startswith("/") else []
    if not segments:
        raise IdentityError(f"{uri!r} names no role")
    try:
        role = Role(segments[0])
    except ValueError as exc:
        raise IdentityError(f"{uri!r} names unknown role {segments[0]!r}") from exc
    names = segments[1:]
    if len(names) != _SEGMENTS[role]:
        shape = "relay/POOL/RELAY" if role is Role.RELAY else f"{role}/NAME"
        raise IdentityError(f"{uri!r} must have the form spiffe://{trust_domain}/{shape}")
    v = Violations()
    for n in names:
        check_identifier(v, "name", n)
    if v:
        raise IdentityError(f"{uri!r}: " + "; ".join(d for _f, d in v.items))
    if role is Role.RELAY:
        return Identity(role=role, pool=names[0], name=names[1])
    return Identity(role=role, name=names[0])


def identity_from_certificate(pem: bytes, trust_domain: str) -> Identity:
    """The identity in a peer certificate: its one spiffe:// URI SAN in `trust_domain`."""
    from cryptography import x509  # loaded when a certificate is read: it costs every CLI start otherwise

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise IdentityError("the peer certificate cannot be read") from exc
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound as exc:
        raise IdentityError("the peer certificate has no subject alternative names") from exc
    return identity_from_uris(sans.get_values_for_type(x509.UniformResourceIdentifier), trust_domain)


def certificate_uris(der: bytes) -> list[str]:
    """The URI SANs of a DER certificate (a verified TLS peer's); [] when it has none or cannot be read."""
    from cryptography import x509

    try:
        cert = x509.load_der_x509_certificate(der)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return []
    return list(sans.get_values_for_type(x509.UniformResourceIdentifier))


def identity_from_uris(uris: Iterable[str], trust_domain: str) -> Identity:
    """The identity among a verified peer certificate's URI SANs: exactly one spiffe:// id is required."""
    spiffe = [u for u in uris if u.startswith("spiffe:")]
    if len(spiffe) != 1:
        raise IdentityError(
            f"the peer certificate must carry exactly one spiffe:// URI SAN (has {len(spiffe)})"
        )
    return parse_spiffe(spiffe[0], trust_domain)


# API keys ---------------------------------------------------------------------------------------

API_KEY_PREFIX = "mk_"
"""Generated keys start with this, so a leaked one is easy to recognise and grep for."""

_HASH_PREFIX = "sha256:"


def new_api_key() -> str:
    """A fresh random API key (256 bits)."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """What the keys file stores for `key`: sha256:HEX. Keys are random 256-bit tokens, so a plain
    digest cannot be reversed by guessing; a slow hash would only cost every call."""
    return _HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` value (scheme case-insensitive); None otherwise."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeys:
    """API keys, held as hashes only. Each maps to one identity: a client (a bare NAME, or
    client/NAME) or, for processes that have no certificate (a relay streaming telemetry to a
    loopback router), relay/POOL/RELAY, frontend/NAME or admin/NAME."""

    def __init__(self, entries: Iterable[tuple[str, str]] = ()) -> None:
        """`entries`: (identity as written in a keys file, sha256:HEX) pairs."""
        self._by_hash: dict[str, Identity] = {}
        for name, digest in entries:
            self._by_hash[digest] = replace(key_identity(name), key=digest)

    def __len__(self) -> int:
        return len(self._by_hash)

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        """Reads a keys file: one `NAME sha256:HEX` a line; blank lines and `#` comments ignored.

        Raises ValueError naming the line that is wrong (never echoing a key).
        """
        entries = []
        for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            problem = _entry_problem(fields)
            if problem:
                raise ValueError(f"{path}:{number}: {problem}")
            entries.append((fields[0], fields[1].lower()))
        return cls(entries)

    def identities(self) -> dict[str, frozenset[str]]:
        """Identity (as str) → the digests of its keys: what a reload compares (never the keys)."""
        out: dict[str, set[str]] = {}
        for digest, who in self._by_hash.items():
            out.setdefault(str(who), set()).add(digest)
        return {who: frozenset(digests) for who, digests in out.items()}

    def __contains__(self, digest: object) -> bool:
        """Whether the key of this sha256:HEX is (still) in force."""
        return digest in self._by_hash

    def identify(self, token: str) -> Identity | None:
        """The identity whose key is `token`; None when no key matches."""
        if not token or len(token) > 4 * MAX_ID_LENGTH:
            return None
        # A dict lookup on the digest leaks nothing useful through timing: the digest of a guess
        # is unrelated to any stored digest.
        return self._by_hash.get(hash_api_key(token))


def key_identity(name: str) -> Identity:
    """The identity a keys file's NAME stands for: a bare name is a client; ROLE/NAME (and
    relay/POOL/RELAY) name a role as a SPIFFE id's path does. Raises IdentityError saying why not."""
    if "/" not in name:
        return Identity(role=Role.CLIENT, name=name, source="api-key")
    who = parse_spiffe(f"spiffe://keys/{name}", "keys")
    return Identity(role=who.role, name=who.name, pool=who.pool, source="api-key")


def _entry_problem(fields: list[str]) -> str | None:
    if len(fields) != 2:
        return "expected `NAME sha256:HEX`"
    v = Violations()
    check_identifier(v, "name", fields[0])
    if v:
        return "name " + "; ".join(d for _f, d in v.items)
    try:
        key_identity(fields[0])
    except IdentityError as exc:
        return (
            f"{str(exc).replace('spiffe://keys/', '')} (a key stands for NAME or client/NAME, "
            "admin/NAME, frontend/NAME, relay/POOL/RELAY)"
        )
    digest = fields[1].lower()
    hexpart = digest.removeprefix(_HASH_PREFIX)
    if (
        not digest.startswith(_HASH_PREFIX)
        or len(hexpart) != 64
        or any(c not in "0123456789abcdef" for c in hexpart)
    ):
        return "the key must be stored as sha256:<64 hex digits> (see `make certs`), never in clear"
    return None

"""`make certs`: a development CA, a SPIFFE certificate per mesh role, and a client API key file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshkit import devcerts
from meshkit.identity import Role, hash_api_key, new_api_key, spiffe_id
from meshkit.tls import DEFAULT_TRUST_DOMAIN

# name → (role, path segments): one of each role the demo runs, relays for its pools. Servers that
# never dial a mesh peer (discovery, pool frontends) get no SPIFFE id: they only prove they are the
# host a peer dialled, so their certificate grants nothing if it leaks.
ROLES: dict[str, tuple[Role | None, tuple[str, ...]]] = {
    "discovery": (None, ()),
    "router": (Role.FRONTEND, ("router-1",)),
    "router-2": (Role.FRONTEND, ("router-2",)),
    "pool": (None, ()),
    "relay-pool-a": (Role.RELAY, ("pool-a", "relay-1")),
    "relay-pool-b": (Role.RELAY, ("pool-b", "relay-1")),
    "relay-pool-c": (Role.RELAY, ("pool-c", "relay-1")),
    "admin": (Role.ADMIN, ("ops",)),
    "client": (Role.CLIENT, ("demo",)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_certs", description=__doc__)
    parser.add_argument("--out", default="certs", help="directory to write into (default %(default)s)")
    parser.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN, help="SPIFFE trust domain")
    parser.add_argument("--pools", default="", help="extra relay certificates: comma-separated pool ids")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ca = devcerts.new_authority(f"{args.trust_domain} dev CA")
    (out / "ca.crt").write_bytes(ca.cert_pem)
    roles = dict(ROLES)
    for pool in filter(None, (p.strip() for p in args.pools.split(","))):
        roles[f"relay-{pool}"] = (Role.RELAY, (pool, "relay-1"))
    for name, (role, names) in roles.items():
        uri = spiffe_id(args.trust_domain, role, *names) if role is not None else None
        devcerts.issue(ca, uri).write(out, name)
        print(f"{out / name}.crt  {uri or '(server only, no identity)'}")
    key = new_api_key()
    key_file = out / "client.apikey"
    key_file.touch(mode=0o600, exist_ok=True)
    key_file.write_text(key + "\n")
    (out / "api-keys").write_text(
        f"# NAME sha256:HEX (hashes only; the key itself is in client.apikey)\ndemo {hash_api_key(key)}\n"
    )
    print(f"{out / 'api-keys'}  (client 'demo'; its key is in {key_file})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

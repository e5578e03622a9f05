"""`make certs`: a development CA, a SPIFFE certificate per mesh role, and a client API key file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshkit.devcerts import write_dev_pki
from meshkit.tls import DEFAULT_TRUST_DOMAIN


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_certs", description=__doc__)
    parser.add_argument("--out", default="certs", help="directory to write into (default %(default)s)")
    parser.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN, help="SPIFFE trust domain")
    parser.add_argument(
        "--pools",
        default="pool-a,pool-b,pool-c",
        help="pools to make relay certificates for (comma-separated)",
    )
    parser.add_argument(
        "--frontends", default="router-1,router-2", help="global frontend ids to make certificates for"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    ids = write_dev_pki(
        out,
        trust_domain=args.trust_domain,
        pools=[p.strip() for p in args.pools.split(",") if p.strip()],
        frontends=[f.strip() for f in args.frontends.split(",") if f.strip()],
    )
    for name, uri in ids.items():
        print(f"{out / name}.crt  {uri or '(server only, no identity)'}")
    print(f"{out / 'api-keys'}  (client 'demo'; its key is in {out / 'client.apikey'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

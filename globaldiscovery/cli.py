"""Command line of globaldiscovery: `serve` runs the directory, `pools` lists it for people and scripts."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from globaldiscovery.config import DiscoveryConfig
from globaldiscovery.store.base import StoreUnavailable
from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshkit import cli as flags
from meshkit import settings, timeconv
from meshkit.channels import sync_channel
from meshkit.discovery_endpoints import endpoints_arg
from meshkit.logs import configure_logging

# The one set of defaults: every `serve` flag's default is read from the config dataclass.
_DEFAULTS = DiscoveryConfig()
ENV_PREFIX = "GLOBALDISCOVERY"


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command's parser and its `serve` and `pools` sub-parsers (whose errors name their flags)."""
    parser = argparse.ArgumentParser(
        prog="globaldiscovery",
        description="Global Discovery: the directory of serving pools and global frontends.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a discovery server")
    serve.add_argument(
        "--listen", type=flags.host_port, default=_DEFAULTS.listen, help="HOST:PORT to listen on"
    )
    serve.add_argument(
        "--heartbeat-interval",
        type=float,
        default=_DEFAULTS.heartbeat_interval,
        metavar="SECONDS",
        help="how often relays and frontends renew (fractions allowed; default %(default)s)",
    )
    serve.add_argument(
        "--lease-duration",
        type=float,
        default=_DEFAULTS.lease_duration,
        metavar="SECONDS",
        help="how long a lease lives without renewal; > heartbeat, <= 1 day (default %(default)s)",
    )
    serve.add_argument(
        "--watch-queue-limit",
        type=int,
        default=_DEFAULTS.watch_queue_limit,
        help="events a watcher may fall behind before its stream is ended (default %(default)s)",
    )
    serve.add_argument(
        "--watch-queue-bytes",
        type=int,
        default=_DEFAULTS.watch_queue_bytes,
        metavar="BYTES",
        help="bytes of pool records a watcher may fall behind before its stream is ended (default %(default)s)",
    )
    serve.add_argument(
        "--watch-history-bytes",
        type=int,
        default=_DEFAULTS.watch_history_bytes,
        metavar="BYTES",
        help="bytes of pool records kept for resumed watches; an older resume gets a snapshot "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--store",
        choices=["memory", "etcd"],
        default=_DEFAULTS.store,
        help="where the directory lives: this process, or etcd shared by replicas (default %(default)s)",
    )
    serve.add_argument(
        "--etcd-endpoints",
        type=endpoints_arg,
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="etcd's members, with --store etcd (calls move to another member when one fails)",
    )
    serve.add_argument(
        "--etcd-isolation-timeout",
        type=float,
        default=_DEFAULTS.etcd_isolation_timeout,
        metavar="SECONDS",
        help="with --store etcd: how long without etcd before this replica stops serving "
        "(NOT_SERVING, calls refused) until it re-syncs (default %(default)s)",
    )
    serve.add_argument(
        "--max-watchers",
        type=int,
        default=_DEFAULTS.max_watchers,
        help="WatchPools streams open at once (default %(default)s)",
    )
    serve.add_argument(
        "--stop-grace",
        type=flags.non_negative_number,
        default=_DEFAULTS.stop_grace,
        metavar="SECONDS",
        help="seconds in-flight calls get to finish on SIGTERM (default %(default)s)",
    )
    flags.add_log_level_flag(serve)
    flags.add_security_flags(serve)
    settings.enable(serve, ENV_PREFIX)

    pools = sub.add_parser("pools", help="list the pools a discovery server knows")
    pools.add_argument(
        "--discovery", type=flags.host_port, required=True, help="HOST:PORT of a discovery server"
    )
    pools.add_argument("--json", action="store_true", help="one JSON object a line instead of a table")
    pools.add_argument("--model", default="", help="only pools serving this model")
    pools.add_argument("--region", default="", help="only pools in this region")
    pools.add_argument("--timeout", type=flags.positive_seconds, default=10.0, help="seconds per call")
    flags.add_security_flags(pools, server=False)
    return parser, serve, pools


def main(argv: list[str] | None = None) -> int:
    parser, serve_parser, pools_parser = _parser()
    args = settings.parse_args(parser, argv)  # flags over GLOBALDISCOVERY_* over --config FILE (serve)
    if args.command == "serve":
        return _serve(serve_parser, args)
    flags.security_config(pools_parser, args)
    return _pools(args)


def discovery_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> DiscoveryConfig:
    """The DiscoveryConfig `serve`'s parsed settings name; exits 2 naming the flag when it is wrong."""
    config = DiscoveryConfig(
        listen=args.listen,
        heartbeat_interval=args.heartbeat_interval,
        lease_duration=args.lease_duration,
        watch_queue_limit=args.watch_queue_limit,
        watch_queue_bytes=args.watch_queue_bytes,
        watch_history_bytes=args.watch_history_bytes,
        store=args.store,
        etcd_endpoints=args.etcd_endpoints or "",
        etcd_isolation_timeout=args.etcd_isolation_timeout,
        max_watchers=args.max_watchers,
        stop_grace=args.stop_grace,
        security=flags.security_config(parser, args),
    )
    problems = config.problems()
    if problems:
        parser.error("; ".join(problems))  # exit code 2, message on stderr
    return config


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    config = discovery_config(parser, args)
    configure_logging("globaldiscovery", args.log_level)
    from globaldiscovery.server import serve  # grpc server modules load only for `serve`

    try:
        asyncio.run(serve(config))
    except (RuntimeError, StoreUnavailable) as exc:  # cannot bind, or etcd does not answer
        print(f"globaldiscovery: {exc}", file=sys.stderr)
        return 1
    return 0


def pool_record(pool: pb.Pool) -> dict:
    """One pool as a JSON-ready dict (the `pools --json` line)."""
    return {
        "pool_id": pool.pool_id,
        "model": pool.model,
        "region": pool.region,
        "frontends": list(pool.frontends),
        "draining": pool.draining,
        "relays": [lease.relay_id for lease in pool.leases],
        "capabilities": list(pool.capabilities),
        "revision": pool.revision,
        "drain_deadline": timeconv.wall_seconds(pool.drain_deadline)
        if pool.HasField("drain_deadline")
        else None,
    }


def _pools(args: argparse.Namespace) -> int:
    pools: list[pb.Pool] = []
    complete = True
    try:
        with sync_channel(args.discovery) as channel:
            stub = pb_grpc.DiscoveryServiceStub(channel)
            token = ""
            while True:
                reply = stub.ListPools(
                    pb.ListPoolsRequest(
                        model=args.model, region=args.region, page_size=1000, page_token=token
                    ),
                    timeout=args.timeout,
                )
                pools.extend(reply.pools)
                complete = complete and reply.complete
                token = reply.next_page_token
                if not token:
                    break
    except grpc.RpcError as exc:
        print(f"globaldiscovery pools: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        for pool in pools:
            print(json.dumps(pool_record(pool)))
        return 0
    print(format_table([pool_record(p) for p in pools]))
    if not complete:
        print("(listing not complete yet: this discovery replica started less than one lease ago)")
    return 0


def format_table(records: list[dict]) -> str:
    """A readable table of pool records."""
    headers = ["POOL", "MODEL", "REGION", "DRAINING", "RELAYS", "FRONTENDS"]
    rows = [
        [
            r["pool_id"],
            r["model"],
            r["region"],
            "yes" if r["draining"] else "no",
            ",".join(r["relays"]),
            ",".join(r["frontends"]),
        ]
        for r in records
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if not rows:
        lines.append("(no pools)")
    return "\n".join(lines)

"""Command line of poolrelay: `serve` (the relay) and `status` (ask a running relay)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from datetime import UTC, datetime

import grpc
from google.protobuf import json_format

from meshkit import settings
from meshkit.blocks import DEFAULT_BLOCK_SIZE
from meshkit.channels import sync_channel
from meshkit.cli import (
    add_log_level_flag,
    add_security_flags,
    host_port,
    int_at_least,
    positive_seconds,
    security_config,
    url_list,
)
from meshkit.discovery_endpoints import endpoints_arg
from meshkit.ids import new_incarnation
from meshkit.logs import configure_logging
from meshkit.server import create_server, serve_until_signalled
from meshkit.supervision import BackgroundTaskFailed
from meshkit.timeconv import wall_seconds
from meshkit.tls import SecurityConfig
from meshkit.validation import url_problem
from poolrelay.engine.config import ENGINES, EngineConfig, parse_workers
from poolrelay.engine.translate import check_block_sizes
from poolrelay.metrics import serve_relay_metrics
from poolrelay.relay import Relay, RelayConfig, RelayConfigError
from poolrelay.status import register
from poolrelay.v1 import status_pb2, status_pb2_grpc

ENV_PREFIX = "POOLRELAY"
# The status listener is not part of RelayConfig (the server around the relay binds it).
STATUS_LISTEN = "127.0.0.1:0"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poolrelay", description="Registers a pool and streams its telemetry."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the relay beside a pool")
    serve.add_argument(
        "--engine",
        choices=("mocker", *ENGINES),
        default="mocker",
        help="what the pool runs: the mesh's pool event API (mocker, the default) or vLLM / SGLang servers",
    )
    serve.add_argument("--pool", type=host_port, help="the pool's event API, HOST:PORT (--engine mocker)")
    serve.add_argument(
        "--engine-worker",
        action="append",
        default=[],
        metavar="url=URL,events=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,id=ID][,topic=T]",
        help="one engine instance or data-parallel rank (repeat per worker); events-bind= instead of "
        "events= when the engine connects to the relay",
    )
    serve.add_argument(
        "--engine-block-size",
        type=int_at_least(1),
        help="the engine's KV block size in tokens, a whole multiple of the mesh's 16 (vLLM --block-size)",
    )
    serve.add_argument(
        "--discovery",
        required=True,
        type=endpoints_arg,
        help="globaldiscovery, HOST:PORT[,HOST:PORT...] (replicas on a shared store; a failed one is skipped)",
    )
    serve.add_argument("--routing-pool", required=True, help="the pool id to register")
    serve.add_argument("--routing-pool-region", help="the pool's region (required with --routing-pool)")
    serve.add_argument(
        "--routing-pool-frontends",
        type=url_list,
        default=[],
        help="the pool's frontends, http(s)://HOST[:PORT][/BASE][,...] (optional: a pool with none is listed "
        "but not routable; engines: default every worker's url)",
    )
    serve.add_argument("--relay-id", help="this replica's id (default: hostname-pid)")
    serve.add_argument(
        "--global-frontends",
        type=url_list,
        default=[],
        help="global frontends to stream telemetry to, besides those discovery lists",
    )
    serve.add_argument(
        "--status-listen", type=host_port, default=STATUS_LISTEN, help="status + health, HOST:PORT"
    )
    serve.add_argument(
        "--metrics-listen",
        type=host_port,
        help="serve Prometheus /metrics on HOST:PORT (HTTPS under --tls-cert/--tls-key, mutual with "
        "--tls-ca; loopback only without TLS unless --insecure); off when not given",
    )
    serve.add_argument(
        "--report-interval",
        type=positive_seconds,
        default=settings.field_default(RelayConfig, "report_interval"),
        help="seconds between load reports (default %(default)s)",
    )
    serve.add_argument(
        "--unregister-on-exit",
        action="store_true",
        default=settings.field_default(RelayConfig, "unregister_on_exit"),
        help="unregister on SIGTERM so the pool leaves at once (default: stop renewing; the pool "
        "leaves one lease later, so a relay restart keeps it routed)",
    )
    add_log_level_flag(serve)
    add_security_flags(serve)
    settings.enable(serve, ENV_PREFIX)

    status = sub.add_parser("status", help="show a running relay's status")
    status.add_argument("--relay", required=True, type=host_port, help="the relay's status address")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    add_security_flags(status, server=False)
    return parser


# RelayConfig field -> the flag that sets it, so a config error names what the user typed.
_FLAGS = {
    "pool": "--pool",
    "pool_id": "--routing-pool",
    "region": "--routing-pool-region",
    "frontends": "--routing-pool-frontends",
    "relay_id": "--relay-id",
    "global_frontends": "--global-frontends",
    "report_interval": "--report-interval",
    "metrics_listen": "--metrics-listen",
}


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RelayConfig:
    """Checks the flags (the dataclass runs the same checks); exits 2 with a message naming the flag."""
    if not args.routing_pool:
        parser.error("--routing-pool must name the pool (got an empty string)")
    if not args.routing_pool_region:
        parser.error("--routing-pool requires --routing-pool-region")
    engine = None
    if args.engine == "mocker":
        if not args.pool:
            parser.error("--pool is required with --engine mocker")
        if args.engine_worker or args.engine_block_size:
            parser.error("--engine-worker and --engine-block-size need --engine vllm or sglang")
        for url in args.routing_pool_frontends:
            problem = url_problem(url, allow_path=False)
            if problem:
                parser.error(f"--routing-pool-frontends: frontend {url!r} {problem}")
    else:
        if not args.engine_worker:
            parser.error(f"--engine {args.engine} needs at least one --engine-worker")
        if not args.engine_block_size:
            parser.error(f"--engine {args.engine} needs --engine-block-size (the engine's KV block size)")
        try:
            workers = parse_workers(args.engine_worker)
            check_block_sizes(args.engine_block_size, DEFAULT_BLOCK_SIZE)
        except ValueError as exc:
            parser.error(str(exc))
        engine = EngineConfig(kind=args.engine, workers=workers, block_size=args.engine_block_size)
        if not args.routing_pool_frontends:
            args.routing_pool_frontends = list(dict.fromkeys(w.url for w in workers))
    try:
        return RelayConfig(
            pool=args.pool or "",
            discovery=args.discovery,
            pool_id=args.routing_pool,
            region=args.routing_pool_region,
            frontends=tuple(args.routing_pool_frontends),
            relay_id=args.relay_id or f"{socket.gethostname()}-{os.getpid()}",
            incarnation=new_incarnation(),
            global_frontends=tuple(args.global_frontends),
            report_interval=args.report_interval,
            engine=engine,
            unregister_on_exit=args.unregister_on_exit,
            metrics_listen=args.metrics_listen or "",
        )
    except RelayConfigError as exc:
        named = "; ".join(f"{_FLAGS.get(f.split('[')[0], f)}: {d}" for f, d in exc.violations.items)
        parser.error(named)


async def serve(config: RelayConfig, listen: str, security: SecurityConfig | None = None) -> None:
    log = configure_logging("poolrelay")
    relay = Relay(config)
    handle = create_server(listen, register(relay), security=security, listen_flag="--status-listen")
    log.info(
        "relay starting",
        status=f"{listen.rpartition(':')[0]}:{handle.port}",
        pool=config.pool,
        pool_id=config.pool_id,
        relay_id=config.relay_id,
    )
    metrics = None
    if config.metrics_listen:
        # The process's TLS flags and the status listener's certificate reloader (SIGHUP reaches
        # both). Before the relay starts: a refused --metrics-listen stops the process at once.
        metrics = serve_relay_metrics(
            relay, asyncio.get_running_loop(), config.metrics_listen, security, handle.certificates
        )
        log.info("metrics served", listen=config.metrics_listen, port=metrics.port)
    await relay.start()

    async def close_metrics() -> None:
        if metrics is not None:
            # In a thread: shutdown() waits for the accept loop's next poll, which must not hold
            # the event loop (a scrape in flight reads the status on it).
            await asyncio.to_thread(metrics.close)

    await serve_until_signalled(
        handle, on_stop=[relay.stop], after_stop=[close_metrics], stop_event=relay.stop_requested
    )
    log.info("relay stopped")
    relay.supervisor.raise_if_failed()  # a background task failed: exit non-zero


def show_status(relay: str, as_json: bool) -> int:
    with sync_channel(relay) as channel:
        stub = status_pb2_grpc.RelayStatusServiceStub(channel)
        try:
            reply = stub.GetRelayStatus(status_pb2.GetRelayStatusRequest(), timeout=5.0)
        except grpc.RpcError as exc:
            print(f"poolrelay status: {relay}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if as_json:
        print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True), indent=2))
        return 0
    reason = status_pb2.UnregisteredReason.Name(reply.routing_pool_unregistered_reason)
    lease = "-"
    if reply.HasField("lease_expire_time"):
        expires = wall_seconds(reply.lease_expire_time)
        when = datetime.fromtimestamp(expires, tz=UTC).isoformat(timespec="milliseconds")
        lease = f"{when} (in {expires - time.time():.1f} s)"
    print(f"healthy:          {reply.healthy}")
    print(f"pool:             {reply.pool_id} (relay {reply.relay_id}, incarnation {reply.incarnation})")
    print(f"registered model: {reply.registered_model or '-'}")
    print(f"lease expires:    {lease}")
    print(f"unregistered:     {reason} {reply.routing_pool_unregistered_detail}".rstrip())
    print(f"pool blocks:      {reply.pool_blocks}   draining: {reply.draining}")
    for s in reply.telemetry_streams:
        state = status_pb2.TelemetryStreamState.Name(s.state).removeprefix("TELEMETRY_STREAM_STATE_")
        print(
            f"telemetry {s.frontend_url}: {state} sent={s.messages_sent} queue={s.queue_depth} "
            f"connects={s.connects} snapshots={s.snapshots_sent} dropped={s.messages_dropped}"
            + (f" error={s.last_error}" if s.last_error else "")
        )
    for w in reply.engine_workers:
        seq = w.last_sequence if w.HasField("last_sequence") else "-"
        print(
            f"engine {w.worker_id} {w.url}: {'healthy' if w.healthy else 'DOWN'} "
            f"failures={w.consecutive_failures} batches={w.kv_event_batches} events={w.kv_events_applied} "
            f"gaps={w.gaps} replays={w.replays_asked} closed={w.replays_closed} resets={w.resets} "
            f"malformed={w.malformed_dropped} last_seq={seq} blocks={w.blocks}"
            + (f" error={w.last_error}" if w.last_error else "")
            + (f" last_reset={w.last_reset_reason}" if w.last_reset_reason else "")
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = settings.parse_args(parser, argv)  # flags over POOLRELAY_* over --config FILE (serve)
    security = security_config(parser, args)  # also how this process dials discovery and frontends
    if args.command == "status":
        return show_status(args.relay, args.json)
    config = config_from_args(parser, args)
    configure_logging("poolrelay", args.log_level)
    try:
        asyncio.run(serve(config, args.status_listen, security))
    except BackgroundTaskFailed as exc:
        print(f"poolrelay: {exc}", file=sys.stderr)
        return exc.exit_code
    except RuntimeError as exc:
        print(f"poolrelay: {exc}", file=sys.stderr)
        return 1
    return 0

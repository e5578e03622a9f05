"""Command line of mocker, the simulated pool: every flag is parsed and checked here."""

from __future__ import annotations

import argparse
import asyncio
import sys

from meshkit import settings
from meshkit.cli import (
    add_log_level_flag,
    add_security_flags,
    host_port,
    int_at_least,
    non_negative_number,
    positive_number,
    positive_seconds,
    security_config,
)
from meshkit.logs import configure_logging
from meshkit.validation import Violations, check_identifier
from mocker.config import Faults, PoolConfig

# One snapshot message per worker must fit in a gRPC message (8 MiB at 8 bytes per block hash).
MAX_WORKER_CAPACITY_BLOCKS = 1_000_000
MAX_WORKERS = 1024

# The one set of defaults: every flag's default is read from the config dataclasses.
_DEFAULTS = PoolConfig(pool_id="-", models=("-",))
_FAULTS = Faults()
ENV_PREFIX = "MOCKER"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mocker", description="A simulated LLM serving pool.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a simulated pool (serving link, pool events, admin API)")
    d = _DEFAULTS
    s.add_argument("--listen", type=host_port, required=True, help="HOST:PORT to serve on")
    s.add_argument(
        "--pool-id",
        required=True,
        help="the pool's id (reported in its status; with TLS, only this pool's relays may read its events)",
    )
    s.add_argument("--model", action="append", required=True, help="a model the pool serves (repeatable)")
    s.add_argument("--workers", type=int_at_least(1, MAX_WORKERS), default=d.workers)
    s.add_argument(
        "--worker-capacity-blocks",
        type=int_at_least(1, MAX_WORKER_CAPACITY_BLOCKS),
        default=d.worker_capacity_blocks,
        help="KV blocks per worker",
    )
    s.add_argument("--block-size", type=int_at_least(1), default=d.block_size, help="tokens per KV block")
    s.add_argument("--speedup", type=positive_number, default=d.speedup, help="divides every duration")
    s.add_argument("--max-queue", type=int_at_least(0), default=d.max_queue, help="waiting requests admitted")
    s.add_argument("--max-running-per-worker", type=int_at_least(1), default=d.max_running_per_worker)
    s.add_argument("--prefill-tokens-per-second", type=positive_number, default=d.prefill_tokens_per_second)
    s.add_argument("--decode-tokens-per-second", type=positive_number, default=d.decode_tokens_per_second)
    s.add_argument(
        "--queue-report-interval",
        type=positive_seconds,
        default=d.queue_report_interval,
        help="seconds between the 'queued, position N' messages to a request waiting for a slot "
        "(real seconds, not divided by --speedup)",
    )
    s.add_argument(
        "--vocab-size",
        type=int_at_least(1, 2**32),
        default=d.vocab_size,
        help="output token ids are below this (match the tokenizer that decodes them)",
    )
    s.add_argument(
        "--drain-timeout",
        type=positive_seconds,
        default=d.drain_timeout,
        help="seconds accepted work may run after SIGTERM",
    )
    s.add_argument(
        "--fail-after-tokens",
        type=int_at_least(0),
        default=_FAULTS.fail_after_tokens,
        help="exit abruptly once any stream has sent this many tokens (0: never)",
    )
    s.add_argument(
        "--stall-after-tokens",
        type=int_at_least(0),
        default=_FAULTS.stall_after_tokens,
        help="a stream that has sent this many tokens hangs: open, silent, forever (0: never)",
    )
    s.add_argument(
        "--added-latency",
        type=non_negative_number,
        default=_FAULTS.added_latency,
        help="seconds before admission",
    )
    s.add_argument(
        "--refuse-all",
        action="store_true",
        default=_FAULTS.refuse_all,
        help="refuse every request (RESOURCE_EXHAUSTED)",
    )
    s.add_argument(
        "--not-ready",
        nargs="+",
        default=list(d.not_ready),
        metavar="MODEL",
        help="models that start not ready",
    )
    s.add_argument(
        "--adapter",
        action="append",
        default=list(d.adapters),
        metavar="NAME",
        help="a LoRA adapter the pool serves on its first --model (repeatable)",
    )
    s.add_argument(
        "--kv-subscriber-queue",
        type=int_at_least(1),
        default=d.kv_subscriber_queue,
        help="KV events buffered per WatchKvEvents subscriber before it is ended as too slow",
    )
    add_log_level_flag(s)
    add_security_flags(s)
    settings.enable(s, ENV_PREFIX)
    return parser


def parse_serve(argv: list[str] | None) -> tuple[argparse.Namespace, PoolConfig, Faults]:
    """Parses `mocker serve` flags into configuration; exits 2 with a clear message on bad flags."""
    parser = build_parser()
    args = settings.parse_args(parser, argv)  # flags over MOCKER_* over --config FILE
    v = Violations()
    check_identifier(v, "--pool-id", args.pool_id)
    for model in args.model:
        check_identifier(v, "--model", model)
    if len(set(args.model)) != len(args.model):
        v.add("--model", "lists a model twice")
    for adapter in args.adapter:
        check_identifier(v, "--adapter", adapter)
        if adapter in args.model:
            v.add("--adapter", f"{adapter!r} is also a --model: an adapter needs a name of its own")
    if len(set(args.adapter)) != len(args.adapter):
        v.add("--adapter", "lists an adapter twice")
    for model in args.not_ready:
        if model not in args.model:
            v.add("--not-ready", f"{model!r} is not one of the --model values")
    if v:
        parser.error("; ".join(f"{f}: {d}" for f, d in v.items))
    args.security = security_config(parser, args)
    config = PoolConfig(
        pool_id=args.pool_id,
        models=tuple(args.model),
        workers=args.workers,
        worker_capacity_blocks=args.worker_capacity_blocks,
        block_size=args.block_size,
        speedup=args.speedup,
        max_queue=args.max_queue,
        max_running_per_worker=args.max_running_per_worker,
        prefill_tokens_per_second=args.prefill_tokens_per_second,
        decode_tokens_per_second=args.decode_tokens_per_second,
        drain_timeout=args.drain_timeout,
        not_ready=tuple(args.not_ready),
        vocab_size=args.vocab_size,
        kv_subscriber_queue=args.kv_subscriber_queue,
        queue_report_interval=args.queue_report_interval,
        adapters=tuple(args.adapter),
    )
    faults = Faults(
        fail_after_tokens=args.fail_after_tokens,
        added_latency=args.added_latency,
        refuse_all=args.refuse_all,
        stall_after_tokens=args.stall_after_tokens,
    )
    return args, config, faults


def main(argv: list[str] | None = None) -> int:
    args, config, faults = parse_serve(argv)
    configure_logging("mocker", args.log_level)
    from mocker.server import serve  # imported late: `--help` and flag errors need no gRPC

    try:
        asyncio.run(serve(args.listen, config, faults, security=args.security))
    except RuntimeError as exc:
        print(f"mocker: {exc}", file=sys.stderr)
        return 1
    return 0

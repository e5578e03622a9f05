"""`globalrouter serve`: the one place its flags are parsed into a RouterConfig."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from globalrouter import stall
from globalrouter.config import RouterConfig
from globalrouter.http_api.config import HttpConfig
from globalrouter.server import serve
from globalrouter.wait_slo import WaitSlo
from meshkit.cli import (
    add_security_flags,
    fraction,
    host_port,
    identifier,
    int_at_least,
    positive_number,
    positive_seconds,
    url,
)
from meshkit.discovery_endpoints import endpoints_arg
from meshkit.logs import configure_logging, get_logger

log = get_logger(module="globalrouter.serve_cli")


def tokenizer_spec(value: str) -> tuple[str, str]:
    """argparse type: MODEL=DIR where DIR holds a tokenizer.json."""
    model, sep, directory = value.partition("=")
    if not sep or not model.strip() or not directory:
        raise argparse.ArgumentTypeError(f"expected MODEL=DIR, got {value!r}")
    if not (Path(directory) / "tokenizer.json").is_file():
        raise argparse.ArgumentTypeError(f"{directory!r} has no tokenizer.json")
    return model.strip(), directory


def add_parser(subparsers) -> None:
    """`globalrouter serve` flags (the one place they are parsed)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run a global frontend",
        description="Run a global frontend (RouterService + TelemetryService).",
    )
    p.add_argument("--listen", type=host_port, default="127.0.0.1:50061", help="HOST:PORT to serve on")
    p.add_argument(
        "--discovery",
        type=endpoints_arg,
        required=True,
        help="discovery HOST:PORT[,HOST:PORT...] (replicas on a shared store; a failed one is skipped)",
    )
    p.add_argument("--advertise", type=url, default=None, help="URL relays dial (default http://<listen>)")
    p.add_argument(
        "--frontend-id", type=identifier, default=None, help="id in discovery (default globalrouter-<port>)"
    )
    p.add_argument("--region", type=identifier, default=None, help="this frontend's region")
    p.add_argument(
        "--migration-limit", type=int_at_least(0), default=3, help="mid-stream migrations per request"
    )
    p.add_argument(
        "--admission-tries", type=int_at_least(1), default=4, help="pools asked per admission round"
    )
    p.add_argument(
        "--stall-timeout",
        type=positive_number,
        default=stall.DEFAULT_STALL_TIMEOUT_S,
        help="seconds a pool may go silent mid-stream before the request migrates; a slow pool gets "
        f"{stall.DEFAULT_PACE_FACTOR:g}x its own gap between messages when that is longer (default %(default)s)",
    )
    p.add_argument(
        "--first-token-timeout",
        type=positive_number,
        default=stall.DEFAULT_FIRST_TOKEN_TIMEOUT_S,
        help=f"seconds from admission to the first token, plus {stall.DEFAULT_PREFILL_FACTOR:g}x the pool's predicted prefill, before the "
        "pool counts as having refused (default %(default)s)",
    )
    p.add_argument(
        "--wait-slo",
        type=positive_number,
        default=None,
        metavar="SECONDS",
        help="rank under a wait SLO: strong cache affinity, plus a price per second of estimated "
        "wait beyond SECONDS, raised or lowered online so that the wait this frontend estimates at "
        "the pool it picks exceeds SECONDS on at most 1 - --wait-slo-quantile of requests "
        "(default: off, fixed weights)",
    )
    p.add_argument(
        "--wait-slo-quantile",
        type=fraction,
        default=0.99,
        help="the share of requests whose estimated wait should be within --wait-slo (default %(default)s)",
    )
    p.add_argument(
        "--metrics-listen",
        type=host_port,
        default=None,
        help="HOST:PORT for Prometheus /metrics (HTTPS under the TLS flags, mutual with --tls-ca)",
    )
    p.add_argument(
        "--http-listen",
        type=host_port,
        default=None,
        help="HOST:PORT of the OpenAI-compatible HTTP front and status page (default: off)",
    )
    p.add_argument(
        "--tokenizer",
        type=tokenizer_spec,
        action="append",
        default=[],
        metavar="MODEL=DIR",
        help="a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json) for MODEL "
        "(repeatable); other models use one token per UTF-8 byte",
    )
    p.add_argument(
        "--tokenizer-threads",
        type=int_at_least(1),
        default=2,
        help="threads that encode text prompts off the event loop (default %(default)s)",
    )
    p.add_argument(
        "--tokenizer-queue",
        type=int_at_least(0),
        default=64,
        help="prompts that may wait for an encoding thread; one more is refused with "
        "RESOURCE_EXHAUSTED / HTTP 429 (default %(default)s)",
    )
    p.add_argument(
        "--http-max-body-bytes",
        type=int_at_least(1024),
        default=8 * 1024 * 1024,
        help="larger bodies get 413",
    )
    p.add_argument(
        "--http-write-timeout",
        type=positive_seconds,
        default=30.0,
        help="seconds a streaming client may stop reading before its request is ended",
    )
    p.add_argument(
        "--http-default-max-tokens",
        type=int_at_least(1),
        default=256,
        help="output tokens when an HTTP request sets no max_tokens",
    )
    p.add_argument(
        "--http-max-header-bytes",
        type=int_at_least(1024),
        default=32 * 1024,
        help="request line and headers of one HTTP request, in bytes (more: 431)",
    )
    p.add_argument(
        "--http-header-timeout",
        type=positive_seconds,
        default=10.0,
        help="seconds from accept (TLS handshake included) to a complete request head (then 408 and closed)",
    )
    p.add_argument(
        "--http-max-headers",
        type=int_at_least(8),
        default=100,
        help="headers of one HTTP request (more: 431)",
    )
    p.add_argument("--grace", type=float, default=5.0, help="seconds in-flight calls get on SIGTERM")
    p.add_argument(
        "--max-streams-per-client",
        type=int_at_least(1),
        default=64,
        help="concurrent Generate streams per client identity (with TLS or API keys)",
    )
    p.add_argument(
        "--max-prompt-tokens", type=int_at_least(1), default=1_048_576, help="longest prompt accepted"
    )
    p.add_argument(
        "--max-output-tokens", type=int_at_least(1), default=1_048_576, help="largest max_tokens accepted"
    )
    p.add_argument(
        "--max-telemetry-streams", type=int_at_least(1), default=1024, help="telemetry streams open at once"
    )
    p.add_argument(
        "--max-snapshot-blocks",
        type=int_at_least(1),
        default=4_194_304,
        help="block hashes one telemetry snapshot may carry across its chunks",
    )
    p.add_argument("--log-level", default="info")
    add_security_flags(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    configure_logging("globalrouter", args.log_level)
    config = RouterConfig(
        listen=args.listen,
        discovery=args.discovery,
        advertise=args.advertise or "",
        frontend_id=args.frontend_id or "",
        region=args.region or "",
        migration_limit=args.migration_limit,
        admission_tries=args.admission_tries,
        stall=stall.StallPolicy(
            stall_timeout=args.stall_timeout, first_token_timeout=args.first_token_timeout
        ),
        metrics_listen=args.metrics_listen or "",
        wait_slo=WaitSlo(args.wait_slo, quantile=args.wait_slo_quantile) if args.wait_slo else None,
        grace=args.grace,
        max_streams_per_client=args.max_streams_per_client,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_telemetry_streams=args.max_telemetry_streams,
        max_snapshot_blocks=args.max_snapshot_blocks,
        security=args.security,
        tokenizers=tuple(args.tokenizer),
        tokenizer_threads=args.tokenizer_threads,
        tokenizer_queue=args.tokenizer_queue,
        http=HttpConfig(
            listen=args.http_listen or "",
            max_body_bytes=args.http_max_body_bytes,
            write_timeout=args.http_write_timeout,
            default_max_tokens=args.http_default_max_tokens,
            max_head_bytes=args.http_max_header_bytes,
            max_headers=args.http_max_headers,
            head_timeout=args.http_header_timeout,
        ),
    )
    try:
        asyncio.run(serve(config))
    except RuntimeError as exc:
        log.error("cannot start", error=str(exc))
        return 1
    return 0

"""`globalrouter serve`: the one place its flags are parsed into a RouterConfig."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NoReturn, TypeVar

from globalrouter import policy, stall
from globalrouter.aliases import AliasError, load_aliases
from globalrouter.config import (
    KV_STATES,
    MAX_TELEMETRY_BATCH_INTERVAL,
    GcConfig,
    OpenAILinkConfig,
    ProbeConfig,
    RouterConfig,
)
from globalrouter.dispatch import ORDERS, PLACEMENTS, DispatchConfig
from globalrouter.http_api.config import HttpConfig
from globalrouter.pool_state import FreshnessLimits
from globalrouter.selection import RANKINGS
from globalrouter.server import serve
from globalrouter.wait_slo import WaitSlo
from meshkit import settings, tracing
from meshkit.cli import (
    add_log_level_flag,
    add_security_flags,
    fraction,
    host_port,
    identifier,
    int_at_least,
    non_negative_number,
    positive_number,
    positive_seconds,
    url,
)
from meshkit.discovery_endpoints import endpoints_arg
from meshkit.logs import configure_logging, get_logger
from meshkit.supervision import BackgroundTaskFailed

log = get_logger(module="globalrouter.serve_cli")

# The one set of defaults: every flag's default is read from the config dataclasses.
_D = RouterConfig()
ENV_PREFIX = "GLOBALROUTER"


def aliases_file(value: str) -> str:
    """argparse type: a readable aliases TOML file (globalrouter.aliases) with no error in it
    ("" is no file: argparse passes a string default through here too)."""
    if not value:
        return value
    try:
        load_aliases(value)
    except AliasError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def tokenizer_spec(value: str) -> tuple[str, str]:
    """argparse type: MODEL=DIR where DIR holds a tokenizer.json."""
    model, sep, directory = value.partition("=")
    if not sep or not model.strip() or not directory:
        raise argparse.ArgumentTypeError(f"expected MODEL=DIR, got {value!r}")
    if not (Path(directory) / "tokenizer.json").is_file():
        raise argparse.ArgumentTypeError(f"{directory!r} has no tokenizer.json")
    return model.strip(), directory


def policy_file(value: str) -> str:
    """argparse type: a policy file that parses (refused with the file, entry and key named)."""
    try:
        policy.load(value)
    except policy.PolicyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


_V = TypeVar("_V", int, float)


def _class_map(
    value: str, kind: str, convert: Callable[[str], _V], ok: Callable[[_V], bool]
) -> dict[int, _V]:
    """CLASS=VALUE[,CLASS=VALUE...] (priority classes 0-9) with each VALUE converted and checked."""
    out: dict[int, _V] = {}
    for part in filter(None, (x.strip() for x in value.split(","))):
        cls, sep, text = part.partition("=")
        try:
            number, item = int(cls), convert(text)
        except ValueError:
            number, item = -1, None
        if not sep or not 0 <= number <= policy.MAX_PRIORITY or item is None or not ok(item):
            raise argparse.ArgumentTypeError(
                f"expected CLASS={kind} with CLASS 0 to {policy.MAX_PRIORITY} and {_KIND_RULES[kind]}, got {part!r}"
            )
        out[number] = item
    return out


_KIND_RULES = {
    "SECONDS": "SECONDS >= 0",
    "POOLS": "POOLS 0 to 100000",
    "TOKENS_PER_S": "TOKENS_PER_S a positive number",
}


def class_seconds(value: str) -> dict[int, float]:
    """argparse type: CLASS=SECONDS[,CLASS=SECONDS...] (priority classes 0-9), "" for none."""
    return _class_map(value, "SECONDS", float, lambda v: v >= 0 and math.isfinite(v))


def class_pools(value: str) -> dict[int, int]:
    """argparse type: CLASS=POOLS[,CLASS=POOLS...] (priority classes 0-9, whole pools >= 0), "" for none."""
    return _class_map(value, "POOLS", int, lambda v: 0 <= v <= 100_000)


def add_dispatch_slo_flags(p: argparse.ArgumentParser) -> None:
    """--dispatch-order and --dispatch-slo-feedback, the late binding's SLO settings: one definition
    for `serve` and `simulate`."""
    p.add_argument(
        "--dispatch-order",
        choices=ORDERS,
        default="fifo",
        help="late, with --wait-slo: fifo, queue order; deadline, a request queued longer than the "
        "target goes behind those of its class that can still start within it (for at most 10 x the "
        "target), and with the rank placement pools queue up to 0.2 x the target (the SLO's p99 "
        "tracks its target more closely, a longer wait for the few that miss it; bench_dispatch) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--dispatch-slo-feedback",
        action="store_true",
        help="late, with --wait-slo: scale the pools' queue depth and the hold by the observed wait "
        "p99 over a window of the last 512 decisions, up to 64x while it is under the target "
        "(more share where the fixed settings leave the tail far under it; bench_dispatch)",
    )


def class_rates(value: str) -> dict[int, float]:
    """argparse type: CLASS=TOKENS_PER_S[,...] (priority classes 0-9, positive rates), "" for none."""
    return _class_map(value, "TOKENS_PER_S", float, lambda v: v > 0 and math.isfinite(v))


def _batch_interval(value: str) -> float:
    """argparse type of --telemetry-batch-interval: seconds from 0 to MAX_TELEMETRY_BATCH_INTERVAL."""
    seconds = non_negative_number(value)
    if seconds > MAX_TELEMETRY_BATCH_INTERVAL:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_TELEMETRY_BATCH_INTERVAL:g} seconds, got {value!r}"
        )
    return seconds


def add_parser(subparsers) -> None:
    """`globalrouter serve` flags (the one place they are parsed)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run a global frontend",
        description="Run a global frontend (RouterService + TelemetryService).",
    )
    # The command's own listen default (the dataclass's port 0 is for tests).
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
        "--migration-limit",
        type=int_at_least(0),
        default=_D.migration_limit,
        help="mid-stream migrations per request",
    )
    p.add_argument(
        "--admission-tries",
        type=int_at_least(1),
        default=_D.admission_tries,
        help="pools asked per admission round",
    )
    p.add_argument(
        "--stall-timeout",
        type=positive_number,
        default=_D.stall.stall_timeout,
        help="seconds a pool may go silent mid-stream before the request migrates; a slow pool gets "
        "--stall-pace-factor times its own gap between messages when that is longer (default %(default)s)",
    )
    p.add_argument(
        "--first-token-timeout",
        type=positive_number,
        default=_D.stall.first_token_timeout,
        help="seconds from admission to the first token, plus --first-token-prefill-factor times the pool's "
        "predicted prefill, before the pool counts as having refused (default %(default)s)",
    )
    p.add_argument(
        "--max-queue-wait",
        type=positive_number,
        default=_D.stall.max_queue_wait,
        help="seconds a request may wait for its first token at a pool that says it is busy (queue "
        "reports, or a fresh load showing it full) before it tries another pool; the busy pool's "
        "link is not backed off (default %(default)s)",
    )
    p.add_argument(
        "--routed-prefix-ttl",
        type=non_negative_number,
        default=_D.routed_prefix_ttl,
        metavar="SECONDS",
        help="a prompt this frontend sent to a pool counts as cached there for SECONDS, until the pool's "
        "KV events can say so, so that the next request sharing its prefix follows it; 0: off "
        "(default %(default)s)",
    )
    p.add_argument(
        "--ranking",
        choices=tuple(RANKINGS),
        default=_D.ranking,
        help="the ranking's weights: default, or dynamo (Dynamo's KV router cost one level up: prefill "
        "left after the pool's cached prefix plus its queued work, equal weights; a baseline to "
        "compare with, not for --wait-slo) (default %(default)s)",
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
        default=settings.field_default(WaitSlo, "quantile"),
        help="the share of requests whose estimated wait should be within --wait-slo (default %(default)s)",
    )
    p.add_argument(
        "--dispatch",
        choices=("early", "late"),
        default="early",
        help="early: commit each request to a pool at arrival; late: hold it in a bounded queue per "
        "model until a pool can start it, higher --policy priority classes first and tenants by "
        "weight (globalrouter.dispatch; with --wait-slo its timing follows the SLO) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--dispatch-max-queued",
        type=int_at_least(1),
        default=settings.field_default(DispatchConfig, "max_queued"),
        help="late: requests one model's queue holds; beyond it RESOURCE_EXHAUSTED / 429 (default %(default)s)",
    )
    p.add_argument(
        "--dispatch-max-wait",
        type=positive_number,
        default=settings.field_default(DispatchConfig, "max_queue_seconds"),
        metavar="SECONDS",
        help="late: seconds a request may wait in the queue before it is shed (default %(default)s)",
    )
    p.add_argument(
        "--dispatch-shed-after",
        type=class_seconds,
        default="",
        metavar="CLASS=SECONDS[,...]",
        help="late: under overload, a request of priority class CLASS queued longer than SECONDS is "
        "shed (429 / RESOURCE_EXHAUSTED, shed reason OVERLOADED) so that higher classes keep the "
        "pools; classes not named wait up to --dispatch-max-wait (default: none)",
    )
    p.add_argument(
        "--dispatch-reserve",
        type=class_pools,
        default="",
        metavar="CLASS=POOLS[,...]",
        help="late: a request of priority class CLASS dispatches only while more than POOLS pools "
        "can take work, leaving them to higher classes (pools do not preempt: without a reserve a "
        "higher class arriving under a flood waits for a pool to finish lower-class work) "
        "(default: none)",
    )
    p.add_argument(
        "--dispatch-reserve-window",
        type=non_negative_number,
        default=settings.field_default(DispatchConfig, "reserve_window_seconds"),
        metavar="SECONDS",
        help="late, with --dispatch-reserve: a reserving class also leaves free the pools higher "
        "classes were given work at within SECONDS (0: the fixed count only) (default %(default)s)",
    )
    p.add_argument(
        "--dispatch-placement",
        choices=PLACEMENTS,
        default=settings.field_default(DispatchConfig, "placement"),
        help="late: rank, each queued request in order takes the pool the ranking puts first; match, "
        "pool-driven: free pools go to the queued requests with the longest prefix cached there "
        "(a higher share of the ideal hit rate at a higher wait p99; bench_dispatch) (default %(default)s)",
    )
    add_dispatch_slo_flags(p)
    p.add_argument(
        "--dispatch-pace",
        type=class_rates,
        default="",
        metavar="CLASS=TOKENS_PER_S[,...]",
        help="late: requests of priority class CLASS leave the queue at most TOKENS_PER_S tokens "
        "(prompt + max output) per second, e.g. its budget's tokens per minute / 60: work a "
        "budget admits in bursts then reaches the pools spread out, and higher classes do not "
        "wait for pools it filled (pools do not preempt); held requests keep their deadlines "
        "(default: none)",
    )
    p.add_argument(
        "--dispatch-pace-burst",
        type=non_negative_number,
        default=settings.field_default(DispatchConfig, "pace_burst_seconds"),
        metavar="SECONDS",
        help="late, with --dispatch-pace: seconds of its rate a paced class may send at once "
        "after idling (default %(default)s)",
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
        "--probe-listen",
        type=host_port,
        default=None,
        help="HOST:PORT of a gRPC health service (grpc.health.v1) answered by its own thread, off the "
        'serving loop, plaintext: service "" is readiness (as the main port\'s health, and the loop ticked '
        'within --probe-ready-within), "liveness" is liveness (the loop ticked within '
        "--probe-live-within); for kubelet probes under load (default: off)",
    )
    p.add_argument(
        "--probe-http-listen",
        type=host_port,
        default=None,
        help="HOST:PORT of HTTP GET /livez and /readyz with the same answers as --probe-listen, from "
        "its own thread, plaintext (default: off)",
    )
    p.add_argument(
        "--probe-live-within",
        type=positive_seconds,
        default=_D.probe.live_within,
        help="seconds without a serving-loop tick after which the probe says not live (default %(default)s)",
    )
    p.add_argument(
        "--probe-ready-within",
        type=positive_seconds,
        default=_D.probe.ready_within,
        help="seconds without a serving-loop tick after which the probe says not ready; at most "
        "--probe-live-within (default %(default)s)",
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
        "--aliases",
        type=aliases_file,
        default=_D.aliases,
        metavar="FILE",
        help='a TOML file of public model names: [aliases] NAME = "MODEL" or "MODEL:ADAPTER", or '
        "NAME = { MODEL = WEIGHT, ... } to split traffic (by request id); re-read on SIGHUP",
    )
    p.add_argument(
        "--http-max-body-bytes",
        type=int_at_least(1024),
        default=_D.http.max_body_bytes,
        help="larger bodies get 413",
    )
    p.add_argument(
        "--http-write-timeout",
        type=positive_seconds,
        default=_D.http.write_timeout,
        help="seconds a streaming client may stop reading before its request is ended",
    )
    p.add_argument(
        "--http-default-max-tokens",
        type=int_at_least(1),
        default=_D.http.default_max_tokens,
        help="output tokens when an HTTP request sets no max_tokens",
    )
    p.add_argument(
        "--http-max-header-bytes",
        type=int_at_least(1024),
        default=_D.http.max_head_bytes,
        help="request line and headers of one HTTP request, in bytes (more: 431)",
    )
    p.add_argument(
        "--http-header-timeout",
        type=positive_seconds,
        default=_D.http.head_timeout,
        help="seconds from accept (TLS handshake included) to a complete request head (then 408 and closed)",
    )
    p.add_argument(
        "--http-max-headers",
        type=int_at_least(8),
        default=_D.http.max_headers,
        help="headers of one HTTP request (more: 431)",
    )
    p.add_argument(
        "--grace", type=non_negative_number, default=_D.grace, help="seconds in-flight calls get on SIGTERM"
    )
    p.add_argument(
        "--ready-timeout",
        type=non_negative_number,
        default=_D.ready_timeout,
        help="seconds after the start at most that health (gRPC, /readyz) waits for the KV state of "
        "every pool the directory lists before saying ready anyway; the synced directory is "
        "waited for in any case (default %(default)s)",
    )
    p.add_argument(
        "--max-streams-per-client",
        type=int_at_least(1),
        default=_D.max_streams_per_client,
        help="concurrent Generate streams per client identity (with TLS or API keys)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int_at_least(1),
        default=_D.max_prompt_tokens,
        help="longest prompt accepted",
    )
    p.add_argument(
        "--max-output-tokens",
        type=int_at_least(1),
        default=_D.max_output_tokens,
        help="largest max_tokens accepted",
    )
    p.add_argument(
        "--max-telemetry-streams",
        type=int_at_least(1),
        default=_D.max_telemetry_streams,
        help="telemetry streams open at once",
    )
    p.add_argument(
        "--snapshot-readers",
        type=int_at_least(0),
        default=_D.snapshot_readers,
        metavar="N",
        help="telemetry streams that may read a snapshot at the same time, the others waiting for a slot "
        f"(0: no bound; default {_D.snapshot_readers})",
    )
    p.add_argument(
        "--telemetry-batch-interval",
        type=_batch_interval,
        default=_D.telemetry_batch_interval,
        metavar="SECONDS",
        help="write interval asked of every relay in its telemetry hello ack: at most one message per "
        "stream per interval, what is queued meanwhile sent as one batch; 0 to "
        f"{MAX_TELEMETRY_BATCH_INTERVAL:g} (default 0: relays write as soon as something is queued)",
    )
    p.add_argument(
        "--max-snapshot-blocks",
        type=int_at_least(1),
        default=_D.max_snapshot_blocks,
        help="block hashes one telemetry snapshot may carry across its chunks",
    )
    p.add_argument(
        "--max-generate-streams",
        type=int_at_least(1),
        default=_D.max_generate_streams,
        help="concurrent Generate streams of all clients together (default %(default)s)",
    )
    p.add_argument(
        "--stall-pace-factor",
        type=positive_number,
        default=_D.stall.pace_factor,
        help="mid-stream silence allowed as a multiple of the stream's own typical gap, when longer "
        "than --stall-timeout (default %(default)s)",
    )
    p.add_argument(
        "--first-token-prefill-factor",
        type=non_negative_number,
        default=_D.stall.prefill_factor,
        help="added to --first-token-timeout: this many times the pool's predicted prefill time "
        "(default %(default)s)",
    )
    p.add_argument(
        "--link-backoff-initial",
        type=positive_seconds,
        default=_D.link_backoff_initial,
        help="seconds a pool's serving link is avoided after its first failure, doubling per failure "
        "(default %(default)s)",
    )
    p.add_argument(
        "--link-backoff-max",
        type=positive_seconds,
        default=_D.link_backoff_max,
        help="upper bound of the serving-link back-off, seconds (default %(default)s)",
    )
    p.add_argument(
        "--load-max-age",
        type=positive_seconds,
        default=_D.freshness.load_max_age,
        help="seconds after which a pool's load report counts as unknown (default %(default)s)",
    )
    p.add_argument(
        "--kv-max-age",
        type=positive_seconds,
        default=_D.freshness.kv_max_age,
        help="seconds without a message on a pool's KV streams after which its cached blocks count as "
        "unknown (default %(default)s)",
    )
    p.add_argument(
        "--state-max-age",
        type=positive_seconds,
        default=_D.freshness.state_max_age,
        help="seconds after which a pool's telemetry readiness/drain state counts as unknown "
        "(default %(default)s)",
    )
    p.add_argument(
        "--http-body-timeout",
        type=positive_seconds,
        default=_D.http.body_timeout,
        help="seconds an HTTP client may take to send its request body (then 408; default %(default)s)",
    )
    p.add_argument(
        "--http-max-connections",
        type=int_at_least(1),
        default=_D.http.max_connections,
        help="concurrent HTTP connections; one more is answered 503 and closed (default %(default)s)",
    )
    p.add_argument(
        "--openai-connect-timeout",
        type=positive_seconds,
        default=_D.openai_link.connect_timeout,
        help="seconds to connect to an OpenAI HTTP pool before it counts as unreachable (default %(default)s)",
    )
    p.add_argument(
        "--openai-read-timeout",
        type=positive_seconds,
        default=_D.openai_link.read_timeout,
        help="seconds an admitted OpenAI HTTP stream may go without a byte before it counts as broken "
        "(default %(default)s)",
    )
    p.add_argument(
        "--openai-max-connections",
        type=int_at_least(1),
        default=_D.openai_link.max_connections,
        help="connections open at once to all OpenAI HTTP pools together (default %(default)s)",
    )
    p.add_argument(
        "--max-snapshot-blocks-per-relay",
        type=int_at_least(1),
        default=_D.max_snapshot_blocks_per_relay,
        help="snapshot blocks not yet applied one relay may hold across its streams (8 bytes each)",
    )
    p.add_argument(
        "--max-snapshot-blocks-total",
        type=int_at_least(1),
        default=_D.max_snapshot_blocks_total,
        help="snapshot blocks not yet applied all telemetry streams may hold (8 bytes each)",
    )
    p.add_argument(
        "--snapshot-step-blocks",
        type=int_at_least(1),
        default=_D.snapshot_step_blocks,
        help="most snapshot blocks applied (or a leaving stream's blocks removed) per step of the serving "
        "loop (fewer when a step takes over 2 ms)",
    )
    p.add_argument(
        "--policy",
        type=policy_file,
        default=None,
        metavar="FILE",
        help="tenant policy (TOML): per identity, priority class, weight, token and request budgets, "
        "allowed regions and models; re-read on SIGHUP, a bad file refused and the policy in force kept "
        "(default: none, everyone may use everything)",
    )
    p.add_argument(
        "--budget-etcd-endpoints",
        type=endpoints_arg,
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="etcd where the fleet's frontends share the policy's budget counters, so a budget holds "
        "across them (default: counted in this process only)",
    )
    p.add_argument(
        "--kv-state",
        choices=KV_STATES,
        default=_D.kv_state,
        help="how the pools' KV blocks are held: exact (per relay stream, exact; small fleets) or summary "
        "(a fingerprint table per pool, about 2.4 bytes per pool-block; hundreds of pools)",
    )
    p.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="do not gc.freeze() at the start, once ready and after each full collection (by default what "
        "is alive then is left out of the garbage collector's later passes: full passes over a fleet's "
        "state paused the serving loop 100-500 ms)",
    )
    p.add_argument(
        "--gc-full-every",
        type=non_negative_number,
        default=_D.gc.full_every,
        metavar="SECONDS",
        help="with the gc freeze: seconds between planned full collections over everything, which free "
        "cycles among frozen objects that became garbage (one pause of a full collection's length; "
        "0: never) (default %(default)s)",
    )
    p.add_argument(
        "--gc-young-every",
        type=non_negative_number,
        default=_D.gc.young_every,
        metavar="SECONDS",
        help="seconds between the young garbage collections the serving loop runs itself, each followed "
        "by a freeze of what survived (with the gc freeze); 0: none, Python's thresholds alone decide "
        "(default %(default)s)",
    )
    p.add_argument(
        "--gc-threshold",
        type=int_at_least(0),
        default=_D.gc.threshold,
        metavar="ALLOCATIONS",
        help="allocations between young-generation garbage collections (gc.set_threshold's first value; "
        "default 0: Python's, 700)",
    )
    p.add_argument(
        "--gc-threshold1",
        type=int_at_least(0),
        default=_D.gc.threshold1,
        metavar="COLLECTIONS",
        help="young garbage collections between generation-1 ones (gc.set_threshold's second value; 0: "
        "Python's, 10). A generation-1 collection walks every open stream's pending read: its length "
        "grows with the streams, this sets how often it comes (default %(default)s)",
    )
    p.add_argument(
        "--loop-stall-sample",
        type=non_negative_number,
        default=_D.loop_stall_sample,
        metavar="SECONDS",
        help="a diagnosis: sample the serving loop's stack whenever its heartbeat is late by more than "
        "this, and log the counts every 10 s ('loop stalls sampled'); 0: off (default %(default)s)",
    )
    add_log_level_flag(p)
    add_security_flags(p)
    tracing.add_tracing_flags(p)
    settings.enable(p, ENV_PREFIX)
    p.set_defaults(func=_run)


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig `globalrouter serve`'s parsed settings (args.security included) name."""
    return RouterConfig(
        listen=args.listen,
        discovery=args.discovery,
        advertise=args.advertise or "",
        frontend_id=args.frontend_id or "",
        region=args.region or "",
        migration_limit=args.migration_limit,
        admission_tries=args.admission_tries,
        stall=stall.StallPolicy(
            stall_timeout=args.stall_timeout,
            pace_factor=args.stall_pace_factor,
            first_token_timeout=args.first_token_timeout,
            prefill_factor=args.first_token_prefill_factor,
            max_queue_wait=args.max_queue_wait,
        ),
        link_backoff_initial=args.link_backoff_initial,
        link_backoff_max=args.link_backoff_max,
        freshness=FreshnessLimits(
            load_max_age=args.load_max_age, kv_max_age=args.kv_max_age, state_max_age=args.state_max_age
        ),
        max_generate_streams=args.max_generate_streams,
        metrics_listen=args.metrics_listen or "",
        ranking=args.ranking,
        routed_prefix_ttl=args.routed_prefix_ttl,
        wait_slo=WaitSlo(args.wait_slo, quantile=args.wait_slo_quantile) if args.wait_slo else None,
        dispatch=_dispatch_config(args),
        grace=args.grace,
        ready_timeout=args.ready_timeout,
        max_streams_per_client=args.max_streams_per_client,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_telemetry_streams=args.max_telemetry_streams,
        snapshot_readers=args.snapshot_readers,
        telemetry_batch_interval=args.telemetry_batch_interval,
        max_snapshot_blocks=args.max_snapshot_blocks,
        max_snapshot_blocks_per_relay=args.max_snapshot_blocks_per_relay,
        max_snapshot_blocks_total=args.max_snapshot_blocks_total,
        snapshot_step_blocks=args.snapshot_step_blocks,
        kv_state=args.kv_state,
        gc=GcConfig(
            freeze=not args.no_gc_freeze,
            full_every=args.gc_full_every,
            young_every=args.gc_young_every,
            threshold=args.gc_threshold,
            threshold1=args.gc_threshold1,
        ),
        loop_stall_sample=args.loop_stall_sample,
        security=args.security,
        tracing=tracing.tracing_config(args),
        tokenizers=tuple(args.tokenizer),
        tokenizer_threads=args.tokenizer_threads,
        tokenizer_queue=args.tokenizer_queue,
        aliases=args.aliases or "",
        http=HttpConfig(
            listen=args.http_listen or "",
            max_body_bytes=args.http_max_body_bytes,
            body_timeout=args.http_body_timeout,
            max_connections=args.http_max_connections,
            write_timeout=args.http_write_timeout,
            default_max_tokens=args.http_default_max_tokens,
            max_head_bytes=args.http_max_header_bytes,
            max_headers=args.http_max_headers,
            head_timeout=args.http_header_timeout,
        ),
        probe=ProbeConfig(
            listen=args.probe_listen or "",
            http_listen=args.probe_http_listen or "",
            live_within=args.probe_live_within,
            ready_within=args.probe_ready_within,
        ),
        openai_link=OpenAILinkConfig(
            connect_timeout=args.openai_connect_timeout,
            read_timeout=args.openai_read_timeout,
            max_connections=args.openai_max_connections,
        ),
        policy=args.policy or "",
        budget_etcd=args.budget_etcd_endpoints or "",
    )


def _run(args: argparse.Namespace) -> int:
    configure_logging("globalrouter", args.log_level)
    try:
        config = router_config(args)
    except ValueError as exc:  # settings that each parse but do not go together
        log.error("cannot start", error=str(exc))
        return 2
    tracing.setup("globalrouter", config.tracing, config.security, instance=config.frontend_id)
    code = 0
    try:
        asyncio.run(serve(config))
    except BackgroundTaskFailed as exc:
        log.error("stopped: a background task failed", error=str(exc), exit_code=exc.exit_code)
        code = exc.exit_code
    except RuntimeError as exc:
        log.error("cannot start", error=str(exc))
        code = 1
    finally:
        tracing.shutdown()  # the spans still queued go out before the process ends
    if getattr(args, "whole_process", False):
        _exit_now(code)
    return code


def _dispatch_config(args: argparse.Namespace) -> DispatchConfig | None:
    """The late-binding queue from --dispatch and its flags (None: early binding)."""
    if args.dispatch != "late":
        return None
    placement = args.dispatch_placement
    if args.dispatch_order != "fifo" and not args.wait_slo:
        raise ValueError(f"--dispatch-order {args.dispatch_order} needs --wait-slo (the order's target)")
    if args.dispatch_slo_feedback and not args.wait_slo:
        raise ValueError("--dispatch-slo-feedback needs --wait-slo (the feedback's target)")
    base = (
        DispatchConfig.for_wait_slo(args.wait_slo, placement, args.dispatch_order, args.dispatch_slo_feedback)
        if args.wait_slo
        else DispatchConfig(placement=placement)
    )
    return replace(
        base,
        max_queued=args.dispatch_max_queued,
        max_queue_seconds=args.dispatch_max_wait,
        shed_after_seconds=args.dispatch_shed_after,
        reserved_pools=args.dispatch_reserve,
        reserve_window_seconds=args.dispatch_reserve_window,
        pace_tokens_per_second=args.dispatch_pace,
        pace_burst_seconds=args.dispatch_pace_burst,
    )


def _exit_now(code: int) -> NoReturn:
    """Ends the process once its orderly stop is done, skipping the interpreter's teardown: freeing
    a loaded frontend's millions of objects one by one took seconds past the grace at 1,000 pools,
    and nothing is left to release (the server, links, channels, metrics and tracing are closed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)

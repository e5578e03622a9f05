"""`globalrouter serve`: RouterService (Generate, Route, ListPools) and TelemetryService on one gRPC server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import grpc

from globalrouter.config import RouterConfig
from globalrouter.directory import DirectoryWatcher, PoolTable
from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.migration import GenerateError, GenerateRun
from globalrouter.pool_state import PoolState
from globalrouter.registration import FrontendRegistration
from globalrouter.routing import RoutingCore, describe_filtered
from globalrouter.selection import SelectionConfig, Selector
from globalrouter.serving import ServingLinks
from globalrouter.telemetry import TelemetryIngest, TelemetryServicer
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit import pagination
from meshkit.blocks import text_to_tokens
from meshkit.channels import aio_channel
from meshkit.cli import host_port
from meshkit.clock import Clock, SystemClock
from meshkit.ids import new_incarnation, new_request_id
from meshkit.logs import configure_logging, get_logger
from meshkit.server import ServerHandle, serve_until_signalled
from meshkit.server import create_server as create_grpc_server
from meshkit.timeconv import duration
from meshkit.validation import Violations, check_identifier, url_problem
from poolrelay.v1 import telemetry_pb2, telemetry_pb2_grpc

log = get_logger(module="globalrouter.server")

MAX_PROMPT_TOKENS = 1_048_576
MAX_OUTPUT_TOKENS = 1_048_576
MAX_TOKEN_ID = 2**32 - 1
DEFAULT_ROUTE_MAX_TOKENS = 16


def prompt_tokens(v: Violations, field_path: str, prompt: router_pb2.Prompt) -> list[int]:
    """The prompt as token ids (text: one token per UTF-8 byte); records what is wrong with it."""
    kind = prompt.WhichOneof("content")
    if kind == "text":
        tokens = text_to_tokens(prompt.text)
        if not tokens:
            v.add(f"{field_path}.text", "must not be empty")
    elif kind == "token_ids":
        tokens = list(prompt.token_ids.ids)
        if not tokens:
            v.add(f"{field_path}.token_ids.ids", "must list at least one token id")
    else:
        v.add(field_path, "must set token_ids or text")
        return []
    if len(tokens) > MAX_PROMPT_TOKENS:
        v.add(field_path, f"must have at most {MAX_PROMPT_TOKENS} tokens (got {len(tokens)})")
    return tokens


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """The client API of one global frontend."""

    def __init__(self, core: RoutingCore, links: ServingLinks, config: RouterConfig) -> None:
        self._core = core
        self._links = links
        self.config = config

    # ---- Generate ---------------------------------------------------------------------------
    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        v = Violations()
        check_identifier(v, "model", request.model)
        tokens = prompt_tokens(v, "prompt", request.prompt)
        if request.max_tokens == 0 or request.max_tokens > MAX_OUTPUT_TOKENS:
            v.add("max_tokens", f"must be 1 to {MAX_OUTPUT_TOKENS} (got {request.max_tokens})")
        if request.request_id:
            check_identifier(v, "request_id", request.request_id)
        await v.abort_if_any(context)
        request_id = request.request_id or new_request_id()
        metrics = self._core.metrics
        decision = self._core.decide(request.model, tokens, request.max_tokens)
        error = self._no_candidate_error(request.model, decision)
        if error is not None:
            # A model no pool serves is labelled as such: clients must not grow the label set.
            label = request.model if decision.model_served else "(not served)"
            metrics.requests.labels(label, error.code.name).inc()
            await context.abort(error.code, error.message)
        run = GenerateRun(
            self._core,
            self._links,
            request_id=request_id,
            model=request.model,
            prompt=tokens,
            max_tokens=request.max_tokens,
            migration_limit=self.config.migration_limit,
            admission_tries=self.config.admission_tries,
        )
        outcome = "OK"
        try:
            async for response in run.stream(decision):
                yield response
        except GenerateError as exc:
            outcome = exc.code.name
            self._trailers(context, run)
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            outcome = "CANCELLED"
            raise
        finally:
            metrics.requests.labels(request.model, outcome).inc()
        self._trailers(context, run)

    @staticmethod
    def _trailers(context: grpc.aio.ServicerContext, run: GenerateRun) -> None:
        context.set_trailing_metadata(
            (("x-pools", ",".join(run.record.pools)), ("x-migrations", str(run.record.migrations)))
        )

    def _no_candidate_error(self, model: str, decision) -> GenerateError | None:
        if not decision.model_served:
            return GenerateError(grpc.StatusCode.NOT_FOUND, f"no listed pool serves model {model!r}")
        if not decision.candidates:
            return GenerateError(
                grpc.StatusCode.UNAVAILABLE,
                f"pools serve model {model!r} but none is eligible: {describe_filtered(decision)}",
            )
        return None

    # ---- Route ------------------------------------------------------------------------------
    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext):
        v = Violations()
        check_identifier(v, "model", request.model)
        tokens = prompt_tokens(v, "prompt", request.prompt)
        if request.max_tokens > MAX_OUTPUT_TOKENS:
            v.add("max_tokens", f"must be at most {MAX_OUTPUT_TOKENS} (got {request.max_tokens})")
        await v.abort_if_any(context)
        decision = self._core.decide(request.model, tokens, request.max_tokens or DEFAULT_ROUTE_MAX_TOKENS)
        if not decision.model_served:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no listed pool serves model {request.model!r}")
        return router_pb2.RouteResponse(
            candidates=[
                router_pb2.Candidate(
                    pool_id=c.pool_id,
                    rank=i,
                    total_cost=c.total_cost,
                    prefill_cost=c.prefill_cost,
                    load_cost=c.load_cost,
                    pending_cost=c.pending_cost,
                    cached_blocks=c.cached_blocks,
                    prompt_blocks=c.prompt_blocks,
                    load_known=c.load_known,
                    region=c.region,
                )
                for i, c in enumerate(decision.candidates, start=1)
            ],
            filtered=[
                router_pb2.FilteredPool(
                    pool_id=f.pool_id,
                    reason=router_pb2.FilterReason.Value(f"FILTER_REASON_{f.reason.name}"),
                    detail=f.detail,
                )
                for f in decision.filtered  # ordered by pool_id
            ],
            prompt_blocks=decision.prompt_blocks,
        )

    # ---- ListPools --------------------------------------------------------------------------
    async def ListPools(self, request: router_pb2.ListPoolsRequest, context: grpc.aio.ServicerContext):
        v = Violations()
        size = 0
        after: str | None = None
        filters = (request.model,)
        try:
            size = pagination.page_size(request.page_size)
        except ValueError as exc:
            v.add("page_size", str(exc))
        try:
            after = pagination.decode_page_token(request.page_token, filters)
        except pagination.PageTokenError as exc:
            v.add("page_token", str(exc))
        await v.abort_if_any(context)
        pools = sorted(
            (p for p in self._core.table.pools.values() if not request.model or p.model == request.model),
            key=lambda p: p.pool_id,
        )
        if after is not None:
            pools = [p for p in pools if p.pool_id > after]
        page, rest = pools[:size], pools[size:]
        now = self._core.clock.monotonic()
        return router_pb2.ListPoolsResponse(
            pools=[self._view(p, now) for p in page],
            next_page_token=pagination.encode_page_token(page[-1].pool_id, filters) if rest else "",
        )

    def _view(self, pool: PoolState, now: float) -> router_pb2.PoolView:
        limits = self._core.selector_limits
        view = router_pb2.PoolView(
            pool_id=pool.pool_id,
            model=pool.model,
            region=pool.region,
            frontends=pool.frontends,
            draining=pool.draining(),
            ready=pool.ready(pool.model, now, limits),
            load_freshness=_freshness(pool.load_at, pool.load_fresh(now, limits), now),
            kv_freshness=_freshness(pool.kv_at, pool.kv_fresh(now, limits), now),
            state_freshness=_freshness(pool.state_at, pool.state_fresh(now, limits), now),
            indexed_blocks=max((self._core.index.block_count(s) for s in pool.kv_sources), default=0),
            telemetry_streams=self._core.table.stream_counts.get(pool.pool_id, 0),
            pending_requests=pool.pending_requests,
            listed=pool.listed,
        )
        if pool.load is not None:
            ld = pool.load
            view.load.CopyFrom(
                router_pb2.PoolLoadView(
                    requests_waiting=ld.requests_waiting,
                    requests_running=ld.requests_running,
                    prefill_tokens_in_flight=ld.prefill_tokens_in_flight,
                    kv_blocks_used=ld.kv_blocks_used,
                    kv_blocks_total=ld.kv_blocks_total,
                    max_running_requests=ld.max_running_requests,
                    decode_tokens_in_flight=ld.decode_tokens_in_flight,
                )
            )
        return view


def _freshness(at: float | None, fresh: bool, now: float) -> router_pb2.SignalFreshness:
    f = router_pb2.SignalFreshness(fresh=fresh)
    if at is not None:
        f.age.CopyFrom(duration(max(0.0, now - at)))
    return f


@dataclass
class Router:
    """One global frontend, built and bound but not yet running its background tasks."""

    config: RouterConfig
    handle: ServerHandle
    core: RoutingCore
    links: ServingLinks
    ingest: TelemetryIngest
    telemetry: TelemetryServicer
    metrics: RouterMetrics
    clock: Clock
    watcher: DirectoryWatcher | None = None
    registration: FrontendRegistration | None = None
    metrics_port: int = 0
    _tasks: tuple[asyncio.Task, ...] = ()
    _discovery_channel: grpc.aio.Channel | None = None

    @property
    def port(self) -> int:
        return self.handle.port

    def start_background(self) -> None:
        """Starts the directory watch and the lease renewals (needs a running loop)."""
        if self.config.discovery:
            self._discovery_channel = aio_channel(self.config.discovery)
            self.registration = registration = FrontendRegistration(
                self._discovery_channel,
                self.clock,
                frontend_id=self.config.frontend_id,
                url=self.config.advertise,
                region=self.config.region,
                incarnation=self.config.incarnation,
            )
            self.watcher = DirectoryWatcher(
                self.core.table,
                self._discovery_channel,
                self.clock,
                on_change=self._directory_changed,
                resync_after=lambda: registration.lease_duration,
            )
            self._tasks = (
                asyncio.create_task(self.watcher.run(), name="directory-watch"),
                asyncio.create_task(self.registration.run(), name="frontend-registration"),
            )
        if self.config.metrics_listen:
            self.metrics_port = self.metrics.serve(self.config.metrics_listen)
            log.info("metrics served", listen=self.config.metrics_listen, port=self.metrics_port)

    def _directory_changed(self) -> None:
        urls = {u for p in self.core.table.pools.values() if p.listed for u in p.frontends}
        asyncio.get_running_loop().create_task(self.links.prune(urls))

    async def stop_background(self) -> None:
        """Stops renewing, unregisters (so relays stop streaming here), and closes links."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.registration is not None:
            await self.registration.unregister()
        self.telemetry.end_streams()
        if self._discovery_channel is not None:
            await self._discovery_channel.close()
        await self.links.close()
        self.metrics.close()


def _advertised(config: RouterConfig, port: int) -> RouterConfig:
    """Fills in what depends on the bound port: advertise URL, frontend id, incarnation."""
    host = config.listen.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return replace(
        config,
        advertise=config.advertise or f"http://{host}:{port}",
        frontend_id=config.frontend_id or f"globalrouter-{port}",
        incarnation=config.incarnation or new_incarnation(),
    )


def create_server(
    config: RouterConfig, *, clock: Clock | None = None, index: KvIndex | None = None
) -> Router:
    """Builds and binds a global frontend (servers are not started; see `serve` or Router.start_background)."""
    clock = clock or SystemClock()
    metrics = RouterMetrics()
    table = PoolTable()
    index = index if index is not None else KvIndex()
    selector = Selector(SelectionConfig(freshness=config.freshness))
    core = RoutingCore(table, index, selector, clock, metrics)
    links = ServingLinks(config.link_backoff_initial, config.link_backoff_max)
    ingest = TelemetryIngest(table, index, clock, metrics)
    router_servicer = RouterServicer(core, links, config)
    telemetry_servicer = TelemetryServicer(ingest, config.frontend_id)

    def register(server: grpc.aio.Server) -> Sequence[str]:
        router_pb2_grpc.add_RouterServiceServicer_to_server(router_servicer, server)
        telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(telemetry_servicer, server)
        return [
            router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name,
            telemetry_pb2.DESCRIPTOR.services_by_name["TelemetryService"].full_name,
        ]

    handle = create_grpc_server(config.listen, register)
    # The frontend id and advertised URL may depend on the bound port: fill them in now.
    final = _advertised(config, handle.port)
    telemetry_servicer.frontend_id = final.frontend_id
    router_servicer.config = final
    return Router(
        config=final,
        handle=handle,
        core=core,
        links=links,
        ingest=ingest,
        telemetry=telemetry_servicer,
        metrics=metrics,
        clock=clock,
    )


async def serve(config: RouterConfig) -> None:
    """Runs a global frontend until SIGTERM/SIGINT: NOT_SERVING → unregister → stop(grace)."""
    router = create_server(config)
    log.info(
        "global frontend starting",
        listen=config.listen,
        port=router.port,
        advertise=router.config.advertise,
        frontend_id=router.config.frontend_id,
        discovery=config.discovery,
    )
    router.start_background()
    await serve_until_signalled(router.handle, grace=config.grace, on_stop=[router.stop_background])
    log.info("global frontend stopped")


def add_parser(subparsers) -> None:
    """`globalrouter serve` flags (the one place they are parsed)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run a global frontend",
        description="Run a global frontend (RouterService + TelemetryService).",
    )
    p.add_argument("--listen", type=host_port, default="127.0.0.1:50061", help="HOST:PORT to serve on")
    p.add_argument("--discovery", type=host_port, required=True, help="discovery HOST:PORT")
    p.add_argument("--advertise", type=_url, default=None, help="URL relays dial (default http://<listen>)")
    p.add_argument(
        "--frontend-id", type=_identifier, default=None, help="id in discovery (default globalrouter-<port>)"
    )
    p.add_argument("--region", type=_identifier, default=None, help="this frontend's region")
    p.add_argument(
        "--migration-limit", type=_non_negative, default=3, help="mid-stream migrations per request"
    )
    p.add_argument("--admission-tries", type=_positive, default=4, help="pools asked per admission round")
    p.add_argument("--metrics-listen", type=host_port, default=None, help="HOST:PORT for Prometheus /metrics")
    p.add_argument("--grace", type=float, default=5.0, help="seconds in-flight calls get on SIGTERM")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_run)


def _non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return n


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return n


def _url(value: str) -> str:
    """argparse type: an http(s) URL with host and port only."""
    problem = url_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(f"{value!r} {problem}")
    return value


def _identifier(value: str) -> str:
    """argparse type: an id (non-empty, at most 128 characters, no surrounding space or control characters)."""
    v = Violations()
    check_identifier(v, "id", value)
    if v:
        raise argparse.ArgumentTypeError("; ".join(d for _f, d in v.items))
    return value


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
        metrics_listen=args.metrics_listen or "",
        grace=args.grace,
    )
    try:
        asyncio.run(serve(config))
    except RuntimeError as exc:
        log.error("cannot start", error=str(exc))
        return 1
    return 0

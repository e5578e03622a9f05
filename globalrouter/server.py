"""Assembly of one global frontend: routing core, serving links, telemetry ingest, discovery lease, one gRPC server."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import grpc

from globalrouter.aliases import AliasError, ModelResolver
from globalrouter.budgets import BudgetStore, MemoryStore, TenantBudgets
from globalrouter.config import KV_STATES, RouterConfig
from globalrouter.dispatch_live import LateBinder
from globalrouter.encoding import Encoder
from globalrouter.frontend_lease import FrontendRegistration
from globalrouter.gc_pauses import GcPauses, apply_gc_settings, freeze_alive
from globalrouter.health_probe import ProbeServer, ProbeStatus
from globalrouter.http_api.app import OpenAIFront
from globalrouter.http_api.server import HttpServer
from globalrouter.http_api.status_page import pool_states
from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import KvSummary
from globalrouter.loop_lag import sample_loop_lag
from globalrouter.loop_stalls import StallSampler
from globalrouter.metrics import RouterMetrics
from globalrouter.policy import PolicyError, PolicyFile
from globalrouter.pool_directory import DirectoryWatcher, PoolTable
from globalrouter.readiness import Readiness
from globalrouter.request_path import RequestPath
from globalrouter.routed_prefixes import RoutedPrefixes
from globalrouter.router_api import RouterServicer, generate_streams
from globalrouter.routing import RoutingCore
from globalrouter.selection import SelectionConfig, Selector
from globalrouter.serving import ServingLinks
from globalrouter.snapshot_readers import SnapshotReaders
from globalrouter.telemetry_ingest import TelemetryIngest, TelemetryServicer
from globalrouter.tenancy import TenantGate
from globalrouter.tokenizer import TokenizerError, Tokenizers
from globalrouter.v1 import router_pb2
from meshkit import discovery_endpoints
from meshkit.authz import Authorizer
from meshkit.clock import Clock, SystemClock
from meshkit.ids import new_incarnation
from meshkit.limits import add_sized_servicer
from meshkit.logs import get_logger
from meshkit.server import ServerHandle, serve_until_signalled
from meshkit.server import create_server as create_grpc_server
from meshkit.supervision import Restart, Supervisor, TaskFailure
from poolrelay.v1 import telemetry_pb2

log = get_logger(module="globalrouter.server")

GC_TICK = 1.0
"""Seconds between reports of the garbage collector's pauses (and freezes of what survived a full
collection)."""

# Pruning closes serving links no listed pool names; it is computed afresh from the table on
# every run, so a failed prune is safely run again (bounded back-off, then the process fails).
PRUNE_RESTART = Restart(initial=0.5, maximum=5.0, max_failures=5)


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
    readiness: Readiness
    gate: TenantGate
    """The tenant policy, budgets and model access both fronts apply (through the request path)."""
    watcher: DirectoryWatcher | None = None
    registration: FrontendRegistration | None = None
    metrics_port: int = 0
    http: HttpServer | None = None
    """The OpenAI-compatible HTTP front, when config.http.listen is set."""
    probe: ProbeServer | None = None
    """Health answered off the loop (config.probe), from the status the loop publishes."""
    _http_stopping: asyncio.Task | None = None
    _discovery_channel: grpc.aio.Channel | None = None
    gc_pauses: GcPauses = field(init=False)
    """Times the garbage collector's pauses; serve() turns its refreezing on from config.gc (a
    process-wide setting, left alone by frontends made in-process)."""
    """Times the cyclic garbage collector's pauses (globalrouter_gc_pause_seconds), from the start."""
    supervisor: Supervisor = field(init=False)
    """Every background task (directory watch, registration, HTTP start, pruning): one that fails
    turns health NOT_SERVING and stops the process with a non-zero status."""
    heartbeat: Supervisor = field(init=False)
    """The loop-lag sampler, which is also the probe's heartbeat: apart from `supervisor` because
    it runs until close(), through the stop (the loop still turns then, and says so)."""
    stop_requested: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    """Set to stop serving (SIGTERM/SIGINT set it too, or a failed background task)."""
    stalls: StallSampler | None = None
    """Samples the loop's stack while its heartbeat is late (config.loop_stall_sample; off by default)."""
    _prune_due: bool = False
    _health_off: asyncio.Task[None] | None = None
    _pruning: asyncio.Task | None = None

    def __post_init__(self) -> None:
        self.gc_pauses = GcPauses(lambda gen, s: self.metrics.gc_pause.labels(generation=str(gen)).observe(s))
        self.supervisor = Supervisor("globalrouter", clock=self.clock, on_failure=self._task_failed)
        self.heartbeat = Supervisor("globalrouter", clock=self.clock, on_failure=self._task_failed)
        # The telemetry index worker too: applying a snapshot that fails leaves the index's work
        # queue in an unknown state (a fresh process gets every relay's snapshot again).
        self.telemetry.supervisor = self.supervisor

    @property
    def port(self) -> int:
        return self.handle.port

    def _task_failed(self, failure: TaskFailure) -> None:
        # Health first (a frontend whose directory froze must not keep taking traffic), then the
        # ordinary stop: unregister, grace for in-flight streams, exit non-zero (serve()).
        self._health_off = asyncio.get_running_loop().create_task(self.handle.set_serving(False))
        self.stop_requested.set()

    def start_background(self) -> None:
        """Starts the directory watch, the lease renewals and the HTTP front (needs a running loop)."""
        if self.config.metrics_listen:
            # The process's TLS flags, and the gRPC listener's certificate reloader (SIGHUP too).
            # First: a refused --metrics-listen stops the start before any task runs.
            self.metrics_port = self.metrics.serve(
                self.config.metrics_listen, self.config.security, self.handle.certificates
            )
            log.info("metrics served", listen=self.config.metrics_listen, port=self.metrics_port)
        if self.probe is not None:
            self.probe.start()
        # Every task fails the process when it dies: each already retries what is expected to fail
        # (discovery unreachable, a broken watch), so what reaches the supervisor is a bug whose
        # state (the directory table, the lease) a fresh process rebuilds; an in-place restart would
        # run the same code on the same state. Pruning and the loop-lag sampler, which hold no
        # state, are restarted with bounded back-off instead.
        self.gc_pauses.install()
        self.heartbeat.spawn("gc-tick", self._gc_tick, restart=Restart())
        if self.config.gc.young_every > 0:
            self.heartbeat.spawn("gc-young", self._gc_young, restart=Restart())
        if self.config.loop_stall_sample > 0 and self.stalls is None:
            self.stalls = StallSampler(late_after=self.config.loop_stall_sample)
            self.stalls.start(lambda counts: log.info("loop stalls sampled", **counts))
        self.heartbeat.spawn(
            "loop-lag",
            lambda: sample_loop_lag(
                self.metrics.event_loop_lag.observe,
                on_tick=self._beat if self.probe is not None or self.stalls is not None else None,
            ),
            restart=Restart(),
        )
        if self.http is not None:
            self.supervisor.spawn("http-front-start", self.http.start, one_shot=True)
        if self.config.discovery:
            # One or several discovery replicas: calls and the watch move on when one fails.
            self._discovery_channel = discovery_endpoints.aio_channel(self.config.discovery)
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
                lease_duration=lambda: registration.lease_duration,
            )
            self.supervisor.spawn("directory-watch", self.watcher.run)
            self.supervisor.spawn("frontend-registration", self.registration.run)

    def _gc_frozen(self, when: str) -> None:
        frozen = freeze_alive()
        self.metrics.gc_frozen.set(frozen)
        log.info("gc frozen", when=when, objects=frozen)

    async def _gc_tick(self) -> None:
        # On the loop: the collections' pauses reported, and with the freeze what survived a full
        # collection frozen soon after (GcPauses.tick).
        while True:
            await asyncio.sleep(GC_TICK)
            frozen = self.gc_pauses.tick()
            if frozen is not None:
                self.metrics.gc_frozen.set(frozen)

    async def _gc_young(self) -> None:
        # On the loop: young collections on a timer (GcConfig.young_every), each one short.
        every = self.config.gc.young_every
        while True:
            await asyncio.sleep(every)
            self.gc_pauses.young()

    def _beat(self) -> None:
        # On the loop, every ~0.1 s: the proof it turns, with what readiness last saw (no table walk).
        if self.stalls is not None:
            self.stalls.beat()
        if self.probe is not None:
            self.probe.status.beat(
                directory_synced=self.core.table.synced, pools_without_kv=self.readiness.pools_without_kv
            )

    async def _until_ready(self) -> None:
        """serve_until_signalled's `ready`: returns when health may say SERVING, the probe with it."""
        await self.readiness.wait()
        if self.gc_pauses.refreeze:
            # The listed pools' state and their telemetry streams are in: out of later passes.
            self._gc_frozen("ready")
        if self.probe is not None:
            self.probe.status.set_serving(True)

    def _directory_changed(self) -> None:
        # One prune at a time; changes meanwhile are folded into one more pass.
        self._prune_due = True
        if self._pruning is None or self._pruning.done():
            self._pruning = self.supervisor.spawn(
                "link-prune", self._prune, one_shot=True, restart=PRUNE_RESTART
            )

    async def _prune(self) -> None:
        while self._prune_due:
            self._prune_due = False
            urls = {u for p in self.core.table.pools.values() if p.listed for u in p.frontends}
            try:
                await self.links.prune(urls)
            except BaseException:
                self._prune_due = True  # the restart prunes again
                raise

    async def run(self) -> None:
        """Starts the background tasks and serves until SIGTERM/SIGINT, `stop_requested` or a failed
        background task (then BackgroundTaskFailed, after the same graceful stop). Health says
        SERVING only once ready (`Readiness`)."""
        self.start_background()
        await serve_until_signalled(
            self.handle,
            grace=self.config.grace,
            on_stop=[self.leave],
            after_stop=[self.close],
            stop_event=self.stop_requested,
            ready=self._until_ready,
        )
        self.supervisor.raise_if_failed()
        self.heartbeat.raise_if_failed()

    async def leave(self) -> None:
        """First half of a stop, before the server's grace period: stops renewing and watching,
        unregisters (so relays stop streaming here) and ends telemetry streams, which never finish
        by themselves and must not hold the grace period in-flight Generates need."""
        if self.probe is not None:
            self.probe.status.set_stopping()  # the main port's health has just turned NOT_SERVING
        self.telemetry.stop_index_work()
        if self.http is not None:
            # The HTTP front stops taking requests now; its open streams finish during the same
            # grace period as the gRPC ones (close() waits for them before the links go).
            self._http_stopping = asyncio.create_task(self.http.stop(), name="http-front-stop")
        await self.supervisor.stop()
        if self.registration is not None:
            await self.registration.unregister()
        self.telemetry.end_streams()

    async def close(self) -> None:
        """Second half, after the server stopped: in-flight Generates are done, so the serving
        links (which they stream over) and the discovery channel can close."""
        if self._http_stopping is not None:
            await self._http_stopping
        elif self.http is not None:
            await self.http.stop()
        if self._discovery_channel is not None:
            await self._discovery_channel.close()
        await self.links.close()
        await self.gate.close()  # unused budget reservations go back to the shared counters
        self.metrics.close()
        self.gc_pauses.uninstall()
        await self.heartbeat.stop()
        if self.stalls is not None:
            self.stalls.stop()
            log.info("loop stalls sampled", **self.stalls.report())
        if self.probe is not None:
            await asyncio.to_thread(self.probe.stop)  # joins its threads: not on the loop


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
    if index is None:
        if config.kv_state not in KV_STATES:
            raise ValueError(f"kv_state must be one of {KV_STATES}, got {config.kv_state!r}")
        # The summary answers the index's calls (and the ingest's build/commit ones; see TelemetryIngest).
        index = cast(KvIndex, KvSummary()) if config.kv_state == "summary" else KvIndex()
    selector = Selector(
        SelectionConfig.for_ranking(config.ranking, freshness=config.freshness, wait_slo=config.wait_slo)
    )
    metrics.wait_slo_price.set_function(lambda: selector.wait_excess_weight)
    core = RoutingCore(table, index, selector, clock, metrics)
    if config.routed_prefix_ttl > 0:
        routed = core.routed = RoutedPrefixes(config.routed_prefix_ttl)
        metrics.routed_prefix_blocks.set_function(lambda: routed.blocks)  # read at scrape time
    try:
        core.resolver = ModelResolver.from_file(config.aliases)
    except AliasError as exc:
        raise RuntimeError(str(exc)) from exc
    links = ServingLinks(config.link_backoff_initial, config.link_backoff_max, config.openai_link)
    ingest = TelemetryIngest(
        table,
        index,
        clock,
        metrics,
        max_snapshot_blocks=config.max_snapshot_blocks,
        max_snapshot_blocks_per_relay=config.max_snapshot_blocks_per_relay,
        max_snapshot_blocks_total=config.max_snapshot_blocks_total,
        step_blocks=config.snapshot_step_blocks,
    )
    metrics.snapshot_blocks_held.set_function(lambda: ingest.snapshot_blocks_held)
    # The lease grace: a pool whose lease lapsed stays routable while its telemetry is live here.
    table.telemetry_heard = ingest.last_heard
    table.telemetry_interval = ingest.report_interval
    table.on_grace = lambda outcome: metrics.lease_grace.labels(outcome).inc()
    metrics.pools_in_lease_grace.set_function(lambda: len(table.lease_grace))
    metrics.pools_by_state(lambda: pool_states(core))
    metrics.pool_kv_ages(core.kv_ages)
    authorizer = Authorizer(config.security, service="globalrouter", registry=metrics.registry)
    try:
        tokenizers = Tokenizers.load(config.tokenizers)
    except TokenizerError as exc:
        raise RuntimeError(str(exc)) from exc
    # One limit of concurrent generations per identity, over gRPC Generate and the HTTP front.
    streams = generate_streams(config, enforced=authorizer.enforced)
    gate = tenant_gate(config, clock, metrics)
    # One request path (tenant gate, decide, run, migrate, count) and one prompt encoder for both
    # fronts. Without --policy nobody is limited: the path skips the gate.
    binder = LateBinder(core, config.dispatch) if config.dispatch is not None else None
    path = RequestPath.of(core, links, config, gate=gate if config.policy else None, binder=binder)
    encoder = Encoder(config.tokenizer_threads, config.tokenizer_queue)
    router_servicer = RouterServicer(
        core, links, config, tokenizers, authorizer=authorizer, streams=streams, path=path, encoder=encoder
    )
    telemetry_servicer = TelemetryServicer(
        ingest,
        config.frontend_id,
        authorizer=authorizer,
        max_streams=config.max_telemetry_streams,
        snapshot_readers=SnapshotReaders(config.snapshot_readers),
        batch_interval=config.telemetry_batch_interval,
    )

    def snapshot_readers() -> tuple[int, int, int]:
        readers = telemetry_servicer.snapshot_readers
        return readers.reading, readers.waiting, readers.idled

    metrics.snapshot_readers(snapshot_readers)

    def register(server: grpc.aio.Server) -> Sequence[str]:
        # Each request measured as received: ByteSize() of a 16k-token prompt costs more than its decoding.
        add_sized_servicer(server, router_servicer, router_pb2.DESCRIPTOR.services_by_name["RouterService"])
        telemetry_servicer.add_to_server(server)  # each message measured as received
        return [
            router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name,
            telemetry_pb2.DESCRIPTOR.services_by_name["TelemetryService"].full_name,
        ]

    handle = create_grpc_server(config.listen, register, security=config.security, authorizer=authorizer)
    if config.aliases:
        handle.reload_hooks.append(("aliases", core.resolver.reload))
    if config.policy:
        handle.reload_hooks.append(("policy", gate.reload))
    # The frontend id and advertised URL may depend on the bound port: fill them in now.
    final = _advertised(config, handle.port)
    telemetry_servicer.frontend_id = final.frontend_id
    router_servicer.config = final
    http = None
    if final.http.listen:
        front = OpenAIFront(
            core,
            path,
            tokenizers,
            final.http,
            encoder=encoder,
            frontend_id=final.frontend_id,
            authorizer=authorizer,
            streams=streams,
            max_prompt_tokens=final.max_prompt_tokens,
            max_output_tokens=final.max_output_tokens,
        )
        http = HttpServer(
            front,
            final.http.listen,
            grace=final.grace,
            security=final.security,
            certificates=handle.certificates,  # one reloader (and SIGHUP) for both listeners
        )
    readiness = Readiness(
        table, clock, directory=bool(final.discovery), timeout=final.ready_timeout, registry=metrics.registry
    )
    probe = None
    if final.probe.enabled:
        # Bound now, so that a taken port stops the start; the loop's clock is the probe's (a fake
        # one in tests), its monotonic time read from both threads.
        probe = ProbeServer(
            ProbeStatus(
                clock.monotonic, live_within=final.probe.live_within, ready_within=final.probe.ready_within
            ),
            grpc_listen=final.probe.listen,
            http_listen=final.probe.http_listen,
            ready_names=tuple(handle.service_names),
        )
    if http is not None:
        http.front.readiness = readiness
    # Until ready the frontend serves only health (the probe port answers off the loop) and its
    # readiness waits on the snapshots' builds: they get more of the loop meanwhile.
    telemetry_servicer.builds_first = lambda: not readiness.ready
    return Router(
        config=final,
        handle=handle,
        core=core,
        links=links,
        ingest=ingest,
        telemetry=telemetry_servicer,
        metrics=metrics,
        clock=clock,
        readiness=readiness,
        gate=gate,
        http=http,
        probe=probe,
    )


def tenant_gate(config: RouterConfig, clock: Clock, metrics: RouterMetrics) -> TenantGate:
    """The policy file (--policy) and the budget counters: in etcd when --budget-etcd-endpoints
    names one (shared by the fleet), else in this process."""
    try:
        policy = PolicyFile(config.policy or None)
    except PolicyError as exc:
        raise RuntimeError(str(exc)) from exc
    store: BudgetStore
    if config.budget_etcd:
        from globalrouter.budget_etcd import EtcdBudgetStore  # aetcd only where etcd is used

        store = EtcdBudgetStore(config.budget_etcd, clock)
    else:
        store = MemoryStore(clock)
    if config.policy:
        log.info(
            "tenant policy",
            path=config.policy,
            identities=len(policy.current.entries),
            budget_store="etcd" if config.budget_etcd else "memory",
        )
    return TenantGate(policy, TenantBudgets(store, policy.current.budget, clock), metrics)


async def serve(config: RouterConfig) -> None:
    """Runs a global frontend until SIGTERM/SIGINT: NOT_SERVING → unregister → stop(grace), which
    lets in-flight Generate streams finish → close the serving links. Raises BackgroundTaskFailed
    (after the same stop) when a background task failed."""
    router = create_server(config)
    apply_gc_settings(config.gc.threshold, config.gc.threshold1)
    if config.gc.freeze:
        router._gc_frozen("start")
        router.gc_pauses.refreeze = True
        router.gc_pauses.full_every = config.gc.full_every
    log.info(
        "global frontend starting",
        listen=config.listen,
        port=router.port,
        advertise=router.config.advertise,
        frontend_id=router.config.frontend_id,
        discovery=config.discovery,
        http_port=router.http.port if router.http else None,
        probe_port=router.probe.grpc_port or None if router.probe else None,
        probe_http_port=router.probe.http_port or None if router.probe else None,
    )
    await router.run()
    log.info("global frontend stopped")

"""The relay: reads the pool, registers it with discovery on the heartbeat, streams telemetry, carries drain."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from meshkit import discovery_endpoints, tracing
from meshkit.clock import Clock, SystemClock
from meshkit.logs import get_logger
from meshkit.supervision import Supervisor, TaskFailure
from meshkit.timeconv import seconds, timestamp, wall_seconds
from meshkit.tracing import TracingConfig
from meshkit.validation import Violations, check_frontends, check_identifier, check_url, host_port_problem
from poolrelay.engine.config import EngineConfig
from poolrelay.engine.source import EngineSource
from poolrelay.heartbeat import HeartbeatLoop, Renewal
from poolrelay.lease_stream import KeepAliveClient
from poolrelay.model_choice import Choice, ModelView, Reason, choose_model
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.pool_source import PoolSource
from poolrelay.retry import describe_error
from poolrelay.telemetry_publisher import TelemetryConfig, TelemetryHub
from poolrelay.v1 import pool_events_pb2 as pe

log = get_logger(module="poolrelay.relay")

CALL_TIMEOUT_S = 3.0
# A renewal over the stream whose reply takes longer than min(heartbeat interval, this) failed.
RENEWAL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RelayConfig:
    """Everything `poolrelay serve` is told on its command line."""

    pool: str
    """HOST:PORT of the pool's event API (PoolEventsService)."""
    discovery: str
    """HOST:PORT (or URL) of globaldiscovery; several, comma-separated, for replicas on a shared store."""
    pool_id: str
    """The routing pool id registered with discovery."""
    region: str
    """The pool's region."""
    frontends: tuple[str, ...]
    """The pool's frontends (http/https URLs) registered with discovery."""
    relay_id: str
    """This relay replica's id."""
    incarnation: int
    """This relay process's incarnation; a restart uses a higher one."""
    global_frontends: tuple[str, ...] = ()
    """Global frontends to stream telemetry to in addition to those discovery lists."""
    report_interval: float = 1.0
    """Seconds between periodic telemetry reports."""
    engine: EngineConfig | None = None
    """An engine pool (vLLM, SGLang) read over ZMQ and HTTP instead of the pool event API at `pool`."""
    unregister_on_exit: bool = False
    """Unregister at a graceful stop, so the pool leaves at once; by default (PR #18077) the relay
    only stops renewing and the pool leaves one lease later, so a relay restart keeps it routed."""
    metrics_listen: str = ""
    tracing: TracingConfig = field(default_factory=TracingConfig)
    """OpenTelemetry export (--otlp-endpoint; empty: off): registration and telemetry stream spans."""
    """HOST:PORT of the Prometheus /metrics endpoint (--metrics-listen); empty: none."""

    def __post_init__(self) -> None:
        # The same checks as the command line, so a relay built in code cannot register garbage.
        problems = self.violations()
        if problems:
            raise RelayConfigError(problems)

    def violations(self) -> Violations:
        """Every field that is wrong, named by its config field."""
        v = Violations()
        check_identifier(v, "pool_id", self.pool_id)
        check_identifier(v, "region", self.region or "")
        # Engines' frontends speak OpenAI HTTP and may carry a base path; the mesh's own are gRPC.
        check_frontends(
            v, "frontends", list(self.frontends), required=False, allow_path=self.engine is not None
        )
        check_identifier(v, "relay_id", self.relay_id)
        if self.incarnation <= 0:
            v.add("incarnation", f"must be > 0 (got {self.incarnation})")
        if self.engine is None and not self.pool:
            v.add("pool", "must name the pool's event API (HOST:PORT) when no engine is set")
        for i, url in enumerate(self.global_frontends):
            check_url(v, f"global_frontends[{i}]", url, allow_path=False)
        if not self.report_interval > 0:
            v.add("report_interval", f"must be > 0 seconds (got {self.report_interval})")
        problem = host_port_problem(self.metrics_listen) if self.metrics_listen else None
        if problem:
            v.add("metrics_listen", problem)
        return v


class RelayConfigError(ValueError):
    """A RelayConfig with fields that are wrong; `violations` names each one."""

    def __init__(self, violations: Violations) -> None:
        super().__init__("invalid relay config: " + "; ".join(f"{f}: {d}" for f, d in violations.items))
        self.violations = violations


@dataclass(frozen=True)
class Wanted:
    """What the next RegisterPool call says (compared to decide whether to send at once)."""

    model: str
    draining: bool
    drain_deadline: float | None
    capacity: tuple[int, int, int]


class Relay:
    """One relay replica for one pool."""

    def __init__(self, config: RelayConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.blocks = PoolBlocks()
        self.hub = TelemetryHub(
            TelemetryConfig(
                pool_id=config.pool_id,
                relay_id=config.relay_id,
                incarnation=config.incarnation,
                region=config.region,
                report_interval=config.report_interval,
            ),
            self.blocks,
            self.clock,
        )
        self.source: PoolSource | EngineSource = (
            EngineSource(
                config.engine,
                self.blocks,
                clock=self.clock,
                on_status=self._on_status,
                on_reachable=self._on_reachable,
                on_blocks=self.hub.blocks_changed,
            )
            if config.engine is not None
            else PoolSource(
                config.pool,
                self.blocks,
                on_status=self._on_status,
                on_reachable=self._on_reachable,
                on_blocks=self.hub.blocks_changed,
            )
        )
        # One or several discovery replicas: calls move to another replica when one fails.
        self._discovery_channel = discovery_endpoints.aio_channel(config.discovery)
        self._discovery = dpb_grpc.DiscoveryServiceStub(self._discovery_channel)
        # Every registration, the first included, goes over one KeepAlivePools stream (unary
        # RegisterPool only when discovery does not implement the stream).
        self.keepalive = KeepAliveClient(self._discovery, unary_timeout=CALL_TIMEOUT_S)
        self.heartbeat: HeartbeatLoop[Wanted] = HeartbeatLoop(
            self.clock, self._wanted, self._register, on_failure=self._register_failed
        )
        self.status: pe.WatchPoolStatusResponse | None = None
        self.reachable = True  # until the first dial fails: "not read yet" says NO_MODEL
        self.choice = Choice(None, Reason.NO_MODEL, "the pool's status has not been read yet")
        self._sticky_model: str | None = None
        self.registered_model = ""
        self.lease_expire_wall: float | None = None
        self.call_error = ""
        self.stopped = False
        self.unregistered_at_stop = False
        self._logged_choice: tuple[Reason, str] | None = None
        self.drain_requested_deadline: float | None = None
        self._drain_passed = False
        self._drained_unregistered = False
        self._runners: list[asyncio.Task[None]] = []
        # Every background task fails the relay when it dies: each already retries what is expected
        # to fail (the pool, discovery, a frontend unreachable), so what reaches the supervisor is
        # a bug; a new process (new incarnation, state read afresh from the pool) is the clean
        # recovery, and the pool stays routed meanwhile as on any relay restart (PR #18077).
        self.supervisor = Supervisor("poolrelay", clock=self.clock, on_failure=self._task_failed)
        self.hub.supervisor = self.supervisor
        self.stop_requested = asyncio.Event()
        """Set when the relay must stop (a failed background task); `poolrelay serve` stops on it."""

    # --- pool side ----------------------------------------------------------------------------

    def _on_status(self, status: pe.WatchPoolStatusResponse) -> None:
        self.status = status
        self.hub.set_status(status, self.clock.wall())
        if status.drain.state == pe.DRAIN_STATE_DRAINED and not self._drained_unregistered:
            self._drained_unregistered = True
            self._spawn(self._unregister(dpb.REMOVAL_REASON_DRAINED))
        self.heartbeat.poke()

    def _on_reachable(self, reachable: bool) -> None:
        self.reachable = reachable
        if not reachable:
            self.hub.forget_load()
        self.heartbeat.poke()

    @property
    def draining(self) -> bool:
        """Whether the pool drains (its own drain, or one passed on from discovery)."""
        pool_side = self.status is not None and self.status.drain.state in (
            pe.DRAIN_STATE_DRAINING,
            pe.DRAIN_STATE_DRAINED,
        )
        return pool_side or self.drain_requested_deadline is not None

    # --- registration -------------------------------------------------------------------------

    def _wanted(self) -> Wanted | None:
        if self.stopped:
            return None
        st = self.status
        models = (
            None if st is None else [ModelView(m.model, m.state == pe.MODEL_STATE_READY) for m in st.models]
        )
        drained = st is not None and st.drain.state == pe.DRAIN_STATE_DRAINED
        self.choice = choose_model(models, self._sticky_model, reachable=self.reachable, drained=drained)
        self._log_choice()
        if self.choice.model is None:
            self.registered_model = ""
            self.lease_expire_wall = None
            return None
        self._sticky_model = self.choice.model
        assert st is not None
        draining = st.drain.state == pe.DRAIN_STATE_DRAINING
        deadline = wall_seconds(st.drain.deadline) if draining and st.drain.HasField("deadline") else None
        capacity = (st.load.max_running_requests, st.load.kv_blocks_total, st.prefill_tokens_per_second)
        return Wanted(self.choice.model, draining, deadline, capacity)

    def _log_choice(self) -> None:
        """Logs why nothing is registered (no model, several, ...) once per change, not per poke."""
        if self.status is None and self.reachable:
            return  # not read yet: nothing worth a warning
        said = (self.choice.reason, self.choice.detail)
        if said == self._logged_choice:
            return
        self._logged_choice = said
        if self.choice.model is None:
            log.warning(
                "registering nothing",
                pool=self.config.pool_id,
                reason=self.choice.reason.name,
                detail=self.choice.detail,
            )
        else:
            log.info("a model to register", pool=self.config.pool_id, model=self.choice.model)

    def _request(self, want: Wanted) -> dpb.RegisterPoolRequest:
        c = self.config
        req = dpb.RegisterPoolRequest(
            pool_id=c.pool_id,
            model=want.model,
            region=c.region,
            frontends=list(c.frontends),
            relay_id=c.relay_id,
            incarnation=c.incarnation,
            capacity=dpb.PoolCapacity(
                max_running_requests=want.capacity[0],
                kv_cache_blocks=want.capacity[1],
                prefill_tokens_per_second=want.capacity[2],
            ),
            draining=want.draining,
            frontend_protocol=(
                dpb.FRONTEND_PROTOCOL_OPENAI_HTTP if c.engine is not None else dpb.FRONTEND_PROTOCOL_MESH_GRPC
            ),
        )
        if want.drain_deadline is not None:
            req.drain_deadline.CopyFrom(timestamp(want.drain_deadline))
        return req

    async def _register(self, want: Wanted) -> Renewal:
        timeout = min(self.heartbeat.schedule.interval, RENEWAL_TIMEOUT_S)
        span = None
        if tracing.enabled():
            span = tracing.start_span(
                "poolrelay.register",
                attributes={
                    "pool.id": self.config.pool_id,
                    "relay.id": self.config.relay_id,
                    "pool.model": want.model,
                    "registration.first": self.lease_expire_wall is None,
                },
            )
        try:
            reply = await self.keepalive.register(self._request(want), timeout)
        except BaseException as exc:
            tracing.end_span(span, exc)
            raise
        if span is not None:
            tracing.end_span(span, **{"lease.duration_s": seconds(reply.lease_duration)})
        if self.registered_model != want.model:
            log.info("registered", pool=self.config.pool_id, model=want.model)
        self.registered_model = want.model
        self.lease_expire_wall = wall_seconds(reply.lease_expire_time)
        self.call_error = ""
        self.hub.set_model(want.model)
        self.hub.set_frontends(dynamic=[f.url for f in reply.frontends])
        if reply.drain_requested and not self._drain_passed:
            deadline = wall_seconds(reply.drain_deadline) if reply.HasField("drain_deadline") else None
            self._spawn(self._pass_drain(deadline))
        return Renewal(seconds(reply.heartbeat_interval), seconds(reply.lease_duration))

    def _register_failed(self, want: Wanted, exc: BaseException) -> None:
        self.call_error = describe_error(exc)
        log.warning("RegisterPool failed; retrying", pool=self.config.pool_id, error=self.call_error)

    async def _pass_drain(self, deadline: float | None) -> None:
        """Passes a discovery-side drain on to the pool (StartDrain), once; retried on the next reply."""
        self._drain_passed = True
        timeout = (deadline - self.clock.wall()) if deadline is not None else 60.0
        try:
            reply = await self.source.start_drain(timeout, "discovery")
        except grpc.RpcError as exc:
            self._drain_passed = False
            log.warning("StartDrain failed", error=describe_error(exc))
            return
        self.drain_requested_deadline = deadline
        self.hub.set_drain(reply.drain)
        log.info("drain passed on to the pool", deadline=deadline)

    async def _unregister(self, reason: int) -> None:
        req = dpb.UnregisterPoolRequest(
            pool_id=self.config.pool_id,
            relay_id=self.config.relay_id,
            incarnation=self.config.incarnation,
            reason=reason,  # type: ignore[arg-type]  # a proto enum field takes its number
        )
        try:
            await self._discovery.UnregisterPool(req, timeout=CALL_TIMEOUT_S)
            log.info("unregistered", pool=self.config.pool_id, reason=dpb.RemovalReason.Name(reason))
        except grpc.RpcError as exc:
            log.warning("UnregisterPool failed", error=describe_error(exc))

    # --- status -------------------------------------------------------------------------------

    @property
    def unregistered(self) -> tuple[Reason, str]:
        """Why the pool is not registered now (NONE while it is), with a sentence."""
        if self.stopped:
            if self.unregistered_at_stop:
                return Reason.RELAY_STOPPED, "the relay stopped and unregistered the pool"
            return Reason.RELAY_STOPPED, "the relay stopped renewing; the pool leaves when its lease ends"
        if self.choice.model is None:
            return self.choice.reason, self.choice.detail
        if self.call_error:
            return Reason.CALL_FAILED, f"RegisterPool failed: {self.call_error}"
        if not self.registered_model:
            return Reason.NO_MODEL, "the first RegisterPool call has not returned yet"
        return Reason.NONE, ""

    @property
    def heartbeat_stopped(self) -> bool:
        """Whether the registration heartbeat has ended (after stop(): no renewal goes out)."""
        return self.stopped and all(t.done() for t in self._runners)

    # --- life cycle ---------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        self.supervisor.spawn(getattr(coro, "__name__", "relay job"), lambda: coro, one_shot=True)

    def _task_failed(self, failure: TaskFailure) -> None:
        self.stop_requested.set()

    async def start(self) -> None:
        """Starts reading the pool, the heartbeat and the telemetry streams."""
        self.hub.set_frontends(static=list(self.config.global_frontends))
        self._runners = [
            self.supervisor.spawn("pool source", self.source.run),
            self.supervisor.spawn("heartbeat", self.heartbeat.run),
            self.supervisor.spawn("discovery channel", self._follow_discovery_channel),
            self.supervisor.spawn("telemetry reports", self.hub.run_periodic),
        ]

    async def _follow_discovery_channel(self) -> None:
        """Tells the heartbeat when the channel to discovery connects again, so that after an
        outage the pool registers as soon as discovery answers, not at the end of the failed
        renewal's doubled wait (HeartbeatSchedule.on_reachable, up to a heartbeat interval later).
        During a failure streak the channel is also kept trying to connect (an idle one would not)."""
        channel = self._discovery_channel
        state = channel.get_state(try_to_connect=False)
        while True:
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=self.heartbeat.schedule.failures > 0)
            if state == grpc.ChannelConnectivity.READY:
                self.heartbeat.reachable()

    async def stop(self) -> None:
        """Graceful stop: stop renewing and close every stream (PR #18077: the pool leaves one lease
        later, so a relay restart does not pull it out of routing); with `unregister_on_exit` the
        pool is unregistered and leaves at once."""
        self.stopped = True
        for t in self._runners:
            t.cancel()
        for t in self._runners:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.config.unregister_on_exit and not self._drained_unregistered:
            self.unregistered_at_stop = True
            await self._unregister(dpb.REMOVAL_REASON_UNREGISTERED)
        else:
            log.info(
                "stopped renewing; the pool leaves when its lease ends",
                pool=self.config.pool_id,
                lease_expires=self.lease_expire_wall,
            )
        self.registered_model = ""
        self.lease_expire_wall = None
        await self.hub.close()
        await self.supervisor.stop()
        await self.keepalive.close()
        await self._discovery_channel.close()

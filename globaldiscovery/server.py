"""DiscoveryService over gRPC: validates each request, calls the store, maps results and errors to messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from google.rpc import status_pb2
from grpc_status import rpc_status

from globaldiscovery import convert, request_checks
from globaldiscovery.config import DiscoveryConfig
from globaldiscovery.lease_rules import DrainCompleted, ModelConflict, NotFound, StaleIncarnation
from globaldiscovery.records import PoolRegistration
from globaldiscovery.store import MemoryStore, Store, StoreIsolated, StoreUnavailable
from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from globaldiscovery.watch_fanout import WatcherClosed
from meshkit import pagination, timeconv
from meshkit.authz import Authorizer
from meshkit.clock import Clock, SystemClock
from meshkit.errors import Reason, abort_with_reason, rpc_status_for
from meshkit.limits import (
    ByteBoundedCache,
    LimitExceeded,
    Oversized,
    Slots,
    add_sized_servicer,
    check_size,
    fitting,
    too_large,
)
from meshkit.logs import get_logger
from meshkit.server import ServerHandle, create_server, serve_until_signalled
from meshkit.wire import varint_field

log = get_logger(module="globaldiscovery.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DiscoveryService"].full_name

# Store refusals → the contract's gRPC code (discovery.proto) and the ErrorInfo reason callers act on.
_REFUSALS: dict[type[Exception], tuple[grpc.StatusCode, Reason]] = {
    StaleIncarnation: (grpc.StatusCode.PERMISSION_DENIED, Reason.STALE_INCARNATION),
    ModelConflict: (grpc.StatusCode.FAILED_PRECONDITION, Reason.MODEL_CONFLICT),
    DrainCompleted: (grpc.StatusCode.FAILED_PRECONDITION, Reason.DRAIN_COMPLETED),
    NotFound: (grpc.StatusCode.NOT_FOUND, Reason.POOL_NOT_FOUND),
    StoreUnavailable: (grpc.StatusCode.UNAVAILABLE, Reason.STORE_UNAVAILABLE),
    StoreIsolated: (grpc.StatusCode.UNAVAILABLE, Reason.STORE_UNAVAILABLE),
}
_DIRECTORY_ERRORS = tuple(_REFUSALS)
_SHUTTING_DOWN = "discovery is shutting down; call another replica"
_ISOLATED = "this discovery replica lost etcd; its directory is frozen: call another replica"

T = TypeVar("T")
V = TypeVar("V")
M = TypeVar("M")


def _metadata(exc: Exception) -> dict[str, str]:
    """ErrorInfo metadata: the ids a caller needs to act on the refusal without parsing text."""
    if isinstance(exc, StaleIncarnation):
        return {"held_incarnation": str(exc.held), "offered_incarnation": str(exc.offered)}
    if isinstance(exc, ModelConflict):
        h = exc.holder
        return {"pool_id": h.pool_id, "holder_relay_id": h.relay_id, "model": h.model, "region": h.region}
    if isinstance(exc, DrainCompleted):
        r = exc.registration
        return {"pool_id": r.pool_id, "relay_id": r.relay_id, "incarnation": str(r.incarnation)}
    if isinstance(exc, NotFound):
        return {"pool_id": exc.pool_id}
    return {}


def _error_status(exc: Exception) -> status_pb2.Status:
    """The google.rpc.Status (code, message, ErrorInfo) of a store refusal."""
    code, reason = _REFUSALS[type(exc)]
    return rpc_status_for(code, reason, str(exc), _metadata(exc))


async def _answered(call: Awaitable[T], context: grpc.aio.ServicerContext) -> T:
    """The result of a store call; a refusal aborts the RPC with the contract's code and reason."""
    try:
        return await call
    except _DIRECTORY_ERRORS as exc:
        await context.abort_with_status(rpc_status.to_status(_error_status(exc)))
        raise  # not reached: abort raises


class Refused(Exception):
    """A registration that is refused, with the google.rpc.Status the caller gets (unary or stream)."""

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self.status = status


# Renewals are mostly byte-for-byte repeats of the last registration; remembering already-validated
# requests lets a repeat skip validation and conversion. Bounded by bytes, not count: one entry
# may carry 64 frontend URLs. The request, its conversion and the dict overhead are ~4x its wire size.
_REMEMBERED_BYTES = 64 * 1024 * 1024
_KEEPALIVE_METHOD = "/globaldiscovery.v1.DiscoveryService/KeepAlivePools"
_SEQUENCE_FIELD = pb.KeepAlivePoolsRequest.DESCRIPTOR.fields_by_name["sequence"].number


def _remembered_size(key: tuple[str, str], value: tuple[pb.RegisterPoolRequest, PoolRegistration]) -> int:
    return 4 * value[0].ByteSize() + 256


class DiscoveryServicer(pb_grpc.DiscoveryServiceServicer):
    """The gRPC face of a Store."""

    def __init__(
        self, store: Store, authorizer: Authorizer | None = None, *, max_watchers: int = 1024
    ) -> None:
        self.store = store
        self.authorizer = authorizer
        self._watchers = Slots("pool watches", per_key=max_watchers, total=max_watchers)
        self._validated: ByteBoundedCache[
            tuple[str, str], tuple[pb.RegisterPoolRequest, PoolRegistration]
        ] = ByteBoundedCache(_REMEMBERED_BYTES, _remembered_size)
        self._frontends: tuple[object, list[pb.Frontend]] = (None, [])
        self._idle_streams: set[asyncio.Task] = set()
        self._closing = False
        self._isolated = False  # the store lost what it shares: streams end, callers move on
        self.sized_on_receipt = False
        """Each request was measured as received (add_to_server): only an Oversized is refused
        here. False (registered otherwise, e.g. by discovery_pb2_grpc): each renewal is measured
        with ByteSize()."""
        store.on_health(self._store_health)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers DiscoveryService on `server` with every request measured by the bytes received
        (meshkit.limits.add_sized_servicer): a renewal is not measured again with ByteSize() (a
        walk of the message, about 2,000 a second at 1,000 pools x 2 relays), and one over the
        cap is not decoded."""
        add_sized_servicer(server, self, pb.DESCRIPTOR.services_by_name["DiscoveryService"])
        self.sized_on_receipt = True

    def _store_health(self, serving: bool) -> None:
        """The store stopped serving (or serves again): a keep-alive stream would otherwise stay on
        this replica, each renewal refused, so every idle stream ends with UNAVAILABLE and the
        relay's next renewal opens a stream on another replica (a busy one ends after its reply)."""
        self._isolated = not serving
        if self._isolated:
            for task in list(self._idle_streams):
                task.cancel()

    def _registration(self, request: pb.RegisterPoolRequest) -> PoolRegistration:
        key = (request.pool_id, request.relay_id)
        known = self._validated.get(key)
        if known is not None and known[0] == request:
            return known[1]
        violations = request_checks.register_pool(request)
        if violations:
            raise Refused(violations.to_rpc_status())
        registration = convert.registration(request)
        self._validated.put(key, (request, registration))
        return registration

    async def _frontend_list(self) -> list[pb.Frontend]:
        """The live frontends as messages, rebuilt only when the frontend table changed."""
        version = self.store.frontends_version()
        if self._frontends[0] != version or version is None:
            frontends, _ = await self.store.list_frontends()
            self._frontends = (version, [convert.frontend(f) for f in frontends])
        return self._frontends[1]

    async def _register(self, request: pb.RegisterPoolRequest) -> pb.RegisterPoolResponse:
        """One registration or renewal: the single code path of RegisterPool and KeepAlivePools.

        Raises Refused with the status the caller gets when the request is invalid or the
        directory refuses it.
        """
        registration = self._registration(request)
        try:
            result = await self.store.register_pool(registration)
        except _DIRECTORY_ERRORS as exc:
            log.info("register refused", pool_id=request.pool_id, relay_id=request.relay_id, reason=str(exc))
            raise Refused(_error_status(exc)) from exc
        reply = pb.RegisterPoolResponse(
            heartbeat_interval=timeconv.duration(self.store.heartbeat_interval),
            lease_duration=timeconv.duration(self.store.lease_duration),
            lease_expire_time=timeconv.timestamp(result.lease_expire_wall),
            frontends=await self._frontend_list(),
            drain_requested=result.drain_requested,
            pool=convert.pool(result.pool),
        )
        if result.drain_deadline_wall is not None:
            reply.drain_deadline.CopyFrom(timeconv.clamped_timestamp(result.drain_deadline_wall))
        return reply

    async def RegisterPool(self, request: pb.RegisterPoolRequest, context: grpc.aio.ServicerContext):
        try:
            return await self._register(request)
        except Refused as refused:
            await context.abort_with_status(rpc_status.to_status(refused.status))

    async def _keepalive_reply(
        self, request: pb.KeepAlivePoolsRequest | Oversized
    ) -> pb.KeepAlivePoolsResponse:
        try:
            # Each renewal on the stream must fit the cap and name the caller's own pool and relay
            # id. Registered by add_to_server it was measured as received: one over the cap was not
            # decoded (an Oversized), its sequence is read from its bytes for the reply.
            if isinstance(request, Oversized):
                sequence = varint_field(request.data, _SEQUENCE_FIELD)
                raise Refused(too_large(_KEEPALIVE_METHOD, request.size).rpc_status())
            sequence = request.sequence
            if not self.sized_on_receipt:
                try:
                    check_size(_KEEPALIVE_METHOD, request)
                except LimitExceeded as exc:
                    raise Refused(exc.rpc_status()) from exc
            refusal = self.authorizer.check_message(_KEEPALIVE_METHOD, request) if self.authorizer else None
            if refusal is not None:
                raise Refused(refusal.rpc_status())
            reply = await self._register(request.register)
        except Refused as refused:
            s = refused.status
            # `error` is deprecated but still filled, for clients that read only it.
            error = pb.KeepAliveError(code=s.code, message=s.message, details=s.details)
            return pb.KeepAlivePoolsResponse(sequence=sequence, error=error, status=s)
        return pb.KeepAlivePoolsResponse(sequence=sequence, register=reply)

    async def KeepAlivePools(  # type: ignore[override]  # writes with context.write instead of yielding
        self, request_iterator: AsyncIterator[pb.KeepAlivePoolsRequest], context: grpc.aio.ServicerContext
    ) -> None:
        # One request at a time, answered before the next is read: replies keep request order and
        # renewals of one lease never race; the client pipelines by sending ahead.
        task = asyncio.current_task()
        assert task is not None
        try:
            while not self._closing and not self._isolated:
                # Only a stream waiting for its next request is cancelled by close_streams(); a
                # busy one sees _closing once its current reply is written.
                self._idle_streams.add(task)
                try:
                    request = await context.read()
                finally:
                    self._idle_streams.discard(task)
                if request is grpc.aio.EOF:
                    return
                await context.write(await self._keepalive_reply(request))
        except asyncio.CancelledError:
            if not self._closing and not self._isolated:
                raise
            task.uncancel()
        if self._closing:
            await abort_with_reason(
                context, grpc.StatusCode.UNAVAILABLE, Reason.SHUTTING_DOWN, _SHUTTING_DOWN
            )
        await abort_with_reason(context, grpc.StatusCode.UNAVAILABLE, Reason.STORE_UNAVAILABLE, _ISOLATED)

    async def close_streams(self) -> None:
        """Ends every KeepAlivePools stream with UNAVAILABLE (a stop hook: streams never end by
        themselves, so they would otherwise hold the server's grace period)."""
        self._closing = True
        for task in list(self._idle_streams):
            task.cancel()

    async def UnregisterPool(self, request: pb.UnregisterPoolRequest, context: grpc.aio.ServicerContext):
        await request_checks.unregister_pool(request).abort_if_any(context)
        removed = await _answered(
            self.store.unregister_pool(
                request.pool_id, request.relay_id, request.incarnation, convert.removal(request.reason)
            ),
            context,
        )
        log.info("unregistered", pool_id=request.pool_id, relay_id=request.relay_id, pool_removed=removed)
        return pb.UnregisterPoolResponse(pool_removed=removed)

    async def ListPools(self, request: pb.ListPoolsRequest, context: grpc.aio.ServicerContext):
        violations, page = request_checks.list_pools(request)
        await violations.abort_if_any(context)
        pools, more, complete = await _answered(
            self.store.list_pools(
                model=request.model, region=request.region, after=page.after, limit=page.size
            ),
            context,
        )
        items = _each_converted(pools, convert.pool)
        # A page of pools with many long frontend URLs could outgrow the message limit: cut it by bytes.
        kept = fitting(items)
        if kept < len(items):
            items = items[:kept]
            token = pagination.next_token(items, True, lambda p: p.pool_id, page.filters)
        else:
            token = pagination.next_token(pools, more, lambda p: p.pool_id, page.filters)
        return pb.ListPoolsResponse(pools=items, next_page_token=token, complete=complete)

    async def WatchPools(
        self, request: pb.WatchPoolsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchPoolsResponse]:
        await request_checks.filters(request).abort_if_any(context)
        try:
            self._watchers.acquire("all")
        except LimitExceeded as exc:
            await context.abort_with_status(exc.status())
        try:
            async for event in self._watch(request, context):
                yield event
        finally:
            self._watchers.release("all")

    async def _watch(
        self, request: pb.WatchPoolsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchPoolsResponse]:
        watcher = await _answered(
            self.store.watch(
                model=request.model, region=request.region, start_revision=request.start_revision
            ),
            context,
        )
        log.info(
            "watch opened", model=request.model, region=request.region, start_revision=request.start_revision
        )
        try:
            while True:
                event = await watcher.next()
                if event is None:
                    break
                try:
                    message = convert.watch_event(event)
                except Exception:  # one record that cannot be sent must not end every watch
                    log.exception("cannot convert a watch event; skipped", kind=event.kind.name)
                    continue
                yield message
        finally:
            self.store.unwatch(watcher)
        if watcher.closed is WatcherClosed.OVERFLOW:
            log.warning("watcher fell behind", limit=watcher.limit, byte_limit=watcher.byte_limit)
            await abort_with_reason(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                Reason.SLOW_CONSUMER,
                f"this watch fell more than {watcher.limit} events or {watcher.byte_limit} bytes of pool "
                "records behind; watch again for a fresh snapshot",
            )
        if watcher.closed is WatcherClosed.RESYNC:
            await abort_with_reason(
                context,
                grpc.StatusCode.UNAVAILABLE,
                Reason.STORE_UNAVAILABLE,
                "this replica lost its etcd history and re-read the directory; watch again (resume or snapshot)",
            )
        if watcher.closed is WatcherClosed.ISOLATED:
            log.info("watch ended: this replica lost etcd")
            await abort_with_reason(context, grpc.StatusCode.UNAVAILABLE, Reason.STORE_UNAVAILABLE, _ISOLATED)
        await abort_with_reason(context, grpc.StatusCode.UNAVAILABLE, Reason.SHUTTING_DOWN, _SHUTTING_DOWN)

    async def DrainPool(self, request: pb.DrainPoolRequest, context: grpc.aio.ServicerContext):
        await request_checks.drain_pool(request).abort_if_any(context)
        view = await _answered(
            self.store.drain_pool(request.pool_id, timeconv.seconds(request.timeout)), context
        )
        log.info("drain started", pool_id=request.pool_id, deadline=view.drain_deadline_wall)
        return pb.DrainPoolResponse(pool=convert.pool(view))

    async def RemovePool(self, request: pb.RemovePoolRequest, context: grpc.aio.ServicerContext):
        await request_checks.remove_pool(request).abort_if_any(context)
        view = await _answered(self.store.remove_pool(request.pool_id), context)
        log.info("pool removed", pool_id=request.pool_id)
        return pb.RemovePoolResponse(pool=convert.pool(view))

    async def RegisterFrontend(self, request: pb.RegisterFrontendRequest, context: grpc.aio.ServicerContext):
        await request_checks.register_frontend(request).abort_if_any(context)
        view = await _answered(
            self.store.register_frontend(
                request.frontend_id, request.url, request.region, request.incarnation
            ),
            context,
        )
        return pb.RegisterFrontendResponse(
            heartbeat_interval=timeconv.duration(self.store.heartbeat_interval),
            lease_duration=timeconv.duration(self.store.lease_duration),
            lease_expire_time=timeconv.timestamp(view.expire_wall),
        )

    async def UnregisterFrontend(
        self, request: pb.UnregisterFrontendRequest, context: grpc.aio.ServicerContext
    ):
        await request_checks.unregister_frontend(request).abort_if_any(context)
        await _answered(self.store.unregister_frontend(request.frontend_id, request.incarnation), context)
        return pb.UnregisterFrontendResponse()

    async def ListFrontends(self, request: pb.ListFrontendsRequest, context: grpc.aio.ServicerContext):
        violations, page = request_checks.list_frontends(request)
        await violations.abort_if_any(context)
        frontends, complete = await _answered(self.store.list_frontends(), context)
        listed, token = pagination.paginate(frontends, lambda f: f.frontend_id, page)
        return pb.ListFrontendsResponse(
            frontends=_each_converted(listed, convert.frontend), next_page_token=token, complete=complete
        )


def _each_converted(values: list[V], to_message: Callable[[V], M]) -> list[M]:
    """Every value as a message, skipping (and logging) one that cannot be converted.

    One bad record must never make the directory unreadable: the listing goes on without it.
    """
    out: list[M] = []
    for value in values:
        try:
            out.append(to_message(value))
        except Exception:
            log.exception("cannot convert a stored record; left out of the listing", record=repr(value)[:300])
    return out


def make_store(config: DiscoveryConfig, clock: Clock) -> Store:
    """The store `config` names."""
    if config.store == "etcd":
        from globaldiscovery.store.etcd import EtcdStore  # aetcd loads only when asked for

        return EtcdStore(
            clock,
            endpoint=config.etcd_endpoints,
            heartbeat_interval=config.heartbeat_interval,
            lease_duration=config.lease_duration,
            watch_queue_limit=config.watch_queue_limit,
            watch_queue_bytes=config.watch_queue_bytes,
            watch_history_bytes=config.watch_history_bytes,
            isolation_timeout=config.etcd_isolation_timeout,
        )
    if config.store != "memory":
        raise ValueError(f"unknown store {config.store!r}")
    return MemoryStore(
        clock,
        heartbeat_interval=config.heartbeat_interval,
        lease_duration=config.lease_duration,
        watch_queue_limit=config.watch_queue_limit,
        watch_queue_bytes=config.watch_queue_bytes,
        watch_history_bytes=config.watch_history_bytes,
    )


def build_server(
    config: DiscoveryConfig, store: Store, servicer: DiscoveryServicer | None = None
) -> ServerHandle:
    """A bound, not yet started server for `store` on config.listen (health and reflection included)."""
    servicer = servicer or DiscoveryServicer(store, max_watchers=config.max_watchers)
    if servicer.authorizer is None:
        servicer.authorizer = Authorizer(config.security, service="globaldiscovery")

    def register(server: grpc.aio.Server) -> list[str]:
        servicer.add_to_server(server)  # each request measured as received
        return [SERVICE_NAME]

    return create_server(config.listen, register, security=config.security, authorizer=servicer.authorizer)


async def serve(
    config: DiscoveryConfig,
    *,
    clock: Clock | None = None,
    stop_event: asyncio.Event | None = None,
    on_started=None,
) -> None:
    """Runs a discovery server until SIGTERM/SIGINT (or `stop_event`), then stops gracefully."""
    store = make_store(config, clock or SystemClock())
    servicer = DiscoveryServicer(store, max_watchers=config.max_watchers)
    handle = build_server(config, store, servicer)
    stop = stop_event or asyncio.Event()
    health_updates: set[asyncio.Task] = set()

    def store_health(serving: bool) -> None:
        # gRPC health follows the store (NOT_SERVING while cut off from etcd), never after a stop began.
        if not stop.is_set():
            update = asyncio.get_running_loop().create_task(handle.set_serving(serving))
            health_updates.add(update)
            update.add_done_callback(health_updates.discard)

    store.on_health(store_health)
    await store.start()
    log.info(
        "discovery serving",
        listen=config.listen,
        port=handle.port,
        heartbeat_interval_s=config.heartbeat_interval,
        lease_duration_s=config.lease_duration,
        store=config.store,
    )
    if on_started is not None:
        on_started(handle)
    # Watchers and keep-alive streams are closed (UNAVAILABLE) before the server stops, so they
    # end cleanly and do not hold up the grace period meant for in-flight unary calls.
    await serve_until_signalled(
        handle, grace=config.stop_grace, on_stop=[servicer.close_streams, store.close], stop_event=stop
    )
    log.info("discovery stopped")

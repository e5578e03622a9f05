"""DiscoveryService over gRPC: validates each request, calls the store, maps results and errors to messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from globaldiscovery import convert, validation
from globaldiscovery.config import DiscoveryConfig
from globaldiscovery.directory import (
    DrainCompleted,
    ModelConflict,
    NotFound,
    PoolRegistration,
    StaleIncarnation,
    WatcherClosed,
)
from globaldiscovery.store import MemoryStore, Store, StoreUnavailable
from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshkit import pagination, timeconv
from meshkit.clock import Clock, SystemClock
from meshkit.logs import get_logger
from meshkit.server import ServerHandle, create_server, serve_until_signalled
from meshkit.validation import Violations

log = get_logger(module="globaldiscovery.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DiscoveryService"].full_name

# Directory errors → gRPC codes (the contract in discovery.proto).
_ERROR_CODES: dict[type[Exception], grpc.StatusCode] = {
    StaleIncarnation: grpc.StatusCode.PERMISSION_DENIED,
    ModelConflict: grpc.StatusCode.FAILED_PRECONDITION,
    DrainCompleted: grpc.StatusCode.FAILED_PRECONDITION,
    NotFound: grpc.StatusCode.NOT_FOUND,
    StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
}
_DIRECTORY_ERRORS = tuple(_ERROR_CODES)


async def _check(violations: Violations, context: grpc.aio.ServicerContext) -> None:
    await violations.abort_if_any(context)


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext) -> None:
    code = _ERROR_CODES[type(exc)]
    await context.abort(code, str(exc))


# Renewals are mostly byte-for-byte repeats of the last registration; remembering that many
# already-validated requests lets a repeat skip validation and conversion.
_MAX_REMEMBERED = 200_000


class DiscoveryServicer(pb_grpc.DiscoveryServiceServicer):
    """The gRPC face of a Store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._validated: dict[tuple[str, str], tuple[pb.RegisterPoolRequest, PoolRegistration]] = {}
        self._frontends: tuple[object, list[pb.Frontend]] = (None, [])

    async def _registration(self, request: pb.RegisterPoolRequest, context) -> PoolRegistration:
        key = (request.pool_id, request.relay_id)
        known = self._validated.get(key)
        if known is not None and known[0] == request:
            return known[1]
        await _check(validation.register_pool(request), context)
        registration = convert.registration(request)
        if len(self._validated) >= _MAX_REMEMBERED:
            self._validated.clear()
        self._validated[key] = (request, registration)
        return registration

    async def _frontend_list(self) -> list[pb.Frontend]:
        """The live frontends as messages, rebuilt only when the frontend table changed."""
        version = self.store.frontends_version()
        if self._frontends[0] != version or version is None:
            frontends, _ = await self.store.list_frontends()
            self._frontends = (version, [convert.frontend(f) for f in frontends])
        return self._frontends[1]

    async def RegisterPool(self, request: pb.RegisterPoolRequest, context: grpc.aio.ServicerContext):
        registration = await self._registration(request, context)
        try:
            result = await self.store.register_pool(registration)
        except _DIRECTORY_ERRORS as exc:
            log.info("register refused", pool_id=request.pool_id, relay_id=request.relay_id, reason=str(exc))
            await _abort_for(exc, context)
            raise  # unreachable: abort raises
        reply = pb.RegisterPoolResponse(
            heartbeat_interval=timeconv.duration(self.store.heartbeat_interval),
            lease_duration=timeconv.duration(self.store.lease_duration),
            lease_expire_time=timeconv.timestamp(result.lease_expire_wall),
            frontends=await self._frontend_list(),
            drain_requested=result.drain_requested,
            pool=convert.pool(result.pool),
        )
        if result.drain_deadline_wall is not None:
            reply.drain_deadline.CopyFrom(timeconv.timestamp(result.drain_deadline_wall))
        return reply

    async def UnregisterPool(self, request: pb.UnregisterPoolRequest, context: grpc.aio.ServicerContext):
        await _check(validation.unregister_pool(request), context)
        try:
            removed = await self.store.unregister_pool(
                request.pool_id, request.relay_id, request.incarnation, convert.removal(request.reason)
            )
        except _DIRECTORY_ERRORS as exc:
            await _abort_for(exc, context)
            raise
        log.info("unregistered", pool_id=request.pool_id, relay_id=request.relay_id, pool_removed=removed)
        return pb.UnregisterPoolResponse(pool_removed=removed)

    async def ListPools(self, request: pb.ListPoolsRequest, context: grpc.aio.ServicerContext):
        violations, after = validation.list_pools(request)
        await _check(violations, context)
        pools, more, complete = await self.store.list_pools(
            model=request.model,
            region=request.region,
            after=after,
            limit=pagination.page_size(request.page_size),
        )
        token = ""
        if more and pools:
            token = pagination.encode_page_token(pools[-1].pool_id, ("pools", request.model, request.region))
        return pb.ListPoolsResponse(
            pools=[convert.pool(p) for p in pools], next_page_token=token, complete=complete
        )

    async def WatchPools(
        self, request: pb.WatchPoolsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchPoolsResponse]:
        await _check(validation.filters(request), context)
        watcher = await self.store.watch(model=request.model, region=request.region)
        log.info("watch opened", model=request.model, region=request.region)
        try:
            while True:
                event = await watcher.next()
                if event is None:
                    break
                yield convert.watch_event(event)
        finally:
            self.store.unwatch(watcher)
        if watcher.closed is WatcherClosed.OVERFLOW:
            log.warning("watcher fell behind", limit=watcher.limit)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this watch fell more than {watcher.limit} events behind; watch again for a fresh snapshot",
            )
        await context.abort(grpc.StatusCode.UNAVAILABLE, "discovery is shutting down; watch another replica")

    async def DrainPool(self, request: pb.DrainPoolRequest, context: grpc.aio.ServicerContext):
        await _check(validation.drain_pool(request), context)
        try:
            view = await self.store.drain_pool(request.pool_id, timeconv.seconds(request.timeout))
        except _DIRECTORY_ERRORS as exc:
            await _abort_for(exc, context)
            raise
        log.info("drain started", pool_id=request.pool_id, deadline=view.drain_deadline_wall)
        return pb.DrainPoolResponse(pool=convert.pool(view))

    async def RemovePool(self, request: pb.RemovePoolRequest, context: grpc.aio.ServicerContext):
        await _check(validation.remove_pool(request), context)
        try:
            view = await self.store.remove_pool(request.pool_id)
        except _DIRECTORY_ERRORS as exc:
            await _abort_for(exc, context)
            raise
        log.info("pool removed", pool_id=request.pool_id)
        return pb.RemovePoolResponse(pool=convert.pool(view))

    async def RegisterFrontend(self, request: pb.RegisterFrontendRequest, context: grpc.aio.ServicerContext):
        await _check(validation.register_frontend(request), context)
        try:
            view = await self.store.register_frontend(
                request.frontend_id, request.url, request.region, request.incarnation
            )
        except _DIRECTORY_ERRORS as exc:
            await _abort_for(exc, context)
            raise
        return pb.RegisterFrontendResponse(
            heartbeat_interval=timeconv.duration(self.store.heartbeat_interval),
            lease_duration=timeconv.duration(self.store.lease_duration),
            lease_expire_time=timeconv.timestamp(view.expire_wall),
        )

    async def UnregisterFrontend(
        self, request: pb.UnregisterFrontendRequest, context: grpc.aio.ServicerContext
    ):
        await _check(validation.unregister_frontend(request), context)
        try:
            await self.store.unregister_frontend(request.frontend_id, request.incarnation)
        except _DIRECTORY_ERRORS as exc:
            await _abort_for(exc, context)
            raise
        return pb.UnregisterFrontendResponse()

    async def ListFrontends(self, request: pb.ListFrontendsRequest, context: grpc.aio.ServicerContext):
        violations, after = validation.list_frontends(request)
        await _check(violations, context)
        frontends, complete = await self.store.list_frontends()
        if after is not None:
            frontends = [f for f in frontends if f.frontend_id > after]
        size = pagination.page_size(request.page_size)
        page, more = frontends[:size], len(frontends) > size
        token = pagination.encode_page_token(page[-1].frontend_id, ("frontends",)) if more else ""
        return pb.ListFrontendsResponse(
            frontends=[convert.frontend(f) for f in page], next_page_token=token, complete=complete
        )


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
        )
    if config.store != "memory":
        raise ValueError(f"unknown store {config.store!r}")
    return MemoryStore(
        clock,
        heartbeat_interval=config.heartbeat_interval,
        lease_duration=config.lease_duration,
        watch_queue_limit=config.watch_queue_limit,
    )


def build_server(config: DiscoveryConfig, store: Store) -> ServerHandle:
    """A bound, not yet started server for `store` on config.listen (health and reflection included)."""

    def register(server: grpc.aio.Server) -> list[str]:
        pb_grpc.add_DiscoveryServiceServicer_to_server(DiscoveryServicer(store), server)
        return [SERVICE_NAME]

    return create_server(config.listen, register)


async def serve(
    config: DiscoveryConfig,
    *,
    clock: Clock | None = None,
    stop_event: asyncio.Event | None = None,
    on_started=None,
) -> None:
    """Runs a discovery server until SIGTERM/SIGINT (or `stop_event`), then stops gracefully."""
    store = make_store(config, clock or SystemClock())
    handle = build_server(config, store)
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
    # Watchers are closed (UNAVAILABLE) before the server stops, so their streams end cleanly
    # and do not hold up the grace period meant for in-flight unary calls.
    await serve_until_signalled(handle, grace=config.stop_grace, on_stop=[store.close], stop_event=stop_event)
    log.info("discovery stopped")

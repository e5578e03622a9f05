"""Wires the simulated pool to one gRPC server: serving link, pool events, admin, health, reflection."""

from __future__ import annotations

import os
from collections.abc import Callable

import grpc

from globalrouter.v1 import pool_frontend_pb2
from meshkit.authz import Authorizer
from meshkit.clock import Clock, SystemClock
from meshkit.limits import add_sized_servicer
from meshkit.logs import get_logger
from meshkit.server import ServerHandle, create_server, serve_until_signalled
from meshkit.tls import SecurityConfig
from mocker.admin import MockerAdmin
from mocker.config import Faults, PoolConfig
from mocker.events import PoolEvents
from mocker.frontend import PoolFrontend
from mocker.pool import Pool
from mocker.v1 import admin_pb2, admin_pb2_grpc
from poolrelay.v1 import pool_events_pb2, pool_events_pb2_grpc

# After the drain, in-flight calls are only the watch streams: they need no long grace.
STOP_GRACE_S = 1.0

log = get_logger(module="mocker.server")


def build_server(
    listen: str,
    pool: Pool,
    exit_process: Callable[[int], None] = os._exit,
    security: SecurityConfig | None = None,
) -> ServerHandle:
    """A bound, not yet started server serving `pool` on `listen` (port 0 picks one)."""

    def register(server: grpc.aio.Server) -> list[str]:
        # Each Generate measured as received (a 16k-token prompt's ByteSize() costs more than its decoding).
        add_sized_servicer(
            server,
            PoolFrontend(pool, exit_process),
            pool_frontend_pb2.DESCRIPTOR.services_by_name["PoolFrontendService"],
        )
        pool_events_pb2_grpc.add_PoolEventsServiceServicer_to_server(PoolEvents(pool), server)
        admin_pb2_grpc.add_MockerAdminServiceServicer_to_server(MockerAdmin(pool), server)
        return [
            pool_frontend_pb2.DESCRIPTOR.services_by_name["PoolFrontendService"].full_name,
            pool_events_pb2.DESCRIPTOR.services_by_name["PoolEventsService"].full_name,
            admin_pb2.DESCRIPTOR.services_by_name["MockerAdminService"].full_name,
        ]

    # The pool events carry this pool's state: a relay certificate of another pool may not read or
    # drain it (authz rules with server_pool compare the caller's pool with this one).
    security = security or SecurityConfig()
    authorizer = Authorizer(security, service="mocker", pool=pool.config.pool_id)
    return create_server(listen, register, security=security, authorizer=authorizer)


async def serve(
    listen: str,
    config: PoolConfig,
    faults: Faults,
    clock: Clock | None = None,
    security: SecurityConfig | None = None,
) -> None:
    """Serves until SIGTERM/SIGINT; then drains for `config.drain_timeout` and exits."""
    pool = Pool(config, clock or SystemClock(), faults)
    handle = build_server(listen, pool, security=security)

    async def drain() -> None:
        # Health is NOT_SERVING already; refuse new work, let accepted work finish or hand it back.
        log.info("draining before exit", timeout_s=config.drain_timeout)
        pool.start_drain(config.drain_timeout)
        await pool.wait_drained()
        log.info("drained")

    log.info(
        "serving",
        listen=listen,
        port=handle.port,
        pool_id=config.pool_id,
        models=list(config.models),
        workers=config.workers,
    )
    await serve_until_signalled(handle, grace=STOP_GRACE_S, on_stop=[drain])

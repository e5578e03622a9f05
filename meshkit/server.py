"""Server bootstrap shared by every service: TLS, authorization, health, reflection, keepalive, SIGTERM → graceful stop, SIGHUP → reload.

Follows grpc's examples/python asyncio idioms: `create_server(addr) -> (server, port)` builds and
binds without starting; `serve_until_signalled()` starts, waits for SIGTERM/SIGINT, flips health to
NOT_SERVING, runs the service's own stop hooks, stops with a grace period so in-flight calls
finish, and only then runs the hooks that release what those calls use. SIGHUP re-reads the
certificate and API keys (whatever the server has of them) and never stops it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meshkit.authz import Authorizer
from meshkit.keepalive import SERVER_OPTIONS
from meshkit.limits import size_cap_interceptor
from meshkit.logs import get_logger
from meshkit.tls import SecurityConfig, ServerCertificates, check_listen
from meshkit.wire import ParseRequests

log = get_logger(module="meshkit.server")


@dataclass
class ServerHandle:
    """A built, bound, not yet started aio server with its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: list[str] = field(default_factory=list)
    authorizer: Authorizer | None = None
    """Who may call what on this server (enforcing only when TLS or API keys are configured)."""
    certificates: ServerCertificates | None = None
    """The server certificate, re-read on change or SIGHUP (None without TLS)."""
    reload_hooks: list[tuple[str, Callable[[], bool]]] = field(default_factory=list)
    """(what, re-read it) run on SIGHUP too; each returns False when it kept what was in force."""

    def reload(self) -> None:
        """SIGHUP: re-read what can be re-read (the certificate before the next handshake, the API
        keys at once) and say so in the log. Never raises: a signal must not stop a server."""
        reloading = []
        try:
            if self.certificates is not None:
                # Open connections keep theirs; the next handshake reads the files.
                self.certificates.request_reload()
                reloading.append("certificates")
            if self.authorizer is not None and self.authorizer.api_keys_path:
                kept = not self.authorizer.reload_api_keys()
                reloading.append("api keys (file refused, current keys kept)" if kept else "api keys")
            for what, hook in self.reload_hooks:
                reloading.append(what if hook() else f"{what} (refused, kept what was in force)")
        except Exception as exc:  # a reload that fails keeps what is in force
            log.error("SIGHUP reload failed; serving on with what was in force", error=repr(exc))
            return
        log.info("SIGHUP", reloaded=reloading or "nothing to reload (no TLS, no --api-keys)")

    async def set_serving(self, serving: bool) -> None:
        """Sets every service's health (and the overall "" entry) to SERVING or NOT_SERVING."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)


def create_server(
    listen: str,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    *,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    security: SecurityConfig | None = None,
    authorizer: Authorizer | None = None,
    listen_flag: str = "--listen",
) -> ServerHandle:
    """Builds an aio server bound to `listen` (HOST:PORT; port 0 picks a free one).

    `register(server)` adds the service's servicers and returns their full service names, which
    get health entries and reflection. Raises RuntimeError naming the address when it cannot bind.

    With `security.tls` it serves TLS (mutual with a CA) and every call is authorized by
    `authorizer` (one is made from `security` when not given). Without TLS it binds only to
    loopback unless `security.insecure` says otherwise, and then says so in its log; a refusal names
    `listen_flag`, the flag `listen` came from (a relay's is --status-listen).
    """
    security = security or SecurityConfig()
    check_listen(listen, security, listen_flag)
    authorizer = authorizer or Authorizer(security, service="mesh")
    # Outermost first. ParseRequests parses (a request that does not parse is INVALID_ARGUMENT, not
    # UNKNOWN) and hands parsed requests to the authorization and size checks inside it; each of
    # these wraps a method's handler once, so ParseRequests sees one handler object per method.
    server = grpc.aio.server(
        options=SERVER_OPTIONS,
        interceptors=[ParseRequests(), authorizer.interceptor(), size_cap_interceptor(), *interceptors],
    )
    names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    certificates = ServerCertificates(security) if security.tls else None
    try:
        if certificates is not None:
            port = server.add_secure_port(listen, certificates.credentials())
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {listen}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"cannot listen on {listen}: address in use or invalid")
    return ServerHandle(
        server=server,
        port=port,
        health=health_servicer,
        service_names=names,
        authorizer=authorizer,
        certificates=certificates,
    )


async def serve_until_signalled(
    handle: ServerHandle,
    *,
    grace: float = 5.0,
    on_stop: Iterable[Callable[[], Awaitable[None]]] = (),
    after_stop: Iterable[Callable[[], Awaitable[None]]] = (),
    stop_event: asyncio.Event | None = None,
    ready: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Starts `handle`, serves until SIGTERM/SIGINT (or `stop_event`), then stops gracefully.

    Health turns SERVING once the server runs, or, with `ready`, once `ready()` returns (a service
    that cannot do its job yet answers NOT_SERVING, so load balancers wait).

    Order on stop: health NOT_SERVING (load balancers and peers stop sending), the service's
    `on_stop` hooks (unregister, close watchers), then `server.stop(grace)` so in-flight calls
    finish within `grace` seconds, then the `after_stop` hooks (close what in-flight calls used,
    e.g. outgoing channels: closing them earlier would cut those calls).
    """
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # SIGHUP (whose default action ends the process) is handled by every server, with TLS or not.
    loop.add_signal_handler(signal.SIGHUP, handle.reload)
    readying: asyncio.Task[None] | None = None
    if ready is not None:
        # grpc's health servicer says SERVING for "" until told otherwise: not before it is ready.
        await handle.set_serving(False)
    await handle.server.start()
    if ready is None:
        await handle.set_serving(True)
    else:
        readying = asyncio.create_task(_serve_when_ready(handle, ready), name="health-ready")
    await stop.wait()
    log.info("stopping", grace_s=grace)
    if readying is not None:
        readying.cancel()  # first: health must not turn SERVING once stopping
        await asyncio.gather(readying, return_exceptions=True)
    await handle.set_serving(False)
    await _run_hooks(on_stop)
    await handle.server.stop(grace)
    await _run_hooks(after_stop)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.remove_signal_handler(sig)


async def _serve_when_ready(handle: ServerHandle, ready: Callable[[], Awaitable[None]]) -> None:
    await ready()
    await handle.set_serving(True)


async def _run_hooks(hooks: Iterable[Callable[[], Awaitable[None]]]) -> None:
    for hook in hooks:
        try:
            await hook()
        except Exception as exc:  # a failing hook must not keep the process from stopping
            log.warning("stop hook failed", error=repr(exc))

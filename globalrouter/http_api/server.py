"""uvicorn serving the HTTP front inside the global frontend's own asyncio loop, beside grpc.aio.

uvicorn.Server.serve() would install its own signal handlers and own the process; here the
socket is bound up front (so the port is known when the frontend is built, as the gRPC one is)
and the server is driven by its startup / main_loop / shutdown steps, so SIGTERM stays with
meshkit.server and both APIs stop together.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import math
import socket
import ssl
from asyncio import sslproto
from collections.abc import Callable

import uvicorn
from prometheus_client import Counter, Gauge

from globalrouter.http_api.app import OpenAIFront
from globalrouter.http_api.security import BoundedHttpProtocol
from meshkit.logs import get_logger
from meshkit.tls import SecurityConfig, ServerCertificates, check_listen

log = get_logger(module="globalrouter.http_api.server")

BACKLOG = 1024
# The kernel send buffer of every connection (accepted sockets inherit it from the listening one).
# Fixed rather than autotuned (up to 4 MiB): a client that stops reading then holds at most this
# much kernel memory, and its stream hits the write timeout after seconds rather than after
# minutes of output. Token streams need far less bandwidth than this buffers.
SEND_BUFFER_BYTES = 256 * 1024
# asyncio's TLS protocol reads through a buffer of 256 KiB, allocated at accept, before the
# handshake: with it, 1,100 connections that never sent a ClientHello took the router from 95 to
# 424 MB. A TLS record is at most 16 KiB (plus its overhead), so reads of 32 KiB lose nothing.
TLS_READ_BYTES = 32 * 1024


# After this many handshakes were in progress at once, the allocator is asked to give freed memory
# back once they are over (glibc keeps freed heap memory for reuse; a burst of idle connections
# would otherwise leave the process at its peak RSS for good).
TRIM_AFTER_HANDSHAKES = 64
TRIM_INTERVAL = 30.0


def _malloc_trim() -> None:
    """Returns the C heap's free memory to the system (glibc's malloc_trim; nothing elsewhere)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


class Handshakes:
    """TLS handshakes in progress, and the allocator's trim once a large burst of them is over."""

    def __init__(self, trim_after: int = TRIM_AFTER_HANDSHAKES, trim_interval: float = TRIM_INTERVAL) -> None:
        self.pending: set[_TlsConnection] = set()
        self.peak = 0
        self.trim_after = trim_after
        self.trim_interval = trim_interval
        self.trims = 0
        self._last_trim = -math.inf
        self._trim_scheduled = False

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, connection: _TlsConnection) -> None:
        self.pending.add(connection)
        self.peak = max(self.peak, len(self.pending))

    def discard(self, connection: _TlsConnection) -> None:
        if connection not in self.pending:
            return
        self.pending.discard(connection)
        # A burst is over when what is left of it is small (steady traffic need not reach zero).
        if self.peak >= self.trim_after and len(self.pending) <= self.peak // 8 and not self._trim_scheduled:
            self.peak = len(self.pending)
            self._trim_scheduled = True
            loop = asyncio.get_running_loop()
            # A second after (the connections' objects are released after this returns), and at
            # most once per trim_interval: a trim walks the heap (tens of ms at 100 MB).
            delay = max(1.0, self._last_trim + self.trim_interval - loop.time())
            loop.call_later(delay, self._trim)

    def _trim(self) -> None:
        self._trim_scheduled = False
        self._last_trim = asyncio.get_running_loop().time()
        self.trims += 1
        # In a worker thread: ctypes lets go of the GIL, so the loop runs on meanwhile.
        asyncio.get_running_loop().run_in_executor(None, _malloc_trim)


class _TlsConnection(sslproto.SSLProtocol):
    """asyncio's server-side TLS protocol with a smaller read buffer, counting its handshake as in
    progress (in `handshakes`) from accept until it ends, however it ends.

    The HTTP protocol is made only once the handshake succeeds (`make_app(accepted_at)`): a
    connection that never finishes its handshake costs no parser or protocol state, and leaves no
    reference cycles behind for the garbage collector to find later.
    """

    max_size = TLS_READ_BYTES

    def __init__(
        self,
        handshakes: Handshakes,
        make_app: Callable[[float], asyncio.BaseProtocol],
        loop: asyncio.AbstractEventLoop,
        sslcontext: ssl.SSLContext,
        *,
        handshake_timeout: float,
    ) -> None:
        # No waiter (nothing awaits the handshake), and a placeholder until the HTTP protocol is made.
        super().__init__(
            loop,
            asyncio.Protocol(),
            sslcontext,
            None,  # type: ignore[arg-type]  # typeshed says Future; asyncio accepts None
            server_side=True,
            ssl_handshake_timeout=handshake_timeout,  # type: ignore[arg-type]  # a float, as asyncio's own
        )
        self._make_app = make_app
        self._accepted_at = loop.time()
        self._handshakes = handshakes
        handshakes.add(self)

    def _on_handshake_complete(self, handshake_exc) -> None:
        self._handshakes.discard(self)
        if handshake_exc is None:
            self._set_app_protocol(self._make_app(self._accepted_at))
        super()._on_handshake_complete(handshake_exc)

    def connection_lost(self, exc) -> None:
        self._handshakes.discard(self)  # cut off, timed out or refused before the handshake ended
        super().connection_lost(exc)


class _Refused(asyncio.Protocol):
    """A TLS connection past the cap: closed at accept (no handshake, so no 503 can be sent)."""

    def connection_made(self, transport) -> None:
        transport.abort()


def bind(listen: str) -> socket.socket:
    """A listening TCP socket on HOST:PORT (port 0 picks a free one); RuntimeError when it cannot."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto given explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto
    # says TCP, and accepted sockets inherit it; with Nagle on, each SSE event after the first on
    # a keep-alive connection waits out the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        sock.bind((host, int(port)))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot listen on {listen} (--http-listen): {exc}") from exc
    sock.setblocking(False)
    return sock


class HttpServer:
    """The OpenAI-compatible HTTP front of one global frontend."""

    def __init__(
        self,
        front: OpenAIFront,
        listen: str,
        *,
        grace: float,
        security: SecurityConfig | None = None,
        certificates: ServerCertificates | None = None,
    ) -> None:
        """With `certificates` it serves TLS (mutual when the security config has a CA), reloading
        them as the gRPC listener does; without, it binds loopback only unless --insecure."""
        security = security or SecurityConfig()
        check_listen(listen, security, "--http-listen")
        if security.tls and certificates is None:
            certificates = ServerCertificates(security)
        self.front = front
        self.listen = listen
        self.tls = certificates is not None
        self._sock = bind(listen)
        self.port: int = self._sock.getsockname()[1]
        # The C parser (h11, pure Python, costs a third of the throughput), with bounded heads.
        self._protocol_class = BoundedHttpProtocol.bounded(
            front.config.max_head_bytes, front.config.max_headers, front.config.head_timeout
        )
        config = uvicorn.Config(
            front.app(),
            log_config=None,
            access_log=False,
            lifespan="off",
            http=self._protocol_class,
            ws="none",
            server_header=False,
            timeout_graceful_shutdown=max(1, math.ceil(grace)),  # whole seconds for uvicorn
            limit_concurrency=front.config.max_connections,
        )
        config.load()
        # The reloading context (uvicorn's own would not reload), served by start()'s listener.
        self._ssl = certificates.ssl_context() if certificates is not None else None
        self._config = config
        self._server = uvicorn.Server(config)
        # What Server.serve() sets up before startup(); lifespan is "off" (nothing to run).
        self._server.lifespan = config.lifespan_class(config)
        self._task: asyncio.Task | None = None
        self._handshakes = Handshakes()
        registry = front.core.metrics.registry
        Gauge(
            "globalrouter_http_tls_handshakes",
            "TLS handshakes in progress at the HTTP front (counted against its connection cap)",
            registry=registry,
        ).set_function(lambda: len(self._handshakes))
        self.refused = Counter(
            "globalrouter_http_tls_refused_at_accept",
            "TLS connections to the HTTP front closed at accept: the connection cap was reached",
            registry=registry,
        )

    async def start(self) -> None:
        """Starts serving on the bound socket (needs the running loop)."""
        await self._server.startup(sockets=[])  # uvicorn's lifespan and state, no listener of its own
        # The listener is made here because uvicorn's startup() passes no ssl_handshake_timeout, which
        # leaves a TLS handshake asyncio's 60 s: a client that connects and never finishes its
        # handshake would hold a socket that long. The handshake gets the head deadline instead
        # (one budget from accept to a complete first head; BoundedHttpProtocol times the rest).
        # With TLS, the listener is plain TCP and _tls_protocol makes each connection's TLS protocol:
        # a handshake in progress counts against the connection cap, and its read buffer is small
        # (asyncio's own TLS listener would do neither).
        server = await asyncio.get_running_loop().create_server(
            self._protocol if self._ssl is None else self._tls_protocol, sock=self._sock, backlog=BACKLOG
        )
        self._server.servers.append(server)  # closed and awaited by uvicorn's shutdown()
        self._task = asyncio.create_task(self._server.main_loop(), name="http-front")
        log.info("HTTP front serving", listen=self.listen, port=self.port, tls=self.tls)

    def _protocol(self) -> asyncio.Protocol:
        """One connection's protocol, made as uvicorn's startup() makes it."""
        return self._protocol_class(
            config=self._config, server_state=self._server.server_state, app_state=self._server.lifespan.state
        )

    def _tls_protocol(self) -> asyncio.BaseProtocol:
        """A TLS connection at accept: refused past the cap (connections served plus handshakes in
        progress), else its handshake bounded by the head deadline, then the HTTP protocol."""
        assert self._ssl is not None
        if (
            len(self._handshakes) + len(self._server.server_state.connections)
            >= self.front.config.max_connections
        ):
            self.refused.inc()
            return _Refused()
        return _TlsConnection(
            self._handshakes,
            self._http_protocol,
            asyncio.get_running_loop(),
            self._ssl,
            handshake_timeout=self.front.config.head_timeout,
        )

    def _http_protocol(self, accepted_at: float) -> asyncio.Protocol:
        """The HTTP protocol of a connection whose handshake is over; its head deadline counts from accept."""
        protocol = self._protocol()
        protocol._accepted_at = accepted_at  # type: ignore[attr-defined]  # BoundedHttpProtocol's budget start
        return protocol

    @property
    def handshakes(self) -> int:
        """TLS handshakes in progress."""
        return len(self._handshakes)

    async def stop(self) -> None:
        """/health turns 503, new connections are refused, open requests get the grace period."""
        self.front.serving = False
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            await self._server.shutdown(sockets=[self._sock])
        self._sock.close()

"""uvicorn serving the HTTP front inside the global frontend's own asyncio loop, beside grpc.aio.

uvicorn.Server.serve() would install its own signal handlers and own the process; here the
socket is bound up front (so the port is known when the frontend is built, as the gRPC one is)
and the server is driven by its startup / main_loop / shutdown steps, so SIGTERM stays with
meshkit.server and both APIs stop together.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket

import uvicorn

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

    async def start(self) -> None:
        """Starts serving on the bound socket (needs the running loop)."""
        await self._server.startup(sockets=[])  # uvicorn's lifespan and state, no listener of its own
        # The listener is made here because uvicorn's startup() passes no ssl_handshake_timeout, which
        # leaves a TLS handshake asyncio's 60 s: a client that connects and never finishes its
        # handshake would hold a socket that long. The handshake gets the head deadline instead
        # (one budget from accept to a complete first head; BoundedHttpProtocol times the rest).
        server = await asyncio.get_running_loop().create_server(
            self._protocol,
            sock=self._sock,
            ssl=self._ssl,
            backlog=BACKLOG,
            ssl_handshake_timeout=self.front.config.head_timeout if self._ssl is not None else None,
        )
        self._server.servers.append(server)  # closed and awaited by uvicorn's shutdown()
        self._task = asyncio.create_task(self._server.main_loop(), name="http-front")
        log.info("HTTP front serving", listen=self.listen, port=self.port, tls=self.tls)

    def _protocol(self) -> asyncio.Protocol:
        """One connection's protocol, made as uvicorn's startup() makes it."""
        return self._protocol_class(
            config=self._config, server_state=self._server.server_state, app_state=self._server.lifespan.state
        )

    async def stop(self) -> None:
        """/health turns 503, new connections are refused, open requests get the grace period."""
        self.front.serving = False
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            await self._server.shutdown(sockets=[self._sock])
        self._sock.close()

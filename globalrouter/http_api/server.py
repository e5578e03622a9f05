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
        config = uvicorn.Config(
            front.app(),
            log_config=None,
            access_log=False,
            lifespan="off",
            # The C parser (h11, pure Python, costs a third of the throughput), with bounded heads.
            http=BoundedHttpProtocol.bounded(
                front.config.max_head_bytes, front.config.max_headers, front.config.head_timeout
            ),
            ws="none",
            server_header=False,
            timeout_graceful_shutdown=max(1, math.ceil(grace)),  # whole seconds for uvicorn
            limit_concurrency=front.config.max_connections,
        )
        config.load()
        if certificates is not None:
            config.ssl = certificates.ssl_context()  # after load(): uvicorn's own context would not reload
        self._server = uvicorn.Server(config)
        # What Server.serve() sets up before startup(); lifespan is "off" (nothing to run).
        self._server.lifespan = config.lifespan_class(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Starts serving on the bound socket (needs the running loop)."""
        await self._server.startup(sockets=[self._sock])
        self._task = asyncio.create_task(self._server.main_loop(), name="http-front")
        log.info("HTTP front serving", listen=self.listen, port=self.port, tls=self.tls)

    async def stop(self) -> None:
        """/health turns 503, new connections are refused, open requests get the grace period."""
        self.front.serving = False
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            await self._server.shutdown(sockets=[self._sock])
        self._sock.close()

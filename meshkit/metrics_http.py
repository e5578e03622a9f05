"""A bounded Prometheus /metrics HTTP(S) endpoint, shared by every service that exports metrics."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import ssl
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from meshkit.logs import get_logger
from meshkit.tls import SecurityConfig, ServerCertificates, check_listen
from meshkit.validation import host_port_problem

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIApplication

log = get_logger(module="meshkit.metrics_http")

# What socketserver hands its request methods (a datagram server's is a tuple; this one's a socket).
_Request = socket.socket | tuple[bytes, socket.socket]

# Seconds one scrape may take from accept to the last byte (TLS handshake, request, reply): a
# connection that has not finished by then is cut off, whatever it sends or does not send.
SCRAPE_SECONDS = 10.0
# Connections served at once; more are closed at accept. A Prometheus server holds one at a time.
MAX_SCRAPES = 16


@dataclass
class MetricsEndpoint:
    """A running /metrics endpoint: the port it bound, and how to stop it."""

    port: int
    server: _MetricsServer

    def close(self) -> None:
        """Stops accepting and releases the port (a scrape in flight ends at its deadline)."""
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(
    registry: CollectorRegistry,
    listen: str,
    security: SecurityConfig | None = None,
    certificates: ServerCertificates | None = None,
    *,
    flag: str = "--metrics-listen",
    scrape_seconds: float = SCRAPE_SECONDS,
    max_scrapes: int = MAX_SCRAPES,
) -> MetricsEndpoint:
    """Serves `registry` at /metrics on HOST:PORT (port 0 picks one) in a background thread.

    Under the process's TLS flags it serves HTTPS with `certificates` (the gRPC listener's
    reloader, so a rotation reaches both), and with --tls-ca every scraper must present a
    certificate of that CA (mutual TLS); without TLS it binds only loopback unless --insecure,
    like every listener. Each connection gets `scrape_seconds` in all, at most `max_scrapes` at once.
    Refusals raise RuntimeError naming `flag`, the flag `listen` came from.
    """
    security = security or SecurityConfig()
    check_listen(listen, security, flag)
    if security.tls and certificates is None:
        certificates = ServerCertificates(security)
    problem = host_port_problem(listen)
    if problem:
        raise RuntimeError(f"cannot listen on {listen} ({flag}): {problem}")
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    try:
        server = _MetricsServer(
            (host, int(port)),
            make_wsgi_app(registry),
            tls=certificates.ssl_context() if certificates is not None else None,
            scrape_seconds=scrape_seconds,
            max_scrapes=max_scrapes,
        )
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {listen} ({flag}): {exc}") from exc
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return MetricsEndpoint(port=int(server.server_port), server=server)


class _QuietHandler(WSGIRequestHandler):
    """wsgiref's handler without its access log on stderr."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class _MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    """wsgiref's threaded server, bounded: prometheus_client's own one would run the TLS handshake in
    its accept loop, where a client that connects and never sends a ClientHello stops every scrape,
    and it lets each connection take as long and as many threads as clients like."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        app: WSGIApplication,
        *,
        tls: ssl.SSLContext | None,
        scrape_seconds: float,
        max_scrapes: int,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.tls = tls
        self.scrape_seconds = scrape_seconds
        self._slots = threading.BoundedSemaphore(max_scrapes)
        super().__init__(address, _QuietHandler)
        self.set_app(app)

    def process_request(self, request: _Request, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once rather than queued without bound
            return
        try:
            super().process_request(request, client_address)  # the connection's own thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: _Request, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: _Request, client_address: Any) -> None:
        # One deadline for the whole connection: a per-read timeout alone would let a client that
        # sends a byte now and then hold it for ever. Shutting the socket down (through a duplicate,
        # which outlives the TLS wrapper) wakes whatever read or write is blocked on it.
        assert isinstance(request, socket.socket)  # a stream server's request is its connection
        raw = request.dup()
        cut = threading.Timer(self.scrape_seconds, _shut, (raw,))
        cut.start()
        request.settimeout(self.scrape_seconds)
        try:
            if self.tls is not None:
                # The handshake runs here, in this connection's thread, not in the accept loop.
                request = self.tls.wrap_socket(request, server_side=True)
            super().finish_request(request, client_address)
        except (OSError, ValueError) as exc:
            # A plain-HTTP client, no or an untrusted certificate, a cut-off connection.
            log.debug("metrics connection refused or cut off", peer=client_address[0], error=str(exc))
        finally:
            cut.cancel()
            request.close()
            raw.close()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)

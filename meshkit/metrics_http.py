"""A bounded Prometheus /metrics HTTP(S) endpoint, shared by every service that exports metrics."""

from __future__ import annotations

import contextlib
import selectors
import socket
import socketserver
import ssl
import threading
import time
from collections import OrderedDict
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

# Seconds one scrape may take from its first byte to the last (TLS handshake, request, reply): a
# connection that has not finished by then is cut off, whatever it sends or does not send.
SCRAPE_SECONDS = 10.0
# Connections served at once (each in its own thread, from its first byte); more are closed. A
# Prometheus server holds one at a time.
MAX_SCRAPES = 16
# Seconds a connection may stay silent after accept, waiting (without a thread) for its first
# byte: a scraper sends its request (or ClientHello) at once, well inside a scrape interval.
FIRST_BYTE_SECONDS = 2.0
# Silent connections waiting for their first byte; past this the oldest waiting one is closed, so
# that however many a client opens, a scraper's new connection is always let in.
MAX_WAITING = 256


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
    first_byte_seconds: float = FIRST_BYTE_SECONDS,
    max_waiting: int = MAX_WAITING,
) -> MetricsEndpoint:
    """Serves `registry` at /metrics on HOST:PORT (port 0 picks one) in a background thread.

    Under the process's TLS flags it serves HTTPS with `certificates` (the gRPC listener's
    reloader, so a rotation reaches both), and with --tls-ca every scraper must present a
    certificate of that CA (mutual TLS); without TLS it binds only loopback unless --insecure,
    like every listener. A connection waits (without a thread) `first_byte_seconds` at most for its
    first byte, at most `max_waiting` of them (the oldest is dropped for a new one); from its first
    byte it gets `scrape_seconds` in all, at most `max_scrapes` at once.
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
            first_byte_seconds=first_byte_seconds,
            max_waiting=max_waiting,
        )
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {listen} ({flag}): {exc}") from exc
    # shutdown() waits for serve_forever to notice, up to one poll interval (0.5 s by default):
    # on the stop path, inside the process's grace.
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="metrics-http", daemon=True
    ).start()
    return MetricsEndpoint(port=int(server.server_port), server=server)


class _QuietHandler(WSGIRequestHandler):
    """wsgiref's handler without its access log on stderr."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Doorman:
    """Holds accepted connections until their first byte, in one thread (a selector), then hands
    each to the server's threads; silent ones are closed at their deadline, or when the waiting
    room is full (the oldest first), so idle sockets never take a scraper's place."""

    def __init__(self, server: _MetricsServer, first_byte_seconds: float, max_waiting: int) -> None:
        self._server = server
        self._first_byte_seconds = first_byte_seconds
        self._max_waiting = max_waiting
        self._selector = selectors.DefaultSelector()
        self._waiting: OrderedDict[socket.socket, tuple[float, Any]] = OrderedDict()
        self._arrivals: list[tuple[socket.socket, Any]] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="metrics-http-doorman", daemon=True)
        self._thread.start()

    def admit(self, request: socket.socket, client_address: Any) -> None:
        """A connection just accepted (from the accept loop's thread)."""
        with self._lock:
            if self._stopped:
                _close(request)
                return
            if len(self._arrivals) >= self._max_waiting:
                # The doorman is behind (a busy machine): bounded all the same, and as in the
                # waiting room the oldest silent one makes room, not the newest.
                oldest, _ = self._arrivals.pop(0)
                _close(oldest)
            self._arrivals.append((request, client_address))
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while not self._stopped:
                try:
                    self._step()
                except Exception:  # a defect must not stop every scrape: log it and go on
                    log.exception("metrics doorman step failed")
                    time.sleep(0.1)
        finally:
            for sock in list(self._waiting):
                self._drop(sock)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _step(self) -> None:
        timeout = None
        if self._waiting:
            first_deadline = next(iter(self._waiting.values()))[0]
            timeout = max(0.0, first_deadline - time.monotonic())
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._wake_r:
                with contextlib.suppress(BlockingIOError, OSError):
                    self._wake_r.recv(4096)
            else:
                self._dispatch(key.fileobj)  # type: ignore[arg-type]
        self._take_arrivals()
        self._expire()

    def _take_arrivals(self) -> None:
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
        deadline = time.monotonic() + self._first_byte_seconds
        for request, client_address in arrivals:
            while len(self._waiting) >= self._max_waiting:
                self._drop(next(iter(self._waiting)))  # the oldest silent one makes room
            try:
                self._selector.register(request, selectors.EVENT_READ)
            except (OSError, ValueError):  # already closed by the peer's reset
                _close(request)
                continue
            self._waiting[request] = (deadline, client_address)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._waiting:
            sock, (deadline, _) = next(iter(self._waiting.items()))
            if deadline > now:
                return
            self._drop(sock)

    def _dispatch(self, sock: socket.socket) -> None:
        """First bytes (or the client's close) arrived: serve it in a thread of its own, if one is free."""
        _, client_address = self._waiting.pop(sock)
        self._selector.unregister(sock)
        self._server.serve_connection(sock, client_address)

    def _drop(self, sock: socket.socket) -> None:
        self._waiting.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        _close(sock)


class _MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    """wsgiref's threaded server, bounded: prometheus_client's own one would run the TLS handshake in
    its accept loop, where a client that connects and never sends a ClientHello stops every scrape,
    and it lets each connection take as long and as many threads as clients like. Here connections
    wait for their first byte in a doorman thread (idle ones cost a socket, not a thread or a
    slot), then get a thread of their own and a deadline, `max_scrapes` at once."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        app: WSGIApplication,
        *,
        tls: ssl.SSLContext | None,
        scrape_seconds: float,
        max_scrapes: int,
        first_byte_seconds: float,
        max_waiting: int,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.tls = tls
        self.scrape_seconds = scrape_seconds
        self._slots = threading.BoundedSemaphore(max_scrapes)
        self._doorman: _Doorman | None = None  # server_close() runs inside __init__ when binding fails
        super().__init__(address, _QuietHandler)
        self.set_app(app)
        self._doorman = _Doorman(self, first_byte_seconds, max_waiting)

    def process_request(self, request: _Request, client_address: Any) -> None:
        assert isinstance(request, socket.socket)  # a stream server's request is its connection
        assert self._doorman is not None  # made in __init__, before serving starts
        self._doorman.admit(request, client_address)  # until its first byte, without a thread

    def serve_connection(self, request: socket.socket, client_address: Any) -> None:
        """A connection that has sent its first bytes: its own thread, if fewer than the cap are busy."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once rather than queued without bound
            return
        try:
            super().process_request(request, client_address)  # the connection's own thread
        except BaseException:
            self._slots.release()
            raise

    def server_close(self) -> None:
        if self._doorman is not None:
            self._doorman.stop()
        super().server_close()

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


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)

"""Prometheus metrics of one global frontend, in a registry of its own (tests run several)."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import ssl
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app

from meshkit.logs import get_logger
from meshkit.tls import SecurityConfig, ServerCertificates, check_listen

log = get_logger(module="globalrouter.metrics")

# Seconds one scrape may take from accept to the last byte (TLS handshake, request, reply): a
# connection that has not finished by then is cut off, whatever it sends or does not send.
SCRAPE_SECONDS = 10.0
# Connections served at once; more are closed at accept. A Prometheus server holds one at a time.
MAX_SCRAPES = 16


class RouterMetrics:
    """The counters and histograms a global frontend exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "globalrouter_requests",
            "Generate requests by model and outcome (gRPC code name)",
            ["model", "outcome"],
            registry=r,
        )
        self.decisions = Counter(
            "globalrouter_decisions", "Requests sent to each pool (admission attempts)", ["pool"], registry=r
        )
        self.prompt_blocks = Counter(
            "globalrouter_prompt_blocks",
            "Full prompt blocks of requests a pool admitted",
            ["pool"],
            registry=r,
        )
        self.cached_blocks = Counter(
            "globalrouter_cached_blocks",
            "Of those, blocks the pool had cached (its admission reply)",
            ["pool"],
            registry=r,
        )
        self.cached_prefix_ratio = Histogram(
            "globalrouter_cached_prefix_ratio",
            "Cached prompt blocks / prompt blocks at admission",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        self.migrations = Counter(
            "globalrouter_migrations",
            "Requests moved mid-stream away from a failed pool",
            ["from_pool"],
            registry=r,
        )
        self.migration_aborts = Counter(
            "globalrouter_migration_aborts",
            "Requests ended at the migration limit (UNAVAILABLE, MIGRATION_LIMIT_REACHED)",
            registry=r,
        )
        self.refusals = Counter(
            "globalrouter_refusals", "Admission refusals by pool and gRPC code", ["pool", "code"], registry=r
        )
        self.decision_latency = Histogram(
            "globalrouter_decision_latency_seconds",
            "Time to filter and rank pools for one request",
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1),
            registry=r,
        )
        self.telemetry_lag = Histogram(
            "globalrouter_telemetry_lag_seconds",
            "Receive time minus the relay's send/observe time",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.telemetry_snapshot_requests = Counter(
            "globalrouter_telemetry_snapshot_requests", "SnapshotRequests sent to relays (gaps)", registry=r
        )
        self._children: dict[tuple[object, tuple[str, ...]], object] = {}

    def labelled(self, metric, *values: str):
        """`metric.labels(*values)`, looked up once per label set: prometheus validates the values
        and takes a lock on every labels() call, four times per request on the data path. Bounded
        as prometheus's own children are, by the label values the callers admit."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def serve(
        self,
        listen: str,
        security: SecurityConfig | None = None,
        certificates: ServerCertificates | None = None,
        *,
        scrape_seconds: float = SCRAPE_SECONDS,
        max_scrapes: int = MAX_SCRAPES,
    ) -> int:
        """Serves /metrics on HOST:PORT (port 0 picks one) in a background thread; returns the port.

        Under the process's TLS flags it serves HTTPS with `certificates` (the gRPC listener's
        reloader, so a rotation reaches both), and with --tls-ca every scraper must present a
        certificate of that CA (mutual TLS); without TLS it binds only loopback unless --insecure,
        like every listener. Each connection gets `scrape_seconds` in all, at most `max_scrapes` at once.
        """
        security = security or SecurityConfig()
        check_listen(listen, security, "--metrics-listen")
        if security.tls and certificates is None:
            certificates = ServerCertificates(security)
        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        try:
            server = _MetricsServer(
                (host, int(port)),
                make_wsgi_app(self.registry),
                tls=certificates.ssl_context() if certificates is not None else None,
                scrape_seconds=scrape_seconds,
                max_scrapes=max_scrapes,
            )
        except OSError as exc:
            raise RuntimeError(f"cannot listen on {listen} (--metrics-listen): {exc}") from exc
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        """Stops the /metrics endpoint if it runs."""
        server = getattr(self, "_http", None)
        if server is not None:
            server.shutdown()
            server.server_close()


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
        app,
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

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once rather than queued without bound
            return
        try:
            super().process_request(request, client_address)  # the connection's own thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request, client_address) -> None:
        # One deadline for the whole connection: a per-read timeout alone would let a client that
        # sends a byte now and then hold it for ever. Shutting the socket down (through a duplicate,
        # which outlives the TLS wrapper) wakes whatever read or write is blocked on it.
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

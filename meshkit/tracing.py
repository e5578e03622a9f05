"""Distributed tracing for every binary: OTLP export when configured, W3C trace context in and out; nothing when off."""

from __future__ import annotations

import argparse
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshkit.cli import host_port
from meshkit.logs import get_logger
from meshkit.tls import SecurityConfig

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = get_logger(module="meshkit.tracing")

TRACE_HEADERS = ("traceparent", "tracestate")
"""The W3C trace context fields, read from HTTP headers and gRPC metadata (lower case in both)."""


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where spans go; an empty endpoint turns tracing off (no exporter, no span objects)."""

    otlp_endpoint: str = ""
    """HOST:PORT of an OTLP/gRPC trace receiver (a collector, Jaeger, Tempo); empty: off. Dialled with
    the process's TLS flags (--tls-ca, --tls-cert, --tls-key) when they are set, plaintext otherwise."""
    sample_ratio: float = 1.0
    """Share of new traces recorded (parent-based: a request whose caller sampled it, or not, follows
    the caller's choice)."""


_DEFAULTS = TracingConfig()


def sample_ratio(value: str) -> float:
    """argparse type: a share of traces in [0, 1]."""
    try:
        x = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {value!r}") from exc
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value!r}")
    return x


def add_tracing_flags(parser: argparse.ArgumentParser) -> None:
    """--otlp-endpoint and --otlp-sample-ratio, the same on every serving binary."""
    group = parser.add_argument_group("tracing")
    group.add_argument(
        "--otlp-endpoint",
        type=host_port,
        default=_DEFAULTS.otlp_endpoint or None,
        metavar="HOST:PORT",
        help="export OpenTelemetry spans over OTLP/gRPC to HOST:PORT (TLS with --tls-ca/--tls-cert/--tls-key "
        "when given); default: tracing off",
    )
    group.add_argument(
        "--otlp-sample-ratio",
        type=sample_ratio,
        default=_DEFAULTS.sample_ratio,
        metavar="RATIO",
        help="share of new traces recorded, 0 to 1; a request carrying a traceparent follows its "
        "caller's sampling decision (default %(default)s)",
    )


def tracing_config(args: argparse.Namespace) -> TracingConfig:
    """The TracingConfig the tracing flags name."""
    return TracingConfig(otlp_endpoint=args.otlp_endpoint or "", sample_ratio=args.otlp_sample_ratio)


# Process-wide state: None while tracing is off, so every call site's check is one global load.
_tracer: Tracer | None = None
_provider: TracerProvider | None = None
_propagator: Any = None


def enabled() -> bool:
    """Whether this process records spans."""
    return _tracer is not None


def setup(
    service: str, config: TracingConfig, security: SecurityConfig | None = None, *, instance: str = ""
) -> bool:
    """Starts exporting this process's spans as `service`; returns whether tracing is on. Off
    (no endpoint): nothing of the SDK is imported. Spans are batched (a bounded queue: spans beyond
    it are dropped, never the request) and sent from the SDK's own thread."""
    global _tracer, _provider, _propagator
    if not config.otlp_endpoint:
        return False
    # Imported here: a process with tracing off never loads the SDK.
    import grpc
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    sec = security or SecurityConfig()
    if sec.tls_ca or sec.tls_cert:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(sec.tls_ca),
            private_key=_read(sec.tls_key),
            certificate_chain=_read(sec.tls_cert),
        )
        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, credentials=credentials)
    else:
        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=True)
    attributes = {"service.name": service, "host.name": socket.gethostname()}
    if instance:
        attributes["service.instance.id"] = instance
    resource = Resource.create(attributes)
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    _tracer = provider.get_tracer("globalrouter-mesh")
    _propagator = TraceContextTextMapPropagator()
    log.info(
        "tracing on",
        otlp_endpoint=config.otlp_endpoint,
        sample_ratio=config.sample_ratio,
        tls=bool(sec.tls_ca or sec.tls_cert),
    )
    return True


SHUTDOWN_TIMEOUT_S = 3.0
"""How long a stopping process waits for its last spans to go out: a collector that is down must
not hold the exit (the exporter alone would retry for up to its 10 s deadline per batch)."""


def shutdown(timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Sends the spans still queued and stops the exporter (at process exit), waiting at most `timeout`."""
    global _tracer, _provider, _propagator
    provider = _provider
    _tracer = _provider = _propagator = None
    if provider is None:
        return
    flusher = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
    flusher.start()
    flusher.join(timeout)
    if flusher.is_alive():
        log.warning("tracing: the last spans were not all sent", waited_s=timeout)


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _pick(items: Iterable[tuple[str, Any]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in items:
        k = key.lower()
        if k in TRACE_HEADERS and isinstance(value, str):
            out[k] = value
    return out


def extract_metadata(metadata: Iterable[tuple[str, Any]] | None) -> Context | None:
    """The caller's trace context from gRPC invocation metadata; None when tracing is off. A
    missing or malformed traceparent gives an empty context: the request starts a new trace."""
    if _propagator is None:
        return None
    ctx: Context = _propagator.extract(_pick(metadata or ()))
    return ctx


def extract_headers(headers: Mapping[str, str]) -> Context | None:
    """The caller's trace context from HTTP headers (any case); None when tracing is off."""
    if _propagator is None:
        return None
    ctx: Context = _propagator.extract(_pick(headers.items()))
    return ctx


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying the current span's context to the next hop; None when off."""
    if _propagator is None:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return tuple(carrier.items()) or None


def inject_headers(headers: dict[str, str]) -> None:
    """Adds traceparent (and tracestate) of the current span to outgoing HTTP headers; nothing when off."""
    if _propagator is not None:
        _propagator.inject(headers)


def start_span(
    name: str,
    parent: Context | Span | None = None,
    attributes: Mapping[str, Any] | None = None,
    *,
    server: bool = False,
) -> Span | None:
    """A started span (end it with end()), child of `parent` (a context or a span; none: a new
    trace); None when tracing is off, so callers skip all their span work with one check."""
    tracer = _tracer
    if tracer is None:
        return None
    from opentelemetry import trace

    if parent is not None and not isinstance(parent, dict):
        if isinstance(parent, trace.NonRecordingSpan):
            # A trace sampled out: its children would be sampled out too. The parent stands in for
            # them (its end() does nothing; its context, unsampled, is what goes to the pool).
            return parent
        parent = trace.set_span_in_context(parent)
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
    return tracer.start_span(name, context=parent, kind=kind, attributes=attributes)


def end_span(span: Span | None, error: BaseException | None = None, /, **attributes: Any) -> None:
    """Ends `span` (None: nothing), with `attributes` added and an error status when `error` is given."""
    if span is None:
        return
    if attributes and span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:500]))
    span.end()


_NOTHING = nullcontext()


def current(span: Span | None) -> AbstractContextManager[None]:
    """Makes `span` the current one (what outgoing_metadata and inject_headers send) for the block;
    nothing when None (a shared no-op context: no object made per call)."""
    if span is None:
        return _NOTHING
    return _attached(span)


@contextmanager
def _attached(span: Span) -> Iterator[None]:
    from opentelemetry import context, trace

    token = context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        context.detach(token)


def end_span_with(span: Span | None, attributes: Callable[[], Mapping[str, Any]]) -> None:
    """end_span with attributes built only when the span is recorded (not for a trace sampled out)."""
    if span is None:
        return
    if span.is_recording():
        end_span(span, **attributes())
    else:
        span.end()


@contextmanager
def server_span(
    name: str, metadata: Iterable[tuple[str, Any]] | None, attributes: Mapping[str, Any] | None = None
) -> Iterator[Span | None]:
    """A SERVER span for one incoming gRPC call, continuing the caller's trace from its metadata;
    ends (with an error status on an exception) with the block. Yields None when tracing is off."""
    if _tracer is None:
        yield None
        return
    span = start_span(name, extract_metadata(metadata), attributes, server=True)
    try:
        yield span
    except BaseException as exc:
        end_span(span, exc)
        raise
    else:
        end_span(span)

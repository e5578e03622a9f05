"""The relay's Prometheus metrics: its GetRelayStatus, read on each scrape, as `poolrelay_` metric families."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from meshkit.logs import get_logger
from meshkit.metrics_http import MetricsEndpoint, serve_metrics
from meshkit.timeconv import wall_seconds
from meshkit.tls import SecurityConfig, ServerCertificates
from poolrelay.relay import Relay
from poolrelay.status import relay_status
from poolrelay.v1 import status_pb2

log = get_logger(module="poolrelay.metrics")

# How long a scrape waits for the relay's event loop to build the status. Building it takes
# microseconds (a few fields per stream and worker); a loop busy longer than this fails the scrape
# (HTTP 500, Prometheus records the target down) rather than holding a scrape thread for ever.
STATUS_READ_SECONDS = 2.0

# Labels on every family: several relay replicas may serve one pool, each scraped on its own.
_RELAY = ["pool_id", "relay_id"]

# The state-set series each stream / the relay exports: one per enum value, 1 on the current one.
_STREAM_STATES = {
    v.number: v.name.removeprefix("TELEMETRY_STREAM_STATE_").lower()
    for v in status_pb2.TelemetryStreamState.DESCRIPTOR.values
}
_UNREGISTERED_REASONS = {
    v.number: v.name.removeprefix("UNREGISTERED_REASON_").lower()
    for v in status_pb2.UnregisteredReason.DESCRIPTOR.values
    if v.number != status_pb2.UNREGISTERED_REASON_UNSPECIFIED
}

# Per telemetry stream and per engine worker: (status field, metric name after poolrelay_, counter?,
# help). Counters only grow while the relay runs (a restart, or a stream closed and opened again,
# starts them at 0: Prometheus's rate() takes that as a reset).
_Values = tuple[tuple[str, str, bool, str], ...]
_STREAM_VALUES: _Values = (
    ("messages_sent", "telemetry_messages_sent", True, "Telemetry messages sent on the stream"),
    (
        "messages_dropped",
        "telemetry_messages_dropped",
        True,
        "Telemetry messages dropped because the stream's queue was full (a snapshot recovers them)",
    ),
    ("queue_depth", "telemetry_queue_depth", False, "Messages waiting in the stream's bounded queue"),
    ("connects", "telemetry_connects", True, "Times the stream was (re)opened"),
    (
        "snapshots_sent",
        "telemetry_snapshots_sent",
        True,
        "Block-set snapshots sent (the first, and any the frontend asked for)",
    ),
)
_WORKER_VALUES: _Values = (
    ("healthy", "engine_worker_healthy", False, "1 while the worker answers /health"),
    ("consecutive_failures", "engine_worker_consecutive_failures", False, "Failed /health polls in a row"),
    ("blocks", "engine_worker_blocks", False, "Mesh blocks the worker holds now, as rebuilt from its events"),
    (
        "kv_event_batches",
        "engine_kv_event_batches",
        True,
        "KV event batches taken in sequence, live or replayed",
    ),
    ("kv_events_applied", "engine_kv_events_applied", True, "Events in the decoded batches, applied"),
    ("gaps", "engine_gaps", True, "Sequence gaps seen on the live feed"),
    (
        "replays_asked",
        "engine_replays_asked",
        True,
        "Replays asked of the engine (at start, per gap, after a reset)",
    ),
    ("replays_closed", "engine_replays_closed", True, "Replays answered and applied without dropping blocks"),
    ("replayed_batches", "engine_replayed_batches", True, "Batches taken from replays"),
    (
        "duplicates_skipped",
        "engine_duplicates_skipped",
        True,
        "Live copies of batches already replayed, skipped",
    ),
    ("resets", "engine_resets", True, "Times the worker's blocks were dropped and its feed started again"),
    ("malformed_dropped", "engine_malformed_dropped", True, "Messages dropped as not KV event batches"),
)


def _families(values: _Values, labels: list[str]) -> dict[str, CounterMetricFamily | GaugeMetricFamily]:
    """One family per entry of `values`, by status field."""
    return {
        field: (CounterMetricFamily if counter else GaugeMetricFamily)(
            f"poolrelay_{name}", doc, labels=labels
        )
        for field, name, counter, doc in values
    }


def status_families(status: status_pb2.GetRelayStatusResponse, now: float) -> list[Metric]:
    """The metric families of one status (`now`: wall seconds, for the lease's time left).

    Label cardinality is bounded by the relay's own state, not by its scrapers; no label value comes
    from a scrape. pool_id and relay_id are its flags; worker_id and url its --engine-worker flags,
    fixed at start. frontend_url is a --global-frontends flag or a global frontend discovery lists
    (under TLS only a frontend identity registers one, and discovery checks each URL): the relay
    already keeps a publisher with a bounded queue per such URL, the series add a fixed number per
    stream, and a stream's series go when discovery stops listing it.
    """
    relay = [status.pool_id, status.relay_id]
    out: list[Metric] = []

    def gauge(name: str, doc: str, value: float) -> None:
        family = GaugeMetricFamily(f"poolrelay_{name}", doc, labels=_RELAY)
        family.add_metric(relay, value)
        out.append(family)

    reason = status.routing_pool_unregistered_reason
    gauge(
        "registered",
        "1 while the pool is registered and renewed (unregistered reason none)",
        float(reason == status_pb2.UNREGISTERED_REASON_UNSPECIFIED),
    )
    unregistered = GaugeMetricFamily(
        "poolrelay_unregistered_reason",
        "Why the pool is not registered: 1 on the current reason, 0 on the others (all 0 while registered)",
        labels=[*_RELAY, "reason"],
    )
    for number, name in _UNREGISTERED_REASONS.items():
        unregistered.add_metric([*relay, name], float(reason == number))
    out.append(unregistered)
    gauge("draining", "1 while the pool drains", float(status.draining))
    gauge("pool_blocks", "KV blocks the pool holds (pool-level, counted across workers)", status.pool_blocks)
    gauge("incarnation", "This relay process's incarnation (a restart uses a higher one)", status.incarnation)
    if status.HasField("lease_expire_time"):
        gauge(
            "lease_seconds_left",
            "Seconds until the registration's lease ends unless renewed (absent while unregistered)",
            wall_seconds(status.lease_expire_time) - now,
        )

    stream_labels = [*_RELAY, "frontend_url"]
    state = GaugeMetricFamily(
        "poolrelay_telemetry_stream_state",
        "Each telemetry stream's state: 1 on the current one, 0 on the others",
        labels=[*stream_labels, "state"],
    )
    streams = _families(_STREAM_VALUES, stream_labels)
    for s in status.telemetry_streams:
        values = [*relay, s.frontend_url]
        for number, name in _STREAM_STATES.items():
            state.add_metric([*values, name], float(s.state == number))
        for field, family in streams.items():
            family.add_metric(values, float(getattr(s, field)))
    out += [state, *streams.values()]

    if status.engine_workers:
        worker_labels = [*_RELAY, "worker_id", "url"]
        workers = _families(_WORKER_VALUES, worker_labels)
        last = GaugeMetricFamily(
            "poolrelay_engine_worker_last_sequence",
            "The last KV event batch sequence applied (absent before the first, and after a reset)",
            labels=worker_labels,
        )
        for w in status.engine_workers:
            values = [*relay, w.worker_id, w.url]
            for field, family in workers.items():
                family.add_metric(values, float(getattr(w, field)))
            if w.HasField("last_sequence"):
                last.add_metric(values, w.last_sequence)
        out += [*workers.values(), last]
    return out


class RelayCollector:
    """A prometheus_client collector reading the relay's status on each scrape, from `read`.

    `read` returns (status, wall now); `relay_reader` builds one that reads a running relay.
    """

    def __init__(self, read: Callable[[], tuple[status_pb2.GetRelayStatusResponse, float]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        status, now = self._read()
        return status_families(status, now)


def relay_reader(
    relay: Relay, loop: asyncio.AbstractEventLoop, timeout: float = STATUS_READ_SECONDS
) -> Callable[[], tuple[status_pb2.GetRelayStatusResponse, float]]:
    """Reads the status on the relay's event loop, from the scrape's thread.

    The relay's state (publishers, worker feeds, lease) is changed only by tasks on `loop`, and
    relay_status walks dicts that those tasks add to and remove from: read from another thread it
    could see a dict change size mid-walk or a half-made update. Run on the loop it sees one
    consistent moment, as GetRelayStatus does, and takes the loop only as long as building the reply.
    """

    async def _read() -> tuple[status_pb2.GetRelayStatusResponse, float]:
        return relay_status(relay), relay.clock.wall()

    def read() -> tuple[status_pb2.GetRelayStatusResponse, float]:
        future = asyncio.run_coroutine_threadsafe(_read(), loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # not run later, when no scrape waits for it
            raise RuntimeError(
                f"the relay's event loop did not build its status within {timeout} s"
            ) from None

    return read


def serve_relay_metrics(
    relay: Relay,
    loop: asyncio.AbstractEventLoop,
    listen: str,
    security: SecurityConfig | None = None,
    certificates: ServerCertificates | None = None,
) -> MetricsEndpoint:
    """Serves the relay's metrics at /metrics on `listen` (--metrics-listen), in a registry of its
    own, through the shared bounded endpoint (HTTPS with the status listener's `certificates`
    under TLS; loopback only without TLS unless --insecure). Raises RuntimeError naming the flag."""
    registry = CollectorRegistry()
    registry.register(RelayCollector(relay_reader(relay, loop)))
    return serve_metrics(registry, listen, security, certificates, flag="--metrics-listen")

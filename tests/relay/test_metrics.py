"""The relay's Prometheus collector: its status as `poolrelay_` families, read on the relay's loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meshkit.clock import FakeClock
from meshkit.timeconv import timestamp
from poolrelay.cli import build_parser, config_from_args
from poolrelay.engine.config import EngineConfig, parse_workers
from poolrelay.engine.source import EngineSource
from poolrelay.metrics import RelayCollector, relay_reader
from poolrelay.model_choice import Choice, Reason
from poolrelay.relay import Relay, RelayConfig, RelayConfigError
from poolrelay.v1 import status_pb2

pytestmark = pytest.mark.timeout(30)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
RELAY = (("pool_id", "pool-a"), ("relay_id", "relay-1"))


def scrape(read: Callable[[], tuple[status_pb2.GetRelayStatusResponse, float]]) -> Samples:
    """Every sample of one scrape, as Prometheus parses the exposition, by name and sorted labels."""
    registry = CollectorRegistry()
    registry.register(RelayCollector(read))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def labels(*extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((*RELAY, *extra)))


def test_a_status_maps_to_relay_stream_and_state_families() -> None:
    status = status_pb2.GetRelayStatusResponse(
        healthy=True,
        pool_id="pool-a",
        relay_id="relay-1",
        incarnation=7,
        registered_model="m1",
        pool_blocks=42,
        draining=True,
    )
    status.lease_expire_time.CopyFrom(timestamp(1000.0))
    status.telemetry_streams.add(
        frontend_url="http://f1:9000",
        state=status_pb2.TELEMETRY_STREAM_STATE_STREAMING,
        messages_sent=120,
        queue_depth=3,
        connects=2,
        snapshots_sent=4,
        messages_dropped=5,
    )
    samples = scrape(lambda: (status, 987.5))
    f1 = ("frontend_url", "http://f1:9000")
    expected: Samples = {
        ("poolrelay_registered", labels()): 1.0,
        ("poolrelay_draining", labels()): 1.0,
        ("poolrelay_pool_blocks", labels()): 42.0,
        ("poolrelay_incarnation", labels()): 7.0,
        ("poolrelay_lease_seconds_left", labels()): 12.5,
        ("poolrelay_telemetry_messages_sent_total", labels(f1)): 120.0,
        ("poolrelay_telemetry_messages_dropped_total", labels(f1)): 5.0,
        ("poolrelay_telemetry_queue_depth", labels(f1)): 3.0,
        ("poolrelay_telemetry_connects_total", labels(f1)): 2.0,
        ("poolrelay_telemetry_snapshots_sent_total", labels(f1)): 4.0,
    }
    for state in ("unspecified", "connecting", "streaming", "backing_off", "closed", "refused"):
        expected[("poolrelay_telemetry_stream_state", labels(f1, ("state", state)))] = float(
            state == "streaming"
        )
    for reason in (
        "no_model",
        "several_models",
        "call_failed",
        "relay_stopped",
        "pool_unreachable",
        "pool_drained",
    ):
        expected[("poolrelay_unregistered_reason", labels(("reason", reason)))] = 0.0
    # Counters also carry the _created samples prometheus_client adds to every counter it exposes.
    assert {k: v for k, v in samples.items() if not k[0].endswith("_created")} == expected
    assert not any(name.startswith("poolrelay_engine_") for name, _ in samples)


def test_an_unregistered_pool_shows_its_reason_and_no_lease() -> None:
    status = status_pb2.GetRelayStatusResponse(
        pool_id="pool-a",
        relay_id="relay-1",
        incarnation=1,
        routing_pool_unregistered_reason=status_pb2.UNREGISTERED_REASON_SEVERAL_MODELS,
    )
    samples = scrape(lambda: (status, 0.0))
    assert samples[("poolrelay_registered", labels())] == 0.0
    assert samples[("poolrelay_unregistered_reason", labels(("reason", "several_models")))] == 1.0
    assert samples[("poolrelay_unregistered_reason", labels(("reason", "no_model")))] == 0.0
    assert ("poolrelay_lease_seconds_left", labels()) not in samples


@pytest.fixture
async def engine_relay():
    clock = FakeClock()
    workers = parse_workers(
        [
            "url=http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,id=rank0",
            "url=http://127.0.0.1:8002,events=tcp://127.0.0.1:5558,id=rank1",
        ]
    )
    relay = Relay(
        RelayConfig(
            pool="",
            discovery="127.0.0.1:1",
            pool_id="pool-a",
            region="eu",
            frontends=(),
            relay_id="relay-1",
            incarnation=3,
            engine=EngineConfig(kind="vllm", workers=workers, block_size=32),
        ),
        clock=clock,
    )
    assert isinstance(relay.source, EngineSource)
    yield relay, relay.source, clock
    await relay.stop()
    relay.source._ctx.destroy(linger=0)  # the ZMQ context run() would have closed


async def test_a_running_relays_engine_workers_are_read_on_its_loop_from_the_scrape_thread(
    engine_relay,
) -> None:
    relay, source, clock = engine_relay
    # The relay's state as its loop would have left it: registered, a lease, one worker's feed.
    relay.choice = Choice("m1", Reason.NONE, "")
    relay.registered_model = "m1"
    relay.lease_expire_wall = clock.wall() + 30.0
    rank0 = source.workers["rank0"]
    rank0.healthy = True
    rank0.failures = 0
    rank0.feed.last = 17
    c = rank0.feed.counts
    c.batches, c.events, c.gaps, c.replays, c.replays_closed = 18, 40, 2, 3, 2
    c.replayed_batches, c.duplicates, c.resets, c.malformed = 5, 1, 1, 4
    source.workers["rank1"].failures = 6

    # The scrape runs in another thread (as the HTTP server's); the reader hands the status build
    # to this loop and waits for it.
    read = relay_reader(relay, asyncio.get_running_loop())
    samples = await asyncio.to_thread(scrape, read)

    assert samples[("poolrelay_registered", labels())] == 1.0
    assert samples[("poolrelay_incarnation", labels())] == 3.0
    assert samples[("poolrelay_lease_seconds_left", labels())] == 30.0
    r0 = (("worker_id", "rank0"), ("url", "http://127.0.0.1:8001"))
    r1 = (("worker_id", "rank1"), ("url", "http://127.0.0.1:8002"))
    engine = {
        k: v for k, v in samples.items() if k[0].startswith("poolrelay_engine_") and "_created" not in k[0]
    }
    assert {k: v for k, v in engine.items() if k[1] == labels(*r0)} == {
        ("poolrelay_engine_worker_healthy", labels(*r0)): 1.0,
        ("poolrelay_engine_worker_consecutive_failures", labels(*r0)): 0.0,
        ("poolrelay_engine_worker_blocks", labels(*r0)): 0.0,
        ("poolrelay_engine_worker_last_sequence", labels(*r0)): 17.0,
        ("poolrelay_engine_kv_event_batches_total", labels(*r0)): 18.0,
        ("poolrelay_engine_kv_events_applied_total", labels(*r0)): 40.0,
        ("poolrelay_engine_gaps_total", labels(*r0)): 2.0,
        ("poolrelay_engine_replays_asked_total", labels(*r0)): 3.0,
        ("poolrelay_engine_replays_closed_total", labels(*r0)): 2.0,
        ("poolrelay_engine_replayed_batches_total", labels(*r0)): 5.0,
        ("poolrelay_engine_duplicates_skipped_total", labels(*r0)): 1.0,
        ("poolrelay_engine_resets_total", labels(*r0)): 1.0,
        ("poolrelay_engine_malformed_dropped_total", labels(*r0)): 4.0,
    }
    # The other worker: down, failing, no sequence yet (its last_sequence series is absent).
    assert engine[("poolrelay_engine_worker_healthy", labels(*r1))] == 0.0
    assert engine[("poolrelay_engine_worker_consecutive_failures", labels(*r1))] == 6.0
    assert ("poolrelay_engine_worker_last_sequence", labels(*r1)) not in engine
    assert len({k[1] for k in engine}) == 2


def test_a_scrape_fails_within_the_timeout_while_the_relays_loop_is_busy() -> None:
    """A loop held longer than the timeout fails the scrape (the scrape thread does not wait on)."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    busy, release = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        release.wait(20)

    try:
        loop.call_soon_threadsafe(hold)
        assert busy.wait(10)
        read = relay_reader(object.__new__(Relay), loop, timeout=0.1)  # never read: the build is cancelled
        with pytest.raises(RuntimeError, match=r"did not build its status within 0\.1 s"):
            read()
    finally:
        release.set()
        # The loop runs again and has dropped the cancelled build before it stops.
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


def test_metrics_listen_is_off_unless_given_and_a_bad_one_is_refused_naming_it(capsys) -> None:
    base = ["serve", "--pool", "127.0.0.1:1", "--discovery", "127.0.0.1:2"]
    base += ["--routing-pool", "p", "--routing-pool-region", "r"]
    parser = build_parser()
    assert config_from_args(parser, parser.parse_args(base)).metrics_listen == ""
    given = config_from_args(parser, parser.parse_args([*base, "--metrics-listen", "127.0.0.1:9464"]))
    assert given.metrics_listen == "127.0.0.1:9464"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([*base, "--metrics-listen", "9464"])
    assert exc.value.code == 2 and "--metrics-listen" in capsys.readouterr().err
    # A RelayConfig built in code runs the same check.
    with pytest.raises(RelayConfigError, match="metrics_listen: must be HOST:PORT"):
        replace(given, metrics_listen="localhost:http")

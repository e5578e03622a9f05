"""IngestPacer: telemetry messages applied in bounded slices per event-loop iteration, in order, and the
servicer applies every stream's messages through it."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import grpc
import pytest

from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import IngestPacer, StreamRejected, TelemetryIngest, TelemetryServicer
from meshkit.clock import FakeClock
from poolrelay.v1 import telemetry_pb2

COST = 0.001
"""Fake seconds each message takes to apply."""


class FakeTime:
    """perf_counter's stand-in: advanced only by the messages applied."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _pacer(
    clock: FakeTime, applied: list, slice_seconds: float = 0.004, fail: set | None = None
) -> IngestPacer:
    def apply(stream, msg):
        clock.t += COST
        if fail and msg in fail:
            raise StreamRejected(None, None, f"message {msg} refused")  # type: ignore[arg-type]
        applied.append((stream, msg))
        return f"answer {msg}"

    return IngestPacer(apply, slice_seconds, now=clock)


async def test_each_loop_iteration_applies_at_most_one_slice_of_messages_in_arrival_order():
    """200 streams with a message each arrive in one iteration: each later iteration applies at
    most a slice's worth (4 ms / 1 ms, plus the one that crosses it), so another task (a health
    check) runs between slices instead of after all 200; every message is applied, in order."""
    clock, applied = FakeTime(), list[tuple[str, int]]()
    pacer = _pacer(clock, applied)
    seen: list[int] = []

    async def other_call() -> None:
        while len(applied) < 200:
            seen.append(len(applied))
            await asyncio.sleep(0)

    probe = asyncio.ensure_future(other_call())
    answers = await asyncio.gather(*(pacer.submit(f"s{i}", i) for i in range(200)))  # type: ignore[arg-type]
    await probe
    assert answers == [f"answer {i}" for i in range(200)]
    assert [m for _, m in applied] == list(range(200))
    steps = [b - a for a, b in itertools.pairwise(seen)]
    assert max(steps) <= 5, steps
    assert len(seen) >= 200 // 5
    assert pacer.deferred >= 190 and pacer.waiting == 0


async def test_a_quiet_loop_applies_a_message_at_once():
    clock, applied = FakeTime(), list[tuple[str, int]]()
    pacer = _pacer(clock, applied)
    for i in range(10):
        assert await pacer.submit("s", i) == f"answer {i}"  # type: ignore[arg-type]
        await asyncio.sleep(0)  # a new iteration: a fresh slice
    assert pacer.deferred == 0


async def test_a_refusal_reaches_its_own_stream_and_the_others_go_on():
    clock, applied = FakeTime(), list[tuple[str, int]]()
    pacer = _pacer(clock, applied, fail={30})
    results = await asyncio.gather(
        *(pacer.submit(f"s{i}", i) for i in range(60)),  # type: ignore[arg-type]
        return_exceptions=True,
    )
    assert isinstance(results[30], StreamRejected)
    assert [r for i, r in enumerate(results) if i != 30] == [f"answer {i}" for i in range(60) if i != 30]


async def test_a_cancelled_call_s_waiting_message_is_not_applied():
    clock, applied = FakeTime(), list[tuple[str, int]]()
    pacer = _pacer(clock, applied)
    tasks = [asyncio.ensure_future(pacer.submit(f"s{i}", i)) for i in range(20)]  # type: ignore[arg-type]
    await asyncio.sleep(0)  # all submitted; the first slice's applied at once, the rest wait
    assert pacer.waiting > 0
    tasks[-1].cancel()  # the stream ended (replaced, or the frontend stopping)
    await asyncio.gather(*tasks, return_exceptions=True)
    assert [m for _, m in applied] == list(range(19))


class _Folding:
    """The summary's pattern in fake time: each message logs a block (COST apiece), the work (a
    fold, 3 COST) clears the log; both recorded in `events` (the work as `mark()`)."""

    def __init__(self) -> None:
        self.clock, self.events, self.logged = FakeTime(), list[object](), 0
        self.done = asyncio.Event()
        self.mark: Callable[[], object] = lambda: "work"

    def apply(self, stream, msg):
        self.clock.t += COST
        self.events.append(msg)
        self.logged += 1
        return None

    def work(self) -> None:
        self.events.append(self.mark())
        self.clock.t += 3 * COST  # a fold takes most of a slice
        self.logged = 0
        self.done.set()


async def test_work_left_by_the_messages_runs_first_in_a_slice_of_its_own():
    """Once `due` (the summary's fold), no further message is applied in the current slice: the
    work opens the next slice, counted in it, and the messages follow in order."""
    f = _Folding()
    events = f.events
    pacer = IngestPacer(f.apply, 0.004, now=f.clock, due=lambda: f.logged >= 3, work=f.work)
    await asyncio.gather(*(pacer.submit("s", i) for i in range(12)))  # type: ignore[arg-type]
    # Three messages (the slice has room for four), then the work before any fourth.
    assert events[:4] == [0, 1, 2, "work"], events
    for i, e in enumerate(events):
        if e == "work":
            assert events[i - 3 : i] != [] and all(isinstance(x, int) for x in events[i - 3 : i])
    assert [e for e in events if e != "work"] == list(range(12)) and pacer.works == events.count("work") >= 3
    with pytest.raises(ValueError, match="due and work go together"):
        IngestPacer(f.apply, 0.004, due=lambda: True)


async def test_work_left_pending_is_done_within_its_bound_without_another_message():
    """`pending` work that is not due (a few logged deltas) is done `within` seconds after the
    message that left it, once, in a callback of its own: not at the next message, which may
    never come; nothing is scheduled while nothing is pending."""
    logged, events, done = [0], list[object](), asyncio.Event()

    def apply(stream, msg):
        events.append(msg)
        logged[0] += msg
        return None

    def work():
        events.append("work")
        logged[0] = 0
        done.set()

    loop = asyncio.get_running_loop()
    pacer = IngestPacer(
        apply, 0.004, due=lambda: logged[0] >= 100, work=work, pending=lambda: logged[0] > 0, within=0.02
    )
    await pacer.submit("s", 0)  # type: ignore[arg-type]  # leaves nothing: nothing scheduled
    assert pacer._later is None
    started = loop.time()
    await pacer.submit("s", 1)  # type: ignore[arg-type]
    first = pacer._later
    assert first is not None and started + 0.02 <= first.when() <= loop.time() + 0.02
    await pacer.submit("s", 2)
    assert pacer._later is first and events == [0, 1, 2] and pacer.works == 0  # one timer, not yet run
    await asyncio.wait_for(done.wait(), 10)
    assert events == [0, 1, 2, "work"] and pacer.works == 1 and logged == [0]
    assert pacer._later is None  # done once: nothing pending, nothing scheduled again
    with pytest.raises(ValueError, match="pending needs work and within"):
        IngestPacer(apply, 0.004, due=lambda: False, work=work, pending=lambda: True)


async def test_late_work_on_a_spent_slice_waits_for_a_slice_of_its_own():
    """The `within` work (the summary's fold of a few logged deltas) is telemetry work like the
    messages': when its timer comes in an iteration whose slice the messages already spent, it
    moves to the next iteration and opens that one's slice, instead of adding a fold to a spent
    slice (those made the loop's longest turns at 1,000 pools)."""
    f = _Folding()
    pacer = IngestPacer(
        f.apply,
        0.004,
        now=f.clock,
        due=lambda: f.logged >= 100,
        work=f.work,
        pending=lambda: f.logged > 0,
        within=60,
    )
    f.mark = lambda: ("work", f.clock.t - pacer._start)  # how much of its slice was spent before it
    for i in range(4):  # applied at once, one after the other, in this iteration: its slice is spent
        await pacer.submit("s", i)  # type: ignore[arg-type]
    timer = pacer._later
    assert timer is not None and f.events == [0, 1, 2, 3]
    timer.cancel()
    pacer._late_work()  # its timer, come in this iteration
    assert f.events == [0, 1, 2, 3] and pacer.works == 0  # not on top of the spent slice
    assert pacer._later is not None and pacer._later is not timer
    await asyncio.wait_for(f.done.wait(), 10)
    assert f.events == [0, 1, 2, 3, ("work", 0.0)] and pacer.works == 1  # first in a slice of its own
    assert pacer._later is None and f.logged == 0


def test_the_slice_must_be_positive():
    with pytest.raises(ValueError, match="slice_seconds must be > 0"):
        IngestPacer(lambda s, m: None, 0)


# ---- the servicer: every stream's messages go through the pacer -----------------------------
SPIN = 0.0005
"""Wall seconds each heartbeat takes to apply in the servicer test (a busy wait)."""


class StreamContext:
    """A relay stream's server side: a hello, then heartbeats as fast as they are read (each read
    completes in a later loop iteration, as grpc's do), until `total` were read."""

    def __init__(self, pool: str, total: int) -> None:
        self.pool = pool
        self.total = total
        self.sent = 0
        self.written: list = []

    async def read(self):
        await asyncio.sleep(0)
        self.sent += 1
        if self.sent == 1:
            return telemetry_pb2.PublishPoolTelemetryRequest(
                hello=telemetry_pb2.TelemetryHello(
                    pool_id=self.pool,
                    relay_id="relay-0",
                    incarnation=1,
                    protocol_version=1,
                    block_size=16,
                    hash_scheme=telemetry_pb2.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
                )
            )
        if self.sent > self.total:
            return grpc.aio.EOF
        return telemetry_pb2.PublishPoolTelemetryRequest(heartbeat=telemetry_pb2.TelemetryHeartbeat())

    async def write(self, msg) -> None:
        self.written.append(msg)

    async def abort(self, code, details="", trailing_metadata=()):  # pragma: no cover - a failure
        raise AssertionError(f"aborted: {code} {details}")


async def test_100_busy_streams_leave_the_loop_to_other_calls_between_slices():
    """100 streams whose messages are always there to read: the loop applies about a slice's
    worth (4 ms / 0.5 ms a message) between two turns of another task (a health check's), not one
    message of every stream (100, 50 ms) as when each stream's task applied its own at once."""
    ingest = TelemetryIngest(PoolTable(), KvIndex(), FakeClock(), RouterMetrics())
    receive = ingest.receive
    applied = [0]

    def slow_receive(stream, msg):
        applied[0] += 1
        end = time.perf_counter() + SPIN
        while time.perf_counter() < end:
            pass
        return receive(stream, msg)

    ingest.receive = slow_receive  # type: ignore[method-assign]
    servicer = TelemetryServicer(ingest, "frontend-test")
    contexts = [StreamContext(f"pool-{i}", 20) for i in range(100)]
    calls = [servicer.PublishPoolTelemetry(None, c) for c in contexts]  # type: ignore[arg-type]
    streams = [asyncio.ensure_future(call) for call in calls]
    seen: list[int] = []
    while not all(s.done() for s in streams):
        seen.append(applied[0])
        await asyncio.sleep(0)
    await asyncio.gather(*streams)
    assert applied[0] == 100 * 19
    assert all(c.written[0].WhichOneof("payload") == "hello_ack" for c in contexts)
    per_turn = max(b - a for a, b in itertools.pairwise(seen))
    # 4 ms / 0.5 ms, plus the message that crosses the slice's end and one applied at once
    # by a stream whose read completed before the slice opened: at most 10, far from 100.
    assert per_turn <= 10, per_turn

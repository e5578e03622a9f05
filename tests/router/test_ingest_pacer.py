"""IngestPacer: telemetry messages applied in bounded slices per event-loop iteration, in order."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from globalrouter.telemetry_ingest import IngestPacer, StreamRejected

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


def test_the_slice_must_be_positive():
    with pytest.raises(ValueError, match="slice_seconds must be > 0"):
        IngestPacer(lambda s, m: None, 0)

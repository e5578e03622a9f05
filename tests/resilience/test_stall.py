"""The stall allowance (pure) and the clock-driven read race, on a FakeClock (and its real-clock path)."""

from __future__ import annotations

import asyncio

import pytest

from globalrouter.stall import Silent, StallPolicy, StallWatch, within
from meshkit.clock import FakeClock, SystemClock

POLICY = StallPolicy(stall_timeout=5.0, pace_factor=10.0, first_token_timeout=10.0, prefill_factor=3.0)


def test_first_token_allowance_grows_with_the_pools_predicted_prefill():
    assert StallWatch(POLICY).allowance() == 10.0
    # 20 000 uncached tokens at 10 000 tokens/s: 2 s of prefill, 3 x 2 s on top of the floor.
    assert StallWatch(POLICY, uncached_tokens=20_000, prefill_rate=10_000).allowance() == pytest.approx(16.0)
    assert StallWatch(POLICY, uncached_tokens=20_000, prefill_rate=0).allowance() == 10.0, "rate unknown"


def test_admission_and_first_token_share_one_allowance():
    watch = StallWatch(POLICY, begun=100.0)
    assert watch.allowance(100.0) == 10.0
    assert watch.allowance(104.0) == 6.0, "what admission used is gone"
    assert watch.allowance(130.0) == 0.05, "never less than a short last chance"


def test_mid_stream_allowance_is_the_floor_or_the_streams_own_pace():
    watch = StallWatch(POLICY)
    watch.arrived(100.0)
    assert watch.started and watch.allowance() == 5.0, "a fast pool that stops: the floor"
    for i in range(1, 30):
        watch.arrived(100.0 + i * 1.0)  # a slow pool: one message a second
    assert watch.pace == pytest.approx(1.0)
    assert watch.allowance() == pytest.approx(10.0), "ten of its own gaps"
    watch.arrived(100.0 + 29 + 30.0)  # one long gap moves the estimate, it does not jump to it
    assert watch.pace == pytest.approx(0.8 * 1.0 + 0.2 * 30.0)


@pytest.mark.parametrize("field", ["stall_timeout", "pace_factor", "first_token_timeout"])
def test_policy_refuses_non_positive_values(field):
    with pytest.raises(ValueError, match=field):
        StallPolicy(**{field: 0.0})


async def test_within_returns_what_arrives_in_time(fake_clock: FakeClock):
    box: asyncio.Queue[int] = asyncio.Queue()
    task = asyncio.ensure_future(within(fake_clock, box.get, 5.0))
    await fake_clock.advance(4.0)
    box.put_nowait(7)
    await fake_clock.settle()
    assert await task == 7
    assert fake_clock.sleepers == 0, "the timer is gone"


async def test_within_gives_up_after_the_allowance_and_cancels_the_read(fake_clock: FakeClock):
    cancelled = asyncio.Event()

    async def hung() -> int:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        return 0

    task = asyncio.ensure_future(within(fake_clock, hung, 5.0))
    await fake_clock.advance(4.9)
    assert not task.done()
    await fake_clock.advance(0.2)
    with pytest.raises(Silent, match=r"5\.0 s"):
        await task
    assert cancelled.is_set()


async def test_within_on_the_real_clock_returns_in_time_gives_up_after_the_allowance_and_keeps_a_reads_own_timeout():
    # The real clock's path (asyncio.timeout around the read, no race of tasks) means the same.
    clock = SystemClock()

    async def value() -> int:
        await asyncio.sleep(0)
        return 7

    assert await within(clock, value, 5.0) == 7
    cancelled = asyncio.Event()

    async def hangs() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(Silent):
        await within(clock, hangs, 0.01)
    assert cancelled.is_set(), "the read was given up on"

    async def times_out_itself() -> None:
        raise TimeoutError("the read's own")

    with pytest.raises(TimeoutError, match="the read's own"):
        await within(clock, times_out_itself, 5.0)

"""The registration heartbeat on a FakeClock: renewal, back-off, the last call before expiry, idle, cancel."""

from __future__ import annotations

import asyncio

import pytest

from meshkit.clock import FakeClock
from poolrelay.heartbeat import HeartbeatLoop, Renewal

INTERVAL, LEASE = 5.0, 15.0


class Discovery:
    """Records call times (relative to the start) and fails while `failing` is set."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.start = clock.monotonic()
        self.calls: list[tuple[float, str]] = []
        self.failing = False

    async def register(self, want: str) -> Renewal:
        self.calls.append((self.clock.monotonic() - self.start, want))
        if self.failing:
            raise ConnectionError("discovery down")
        return Renewal(INTERVAL, LEASE)

    @property
    def times(self) -> list[float]:
        return [t for t, _ in self.calls]


@pytest.fixture
async def setup(fake_clock):
    disco = Discovery(fake_clock)
    wanted = {"value": "model-a"}
    loop = HeartbeatLoop(fake_clock, lambda: wanted["value"], disco.register)
    task = asyncio.get_running_loop().create_task(loop.run())
    await fake_clock.settle()
    yield fake_clock, disco, loop, wanted, task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def advance_to(clock: FakeClock, disco: Discovery, t: float) -> None:
    await clock.advance(disco.start + t - clock.monotonic())


async def test_renews_every_server_dictated_interval(setup):
    clock, disco, _, _, _ = setup
    await advance_to(clock, disco, 16)
    assert disco.times == [0, 5, 10, 15]


async def test_retry_backoff_doubles_to_the_interval_and_resets_after_success(setup):
    clock, disco, _, _, _ = setup
    await advance_to(clock, disco, 4)
    disco.failing = True
    await advance_to(clock, disco, 11)
    assert disco.times == [0, 5, 6, 8], "retried after 1 s, then 2 s"
    disco.failing = False
    await advance_to(clock, disco, 12)  # 8 + 4 s: success
    disco.failing = True
    await advance_to(clock, disco, 17)  # renewal due 12 + 5 fails
    disco.failing = False
    await advance_to(clock, disco, 19)
    assert disco.times == [0, 5, 6, 8, 12, 17, 18], "back-off restarted at 1 s after the success"
    await advance_to(clock, disco, 23.5)
    assert disco.times[-1] == 23, "renewals resume every interval"


async def test_one_more_call_one_second_before_the_lease_ends(setup):
    clock, disco, _, _, _ = setup
    await advance_to(clock, disco, 1)
    disco.failing = True  # lease from the call at 0 ends at 15
    await advance_to(clock, disco, 25)
    # 5 fails; +1, +2, +4 → 12; the next wait (5, capped at the interval) would pass the lease's
    # end, so the last call before it goes at 15 - 1 = 14; then every 5 s, every failure retried.
    assert disco.times == [0, 5, 6, 8, 12, 14, 19, 24]


async def test_nothing_sent_without_a_registration_and_it_goes_out_at_once(fake_clock):
    disco = Discovery(fake_clock)
    wanted: dict[str, str | None] = {"value": None}
    loop = HeartbeatLoop(fake_clock, lambda: wanted["value"], disco.register)
    task = asyncio.get_running_loop().create_task(loop.run())
    await fake_clock.advance(60)
    assert disco.calls == [], "nothing to register: nothing sent"
    wanted["value"] = "model-a"
    loop.poke()
    await fake_clock.settle()
    assert disco.calls == [(60, "model-a")], "the registration goes out at once"
    await fake_clock.advance(2)
    wanted["value"] = "model-b"  # a model change does not wait for the next heartbeat
    loop.poke()
    await fake_clock.settle()
    assert disco.calls[-1] == (62, "model-b")
    wanted["value"] = None
    loop.poke()
    await fake_clock.advance(30)
    assert len(disco.calls) == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_stops_on_cancel(setup):
    clock, disco, _, _, task = setup
    await advance_to(clock, disco, 6)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await advance_to(clock, disco, 30)
    assert disco.times == [0, 5]
    assert clock.sleepers == 0, "no timer left behind"


async def test_discovery_answering_again_ends_the_failure_wait_at_once(setup):
    """After an outage the relay registers as soon as discovery answers, not at the end of the
    doubled wait (fails on the code before: the loop had no `reachable`)."""
    clock, disco, loop, _, _ = setup
    await advance_to(clock, disco, 1)
    disco.failing = True
    await advance_to(clock, disco, 8.5)
    assert disco.times == [0, 5, 6, 8], "failed at 5, 6 and 8; the next try is due at 12"
    loop.reachable()  # the channel connected at 8.5, but the call fails again
    await clock.settle()
    assert disco.times == [0, 5, 6, 8, 8.5], "the retry went at once"
    assert loop.schedule.next_at - disco.start == 13.5, "the back-off went on (4 doubled, capped at 5)"
    disco.failing = False
    await advance_to(clock, disco, 9)
    loop.reachable()  # discovery answers again: the retry goes now, not at 13.5
    await clock.settle()
    assert disco.times == [0, 5, 6, 8, 8.5, 9]
    await advance_to(clock, disco, 9.5)
    loop.reachable()  # outside a failure streak it changes nothing: renewals keep the interval
    await advance_to(clock, disco, 13.9)
    assert disco.times[-1] == 9
    await advance_to(clock, disco, 14)
    assert disco.times[-1] == 14

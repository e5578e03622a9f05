"""The registration heartbeat: a pure renewal schedule and an async loop on an injectable clock.

Schedule (DESIGN.md): renew every server-dictated heartbeat interval; a failed call is retried
after 1 s, the wait doubling up to the interval; one more call is made 1 s before the lease ends
(so an outage that ends before then keeps the pool listed); every failure is retried; a success
resets the back-off. While there is nothing to register nothing is sent, and a registration that
changes (a model appears or changes) goes out at once. When discovery is seen to answer again during
a streak of failed calls (the relay's channel to it connected), the retry goes out at once rather
than at the end of the doubled wait (on_reachable): the sooner the relay registers after an outage,
the sooner a pool whose lease lapsed in it is listed again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from meshkit.clock import Clock

FIRST_RETRY_S = 1.0
LAST_CALL_BEFORE_EXPIRY_S = 1.0
# Until the first reply dictates the interval, back-off is capped at discovery's default interval.
DEFAULT_INTERVAL_S = 5.0


@dataclass(frozen=True)
class Renewal:
    """The server-dictated timing from a successful RegisterPool reply."""

    heartbeat_interval: float
    """Seconds until the next renewal."""
    lease_duration: float
    """Seconds the lease lives without renewal (counted from the call's start)."""


class HeartbeatSchedule:
    """When the next RegisterPool call is due (pure; times are monotonic seconds)."""

    def __init__(self) -> None:
        self.interval = DEFAULT_INTERVAL_S
        self.lease_end: float | None = None
        self.backoff = FIRST_RETRY_S
        self.next_at = 0.0
        self.last_call_made = False
        self.failures = 0
        """Calls failed since the last success (a failure streak while > 0)."""

    def on_success(self, started: float, now: float, renewal: Renewal) -> float:
        """Records a success of a call begun at `started`; returns when the next renewal is due."""
        self.interval = renewal.heartbeat_interval
        # The lease runs from when the server handled the call, which is no earlier than `started`.
        self.lease_end = started + renewal.lease_duration
        self.backoff = FIRST_RETRY_S
        self.last_call_made = False
        self.failures = 0
        self.next_at = now + self.interval
        return self.next_at

    def on_failure(self, now: float) -> float:
        """Records a failed call at `now`; returns when to try again."""
        self.failures += 1
        wait = min(self.backoff, self.interval)
        self.backoff = min(self.backoff * 2, self.interval)
        due = now + wait
        if self.lease_end is not None and not self.last_call_made:
            last_call = self.lease_end - LAST_CALL_BEFORE_EXPIRY_S
            if now < last_call < due:
                due = last_call
                self.last_call_made = True
        self.next_at = due
        return due

    def on_reachable(self, now: float) -> bool:
        """Discovery answers again (the channel to it connected) at `now`: during a failure streak
        the retry is due at once instead of at the end of its doubled wait; True when that moved
        it. Outside a streak nothing changes (renewals keep the server's interval). The back-off
        itself is kept: if that call fails too, the next wait continues the doubling."""
        if self.failures == 0 or self.next_at <= now:
            return False
        self.next_at = now
        return True

    def reset(self) -> None:
        """Forgets the lease (after nothing was registered for a while, or an unregistration)."""
        self.lease_end = None
        self.backoff = FIRST_RETRY_S
        self.last_call_made = False
        self.failures = 0
        self.next_at = 0.0


W = TypeVar("W")


class HeartbeatLoop(Generic[W]):
    """Sends `register(wanted)` on the schedule while `wanted()` returns something.

    `wanted()` returns what to register now (any comparable value) or None; `poke()` says it may
    have changed. `register` raises on failure and returns the server's Renewal on success.
    """

    def __init__(
        self,
        clock: Clock,
        wanted: Callable[[], W | None],
        register: Callable[[W], Awaitable[Renewal]],
        *,
        on_failure: Callable[[W, BaseException], None] | None = None,
    ) -> None:
        self._clock = clock
        self._wanted = wanted
        self._register = register
        self._on_failure = on_failure
        self.schedule = HeartbeatSchedule()
        self._last_sent: W | None = None
        self._changed = asyncio.Event()
        self._sleeper: asyncio.Future[None] | None = None

    def reachable(self) -> None:
        """Discovery answers again: a retry waiting out a failure's back-off goes now
        (HeartbeatSchedule.on_reachable); a no-op otherwise."""
        if self.schedule.on_reachable(self._clock.monotonic()):
            self.poke()

    def poke(self) -> None:
        """What to register may have changed: re-evaluate now."""
        self._changed.set()
        if self._sleeper is not None:
            self._sleeper.cancel()

    async def _wait(self, until: float | None) -> None:
        """Waits until `until` on the clock (forever when None) or until poked.

        No helper tasks beyond the one sleep: on a FakeClock every extra task is an extra loop
        round before the next sleep is registered.
        """
        if until is None:
            await self._changed.wait()
            return
        if self._changed.is_set():
            return
        self._sleeper = asyncio.ensure_future(self._clock.sleep(until - self._clock.monotonic()))
        try:
            await self._sleeper
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the loop itself is cancelled, not just poked
        finally:
            self._sleeper.cancel()
            self._sleeper = None

    async def run(self) -> None:
        """Runs until cancelled."""
        while True:
            self._changed.clear()
            want = self._wanted()
            if want is None:
                if self._last_sent is not None:
                    self.schedule.reset()
                self._last_sent = None
                await self._wait(None)
                continue
            now = self._clock.monotonic()
            if want == self._last_sent and now < self.schedule.next_at:
                await self._wait(self.schedule.next_at)
                continue
            try:
                renewal = await self._register(want)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._last_sent = want
                self.schedule.on_failure(self._clock.monotonic())
                if self._on_failure is not None:
                    self._on_failure(want, exc)
                continue
            self._last_sent = want
            self.schedule.on_success(now, self._clock.monotonic(), renewal)

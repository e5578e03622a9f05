"""An injectable clock: real time in services, a fake clock in tests of leases, heartbeats and back-off."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    """Time as a service sees it: a monotonic clock for deadlines, a wall clock for display."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; only differences mean anything."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch (for timestamps shown to people and other processes)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Waits `seconds` on this clock."""
        ...


class SystemClock:
    """The real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that moves only when a test says so.

    `sleep` parks the caller until `advance` moves time past its wake-up; `advance` wakes sleepers
    in time order and lets each run before moving on, so a loop that sleeps, acts and sleeps
    again behaves exactly as it would in real time.
    """

    def __init__(self, start: float = 1000.0, wall_offset: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_offset
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + max(0.0, seconds), next(self._order), fut))
        await fut

    @property
    def sleepers(self) -> int:
        """How many tasks wait on this clock now."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    def parked_at(self, when: float) -> bool:
        """Whether a task sleeps on this clock until `when` now.

        A test that advances time must first wait for the code under test to park: an advance that
        runs before the sleep is registered is missed, and the sleep then never ends.
        """
        return any(abs(due - when) < 1e-6 and not f.done() for due, _, f in self._sleepers)

    async def settle(self, rounds: int = 5) -> None:
        """Lets ready tasks run until they block (on the clock or elsewhere)."""
        for _ in range(rounds):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Moves time forward by `seconds`, waking every sleeper due on the way, in order."""
        target = self._now + seconds
        await self.settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            due, _, fut = heapq.heappop(self._sleepers)
            self._now = max(self._now, due)
            if not fut.done():
                fut.set_result(None)
            await self.settle()
        self._now = target
        await self.settle()

    def set(self, monotonic: float) -> None:
        """Jumps to `monotonic` without waking anyone (for pure, non-async code under test)."""
        self._now = monotonic

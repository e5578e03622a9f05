"""SnapshotReaders: at most a few telemetry streams read a snapshot at once; the rest read nothing yet."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

SNAPSHOT_READERS = 8
"""Streams that may read a snapshot at the same time. Every message read is a callback on the
serving loop (gRPC's read and its parse) before the pacer sees it; in a restart 2,000 streams'
snapshots arrived within seconds, loop turns grew past 100 ms, and a main-port call (which takes
several turns, from its accept to its status) waited up to 0.3-0.8 s at 10,000 blocks a pool
and 3.7-8.8 s at 100,000. With 8 readers the slowest was 0.10-0.19 s and 0.20-0.22 s, and every
pool came back within the same 30 s goal, at times later (10.0 s against 7.9 s in one restart at
10,000 blocks, 23.8 s against 19.5 s at 100,000; BENCHMARKS.md, "Snapshot readers bounded"). The others' data waits in their connections: gRPC's flow control holds their relays
back."""
SNAPSHOT_READ_IDLE = 1.0
"""Seconds a reader may go without a snapshot chunk from its relay (other messages do not count)
before its slot goes to the next stream: a stopped, slow or silent relay must not hold the
others' snapshots back. It then reads the rest of that snapshot without a slot (a slow stream's
reads are few), rather than queue again at the back holding its partial snapshot."""


class Handle(Protocol):
    """A scheduled callback that can be called off (asyncio.TimerHandle)."""

    def cancel(self) -> None: ...


Later = Callable[[float, Callable[[], None]], Handle]
"""Runs a callback some seconds from now: the running loop's call_later, or a test's fake."""


def _call_later(delay: float, callback: Callable[[], None]) -> Handle:
    return asyncio.get_running_loop().call_later(delay, callback)


class SnapshotReaders:
    """Slots for streams owing a snapshot, handed out in arrival order (asyncio.Semaphore)."""

    def __init__(
        self, slots: int = SNAPSHOT_READERS, idle: float = SNAPSHOT_READ_IDLE, later: Later = _call_later
    ) -> None:
        if slots < 0:
            raise ValueError(f"slots must be >= 0 (0: no bound; got {slots})")
        if not idle > 0:
            raise ValueError(f"idle must be > 0 seconds (got {idle})")
        self.idle = idle
        self._later = later
        self._free = asyncio.Semaphore(slots) if slots else None
        self.waiting = 0
        """Streams waiting for a slot now."""
        self.reading = 0
        """Streams holding a slot now."""
        self.idled = 0
        """Slots given up because no snapshot chunk came within `idle` seconds (the rest of that
        snapshot is then read without a slot)."""

    def turn(self) -> SnapshotTurn:
        """One stream's handle (it holds no slot yet)."""
        return SnapshotTurn(self)


class SnapshotTurn:
    """One stream's hold on a SnapshotReaders slot. The stream calls `take` before each read while
    it owes a snapshot, `got` after each snapshot chunk it read holding the slot, and `give_back`
    once it owes none (and when it ends). `engaged` says whether there is anything to give back."""

    __slots__ = ("_readers", "_timer", "free_run", "holding")

    def __init__(self, readers: SnapshotReaders) -> None:
        self._readers = readers
        self.holding = False
        self.free_run = False
        """The slot idled away during this snapshot: the rest of it is read without one."""
        self._timer: Handle | None = None

    @property
    def engaged(self) -> bool:
        return self.holding or self.free_run

    async def take(self) -> None:
        """Waits for a slot unless this stream holds one (or reads on without, after idling), then
        starts the idle bound if none runs (cancelled while waiting: no slot is held)."""
        readers = self._readers
        if self.free_run:
            return
        if not self.holding and readers._free is not None:
            readers.waiting += 1
            try:
                await readers._free.acquire()
            finally:
                readers.waiting -= 1
            self.holding = True
            readers.reading += 1
        if self.holding and self._timer is None:
            self._timer = readers._later(readers.idle, self._idle)

    def got(self) -> None:
        """A snapshot chunk came: the idle bound is off until the next `take`."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def give_back(self) -> None:
        """Frees the slot (if held) for the next waiting stream; the stream owes no snapshot now."""
        self._release()
        self.free_run = False

    def _release(self) -> None:
        self.got()
        if self.holding:
            self.holding = False
            self._readers.reading -= 1
            assert self._readers._free is not None
            self._readers._free.release()

    def _idle(self) -> None:
        self._timer = None
        if self.holding:
            self._readers.idled += 1
            self._release()
            self.free_run = True

"""The task that applies a directory's deadlines (leases, drains) on time: it sleeps until the next one."""

from __future__ import annotations

import asyncio
import contextlib

from globaldiscovery.lease_state import Directory
from meshkit.clock import Clock
from meshkit.logs import get_logger

log = get_logger(module="globaldiscovery.store.expiry")


class Expiry:
    """Wakes exactly at the directory's next deadline (not a coarse poll), so removal lag stays small."""

    def __init__(self, directory: Directory, clock: Clock) -> None:
        self.directory = directory
        self.clock = clock
        self._wake = asyncio.Event()
        self._scheduled: float | None = None  # the deadline the task sleeps towards
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="discovery-expiry")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def poke(self) -> None:
        """Wakes the task when something now ends earlier than what it sleeps towards."""
        deadline = self.directory.next_deadline()
        if deadline is not None and (self._scheduled is None or deadline < self._scheduled):
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            try:
                self.directory.advance(self.clock.monotonic())
            except Exception:  # a bug here must not stop expiry for good
                log.exception("expiry failed")
            self._scheduled = self.directory.next_deadline()
            self._wake.clear()
            waits: set[asyncio.Future] = {asyncio.ensure_future(self._wake.wait())}
            if self._scheduled is not None:
                waits.add(asyncio.ensure_future(self.clock.sleep(self._scheduled - self.clock.monotonic())))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

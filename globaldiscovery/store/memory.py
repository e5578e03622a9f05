"""The in-memory store: one Directory in this process, and a task that ends leases on time."""

from __future__ import annotations

import asyncio
import contextlib

from globaldiscovery.directory import (
    Directory,
    FrontendView,
    PoolRegistration,
    PoolView,
    RegisterResult,
    Removal,
    Watcher,
)
from meshkit.clock import Clock
from meshkit.logs import get_logger

log = get_logger(module="globaldiscovery.store.memory")


class MemoryStore:
    """The directory of one discovery replica; `complete` only one lease duration after start."""

    def __init__(
        self,
        clock: Clock,
        *,
        heartbeat_interval: float,
        lease_duration: float,
        watch_queue_limit: int = 10_000,
    ) -> None:
        self.clock = clock
        self.heartbeat_interval = heartbeat_interval
        self.lease_duration = lease_duration
        now = clock.monotonic()
        self.directory = Directory(
            lease_duration,
            started_at=now,
            wall_offset=clock.wall() - now,
            watch_queue_limit=watch_queue_limit,
        )
        self._wake = asyncio.Event()
        self._scheduled: float | None = None  # the deadline the expiry task sleeps towards
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._expire_loop(), name="discovery-expiry")

    async def close(self) -> None:
        self.directory.close_watchers()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _poke(self) -> None:
        """Wakes the expiry task when something now ends earlier than what it sleeps towards."""
        deadline = self.directory.next_deadline()
        if deadline is not None and (self._scheduled is None or deadline < self._scheduled):
            self._wake.set()

    async def _expire_loop(self) -> None:
        """Sleeps until the next deadline exactly (not a coarse poll), so removal lag stays small."""
        while True:
            try:
                self.directory.advance(self.clock.monotonic())
            except Exception:  # a bug here must not stop expiry for good
                log.exception("expiry failed")
            self._scheduled = self.directory.next_deadline()
            self._wake.clear()
            waiter = asyncio.ensure_future(self._wake.wait())
            waits: set[asyncio.Future] = {waiter}
            if self._scheduled is not None:
                waits.add(asyncio.ensure_future(self.clock.sleep(self._scheduled - self.clock.monotonic())))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    def _now(self) -> float:
        return self.clock.monotonic()

    async def register_pool(self, reg: PoolRegistration) -> RegisterResult:
        try:
            return self.directory.register_pool(reg, self._now())
        finally:
            self._poke()

    async def unregister_pool(self, pool_id: str, relay_id: str, incarnation: int, reason: Removal) -> bool:
        return self.directory.unregister_pool(pool_id, relay_id, incarnation, reason, self._now())

    async def remove_pool(self, pool_id: str) -> PoolView:
        return self.directory.remove_pool(pool_id, self._now())

    async def drain_pool(self, pool_id: str, timeout: float) -> PoolView:  # noqa: ASYNC109 (a drain length)
        try:
            return self.directory.drain_pool(pool_id, timeout, self._now())
        finally:
            self._poke()

    async def list_pools(
        self, *, model: str, region: str, after: str | None, limit: int
    ) -> tuple[list[PoolView], bool, bool]:
        now = self._now()
        pools, more = self.directory.list_pools(now, model=model, region=region, after=after, limit=limit)
        return pools, more, self.directory.complete(now)

    async def watch(self, *, model: str, region: str) -> Watcher:
        return self.directory.watch(self._now(), model=model, region=region)

    def unwatch(self, watcher: Watcher) -> None:
        self.directory.unwatch(watcher)

    async def register_frontend(
        self, frontend_id: str, url: str, region: str, incarnation: int
    ) -> FrontendView:
        try:
            return self.directory.register_frontend(frontend_id, url, region, incarnation, self._now())
        finally:
            self._poke()

    async def unregister_frontend(self, frontend_id: str, incarnation: int) -> bool:
        return self.directory.unregister_frontend(frontend_id, incarnation, self._now())

    def frontends_version(self) -> object:
        self.directory.advance(self._now())  # an expired frontend changes the list too
        return self.directory.frontends_version

    async def list_frontends(self) -> tuple[list[FrontendView], bool]:
        now = self._now()
        return self.directory.list_frontends(now), self.directory.complete(now)

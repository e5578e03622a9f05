"""The in-memory store: one Directory in this process, and a task that ends leases on time."""

from __future__ import annotations

from collections.abc import Callable

from globaldiscovery.lease_state import DEFAULT_HISTORY_BYTES, DEFAULT_QUEUE_BYTES, Directory
from globaldiscovery.records import FrontendView, PoolRegistration, PoolView, RegisterResult, Removal
from globaldiscovery.store.expiry import Expiry
from globaldiscovery.watch_fanout import Watcher
from meshkit.clock import Clock


class MemoryStore:
    """The directory of one discovery replica; `complete` only one lease duration after start."""

    def __init__(
        self,
        clock: Clock,
        *,
        heartbeat_interval: float,
        lease_duration: float,
        watch_queue_limit: int = 10_000,
        watch_queue_bytes: int = DEFAULT_QUEUE_BYTES,
        watch_history_limit: int = 10_000,
        watch_history_bytes: int = DEFAULT_HISTORY_BYTES,
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
            watch_queue_bytes=watch_queue_bytes,
            watch_history_limit=watch_history_limit,
            watch_history_bytes=watch_history_bytes,
        )
        self._expiry = Expiry(self.directory, clock)

    async def start(self) -> None:
        self._expiry.start()

    async def close(self) -> None:
        self.directory.close_watchers()
        await self._expiry.stop()

    def on_health(self, listener: Callable[[bool], None]) -> None:
        """Never called: this process is the whole directory."""

    def _now(self) -> float:
        return self.clock.monotonic()

    async def register_pool(self, reg: PoolRegistration) -> RegisterResult:
        try:
            return self.directory.register_pool(reg, self._now())
        finally:
            self._expiry.poke()  # something may now end earlier

    async def unregister_pool(self, pool_id: str, relay_id: str, incarnation: int, reason: Removal) -> bool:
        return self.directory.unregister_pool(pool_id, relay_id, incarnation, reason, self._now())

    async def remove_pool(self, pool_id: str) -> PoolView:
        return self.directory.remove_pool(pool_id, self._now())

    async def drain_pool(self, pool_id: str, timeout: float) -> PoolView:  # noqa: ASYNC109 (a drain length)
        try:
            return self.directory.drain_pool(pool_id, timeout, self._now())
        finally:
            self._expiry.poke()

    async def list_pools(
        self, *, model: str, region: str, after: str | None, limit: int
    ) -> tuple[list[PoolView], bool, bool]:
        now = self._now()
        pools, more = self.directory.list_pools(now, model=model, region=region, after=after, limit=limit)
        return pools, more, self.directory.complete(now)

    async def watch(self, *, model: str, region: str, start_revision: int = 0) -> Watcher:
        return self.directory.watch(self._now(), model=model, region=region, start_revision=start_revision)

    def unwatch(self, watcher: Watcher) -> None:
        self.directory.unwatch(watcher)

    async def register_frontend(
        self, frontend_id: str, url: str, region: str, incarnation: int
    ) -> FrontendView:
        try:
            return self.directory.register_frontend(frontend_id, url, region, incarnation, self._now())
        finally:
            self._expiry.poke()

    async def unregister_frontend(self, frontend_id: str, incarnation: int) -> bool:
        return self.directory.unregister_frontend(frontend_id, incarnation, self._now())

    def frontends_version(self) -> object:
        self.directory.advance(self._now())  # an expired frontend changes the list too
        return self.directory.frontends_version

    async def list_frontends(self) -> tuple[list[FrontendView], bool]:
        now = self._now()
        return self.directory.list_frontends(now), self.directory.complete(now)

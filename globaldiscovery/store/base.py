"""The Store interface the gRPC layer talks to; each store keeps time (leases, drains) itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from globaldiscovery.records import FrontendView, PoolRegistration, PoolView, RegisterResult, Removal
from globaldiscovery.watch_fanout import Watcher


class StoreUnavailable(Exception):
    """A shared store cannot be reached or did not answer in time (UNAVAILABLE for the caller)."""


class StoreIsolated(StoreUnavailable):
    """This replica lost its shared store for longer than it may serve without it: every call is
    refused (UNAVAILABLE) until it is back, so callers move to another replica."""


class Store(Protocol):
    """The pool and frontend directory behind DiscoveryService.

    Errors are lease_rules' (StaleIncarnation, ModelConflict, DrainCompleted, NotFound) and
    StoreUnavailable.
    """

    heartbeat_interval: float
    lease_duration: float

    async def start(self) -> None:
        """Starts background work (expiry)."""

    async def close(self) -> None:
        """Ends every watcher (they see the stream end) and stops background work."""

    def on_health(self, listener: Callable[[bool], None]) -> None:
        """Calls `listener(False)` when the store stops serving (cut off from what it shares),
        `listener(True)` when it serves again; a store that cannot be cut off never calls it."""

    async def register_pool(self, reg: PoolRegistration) -> RegisterResult:
        """Registers or renews one relay replica's lease of a pool."""

    async def unregister_pool(self, pool_id: str, relay_id: str, incarnation: int, reason: Removal) -> bool:
        """Ends one lease at once; True when that removed the pool."""

    async def remove_pool(self, pool_id: str) -> PoolView:
        """Removes a pool and all its leases."""

    async def drain_pool(self, pool_id: str, timeout: float) -> PoolView:  # noqa: ASYNC109 (a drain length)
        """Starts a discovery-side drain ending `timeout` seconds from now."""

    async def list_pools(
        self, *, model: str, region: str, after: str | None, limit: int
    ) -> tuple[list[PoolView], bool, bool]:
        """A page of pools after `after`; whether more follow; whether the listing is complete."""

    async def watch(self, *, model: str, region: str, start_revision: int = 0) -> Watcher:
        """A watcher holding the snapshot and SNAPSHOT_DONE (or, resumed after `start_revision`,
        a resumed SNAPSHOT_DONE and the events since), then every change."""

    def unwatch(self, watcher: Watcher) -> None:
        """Forgets a watcher whose stream ended."""

    async def register_frontend(
        self, frontend_id: str, url: str, region: str, incarnation: int
    ) -> FrontendView:
        """Registers or renews a global frontend's lease."""

    async def unregister_frontend(self, frontend_id: str, incarnation: int) -> bool:
        """Ends a global frontend's lease at once."""

    def frontends_version(self) -> object:
        """A value that changes whenever the frontend list changes (None: unknown, do not cache)."""

    async def list_frontends(self) -> tuple[list[FrontendView], bool]:
        """Every live frontend ordered by id, and whether the listing is complete."""

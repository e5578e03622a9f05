"""The pool directory as this frontend knows it: kept from discovery's WatchPools, never emptied by an outage."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from globaldiscovery.v1 import discovery_pb2, discovery_pb2_grpc
from globalrouter.pool_state import PoolCapacityHint, PoolState
from meshkit.clock import Clock
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.pool_directory")

EventType = discovery_pb2.WatchEventType


class PoolTable:
    """Every pool this frontend knows, listed by discovery or only heard of over telemetry.

    The directory watch writes the directory fields; telemetry writes the signal fields. A pool
    that leaves the directory is kept while telemetry streams still describe it (listed=False), so
    a re-listing finds its KV state intact.
    """

    def __init__(self) -> None:
        self.pools: dict[str, PoolState] = {}
        self.lease_incarnations: dict[str, dict[str, int]] = {}
        """pool_id -> relay_id -> incarnation of that relay's live lease (from the directory)."""
        self.synced = False
        """True once a watch snapshot has been taken (the directory is then known)."""
        self.complete = False
        """Discovery's own completeness flag of the last snapshot."""
        self.stream_counts: dict[str, int] = {}
        """pool_id -> telemetry streams open for it (maintained by telemetry ingestion)."""

    def get(self, pool_id: str) -> PoolState:
        """The pool's state, created (unlisted) when unknown."""
        pool = self.pools.get(pool_id)
        if pool is None:
            pool = self.pools[pool_id] = PoolState(pool_id=pool_id)
        return pool

    def listed(self) -> list[PoolState]:
        """The pools discovery lists (the only ones selection considers)."""
        return [p for p in self.pools.values() if p.listed]

    def forget_if_unused(self, pool_id: str) -> None:
        """Drops a pool that is neither listed nor described by any telemetry stream."""
        pool = self.pools.get(pool_id)
        if pool is not None and not pool.listed and not self.stream_counts.get(pool_id):
            del self.pools[pool_id]

    # ---- directory events -----------------------------------------------------------------
    def apply_listed(self, msg: discovery_pb2.Pool) -> PoolState:
        """A pool is listed (ADDED/UPDATED): its directory fields take the message's values."""
        pool = self.get(msg.pool_id)
        pool.listed = True
        pool.model = msg.model
        pool.region = msg.region
        pool.frontends = tuple(msg.frontends)
        pool.openai_http = msg.frontend_protocol == discovery_pb2.FRONTEND_PROTOCOL_OPENAI_HTTP
        pool.directory_draining = msg.draining
        cap = msg.capacity
        pool.capacity = PoolCapacityHint(
            max_running_requests=cap.max_running_requests,
            kv_cache_blocks=cap.kv_cache_blocks,
            prefill_tokens_per_second=cap.prefill_tokens_per_second,
        )
        self.lease_incarnations[msg.pool_id] = {lease.relay_id: lease.incarnation for lease in msg.leases}
        return pool

    def apply_removed(self, pool_id: str) -> None:
        """A pool left the directory: it is no longer routed to."""
        pool = self.pools.get(pool_id)
        self.lease_incarnations.pop(pool_id, None)
        if pool is None:
            return
        pool.listed = False
        pool.directory_draining = False
        self.forget_if_unused(pool_id)

    def replace_directory(
        self, listed: Iterable[discovery_pb2.Pool], complete: bool, keep: set[str] | None = None
    ) -> None:
        """A new watch's snapshot is the truth: pools it does not list are unlisted.

        An incomplete snapshot (a fresh discovery replica that has not heard every heartbeat yet)
        only adds and updates: a pool it misses may just not have renewed there yet, and losing
        signals never deletes a pool. The watcher re-watches later for a complete one. Pools in
        `keep` stay listed even when a complete snapshot misses them (the outage grace).
        """
        seen: set[str] = set()
        for msg in listed:
            self.apply_listed(msg)
            seen.add(msg.pool_id)
        if complete:
            gone = [p for p, s in self.pools.items() if s.listed and p not in seen and p not in (keep or ())]
            for pool_id in gone:
                self.apply_removed(pool_id)
        self.synced = True
        self.complete = complete

    def lease_incarnation(self, pool_id: str, relay_id: str) -> int:
        """The incarnation the directory lists for (pool, relay); 0 when none."""
        return self.lease_incarnations.get(pool_id, {}).get(relay_id, 0)


class WatchEnded(Exception):
    """The watch stream ended without an error (the server closed it): watch again."""


# Reconnect to discovery after a broken watch: quickly at first, then every few seconds, forever
# (the frontend keeps routing on the directory it has meanwhile).
WATCH_RECONNECT_WAIT = wait_exponential_jitter(multiplier=0.2, max=3.0, jitter=0.3)


class DirectoryWatcher:
    """Keeps a PoolTable in step with discovery's WatchPools; re-watches with back-off when it breaks."""

    def __init__(
        self,
        table: PoolTable,
        channel: grpc.aio.Channel,
        clock: Clock,
        on_change=None,
        resync_after: Callable[[], float] = lambda: 15.0,
    ) -> None:
        self._table = table
        self._stub = discovery_pb2_grpc.DiscoveryServiceStub(channel)
        self._clock = clock
        self._on_change = on_change
        self._resync_after = resync_after
        self.watches_started = 0
        self.connected = asyncio.Event()
        """Set while a watch is in step with discovery (after its snapshot)."""
        self._synced_this_watch = False
        self._resync: asyncio.Timeout | None = None
        self._after_break = False
        """Set when a watch broke: the next snapshot may get the outage grace (_outage_grace)."""
        self.last_revision = 0
        """Discovery's revision of the last event applied; a re-watch resumes after it."""
        self._want_snapshot = True
        """Set while the next watch must take a snapshot (no sync yet, or a re-sync is due)."""
        self.resumes = 0
        """Watches that resumed (no snapshot) rather than starting from one."""

    async def run(self) -> None:
        """Watches until cancelled."""
        while True:
            async for attempt in AsyncRetrying(
                wait=WATCH_RECONNECT_WAIT,
                retry=retry_if_exception_type((grpc.aio.AioRpcError, WatchEnded)),
                sleep=self._clock.sleep,
                reraise=True,
            ):
                with attempt:
                    await self._watch_once()

    async def _watch_once(self) -> None:
        """One watch. Returns normally when it ended after a snapshot (re-watch at once); raises
        when it broke before one (re-watch after a back-off)."""
        self.watches_started += 1
        self._synced_this_watch = False
        start = 0 if self._want_snapshot else self.last_revision
        call = self._stub.WatchPools(discovery_pb2.WatchPoolsRequest(start_revision=start))
        try:
            async with asyncio.timeout(None) as self._resync:
                await self._follow(call)
        except TimeoutError:
            # The snapshot was incomplete: watch again for a complete one (nothing is lost, the
            # new snapshot carries every pool's current state).
            log.info("re-watching for a complete directory snapshot")
            return
        except grpc.aio.AioRpcError as exc:
            log.warning("directory watch broken; routing on the directory we have", code=exc.code().name)
            self._after_break = True
            if not self._synced_this_watch:
                raise
            return
        finally:
            call.cancel()
            self.connected.clear()
        if not self._synced_this_watch:
            raise WatchEnded("watch ended before its snapshot")

    async def _follow(self, call) -> None:
        snapshot: list[discovery_pb2.Pool] = []
        async for event in call:
            if not self._synced_this_watch:
                if event.type == EventType.WATCH_EVENT_TYPE_SNAPSHOT_DONE and event.resumed:
                    # Discovery still had every change after our revision: they follow, no snapshot.
                    self._synced_this_watch = True
                    self.resumes += 1
                    self._after_break = False  # the changes during the break come exactly
                    self.connected.set()
                    log.info("directory watch resumed", revision=event.revision)
                    continue
                if event.type == EventType.WATCH_EVENT_TYPE_SNAPSHOT_DONE:
                    # A snapshot (first watch, or a reset): its revision is the one to resume from.
                    self.last_revision = event.revision
                    kept = self._outage_grace(snapshot) if event.complete else set()
                    self._table.replace_directory(snapshot, event.complete, keep=kept)
                    self._synced_this_watch = True
                    self.connected.set()
                    log.info("directory snapshot", pools=len(snapshot), complete=event.complete)
                    # A re-sync still due (grace kept pools, or incomplete) needs a snapshot again.
                    self._want_snapshot = bool(kept) or not event.complete
                    if self._want_snapshot and self._resync is not None:
                        self._resync.reschedule(asyncio.get_running_loop().time() + self._resync_after())
                    self._changed()
                elif event.type == EventType.WATCH_EVENT_TYPE_ADDED:
                    snapshot.append(event.pool)
                continue
            if event.revision and event.revision <= self.last_revision:
                continue  # already applied (a replay overlapping what we had): never twice
            if event.revision:
                self.last_revision = event.revision
            if event.type in (EventType.WATCH_EVENT_TYPE_ADDED, EventType.WATCH_EVENT_TYPE_UPDATED):
                self._table.apply_listed(event.pool)
            elif event.type == EventType.WATCH_EVENT_TYPE_REMOVED:
                log.info("pool removed", pool_id=event.pool.pool_id, reason=event.removal_reason)
                self._table.apply_removed(event.pool.pool_id)
            self._changed()

    def _outage_grace(self, snapshot: list[discovery_pb2.Pool]) -> set[str]:
        """The pools the first snapshot after a broken watch must not unlist yet.

        When every discovery replica was down, leases lapsed in the shared store although their
        relays kept retrying; the first snapshot after the outage then misses pools whose relays
        have not renewed yet. A pool whose relays still stream telemetry to this frontend is alive:
        it stays listed and the watch re-syncs one lease later, when it is unlisted if the snapshot
        still misses it. Pools with no telemetry leave at once. Once per outage.
        """
        if not self._after_break:
            return set()
        self._after_break = False
        seen = {p.pool_id for p in snapshot}
        alive = sorted(
            p.pool_id
            for p in self._table.listed()
            if p.pool_id not in seen and self._table.stream_counts.get(p.pool_id)
        )
        if alive:
            log.info(
                "snapshot after an outage misses pools whose relays still stream; re-syncing later",
                pools=alive,
            )
        return set(alive)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

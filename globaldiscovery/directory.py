"""The pool and frontend directory: pool records merged from live leases, drains, and watchers.

Pure and synchronous: every operation takes the monotonic time `now` as an argument and first
applies whatever expired by then, so a caller never sees a lease past its end, and events reach
watchers in the order things happened. The gRPC layer (server.py) maps messages to it and back.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from globaldiscovery.leases import Lease, LeaseTable, StaleIncarnation

__all__ = [
    "Capacity",
    "Directory",
    "DrainCompleted",
    "EventKind",
    "FrontendView",
    "ModelConflict",
    "NotFound",
    "PoolEvent",
    "PoolRegistration",
    "PoolView",
    "Removal",
    "StaleIncarnation",
    "Watcher",
]


class EventKind(enum.Enum):
    """What a watcher is told."""

    ADDED = 1
    UPDATED = 2
    REMOVED = 3
    SNAPSHOT_DONE = 4


class Removal(enum.Enum):
    """Why a pool left (mirrors globaldiscovery.v1.RemovalReason)."""

    UNSPECIFIED = 0
    LEASE_EXPIRED = 1
    UNREGISTERED = 2
    REMOVED = 3
    DRAINED = 4


class ModelConflict(Exception):
    """Another live lease of the pool names a different model or region."""

    def __init__(self, holder: PoolRegistration) -> None:
        super().__init__(
            f"pool {holder.pool_id!r} is registered by relay {holder.relay_id!r} with model {holder.model!r} in "
            f"region {holder.region!r}; a pool serves one model in one region (this relay's earlier "
            f"lease, if any, was ended)"
        )


class DrainCompleted(Exception):
    """A discovery-side drain of the pool completed for this relay incarnation."""

    def __init__(self, reg: PoolRegistration) -> None:
        super().__init__(
            f"pool {reg.pool_id!r} was drained; relay {reg.relay_id!r} incarnation {reg.incarnation} "
            f"may not register it again (a restarted relay, with a higher incarnation, may)"
        )


class NotFound(Exception):
    """The pool is not listed."""


@dataclass(frozen=True, slots=True)
class Capacity:
    """What a pool says it can hold (zero: not stated)."""

    max_running_requests: int = 0
    kv_cache_blocks: int = 0
    prefill_tokens_per_second: int = 0


@dataclass(frozen=True, slots=True)
class PoolRegistration:
    """One relay replica's registration of a pool (already validated)."""

    pool_id: str
    model: str
    region: str
    frontends: tuple[str, ...]
    relay_id: str
    incarnation: int
    capacity: Capacity | None = None
    capabilities: tuple[str, ...] = ()
    draining: bool = False
    drain_deadline_wall: float | None = None
    expire_wall: float | None = None  # set when a shared store (etcd) keeps the lease's time


@dataclass(frozen=True, slots=True)
class LeaseView:
    """One live lease as listed."""

    relay_id: str
    incarnation: int
    frontends: tuple[str, ...]
    expire_wall: float
    draining: bool


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool as listed: the merge of its live leases."""

    pool_id: str
    model: str
    region: str
    frontends: tuple[str, ...]
    draining: bool
    drain_deadline_wall: float | None
    capacity: Capacity | None
    capabilities: tuple[str, ...]
    leases: tuple[LeaseView, ...]
    create_wall: float
    revision: int


@dataclass(frozen=True, slots=True)
class FrontendView:
    """One live global frontend."""

    frontend_id: str
    url: str
    region: str
    incarnation: int
    expire_wall: float


@dataclass(slots=True)
class PoolEvent:
    """One directory event; `encoded` lets the gRPC layer convert it once for every watcher."""

    kind: EventKind
    pool: PoolView | None = None
    reason: Removal = Removal.UNSPECIFIED
    complete: bool = False
    encoded: object = None


@dataclass(frozen=True, slots=True)
class RegisterResult:
    """What a relay learns from a registration."""

    lease_expire_wall: float
    pool: PoolView
    drain_requested: bool
    drain_deadline_wall: float | None


@dataclass(slots=True)
class _Pool:
    pool_id: str
    create_wall: float
    relays: dict[str, Lease] = field(default_factory=dict)
    capacity: Capacity | None = None
    revision: int = 1
    signature: tuple = ()
    last_view: PoolView | None = None  # as watchers last saw it; a REMOVED event repeats it


def _selected(pool: PoolView | PoolRegistration, model: str, region: str) -> bool:
    """Whether `pool` passes the model and region filters (an empty filter passes everything)."""
    return (not model or pool.model == model) and (not region or pool.region == region)


class WatcherClosed(enum.Enum):
    """Why a watcher ended."""

    OVERFLOW = 1
    SHUTDOWN = 2


class Watcher:
    """A bounded queue of events for one WatchPools stream; it never blocks the directory.

    When the reader falls `limit` events behind, the watcher is closed with OVERFLOW (the stream
    then ends with RESOURCE_EXHAUSTED and the client re-watches) instead of holding memory or
    slowing down everyone else.
    """

    def __init__(self, model: str, region: str, limit: int) -> None:
        self.model = model
        self.region = region
        self.limit = limit
        self.closed: WatcherClosed | None = None
        self.seen: set[str] = set()
        self._events: deque[PoolEvent] = deque()
        self._ready = asyncio.Event()

    def matches(self, pool: PoolView) -> bool:
        """Whether `pool` passes this watcher's filter."""
        return _selected(pool, self.model, self.region)

    def push(self, event: PoolEvent) -> bool:
        """Queues `event`; False (and closed) when the queue is full."""
        if self.closed is not None:
            return False
        if len(self._events) >= self.limit:
            self.close(WatcherClosed.OVERFLOW)
            return False
        self._events.append(event)
        self._ready.set()
        return True

    def close(self, why: WatcherClosed) -> None:
        """Ends the watcher; its reader gets None next."""
        if self.closed is None:
            self.closed = why
            self._events.clear()
            self._ready.set()

    async def next(self) -> PoolEvent | None:
        """The next event, waiting for one; None once the watcher is closed."""
        while not self._events:
            if self.closed is not None:
                return None
            self._ready.clear()
            await self._ready.wait()
        if self.closed is not None:
            return None
        return self._events.popleft()

    def pending(self) -> int:
        """How many events wait to be read."""
        return len(self._events)


class Directory:
    """Pools (leases per (pool_id, relay_id)), frontends (leases per frontend_id), drains, watchers."""

    def __init__(
        self,
        lease_duration: float,
        *,
        started_at: float,
        wall_offset: float,
        watch_queue_limit: int = 10_000,
        complete_at_start: bool = False,
        on_drained: Callable[[str, list[tuple[str, int]]], None] | None = None,
    ) -> None:
        self.lease_duration = lease_duration
        self._wall_offset = wall_offset  # wall = monotonic + offset, fixed so timestamps agree
        self._complete_at = started_at if complete_at_start else started_at + lease_duration
        self._watch_limit = watch_queue_limit
        self._leases: LeaseTable[tuple[str, str], PoolRegistration] = LeaseTable(lease_duration)
        self._frontends: LeaseTable[str, tuple[str, str]] = LeaseTable(lease_duration)
        self.frontends_version = 0  # grows on every frontend change, so callers can cache the list
        self._pools: dict[str, _Pool] = {}
        self._order: list[str] = []  # pool ids, sorted, for ordered pages
        self._drains: dict[str, float] = {}  # pool_id -> monotonic deadline of an operator drain
        self._drained: dict[tuple[str, str], int] = {}  # (pool, relay) -> highest refused incarnation
        self._watchers: set[Watcher] = set()
        self._on_drained = on_drained  # told (pool_id, [(relay_id, incarnation)]) when a drain completes

    # ----- time -----

    def wall(self, monotonic: float) -> float:
        """The wall-clock time of a monotonic instant."""
        return monotonic + self._wall_offset

    def complete(self, now: float) -> bool:
        """Whether this replica has heard every heartbeat by `now` (one lease after it started)."""
        return now >= self._complete_at

    def next_deadline(self) -> float | None:
        """The earliest instant at which something ends (a lease, a frontend lease or a drain)."""
        candidates = [
            d
            for d in (
                self._leases.next_deadline(),
                self._frontends.next_deadline(),
                min(self._drains.values()) if self._drains else None,
            )
            if d is not None
        ]
        return min(candidates) if candidates else None

    def advance(self, now: float) -> None:
        """Applies everything that ended at or before `now`: expired leases, completed drains."""
        expired = self._leases.expire_due(now)
        if expired:
            touched: dict[str, None] = {}
            for lease in expired:
                pool_id, relay_id = lease.key
                record = self._pools.get(pool_id)
                if record is not None and record.relays.get(relay_id) is lease:
                    del record.relays[relay_id]
                    touched[pool_id] = None
            for pool_id in touched:
                self._settle(pool_id, Removal.LEASE_EXPIRED)
        if self._frontends.expire_due(now):
            self.frontends_version += 1
        if self._drains:
            for pool_id, deadline in sorted(self._drains.items(), key=lambda kv: kv[1]):
                if deadline <= now:
                    self._complete_drain(pool_id)

    # ----- pools -----

    def register_pool(self, reg: PoolRegistration, now: float, *, trusted: bool = False) -> RegisterResult:
        """Registers or renews (reg.pool_id, reg.relay_id)'s lease.

        Raises DrainCompleted, StaleIncarnation or ModelConflict (after ending the caller's own
        earlier lease of the pool) as the contract says. `trusted` applies a registration a shared
        store already accepted (a mirror of etcd), without those checks.
        """
        self.advance(now)
        key = (reg.pool_id, reg.relay_id)
        if trusted:
            self._leases.end(key)  # a mirror follows the store, whatever the incarnation
        refused = None if trusted else self._drained.get(key)
        if refused is not None and reg.incarnation <= refused:
            raise DrainCompleted(reg)
        self._leases.check(key, reg.incarnation)
        record = self._pools.get(reg.pool_id)
        if record is not None and not trusted:
            for relay_id, other in record.relays.items():
                if relay_id == reg.relay_id:
                    continue
                if other.value.model != reg.model or other.value.region != reg.region:
                    self._end_lease(reg.pool_id, reg.relay_id, Removal.UNREGISTERED)
                    raise ModelConflict(other.value)
        lease = self._leases.grant(key, reg.incarnation, reg, now)
        if record is None:
            record = _Pool(pool_id=reg.pool_id, create_wall=self.wall(now))
            self._pools[reg.pool_id] = record
            bisect.insort(self._order, reg.pool_id)
            record.relays[reg.relay_id] = lease
            if reg.capacity is not None:
                record.capacity = reg.capacity
            record.signature = self._signature(record)
            record.last_view = self._view(record)
            self._publish(EventKind.ADDED, record.last_view)
        else:
            record.relays[reg.relay_id] = lease
            if reg.capacity is not None:
                record.capacity = reg.capacity
            self._settle(reg.pool_id, Removal.UNSPECIFIED)
        drain_at = self._drains.get(reg.pool_id)
        return RegisterResult(
            lease_expire_wall=self.wall(lease.expires_at),
            pool=self._view(record),
            drain_requested=drain_at is not None,
            drain_deadline_wall=self.wall(drain_at) if drain_at is not None else None,
        )

    def unregister_pool(
        self, pool_id: str, relay_id: str, incarnation: int, reason: Removal, now: float
    ) -> bool:
        """Ends (pool_id, relay_id)'s lease at once; True when that removed the pool.

        Raises StaleIncarnation when a newer incarnation holds the lease. Idempotent.
        """
        self.advance(now)
        self._leases.check((pool_id, relay_id), incarnation)
        return self._end_lease(pool_id, relay_id, reason)

    def remove_pool(self, pool_id: str, now: float) -> PoolView:
        """Removes a pool and every lease of it (an operator's action). Raises NotFound."""
        self.advance(now)
        record = self._pools.get(pool_id)
        if record is None:
            raise NotFound(f"pool {pool_id!r} is not listed")
        view = self._view(record)
        self._drop(record, Removal.REMOVED)
        return view

    def drain_pool(self, pool_id: str, timeout: float, now: float) -> PoolView:
        """Marks the pool draining until `now + timeout` (an earlier deadline is kept). Raises NotFound."""
        self.advance(now)
        record = self._pools.get(pool_id)
        if record is None:
            raise NotFound(f"pool {pool_id!r} is not listed")
        if pool_id not in self._drains:
            self._drains[pool_id] = now + timeout
            self._settle(pool_id, Removal.UNSPECIFIED)
        return self._view(record)

    def drain_deadline_wall(self, pool_id: str) -> float | None:
        """The deadline of a discovery-side drain of the pool, or None."""
        deadline = self._drains.get(pool_id)
        return self.wall(deadline) if deadline is not None else None

    def get_pool(self, pool_id: str, now: float) -> PoolView | None:
        """The pool as listed, or None."""
        self.advance(now)
        record = self._pools.get(pool_id)
        return self._view(record) if record is not None else None

    def list_pools(
        self, now: float, *, model: str = "", region: str = "", after: str | None = None, limit: int = 100
    ) -> tuple[list[PoolView], bool]:
        """Up to `limit` pools after `after`, ordered by pool_id, filtered; and whether more follow."""
        self.advance(now)
        start = bisect.bisect_right(self._order, after) if after is not None else 0
        page: list[PoolView] = []
        for pool_id in self._order[start:]:
            record = self._pools[pool_id]
            if not _selected(next(iter(record.relays.values())).value, model, region):
                continue
            if len(page) == limit:
                return page, True
            page.append(self._view(record))
        return page, False

    # ----- frontends -----

    def register_frontend(
        self, frontend_id: str, url: str, region: str, incarnation: int, now: float
    ) -> FrontendView:
        """Registers or renews a frontend's lease. Raises StaleIncarnation."""
        self.advance(now)
        lease = self._frontends.grant(frontend_id, incarnation, (url, region), now)
        self.frontends_version += 1
        return self._frontend_view(lease)

    def unregister_frontend(self, frontend_id: str, incarnation: int, now: float) -> bool:
        """Ends a frontend's lease at once. Raises StaleIncarnation. Idempotent."""
        self.advance(now)
        ended = self._frontends.end(frontend_id, incarnation) is not None
        self.frontends_version += 1
        return ended

    def list_frontends(self, now: float) -> list[FrontendView]:
        """Every live frontend, ordered by frontend_id."""
        self.advance(now)
        views = [self._frontend_view(lease) for lease in self._frontends.values()]
        return sorted(views, key=lambda f: f.frontend_id)

    # ----- watchers -----

    def watch(self, now: float, *, model: str = "", region: str = "") -> Watcher:
        """A watcher already holding the snapshot (one ADDED per matching pool) and SNAPSHOT_DONE."""
        self.advance(now)
        snapshot = []
        for pool_id in self._order:
            view = self._view(self._pools[pool_id])
            if _selected(view, model, region):
                snapshot.append(view)
        # The bound applies to changes; the snapshot itself always fits.
        watcher = Watcher(model, region, self._watch_limit + len(snapshot) + 1)
        for view in snapshot:
            watcher.seen.add(view.pool_id)
            watcher.push(PoolEvent(EventKind.ADDED, view))
        watcher.push(PoolEvent(EventKind.SNAPSHOT_DONE, complete=self.complete(now)))
        self._watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        """Forgets a watcher (its stream ended)."""
        self._watchers.discard(watcher)

    def close_watchers(self) -> None:
        """Ends every watcher (the server shuts down)."""
        for watcher in list(self._watchers):
            watcher.close(WatcherClosed.SHUTDOWN)
        self._watchers.clear()

    @property
    def watchers(self) -> Iterable[Watcher]:
        return tuple(self._watchers)

    # ----- internals -----

    def _end_lease(self, pool_id: str, relay_id: str, reason: Removal) -> bool:
        lease = self._leases.end((pool_id, relay_id))
        record = self._pools.get(pool_id)
        if lease is None or record is None:
            return False
        record.relays.pop(relay_id, None)
        return self._settle(pool_id, reason)

    def _settle(self, pool_id: str, reason: Removal) -> bool:
        """After a lease change: REMOVED when no lease is left, else UPDATED if anything visible changed."""
        record = self._pools[pool_id]
        if not record.relays:
            self._drop(record, reason)
            return True
        signature = self._signature(record)
        if signature != record.signature:
            record.signature = signature
            record.revision += 1
            record.last_view = self._view(record)
            self._publish(EventKind.UPDATED, record.last_view)
        return False

    def _drop(self, record: _Pool, reason: Removal) -> None:
        view = self._view(record) if record.relays else record.last_view
        assert view is not None
        for relay_id in list(record.relays):
            self._leases.end((record.pool_id, relay_id))
        record.relays.clear()
        del self._pools[record.pool_id]
        del self._order[bisect.bisect_left(self._order, record.pool_id)]
        self._drains.pop(record.pool_id, None)
        self._publish(EventKind.REMOVED, view, reason)

    def _complete_drain(self, pool_id: str) -> None:
        record = self._pools.get(pool_id)
        if record is None:
            self._drains.pop(pool_id, None)
            return
        refused = []
        for relay_id, lease in record.relays.items():
            key = (pool_id, relay_id)
            self._drained[key] = max(self._drained.get(key, 0), lease.incarnation)
            refused.append((relay_id, lease.incarnation))
        self._drop(record, Removal.DRAINED)
        if self._on_drained is not None:
            self._on_drained(pool_id, refused)

    def _merged(self, record: _Pool) -> tuple:
        leases = [record.relays[r] for r in sorted(record.relays)]
        newest = max(leases, key=lambda lease: lease.expires_at).value
        frontends = tuple(sorted({url for lease in leases for url in lease.value.frontends}))
        capabilities = tuple(sorted({c for lease in leases for c in lease.value.capabilities}))
        drain_at = self._drains.get(record.pool_id)
        relay_draining = [lease.value for lease in leases if lease.value.draining]
        draining = drain_at is not None or bool(relay_draining)
        if drain_at is not None:
            deadline: float | None = self.wall(drain_at)
        else:
            stated = [r.drain_deadline_wall for r in relay_draining if r.drain_deadline_wall is not None]
            deadline = min(stated) if stated else None
        return newest, frontends, capabilities, draining, deadline, leases

    def _signature(self, record: _Pool) -> tuple:
        newest, frontends, capabilities, draining, deadline, leases = self._merged(record)
        per_lease = tuple(
            (lease.key[1], lease.incarnation, lease.value.frontends, lease.value.draining) for lease in leases
        )
        return (
            newest.model,
            newest.region,
            frontends,
            capabilities,
            draining,
            deadline,
            record.capacity,
            per_lease,
        )

    def _view(self, record: _Pool) -> PoolView:
        newest, frontends, capabilities, draining, deadline, leases = self._merged(record)
        return PoolView(
            pool_id=record.pool_id,
            model=newest.model,
            region=newest.region,
            frontends=frontends,
            draining=draining,
            drain_deadline_wall=deadline,
            capacity=record.capacity,
            capabilities=capabilities,
            leases=tuple(
                LeaseView(
                    relay_id=lease.key[1],
                    incarnation=lease.incarnation,
                    frontends=lease.value.frontends,
                    expire_wall=lease.value.expire_wall or self.wall(lease.expires_at),
                    draining=lease.value.draining,
                )
                for lease in leases
            ),
            create_wall=record.create_wall,
            revision=record.revision,
        )

    def _frontend_view(self, lease: Lease[str, tuple[str, str]]) -> FrontendView:
        url, region = lease.value
        return FrontendView(
            frontend_id=lease.key,
            url=url,
            region=region,
            incarnation=lease.incarnation,
            expire_wall=self.wall(lease.expires_at),
        )

    def _publish(self, kind: EventKind, view: PoolView, reason: Removal = Removal.UNSPECIFIED) -> None:
        shared: dict[EventKind, PoolEvent] = {}

        def event(k: EventKind) -> PoolEvent:
            # One event object per kind, shared by every watcher, so it is encoded once.
            if k not in shared:
                shared[k] = PoolEvent(k, view, reason if k is EventKind.REMOVED else Removal.UNSPECIFIED)
            return shared[k]

        for watcher in list(self._watchers):
            was = view.pool_id in watcher.seen
            now_matches = kind is not EventKind.REMOVED and watcher.matches(view)
            if now_matches and not was:
                watcher.seen.add(view.pool_id)
                ok = watcher.push(event(EventKind.ADDED))
            elif now_matches:
                ok = watcher.push(event(EventKind.UPDATED))
            elif was:
                # Removed, or changed so that it no longer matches this watcher's filter.
                watcher.seen.discard(view.pool_id)
                ok = watcher.push(event(EventKind.REMOVED))
            else:
                continue
            if not ok:
                self._watchers.discard(watcher)

"""Lease state: pools (leases per (pool_id, relay_id)), frontend leases, drains, and their timing.

Pure and synchronous: every operation takes the monotonic time `now` as an argument and first
applies whatever expired by then, so a caller never sees a lease past its end, and events reach
watchers (watch_fanout) in the order things happened. What is allowed is decided by lease_rules;
this module keeps the state. The gRPC layer (server.py) reaches it through a Store.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from globaldiscovery import lease_rules
from globaldiscovery.lease_table import Lease, LeaseTable
from globaldiscovery.records import (
    Capacity,
    EventKind,
    FrontendView,
    LeaseView,
    PoolEvent,
    PoolRegistration,
    PoolView,
    RegisterResult,
    Removal,
    pool_view_bytes,
)
from globaldiscovery.watch_fanout import Watcher, WatcherClosed, WatchFanout, selected
from meshkit import pagination

__all__ = ["DEFAULT_HISTORY_BYTES", "DEFAULT_QUEUE_BYTES", "Directory"]

# The watch history's default byte bound: thousands of ordinary changes, and ~260 of the largest
# pools (64 frontends of long URLs, ~250 KB each) rather than 10,000 of them (~2.5 GB).
DEFAULT_HISTORY_BYTES = 64 * 1024 * 1024
# A watcher's queue of unread changes, likewise (the events are shared with the history and every
# other watcher, but a slow reader keeps them alive after the history let them go).
DEFAULT_QUEUE_BYTES = 64 * 1024 * 1024


@dataclass(slots=True)
class _Pool:
    pool_id: str
    create_wall: float
    relays: dict[str, Lease] = field(default_factory=dict)
    capacity: Capacity | None = None
    revision: int = 1
    signature: tuple = ()
    last_view: PoolView | None = None  # as watchers last saw it; a REMOVED event repeats it


class Directory:
    """Pools (leases per (pool_id, relay_id)), frontends (leases per frontend_id), drains, watchers."""

    def __init__(
        self,
        lease_duration: float,
        *,
        started_at: float,
        wall_offset: float,
        watch_queue_limit: int = 10_000,
        watch_queue_bytes: int = DEFAULT_QUEUE_BYTES,
        watch_history_limit: int = 10_000,
        watch_history_bytes: int = DEFAULT_HISTORY_BYTES,
        complete_at_start: bool = False,
        on_drained: Callable[[str, list[tuple[str, int]]], None] | None = None,
        mirror: bool = False,
    ) -> None:
        self.lease_duration = lease_duration
        self._wall_offset = wall_offset  # wall = monotonic + offset, fixed so timestamps agree
        self._complete_at = started_at if complete_at_start else started_at + lease_duration
        self._leases: LeaseTable[tuple[str, str], PoolRegistration] = LeaseTable(lease_duration)
        self._frontends: LeaseTable[str, tuple[str, str]] = LeaseTable(lease_duration)
        self.frontends_version = 0  # grows on every frontend change, so callers can cache the list
        self._pools: dict[str, _Pool] = {}
        self._order: list[str] = []  # pool ids, sorted, for ordered pages
        self._drains: dict[str, float] = {}  # pool_id -> monotonic deadline of an operator drain
        self._drained: dict[str, dict[str, int]] = {}  # pool -> relay -> highest refused incarnation
        self._fanout = WatchFanout(watch_queue_limit, watch_queue_bytes)
        # A mirror follows a shared store (etcd): the store numbers its changes (at_revision), so
        # every replica gives one change the same revision and a watch resumes on any of them; and
        # a drain ends when the store ends its leases (the same change on every replica), not on
        # this replica's timer.
        self.mirror = mirror
        self._completing: dict[str, float] = {}  # mirror: drains past their deadline, ending in the store
        # Otherwise revisions start at this directory's start time in microseconds, so a restarted
        # replica never reuses one an earlier process sent (a resume from it then gets a reset snapshot).
        self.revision = 0 if mirror else int((started_at + wall_offset) * 1_000_000)
        # The changes a resumed watch replays, bounded by count and by bytes (an event holds a
        # whole pool record, which may be large, and outlives the pool): the oldest go first.
        self._history: deque[PoolEvent] = deque()
        self._history_limit = max(1, watch_history_limit)
        self._history_byte_limit = max(1, watch_history_bytes)
        self._history_bytes = 0
        self._history_floor = self.revision  # a resume can start from any revision >= this
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
        record = self._pools.get(reg.pool_id)
        if trusted:
            self._leases.end(key)  # a mirror follows the store, whatever the incarnation
        else:
            refused = self._drained.get(reg.pool_id)
            if refused:
                lease_rules.check_not_drained(reg, refused.get(reg.relay_id))
            self._leases.check(key, reg.incarnation)  # lease_rules.check_incarnation on what it holds
            # Only another relay's lease can conflict; most pools have one relay (renewals skip this).
            if record is not None and (len(record.relays) > 1 or reg.relay_id not in record.relays):
                holder = lease_rules.conflicting_holder(
                    reg, (lease.value for lease in record.relays.values())
                )
                if holder is not None:
                    self._end_lease(reg.pool_id, reg.relay_id, Removal.UNREGISTERED)
                    raise lease_rules.ModelConflict(holder)
        lease = self._leases.grant(key, reg.incarnation, reg, now)
        if record is None:
            record = _Pool(pool_id=reg.pool_id, create_wall=self.wall(now))
            if self.mirror:
                record.revision = max(1, self.revision)
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
        drain_at = self._drain_at(reg.pool_id)
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
        lease_rules.require_listed(pool_id, record)
        assert record is not None
        view = self._view(record)
        self._drop(record, Removal.REMOVED)
        return view

    def drain_pool(self, pool_id: str, timeout: float, now: float) -> PoolView:
        """Marks the pool draining until `now + timeout` (an earlier deadline is kept). Raises NotFound."""
        self.advance(now)
        record = self._pools.get(pool_id)
        lease_rules.require_listed(pool_id, record)
        assert record is not None
        if self._drain_at(pool_id) is None:
            self._drains[pool_id] = lease_rules.drain_deadline(None, now, timeout)
            self._settle(pool_id, Removal.UNSPECIFIED)
        return self._view(record)

    def drain_deadline_wall(self, pool_id: str) -> float | None:
        """The deadline of a discovery-side drain of the pool, or None."""
        deadline = self._drain_at(pool_id)
        return self.wall(deadline) if deadline is not None else None

    def _drain_at(self, pool_id: str) -> float | None:
        """The monotonic deadline of a discovery-side drain (also one a mirror's store is ending)."""
        deadline = self._drains.get(pool_id)
        return deadline if deadline is not None else self._completing.get(pool_id)

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

        def listed() -> Iterator[PoolView]:
            for pool_id in self._order[start:]:
                record = self._pools[pool_id]
                if selected(next(iter(record.relays.values())).value, model, region):
                    yield self._view(record)

        return pagination.take(listed(), limit)

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

    def watch(self, now: float, *, model: str = "", region: str = "", start_revision: int = 0) -> Watcher:
        """A watcher resumed after `start_revision` when this directory still holds every event
        since (unfiltered watches only); otherwise one holding the snapshot and SNAPSHOT_DONE."""
        self.advance(now)
        if self.can_resume(start_revision) and not model and not region:
            replay = self._replay(start_revision, self.revision)
            return self._fanout.resume(list(self._order), replay, self.complete(now), start_revision)
        snapshot = [self._view(self._pools[pool_id]) for pool_id in self._order]
        return self._fanout.open(model, region, snapshot, self.complete(now), self.revision)

    def at_revision(self, revision: int) -> None:
        """Mirror: the store's revision of the change applied next (its event carries it)."""
        assert self.mirror
        self.revision = max(self.revision, revision)

    def rewind(self, revision: int) -> None:
        """Mirror: the store's revisions went back (another store): number from `revision` on.
        The history is of no use any more (the caller re-reads the store, then reset_history)."""
        assert self.mirror
        self._clear_history()
        self.revision = revision

    def reset_history(self) -> None:
        """Mirror: the state was re-read from the store, not followed change by change, so no
        resume from before the current revision can be exact: forget the history."""
        assert self.mirror
        self._clear_history()
        self._history_floor = self.revision

    @property
    def history_floor(self) -> int:
        """A resume can start from any revision from this one on (to self.revision)."""
        return self._history_floor

    @property
    def history_limit(self) -> int:
        """How many events the history keeps at most."""
        return self._history_limit

    @property
    def history_byte_limit(self) -> int:
        """How many bytes (pool_view_bytes) the history's events hold at most."""
        return self._history_byte_limit

    @property
    def history_bytes(self) -> int:
        """The bytes (pool_view_bytes) the history's events hold now."""
        return self._history_bytes

    def history_between(self, after: int, upto: int) -> list[PoolEvent] | None:
        """The events after `after` up to `upto`; None when the history no longer holds them all."""
        if not self.can_resume(after):
            return None
        return self._replay(after, upto)

    def _replay(self, after: int, upto: int) -> list[PoolEvent]:
        """Copies of the history's events after `after` up to `upto`: a copy caches its encoded
        message for its watcher, so the history never holds messages beside its records."""
        return [replace(event, encoded=None) for event in self._history if after < event.revision <= upto]

    def _clear_history(self) -> None:
        self._history.clear()
        self._history_bytes = 0

    def watch_joined(
        self, now: float, earlier: list[PoolEvent], start_revision: int, joined_at: int
    ) -> Watcher | None:
        """Mirror: a resumed (unfiltered) watcher replaying `earlier` (the events after
        `start_revision` up to `joined_at`, read elsewhere: from the store's own history), then this
        directory's events after `joined_at`; None when the history no longer reaches back to it."""
        self.advance(now)
        if not self.can_resume(joined_at):
            return None
        replay = [*earlier, *self._replay(joined_at, self.revision)]
        return self._fanout.resume(list(self._order), replay, self.complete(now), start_revision)

    def can_resume(self, start_revision: int) -> bool:
        """Whether every event after `start_revision` is still in the (bounded) history."""
        return 0 < start_revision and self._history_floor <= start_revision <= self.revision

    def unwatch(self, watcher: Watcher) -> None:
        """Forgets a watcher (its stream ended)."""
        self._fanout.forget(watcher)

    def close_watchers(self, why: WatcherClosed = WatcherClosed.SHUTDOWN) -> None:
        """Ends every watcher (the server shuts down, or a mirror re-synced)."""
        self._fanout.close_all(why)

    @property
    def watchers(self) -> Iterable[Watcher]:
        return self._fanout.watchers

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
            # A mirror's pool revision is the store revision of its last change: equal on every replica.
            record.revision = self.revision if self.mirror else record.revision + 1
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
        self._completing.pop(record.pool_id, None)
        self._publish(EventKind.REMOVED, view, reason)

    def _complete_drain(self, pool_id: str) -> None:
        record = self._pools.get(pool_id)
        if record is None:
            self._drains.pop(pool_id, None)
            return
        holders = [(relay_id, lease.incarnation) for relay_id, lease in record.relays.items()]
        merged = lease_rules.drained_incarnations(self._drained.get(pool_id, {}), holders)
        self._drained.setdefault(pool_id, {}).update(merged)
        refused = list(merged.items())
        if self.mirror:
            # The store ends the leases; their deletions remove the pool on every replica alike.
            self._completing[pool_id] = self._drains.pop(pool_id)
        else:
            self._drop(record, Removal.DRAINED)
        if self._on_drained is not None:
            self._on_drained(pool_id, refused)

    def _merged(self, record: _Pool) -> tuple:
        leases = [record.relays[r] for r in sorted(record.relays)]
        newest = max(leases, key=lambda lease: lease.expires_at).value
        frontends = tuple(sorted({url for lease in leases for url in lease.value.frontends}))
        capabilities = tuple(sorted({c for lease in leases for c in lease.value.capabilities}))
        drain_at = self._drain_at(record.pool_id)
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
            newest.frontend_protocol,
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
            frontend_protocol=newest.frontend_protocol,
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
        # A mirror's change already has its store revision (at_revision; one pool event per change).
        if not self.mirror:
            self.revision += 1
        removal = reason if kind is EventKind.REMOVED else Removal.UNSPECIFIED
        size = pool_view_bytes(view)
        self._history.append(PoolEvent(kind, view, removal, revision=self.revision, size=size))
        self._history_bytes += size
        while len(self._history) > self._history_limit or self._history_bytes > self._history_byte_limit:
            evicted = self._history.popleft()
            self._history_bytes -= evicted.size
            self._history_floor = evicted.revision  # a resume from before it gets a snapshot
        self._fanout.publish(kind, view, reason, self.revision, size)

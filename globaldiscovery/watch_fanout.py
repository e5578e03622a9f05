"""Watch fan-out: one bounded queue per WatchPools stream, fed with each directory change.

A watcher that falls behind is closed (never waited for), so no reader can slow the directory.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Iterable

from globaldiscovery.records import EventKind, PoolEvent, PoolRegistration, PoolView, Removal

__all__ = ["WatchFanout", "Watcher", "WatcherClosed", "selected"]


def selected(pool: PoolView | PoolRegistration, model: str, region: str) -> bool:
    """Whether `pool` passes the model and region filters (an empty filter passes everything)."""
    return (not model or pool.model == model) and (not region or pool.region == region)


class WatcherClosed(enum.Enum):
    """Why a watcher ended."""

    OVERFLOW = 1
    SHUTDOWN = 2
    RESYNC = 3  # the replica re-read its shared store: the stream cannot continue change by change
    ISOLATED = 4  # the replica lost its shared store: its directory is frozen, watch another replica


class Watcher:
    """A bounded queue of events for one WatchPools stream; it never blocks the directory.

    When the reader falls `limit` events or `byte_limit` bytes of pool records (PoolEvent.size)
    behind, the watcher is closed with OVERFLOW (the stream then ends with RESOURCE_EXHAUSTED and
    the client re-watches) instead of holding memory or slowing down everyone else.
    """

    def __init__(self, model: str, region: str, limit: int, byte_limit: int) -> None:
        self.model = model
        self.region = region
        self.limit = limit
        self.byte_limit = byte_limit
        self.closed: WatcherClosed | None = None
        self.seen: set[str] = set()
        self._events: deque[PoolEvent] = deque()
        self._bytes = 0
        self._ready = asyncio.Event()

    def matches(self, pool: PoolView) -> bool:
        """Whether `pool` passes this watcher's filter."""
        return selected(pool, self.model, self.region)

    def push(self, event: PoolEvent) -> bool:
        """Queues `event`; False (and closed) when the queue is full."""
        if self.closed is not None:
            return False
        if len(self._events) >= self.limit or self._bytes + event.size > self.byte_limit:
            self.close(WatcherClosed.OVERFLOW)
            return False
        self._events.append(event)
        self._bytes += event.size
        self._ready.set()
        return True

    def close(self, why: WatcherClosed) -> None:
        """Ends the watcher; its reader gets None next."""
        if self.closed is None:
            self.closed = why
            self._events.clear()
            self._bytes = 0
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
        event = self._events.popleft()
        self._bytes -= event.size
        return event

    def pending(self) -> int:
        """How many events wait to be read."""
        return len(self._events)


class WatchFanout:
    """The open watchers, and how one pool change becomes an event for each of them."""

    def __init__(self, queue_limit: int, queue_bytes: int) -> None:
        self.queue_limit = queue_limit
        self.queue_bytes = queue_bytes
        self._watchers: set[Watcher] = set()

    def open(
        self, model: str, region: str, snapshot: list[PoolView], complete: bool, revision: int = 0
    ) -> Watcher:
        """A watcher already holding `snapshot` (one ADDED per matching pool) and SNAPSHOT_DONE."""
        matching = [view for view in snapshot if selected(view, model, region)]
        # The bound applies to changes; the snapshot itself always fits (its events count no bytes).
        watcher = Watcher(model, region, self.queue_limit + len(matching) + 1, self.queue_bytes)
        for view in matching:
            watcher.seen.add(view.pool_id)
            watcher.push(PoolEvent(EventKind.ADDED, view, revision=revision))
        watcher.push(PoolEvent(EventKind.SNAPSHOT_DONE, complete=complete, revision=revision))
        self._watchers.add(watcher)
        return watcher

    def resume(
        self, listed: Iterable[str], replay: list[PoolEvent], complete: bool, start_revision: int
    ) -> Watcher:
        """An unfiltered watcher holding a resumed SNAPSHOT_DONE, then `replay` (the unfiltered
        events after `start_revision`); `listed` is every pool listed now, as live events expect."""
        # The replay always fits, like a snapshot; the bounds apply to what follows it.
        replayed = sum(event.size for event in replay)
        watcher = Watcher("", "", self.queue_limit + len(replay) + 1, self.queue_bytes + replayed)
        watcher.seen.update(listed)
        marker = PoolEvent(EventKind.SNAPSHOT_DONE, complete=complete, revision=start_revision, resumed=True)
        watcher.push(marker)
        for event in replay:
            watcher.push(event)
        self._watchers.add(watcher)
        return watcher

    def forget(self, watcher: Watcher) -> None:
        """Forgets a watcher (its stream ended)."""
        self._watchers.discard(watcher)

    def close_all(self, why: WatcherClosed = WatcherClosed.SHUTDOWN) -> None:
        """Ends every watcher (the server shuts down, or the replica re-synced)."""
        for watcher in list(self._watchers):
            watcher.close(why)
        self._watchers.clear()

    @property
    def watchers(self) -> Iterable[Watcher]:
        return tuple(self._watchers)

    def publish(
        self,
        kind: EventKind,
        view: PoolView,
        reason: Removal = Removal.UNSPECIFIED,
        revision: int = 0,
        size: int = 0,
    ) -> None:
        """Tells every watcher about a pool that was added, updated or removed, as its filter sees it."""
        shared: dict[EventKind, PoolEvent] = {}

        def event(k: EventKind) -> PoolEvent:
            # One event object per kind, shared by every watcher, so it is encoded once.
            if k not in shared:
                removal = reason if k is EventKind.REMOVED else Removal.UNSPECIFIED
                shared[k] = PoolEvent(k, view, removal, revision=revision, size=size)
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

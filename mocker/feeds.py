"""In-process fan-out of pool signals: KV events to many bounded subscribers, and change notices."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from mocker.workers import KvEvent


class SubscriberTooSlow(Exception):
    """A KV subscriber's queue overflowed; it must re-subscribe for a fresh snapshot."""


class KvSubscription:
    """One subscriber's bounded queue of KV events. Never skips an event: it overflows instead."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.overflowed = False
        self._items: deque[KvEvent] = deque()
        self._wakeup = asyncio.Event()

    def offer(self, event: KvEvent) -> bool:
        """Queues `event`; False (and overflowed) when the queue is full."""
        if len(self._items) >= self.limit:
            self.overflowed = True
            self._wakeup.set()
            return False
        self._items.append(event)
        self._wakeup.set()
        return True

    async def events(self) -> AsyncIterator[KvEvent]:
        """Yields events in order; raises SubscriberTooSlow once the queue overflowed."""
        while True:
            if self.overflowed:
                raise SubscriberTooSlow(f"more than {self.limit} KV events queued for this subscriber")
            while self._items:
                yield self._items.popleft()
                if self.overflowed:
                    break
            if not self._items and not self.overflowed:
                self._wakeup.clear()
                await self._wakeup.wait()


class KvEventHub:
    """Delivers every KV event to every subscriber; a subscriber that falls behind is dropped."""

    def __init__(self, queue_limit: int) -> None:
        self.queue_limit = queue_limit
        self._subs: set[KvSubscription] = set()

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def subscribe(self) -> KvSubscription:
        """A new subscription. Take the snapshot in the same synchronous step, so nothing is missed."""
        sub = KvSubscription(self.queue_limit)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: KvSubscription) -> None:
        self._subs.discard(sub)

    def publish(self, event: KvEvent) -> None:
        for sub in list(self._subs):
            if not sub.offer(event):
                self._subs.discard(sub)


class Changes:
    """A version counter with a wake-up, so status watchers learn that something changed."""

    def __init__(self) -> None:
        self.version = 0
        self._event = asyncio.Event()

    def notify(self) -> None:
        self.version += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait_newer(self, version: int, within: float) -> bool:
        """Waits until the version passes `version` or `within` seconds pass (real time); True if changed."""
        if self.version != version:
            return True
        try:
            await asyncio.wait_for(self._event.wait(), within)
        except TimeoutError:
            return self.version != version
        return True

"""The lease table: leases keyed by any hashable key, timed on a monotonic clock the caller passes in."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from globaldiscovery.lease_rules import check_incarnation

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(slots=True)
class Lease(Generic[K, V]):
    """One live lease: who holds it (incarnation), what it carries, and when it ends."""

    key: K
    incarnation: int
    value: V
    expires_at: float


class LeaseTable(Generic[K, V]):
    """Leases of one fixed duration, kept in deadline order.

    Every grant lasts the same `duration` from a clock that never goes back, so the order of the
    grants *is* the order of the deadlines: an insertion-ordered dict (a renewal moves its key to
    the end) gives O(1) grant, renew, end, next deadline and expiry, with no heap to clean up.
    """

    def __init__(self, duration: float) -> None:
        if not duration > 0:
            raise ValueError("lease duration must be > 0")
        self.duration = duration
        self._leases: OrderedDict[K, Lease[K, V]] = OrderedDict()
        self._last_now = float("-inf")

    def get(self, key: K) -> Lease[K, V] | None:
        """The lease of `key`, or None."""
        return self._leases.get(key)

    def check(self, key: K, incarnation: int) -> None:
        """Raises StaleIncarnation when `key` is held by an incarnation newer than `incarnation`."""
        held = self._leases.get(key)
        check_incarnation(key, held.incarnation if held is not None else None, incarnation)

    def grant(self, key: K, incarnation: int, value: V, now: float) -> Lease[K, V]:
        """Grants or renews the lease of `key` until `now + duration`.

        The same or a higher incarnation renews (a higher one takes the lease over); a lower one
        raises StaleIncarnation and changes nothing.
        """
        self.check(key, incarnation)
        # Deadline order relies on a clock that never goes back; clamp a caller that does.
        now = max(now, self._last_now)
        self._last_now = now
        lease = self._leases.pop(key, None)
        if lease is None:
            lease = Lease(key=key, incarnation=incarnation, value=value, expires_at=now + self.duration)
        else:
            lease.incarnation = incarnation
            lease.value = value
            lease.expires_at = now + self.duration
        self._leases[key] = lease
        return lease

    def end(self, key: K, incarnation: int | None = None) -> Lease[K, V] | None:
        """Ends the lease of `key` at once and returns it (None when there was none).

        With `incarnation`, a lease held by a newer incarnation raises StaleIncarnation instead.
        """
        if incarnation is not None:
            self.check(key, incarnation)
        return self._leases.pop(key, None)

    def next_deadline(self) -> float | None:
        """When the earliest lease ends, or None when there are none."""
        for lease in self._leases.values():
            return lease.expires_at
        return None

    def expire_due(self, now: float) -> list[Lease[K, V]]:
        """Removes and returns every lease whose end is at or before `now` (never one ending later)."""
        expired: list[Lease[K, V]] = []
        while self._leases:
            key, lease = next(iter(self._leases.items()))
            if lease.expires_at > now:
                break
            del self._leases[key]
            expired.append(lease)
        return expired

    def values(self) -> list[Lease[K, V]]:
        """Every live lease, earliest deadline first."""
        return list(self._leases.values())

"""Whether a discovery replica is in touch with etcd: its mirror follows etcd and etcd answered lately.

A replica cut off from etcd would otherwise serve a frozen directory (its mirror never expires a
lease itself) while its watchers wait for changes that never come. After `timeout` seconds
without contact it counts as isolated (the store refuses calls, ends watches, turns NOT_SERVING),
and it is in touch again once its mirror has re-synced from etcd. Pure: the caller passes the time.
"""

from __future__ import annotations

import enum

__all__ = ["DEFAULT_ISOLATION_TIMEOUT", "EtcdLink", "LinkChange"]

# Seconds without etcd before a replica stops serving: shorter than the default lease (15 s), so
# relays and frontends move to another replica before their leases are at risk, and several
# probes long, so one slow answer under load does not take a replica out.
DEFAULT_ISOLATION_TIMEOUT = 5.0


class LinkChange(enum.Enum):
    """A change of the link that the store acts on."""

    LOST = "lost"
    REGAINED = "regained"


class EtcdLink:
    """Contact with etcd as the mirror sees it. Contact counts only while the mirror follows etcd
    (an answer to a probe while the mirror cannot re-sync is not being in touch)."""

    def __init__(self, timeout: float, now: float) -> None:
        self.timeout = timeout
        self.following = True  # the store starts only after its mirror read etcd
        self.isolated = False
        self._last_contact = now

    @property
    def probe_interval(self) -> float:
        """How often to ask etcd when nothing else shows it is there: a few times per timeout."""
        return self.timeout / 4

    def contact(self, now: float) -> None:
        """etcd answered (a probe, a watch event, a re-sync)."""
        if self.following:
            self._last_contact = max(self._last_contact, now)

    def followed(self, now: float) -> None:
        """The mirror follows etcd again (it re-synced); that is contact too."""
        self.following = True
        self.contact(now)

    def broke(self) -> None:
        """The mirror's etcd watch ended: nothing counts as contact until it re-syncs."""
        self.following = False

    def silent_for(self, now: float) -> float:
        """Seconds since the last contact."""
        return max(0.0, now - self._last_contact)

    def check(self, now: float) -> LinkChange | None:
        """LOST when the last contact is more than `timeout` ago (once), REGAINED when an isolated
        replica's mirror follows etcd again and was in touch within `timeout`; else None."""
        silent = self.silent_for(now) > self.timeout
        if not self.isolated and silent:
            self.isolated = True
            return LinkChange.LOST
        if self.isolated and self.following and not silent:
            self.isolated = False
            return LinkChange.REGAINED
        return None

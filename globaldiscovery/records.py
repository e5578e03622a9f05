"""The directory's value types: registrations, pools and frontends as listed, and watch events.

Plain frozen values with no transport and no storage; convert.py maps them to and from messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Capacity",
    "EventKind",
    "FrontendView",
    "LeaseView",
    "PoolEvent",
    "PoolRegistration",
    "PoolView",
    "RegisterResult",
    "Removal",
]


class EventKind(enum.Enum):
    """What a watcher is told (mirrors globaldiscovery.v1.WatchEventType; a test keeps them in step)."""

    ADDED = 1
    UPDATED = 2
    REMOVED = 3
    SNAPSHOT_DONE = 4


class Removal(enum.Enum):
    """Why a pool left (mirrors globaldiscovery.v1.RemovalReason; a test keeps them in step)."""

    UNSPECIFIED = 0
    LEASE_EXPIRED = 1
    UNREGISTERED = 2
    REMOVED = 3
    DRAINED = 4


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
    frontend_protocol: int = 0  # FrontendProtocol number; 0: the mesh's gRPC pool frontend


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
    frontend_protocol: int = 0


# Rough CPython sizes (64-bit) for pool_view_bytes: a str's header, a tuple slot, a slotted
# dataclass instance. An estimate that errs high is safe (a bound kept early, never late).
_STR_BYTES = 56
_SLOT_BYTES = 8
_OBJECT_BYTES = 120


def pool_view_bytes(view: PoolView) -> int:
    """About the memory `view` holds that nothing else may (its strings, tuples and objects):
    what a history bounded by bytes counts for an event. The merged frontends are the leases'
    own strings, so they count as tuple slots only."""
    size = 4 * _OBJECT_BYTES + len(view.pool_id) + len(view.model) + len(view.region) + 3 * _STR_BYTES
    size += _SLOT_BYTES * len(view.frontends)
    size += sum(_STR_BYTES + _SLOT_BYTES + len(c) for c in view.capabilities)
    for lease in view.leases:
        size += _OBJECT_BYTES + _STR_BYTES + len(lease.relay_id)
        size += sum(_STR_BYTES + _SLOT_BYTES + len(url) for url in lease.frontends)
    return size


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
    revision: int = 0  # the directory's revision after this event (see Directory.revision)
    size: int = 0  # pool_view_bytes of its pool record: what queues and the history bounded by bytes count
    resumed: bool = False  # SNAPSHOT_DONE of a resumed watch: no snapshot precedes it


@dataclass(frozen=True, slots=True)
class RegisterResult:
    """What a relay learns from a registration."""

    lease_expire_wall: float
    pool: PoolView
    drain_requested: bool
    drain_deadline_wall: float | None

"""The lease rules, written once: incarnations, model conflicts, completed drains, drain deadlines.

Pure: no transport, no storage, no clock of its own (times are passed in). Both stores (the
in-memory lease state and the etcd store) read what they hold, ask these functions, and act on
the answer, so the two cannot disagree about what the contract in discovery.proto allows.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

from globaldiscovery.records import PoolRegistration

__all__ = [
    "DrainCompleted",
    "ModelConflict",
    "NotFound",
    "StaleIncarnation",
    "check_incarnation",
    "check_not_drained",
    "conflicting_holder",
    "drain_deadline",
    "drained_incarnations",
    "require_listed",
]


class StaleIncarnation(Exception):
    """The lease is held by a newer incarnation than the caller's."""

    def __init__(self, key: Hashable, held: int, offered: int) -> None:
        super().__init__(f"lease {key!r} is held by incarnation {held}, newer than {offered}")
        self.key = key
        self.held = held
        self.offered = offered


class ModelConflict(Exception):
    """Another live lease of the pool names a different model or region."""

    def __init__(self, holder: PoolRegistration) -> None:
        super().__init__(
            f"pool {holder.pool_id!r} is registered by relay {holder.relay_id!r} with model {holder.model!r} in "
            f"region {holder.region!r}; a pool serves one model in one region (this relay's earlier "
            f"lease, if any, was ended)"
        )
        self.holder = holder


class DrainCompleted(Exception):
    """A discovery-side drain of the pool completed for this relay incarnation."""

    def __init__(self, reg: PoolRegistration) -> None:
        super().__init__(
            f"pool {reg.pool_id!r} was drained; relay {reg.relay_id!r} incarnation {reg.incarnation} "
            f"may not register it again (a restarted relay, with a higher incarnation, may)"
        )
        self.registration = reg


class NotFound(Exception):
    """The pool is not listed."""

    def __init__(self, pool_id: str) -> None:
        super().__init__(f"pool {pool_id!r} is not listed")
        self.pool_id = pool_id


def check_incarnation(key: Hashable, held: int | None, offered: int) -> None:
    """Only the incarnation holding a lease, or a newer one, may renew, take over or end it.

    Raises StaleIncarnation when `held` (None: no lease) is newer than `offered`.
    """
    if held is not None and held > offered:
        raise StaleIncarnation(key, held, offered)


def check_not_drained(reg: PoolRegistration, refused: int | None) -> None:
    """After a completed drain, the drained incarnation (and older ones) may not register again.

    `refused` is the highest incarnation the drain refused for (reg.pool_id, reg.relay_id), or
    None. Raises DrainCompleted.
    """
    if refused is not None and reg.incarnation <= refused:
        raise DrainCompleted(reg)


def conflicting_holder(reg: PoolRegistration, others: Iterable[PoolRegistration]) -> PoolRegistration | None:
    """The live lease of another relay naming a different model or region than `reg`, or None.

    A pool serves one model in one region. On a conflict the store ends the caller's own earlier
    lease of the pool (so replicas that all move to a new model converge) and raises
    ModelConflict(holder).
    """
    for other in others:
        if other.relay_id != reg.relay_id and (other.model != reg.model or other.region != reg.region):
            return other
    return None


def drain_deadline(existing: float | None, now: float, timeout: float) -> float:
    """The deadline of a drain asked for at `now`: draining an already-draining pool keeps the earlier one."""
    return existing if existing is not None else now + timeout


def drained_incarnations(refused: Mapping[str, int], holders: Iterable[tuple[str, int]]) -> dict[str, int]:
    """The refusals after a drain completes: per relay, the highest incarnation refused so far.

    `refused` maps relay_id to what was refused before, `holders` are the (relay_id, incarnation)
    leases the drain ended.
    """
    out: dict[str, int] = {}
    for relay_id, incarnation in holders:
        out[relay_id] = max(refused.get(relay_id, 0), incarnation)
    return out


def require_listed(pool_id: str, listed: object | None) -> None:
    """Operator actions (drain, remove) need a listed pool. Raises NotFound."""
    if listed is None:
        raise NotFound(pool_id)

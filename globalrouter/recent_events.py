"""A bounded ring of what the routing core did lately (decisions, migrations, refusals) for the status page."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import asdict, dataclass

DEFAULT_CAPACITY = 200


@dataclass(frozen=True, slots=True)
class RouteEvent:
    """One thing that happened to a request at this frontend."""

    seq: int
    """Grows by one per event, so a reader can ask for what is newer than what it has."""
    wall: float
    """When (seconds since the epoch)."""
    kind: str
    """"decision" (a pool admitted the request), "migration" or "refusal"."""
    request_id: str
    model: str
    pool_id: str
    """The pool chosen (decision), left (migration) or that refused (refusal)."""
    cached_blocks: int = 0
    prompt_blocks: int = 0
    detail: str = ""
    """For a refusal, its code or reason; for a migration, why the pool was left."""
    achieved_share: float | None = None
    """For a decision, the cached share of the prompt's blocks the pool had as the KV index saw it."""
    available_share: float | None = None
    """For a decision, the best such share any eligible pool had (routing.PrefixQuality)."""

    def as_dict(self) -> dict:
        return asdict(self)


class RecentEvents:
    """The last `capacity` events; appending is O(1) and memory stays bounded whatever the load."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._ring: deque[RouteEvent] = deque(maxlen=capacity)
        self._seq = itertools.count(1)

    def add(
        self,
        kind: str,
        *,
        wall: float,
        request_id: str,
        model: str,
        pool_id: str,
        cached_blocks: int = 0,
        prompt_blocks: int = 0,
        detail: str = "",
        achieved_share: float | None = None,
        available_share: float | None = None,
    ) -> RouteEvent:
        event = RouteEvent(
            next(self._seq),
            wall,
            kind,
            request_id,
            model,
            pool_id,
            cached_blocks,
            prompt_blocks,
            detail[:300],
            achieved_share,
            available_share,
        )
        self._ring.append(event)
        return event

    def latest(self, limit: int = DEFAULT_CAPACITY, kind: str | None = None) -> list[RouteEvent]:
        """The newest events first, at most `limit`, optionally of one kind."""
        out: list[RouteEvent] = []
        for event in reversed(self._ring):
            if kind is None or event.kind == kind:
                out.append(event)
                if len(out) >= limit:
                    break
        return out

"""Prompt prefixes this frontend sent to a pool recently, counted as cached there until the pool's
own KV events could have said so.

A pool reports the blocks of a prompt once it has prefilled them, and its relay forwards the
report a delta interval later: a request that shares the prefix and arrives in between sees no
pool holding it, and may be sent elsewhere, where its prefix is prefilled again (and a second copy
takes cache space). The frontend knows where it sent the first request, so for `ttl` seconds it
counts that prompt's blocks as cached at that pool (the most of this and the KV index, so the
index wins once it knows). Dynamo's KV router keeps the same kind of record for pools without KV
events (its approximate indexer). Pure: no clock, no transport; the live frontend and the
simulator share it.

Chained block hashes make a prompt's cached prefix at a pool monotone, so each recorded prompt is
kept whole, under its first block, and a lookup binary-searches each candidate record for the
longest common prefix. Bounded: at most `max_records` records in all (oldest dropped first) and
`PER_FIRST_BLOCK` per first block and pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from globalrouter.selection import PoolOverlaps

DEFAULT_TTL = 10.0
"""Seconds a sent prompt counts as cached at its pool without the pool's KV events (a queue of a
few seconds, the prefill and a relay's delta interval)."""
MAX_RECORDS = 65_536
"""Records kept at most (each holds a reference to its prompt's hash list)."""
PER_FIRST_BLOCK = 4
"""Records kept per (first block, pool): the longest recent ones of a shared system prompt."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading positions where two chained hash lists agree (agreement at i implies at every j < i)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # the largest k with a[k-1] == b[k-1]
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RoutedPrefixes:
    """Recently sent prompts by first block: pool id -> leading blocks it is assumed to hold."""

    __slots__ = ("_by_first", "_order", "max_records", "ttl")

    def __init__(self, ttl: float = DEFAULT_TTL, max_records: int = MAX_RECORDS) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be positive seconds, got {ttl!r}")
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records!r}")
        self.ttl = ttl
        self.max_records = max_records
        self._by_first: dict[int, dict[str, list[tuple[float, Sequence[int]]]]] = {}
        """first block hash -> pool id -> [(expiry, the prompt's block hashes)], newest last."""
        self._order: deque[tuple[float, int, str]] = deque()
        """(expiry, first block, pool id) in the order recorded, for expiry and the bound."""

    def __len__(self) -> int:
        return len(self._order)

    def holds(self, first_block: int) -> bool:
        """Whether some record starts with this block (it may have expired)."""
        return first_block in self._by_first

    def record(self, pool_id: str, hashes: Sequence[int], now: float) -> None:
        """The prompt with these block hashes was sent to `pool_id` at `now`."""
        if not hashes:
            return
        self._expire(now)
        expiry = now + self.ttl
        first = hashes[0]
        records = self._by_first.setdefault(first, {}).setdefault(pool_id, [])
        records.append((expiry, hashes))
        if len(records) > PER_FIRST_BLOCK:
            # the shortest goes: a longer record of the same prefix answers for it too
            records.remove(min(records, key=lambda r: len(r[1])))
        self._order.append((expiry, first, pool_id))
        while len(self._order) > self.max_records:
            self._drop_oldest()

    def overlaps(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Pool id -> leading blocks of `hashes` it was sent within the last `ttl` seconds."""
        if not hashes:
            return {}
        by_pool = self._by_first.get(hashes[0])
        if not by_pool:
            return {}
        out: dict[str, int] = {}
        for pool_id, records in by_pool.items():
            best = 0
            for expiry, recorded in records:
                if expiry > now:
                    best = max(best, common_prefix(recorded, hashes))
            if best:
                out[pool_id] = best
        return out

    def _expire(self, now: float) -> None:
        order = self._order
        while order and order[0][0] <= now:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        expiry, first, pool_id = self._order.popleft()
        by_pool = self._by_first.get(first)
        if by_pool is None:
            return
        records = by_pool.get(pool_id)
        if records:
            # the oldest of this (first block, pool), if the bound above has not dropped it already
            for i, (e, _) in enumerate(records):
                if e <= expiry:
                    del records[i]
                    break
            if not records:
                del by_pool[pool_id]
        if not by_pool:
            del self._by_first[first]


def with_routed(found: PoolOverlaps, routed: dict[str, int]) -> PoolOverlaps:
    """`found` (the KV view's overlaps, `selection.pool_overlaps`) with each pool's count raised to
    what `routed` (the recently sent prompts') says, in the same array form, so that
    `Selector.select` still reads it directly."""
    if not routed:
        return found
    counts = found.counts.copy()
    for i, pool in enumerate(found.pools):
        blocks = routed.get(pool.pool_id)
        if blocks is not None and blocks > counts[i]:
            counts[i] = blocks
    return PoolOverlaps(found.pools, found.rows, counts)

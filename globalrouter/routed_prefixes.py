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
longest common prefix. Bounded: at most `max_blocks` block hashes over all records (oldest
dropped first) and `PER_FIRST_BLOCK` records per first block and pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from globalrouter.selection import PoolOverlaps

DEFAULT_TTL = 10.0
"""Seconds a sent prompt counts as cached at its pool without the pool's KV events (a queue of a
few seconds, the prefill and a relay's delta interval)."""
MAX_BLOCKS = 1_048_576
"""Block hashes held at most over all records (47.0 MB traced at the bound with 16k-token records,
bench/bench_routed_prefixes.py); the oldest records go first past it."""
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


class _Record:
    __slots__ = ("alive", "expiry", "first", "hashes", "pool_id")

    def __init__(self, expiry: float, first: int, pool_id: str, hashes: Sequence[int]) -> None:
        self.expiry = expiry
        self.first = first
        self.pool_id = pool_id
        self.hashes = hashes
        self.alive = True


class RoutedPrefixes:
    """Recently sent prompts by first block: pool id -> leading blocks it is assumed to hold."""

    __slots__ = ("_by_first", "_order", "blocks", "live", "max_blocks", "ttl")

    def __init__(self, ttl: float = DEFAULT_TTL, max_blocks: int = MAX_BLOCKS) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be positive seconds, got {ttl!r}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks!r}")
        self.ttl = ttl
        self.max_blocks = max_blocks
        self.blocks = 0
        """Block hashes the live records hold."""
        self.live = 0
        """Live records."""
        self._by_first: dict[int, dict[str, list[_Record]]] = {}
        """first block hash -> pool id -> its records, oldest first."""
        self._order: deque[_Record] = deque()
        """Every record in the order recorded (so by expiry), for expiry and the bound; a record
        forgotten early (the shortest of its prefix's) stays here until it reaches the front."""

    def __len__(self) -> int:
        return self.live

    def holds(self, first_block: int) -> bool:
        """Whether some record starts with this block (it may have expired)."""
        return first_block in self._by_first

    def record(self, pool_id: str, hashes: Sequence[int], now: float) -> None:
        """The prompt with these block hashes was sent to `pool_id` at `now`."""
        if not hashes:
            return
        self._expire(now)
        rec = _Record(now + self.ttl, hashes[0], pool_id, hashes)
        records = self._by_first.setdefault(rec.first, {}).setdefault(pool_id, [])
        records.append(rec)
        self._order.append(rec)
        self.blocks += len(hashes)
        self.live += 1
        if len(records) > PER_FIRST_BLOCK:
            # the shortest goes: a longer record of the same prefix answers for it too
            self._forget(min(records, key=lambda r: len(r.hashes)))
        while self.blocks > self.max_blocks:
            self._forget(self._order.popleft())

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
            for rec in records:
                if rec.expiry > now:
                    best = max(best, common_prefix(rec.hashes, hashes))
            if best:
                out[pool_id] = best
        return out

    def _expire(self, now: float) -> None:
        order = self._order
        while order and (not order[0].alive or order[0].expiry <= now):
            self._forget(order.popleft())

    def _forget(self, rec: _Record) -> None:
        """Drops one record from its prefix's list (once); `_order` lets go of it lazily."""
        if not rec.alive:
            return
        rec.alive = False
        by_pool = self._by_first[rec.first]
        records = by_pool[rec.pool_id]
        records.remove(rec)  # a few per (first block, pool): PER_FIRST_BLOCK
        if not records:
            del by_pool[rec.pool_id]
            if not by_pool:
                del self._by_first[rec.first]
        self.blocks -= len(rec.hashes)
        self.live -= 1
        rec.hashes = ()  # a dead record may wait in _order for up to the TTL: without its hashes


def with_routed(
    found: PoolOverlaps, routed: RoutedPrefixes | None, hashes: Sequence[int], now: float
) -> PoolOverlaps:
    """`found` (the KV view's overlaps of `hashes`, `selection.pool_overlaps`) with each pool's
    count raised to what the recently sent prompts in `routed` say, in the same array form, so
    that `Selector.select` still reads it directly; `found` itself when nothing raises it."""
    if routed is None or not hashes or not routed.holds(hashes[0]):
        return found
    raised = routed.overlaps(hashes, now)
    if not raised:
        return found
    counts = found.counts.copy()
    for i, pool in enumerate(found.pools):
        blocks = raised.get(pool.pool_id)
        if blocks is not None and blocks > counts[i]:
            counts[i] = blocks
    return PoolOverlaps(found.pools, found.rows, counts)

"""Simulated workers: an LRU KV cache of chained block hashes, numbered KV events, slots, timing."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KvEvent:
    """One numbered change of one worker's block set (event ids are consecutive per worker)."""

    worker_id: str
    event_id: int
    stored: tuple[int, ...]
    removed: tuple[int, ...]
    cleared: bool = False


class KvCache:
    """A block-level prefix cache with least-recently-used eviction and a capacity in blocks."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt are cached (chained hashes: a miss ends the prefix)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Inserts a prompt's blocks (refreshing cached ones); returns the net (stored, removed).

        Only the first `capacity` blocks are kept: a prefix cache gains nothing from a prompt's tail
        without its head, and inserting more would evict the prompt's own first blocks.
        """
        stored: list[int] = []
        removed: list[int] = []
        for h in hashes[: self.capacity]:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            self._blocks[h] = None
            stored.append(h)
            if len(self._blocks) > self.capacity:
                old, _ = self._blocks.popitem(last=False)
                removed.append(old)
        # Every block evicted above was either held before or stored by this call; a block both
        # stored and evicted here never existed for a reader, so it appears in neither list.
        transient = set(stored).intersection(removed)
        if transient:
            stored = [h for h in stored if h not in transient]
            removed = [h for h in removed if h not in transient]
        return stored, removed

    def blocks(self) -> list[int]:
        """Every cached block, least recently used first."""
        return list(self._blocks)


@dataclass(frozen=True)
class TimingModel:
    """How long simulated work takes: prefill grows with uncached tokens, decode per output token."""

    prefill_tokens_per_second: float
    decode_tokens_per_second: float
    speedup: float = 1.0

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Time to prefill `uncached_tokens` prompt tokens."""
        return uncached_tokens / (self.prefill_tokens_per_second * self.speedup)

    def token_interval(self) -> float:
        """Time between two output tokens of one request."""
        return 1.0 / (self.decode_tokens_per_second * self.speedup)


class Worker:
    """One simulated worker: its KV cache, its numbered KV events and its request slots."""

    def __init__(
        self,
        worker_id: str,
        capacity_blocks: int,
        max_running: int,
        on_event: Callable[[KvEvent], None] = lambda _e: None,
    ) -> None:
        self.worker_id = worker_id
        self.cache = KvCache(capacity_blocks)
        self.max_running = max_running
        self.running = 0
        self.event_id = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._on_event = on_event
        # Prefill is compute-bound: a worker prefills one request at a time (first come, first
        # served), so its prefill rate is a real capacity; decode runs batched for every request.
        self.prefill_lock = asyncio.Lock()

    @property
    def waiting(self) -> int:
        """Requests queued for a slot on this worker."""
        return sum(1 for f in self._waiters if not f.done())

    @property
    def has_free_slot(self) -> bool:
        return self.running < self.max_running

    @property
    def load(self) -> int:
        """Requests running or queued here."""
        return self.running + self.waiting

    def store(self, hashes: Sequence[int]) -> KvEvent | None:
        """Caches a prompt's blocks; emits (and returns) the numbered event when the block set changed."""
        stored, removed = self.cache.insert(hashes)
        if not stored and not removed:
            return None
        self.event_id += 1
        event = KvEvent(self.worker_id, self.event_id, tuple(stored), tuple(removed))
        self._on_event(event)
        return event

    def snapshot(self) -> tuple[int, list[int]]:
        """(event id the block set is current at, the blocks in LRU order)."""
        return self.event_id, self.cache.blocks()

    async def acquire(self) -> None:
        """Waits for a request slot (first come, first served)."""
        place = self.take_or_queue()
        if place is None:
            return
        try:
            await place
        except asyncio.CancelledError:
            self.leave(place)
            raise

    def take_or_queue(self) -> asyncio.Future[None] | None:
        """Takes a free slot (None), or joins the line for one: the future is done when the slot
        passes to it (then it holds the slot). A caller that stops waiting calls leave()."""
        if self.running < self.max_running and not self.waiting:
            self.running += 1
            return None
        place: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(place)
        return place

    def leave(self, place: asyncio.Future[None]) -> None:
        """A waiter gives up its place; a slot handed to it just now passes on to the next."""
        if place.done() and not place.cancelled():
            self.release()
        else:
            place.cancel()

    def position(self, place: asyncio.Future[None]) -> int:
        """A waiter's place in the line (1: next to get a slot); 0 once it is no longer waiting."""
        if place.done():
            return 0
        n = 0
        for f in self._waiters:
            if not f.done():
                n += 1
            if f is place:
                return n
        return 0

    def release(self) -> None:
        """Frees a slot, handing it straight to the next waiter if there is one."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes over; `running` stays the same
                return
        self.running -= 1


def choose_worker(workers: Iterable[Worker], hashes: Sequence[int]) -> tuple[Worker, int]:
    """The pool's KV-aware choice: (worker, its cached prefix blocks).

    A worker with a free slot beats a full one (a queue wait usually costs more than a prefill);
    among those, the longest cached prefix wins; ties go to the least loaded, then to the id.
    """
    best: tuple[tuple[int, int, int, str], Worker, int] | None = None
    for w in workers:
        cached = w.cache.cached_prefix(hashes)
        key = (0 if w.has_free_slot else 1, -cached, w.load, w.worker_id)
        if best is None or key < best[0]:
            best = (key, w, cached)
    if best is None:
        raise ValueError("a pool needs at least one worker")
    return best[1], best[2]

"""The pool-level KV block set built from per-worker events, counted across workers (pure, hot path).

A block is in the pool while at least one worker holds it; only 0↔1 transitions of that count
are published, as numbered deltas after a snapshot. Transitions are batched: a block stored and
removed again before the next delta is taken is never published.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Delta:
    """One numbered batch of pool-level transitions."""

    sequence: int
    """Consecutive: the previous delta's sequence + 1."""
    stored: list[int]
    """Blocks the pool now holds and did not."""
    removed: list[int]
    """Blocks no worker holds any more."""


class PoolBlocks:
    """Reference counts of block hashes across workers, with pending transitions."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._workers: dict[str, set[int]] = {}
        self._stored: set[int] = set()  # pending 0→1 since the last delta
        self._removed: set[int] = set()  # pending 1→0 since the last delta
        self._unconfirmed: set[str] = set()
        self.sequence = 0

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, block: int) -> bool:
        return block in self._counts

    @property
    def workers(self) -> list[str]:
        """Workers with a known block set."""
        return sorted(self._workers)

    def worker_blocks(self, worker: str) -> set[int]:
        """A copy of one worker's block set."""
        return set(self._workers.get(worker, ()))

    def _add(self, blocks: Iterable[int], held: set[int]) -> None:
        counts, stored, removed = self._counts, self._stored, self._removed
        for h in blocks:
            if h in held:
                continue
            held.add(h)
            n = counts.get(h, 0)
            counts[h] = n + 1
            if n == 0:
                if h in removed:
                    removed.discard(h)
                else:
                    stored.add(h)

    def _drop(self, blocks: Iterable[int], held: set[int]) -> None:
        counts, stored, removed = self._counts, self._stored, self._removed
        for h in blocks:
            if h not in held:
                continue
            held.discard(h)
            n = counts[h] - 1
            if n:
                counts[h] = n
            else:
                del counts[h]
                if h in stored:
                    stored.discard(h)
                else:
                    removed.add(h)

    def apply_snapshot(self, worker: str, blocks: Iterable[int]) -> None:
        """A worker's whole block set: replaces what was known for it, net transitions only."""
        self._unconfirmed.discard(worker)
        held = self._workers.setdefault(worker, set())
        new = set(blocks)
        self._drop([h for h in held if h not in new], held)
        self._add(new, held)

    def apply_event(
        self, worker: str, stored: Iterable[int] = (), removed: Iterable[int] = (), cleared: bool = False
    ) -> None:
        """One change of a worker's block set (`cleared` applies first)."""
        held = self._workers.get(worker)
        if held is None:
            held = self._workers[worker] = set()
        if cleared:
            self._drop(list(held), held)
        self._drop(removed, held)
        self._add(stored, held)

    def remove_worker(self, worker: str) -> None:
        """A worker left the pool: its blocks no longer count."""
        held = self._workers.pop(worker, None)
        if held:
            self._drop(list(held), held)

    def begin_resync(self) -> None:
        """The event stream is re-subscribed: every worker must send a fresh snapshot."""
        self._unconfirmed = set(self._workers)

    def end_resync(self) -> None:
        """The fresh snapshots are in: workers that sent none left the pool."""
        for worker in sorted(self._unconfirmed):
            self.remove_worker(worker)
        self._unconfirmed = set()

    @property
    def pending(self) -> bool:
        """Whether transitions wait to be taken as a delta."""
        return bool(self._stored or self._removed)

    @property
    def pending_count(self) -> int:
        """How many transitions wait to be taken as a delta."""
        return len(self._stored) + len(self._removed)

    def take_delta(self) -> Delta | None:
        """The pending transitions as the next numbered delta (None when there are none)."""
        if not (self._stored or self._removed):
            return None
        self.sequence += 1
        delta = Delta(self.sequence, list(self._stored), list(self._removed))
        self._stored = set()
        self._removed = set()
        return delta

    def snapshot(self) -> tuple[int, list[int]]:
        """(sequence, every block): the set as of delta `sequence`.

        Pending transitions must be taken (and published) first, so that no transition falls
        between a snapshot and the deltas that follow it.
        """
        if self.pending:
            raise RuntimeError("take the pending delta before a snapshot")
        return self.sequence, list(self._counts)

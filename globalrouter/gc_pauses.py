"""Python's cyclic garbage collector in the frontend: its pauses as metrics, and its settings."""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from typing import Any

PENDING_PAUSES = 4096
"""Collections timed and not yet reported (tick reports them every second; past it the oldest go)."""


class GcPauses:
    """Times every collection of the cyclic garbage collector (gc.callbacks) and reports it: a
    collection runs on whichever thread allocates, the serving loop's mostly, and holds the GIL
    throughout, so each pause is a pause of every call the loop serves. The callback only queues
    the pause; `tick` reports it (`observe`) from the loop: a collection can start inside any
    allocation, e.g. while the metrics thread holds a histogram's lock to read it, and observing
    there would take that lock again on the same thread (a deadlock).

    With `refreeze`, `tick` (called on the serving loop) also keeps the long-lived state out of
    later full collections: after each full collection (generation 2) it freezes what survived
    (gc.freeze), so the next full one walks only what became old since, not the whole state again
    (at 1,000 pools a full collection over it took 100-500 ms). Cycles among frozen objects that
    later become garbage (a closed stream's, say) are not collected while frozen, so every
    `full_every` seconds `tick` unfreezes everything and collects it once (one planned pause of
    that length), then freezes what survived."""

    def __init__(
        self,
        observe: Callable[[int, float], None],
        now: Callable[[], float] = time.perf_counter,
        *,
        refreeze: bool = False,
        full_every: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if full_every < 0:
            raise ValueError(f"full_every must be >= 0 seconds; got {full_every!r}")
        self._observe = observe
        self._now = now
        self._start = 0.0
        self._installed = False
        self.refreeze = refreeze
        self.full_every = full_every
        self._clock = clock
        self._last_full = clock()
        self._full_since = False
        """A full collection ended since the last freeze (set by the callback, on any thread)."""
        self._pauses: deque[tuple[int, float]] = deque(maxlen=PENDING_PAUSES)
        """(generation, seconds) of collections not reported yet (appended by the callback)."""

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = self._now()
        elif self._start:
            generation = int(info.get("generation", 0))
            self._pauses.append((generation, self._now() - self._start))
            self._start = 0.0
            if generation == 2:
                self._full_since = True

    def install(self) -> None:
        """Starts timing collections (idempotent)."""
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def uninstall(self) -> None:
        """Stops timing collections (idempotent)."""
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def report(self) -> int:
        """Reports the collections timed since the last report (`observe`); returns how many."""
        n = 0
        while self._pauses:
            generation, seconds = self._pauses.popleft()
            self._observe(generation, seconds)
            n += 1
        return n

    def tick(self) -> int | None:
        """On the loop: reports the pauses timed since the last tick; with `refreeze`, also the
        planned full collection when due, then a freeze of what survived the last full collection;
        returns the objects frozen in all when it froze, else None."""
        self.report()
        if not self.refreeze:
            return None
        if self.full_every and self._clock() - self._last_full >= self.full_every:
            self._last_full = self._clock()
            gc.unfreeze()
            gc.collect()
            self._full_since = True
        if not self._full_since:
            return None
        self._full_since = False
        frozen = freeze_alive()
        self.report()  # the planned collection's own pause
        return frozen

    def young(self) -> None:
        """On the loop, every GcConfig.young_every: a young collection and, with `refreeze`, a freeze
        of what survived it, so the young generation never holds more than that interval's
        allocations and no older one fills (its pauses are reported by `tick` as any other's)."""
        gc.collect(0)
        if self.refreeze:
            gc.freeze()


def apply_gc_settings(threshold: int, threshold1: int = 0) -> None:
    """Sets the young generation's threshold and generation 1's (each 0 keeps the interpreter's)."""
    young, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold or young, threshold1 or older, oldest)


def freeze_alive() -> int:
    """Moves every object alive now to the collector's permanent generation (gc.freeze), so later
    collections, the full ones too, no longer walk them; returns how many are frozen in all."""
    gc.freeze()
    return gc.get_freeze_count()

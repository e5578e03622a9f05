"""Where the serving loop's long turns go: an opt-in thread that samples the loop thread's stack while its heartbeat is late."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

from globalrouter.loop_lag import INTERVAL

LATE_AFTER = 0.010
"""Seconds past its due time after which the loop's heartbeat counts as late (the lag goal)."""

EVERY = 0.002
"""Seconds between the sampler thread's looks: a 10 ms stall gets about five samples."""

DEPTH = 4
"""Frames of a sample's key, innermost first: enough to tell a fold from a Route reply from a
C callback of gRPC's (which shows as asyncio's Handle._run: Cython makes no Python frame)."""

MAX_KEYS = 2048
"""Distinct keys counted at most (the bound of the counters' memory); later new keys go to '[other]'."""

REPORT_EVERY = 10.0
"""Seconds between the counts' log lines (the process may be killed, so not only at the stop)."""

TOP = 25
"""Keys per log line."""


_SHORT: dict[str, str] = {}
"""File name -> its path under the sys.path entry that holds it (few files: unbounded is fine)."""


def _short(path: str) -> str:
    short = _SHORT.get(path)
    if short is None:
        # The import path: "globalrouter/kv_summary.py", "asyncio/events.py", "grpc/aio/_call.py".
        roots = sorted((r.rstrip("/") for r in sys.path if r), key=len, reverse=True)
        short = next((path[len(r) + 1 :] for r in roots if path.startswith(r + "/")), path)
        _SHORT[path] = short
    return short


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{_short(code.co_filename)}:{code.co_qualname}:{frame.f_lineno}"


def stack_key(frame: FrameType | None, depth: int = DEPTH) -> str:
    """The innermost `depth` frames of a stack, innermost first, joined by ' < '."""
    parts: list[str] = []
    while frame is not None and len(parts) < depth:
        parts.append(_where(frame))
        frame = frame.f_back
    return " < ".join(parts) if parts else "[no Python frame]"


class StallSampler:
    """Counts where the loop thread is while its heartbeat is late by more than `late_after`.

    The loop calls `beat` at every heartbeat (loop_lag's on_tick, every `interval`); a daemon
    thread looks every `every` seconds and, when the next beat is overdue by more than
    `late_after`, takes the loop thread's innermost frames (sys._current_frames) and counts them,
    marked '[gc]' when a garbage collection was running, and counts the other threads' innermost
    frames apart (a thread that holds the GIL, the metrics endpoint rendering, shows there). A
    sample of the loop thread in its selector's wait means the loop was not late of its own doing:
    the process was not scheduled (the host) or another thread held the GIL.

    Sampling needs the GIL, so a sample lands where the loop thread let go of it (a bytecode
    boundary at the switch interval, or a call that releases it): Python work is seen, a long C
    call that keeps the GIL is seen at its Python caller once it ends. Off by default (the flag
    --loop-stall-sample); a look costs a few microseconds, a late one some tens."""

    def __init__(
        self,
        interval: float = INTERVAL,
        late_after: float = LATE_AFTER,
        every: float = EVERY,
        *,
        now: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_KEYS,
        depth: int = DEPTH,
    ) -> None:
        if not (interval > 0 and late_after > 0 and every > 0):
            raise ValueError(
                f"interval, late_after and every must be > 0 seconds; got {interval!r}, {late_after!r}, {every!r}"
            )
        if max_keys < 1 or depth < 1:
            raise ValueError(f"max_keys and depth must be >= 1; got {max_keys!r}, {depth!r}")
        self.interval = interval
        self.late_after = late_after
        self.every = every
        self._now = now
        self._max_keys = max_keys
        self._depth = depth
        self._due: float | None = None
        self._loop_thread: int | None = None
        self._gc_running = False
        self.looks = 0
        """Looks at the heartbeat (a sample or not)."""
        self.late = 0
        """Looks that found the heartbeat late: samples taken."""
        self.loop: Counter[str] = Counter()
        """The loop thread's innermost frames, per late sample."""
        self.others: Counter[str] = Counter()
        """The other threads' innermost frame, per late sample and thread."""
        self._since: tuple[int, int, Counter[str], Counter[str]] = (0, 0, Counter(), Counter())
        """looks, late and the two counters at the last `report(since_last=True)`."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # On the loop thread.

    def beat(self) -> None:
        """The loop's heartbeat: it turned now; the next is due `interval` later."""
        if self._loop_thread is None:
            self._loop_thread = threading.get_ident()
        self._due = self._now() + self.interval

    # On any thread.

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        self._gc_running = phase == "start"

    def _count(self, counter: Counter[str], key: str) -> None:
        if key in counter or len(counter) < self._max_keys:
            counter[key] += 1
        else:
            counter["[other]"] += 1

    def look(self, frames: dict[int, FrameType] | None = None) -> bool:
        """One look: when the heartbeat is late, counts the threads' frames (`frames`, by default
        sys._current_frames()); True when it sampled."""
        self.looks += 1
        due = self._due
        if due is None or self._loop_thread is None or self._now() - due <= self.late_after:
            return False
        if frames is None:
            frames = sys._current_frames()
        me = threading.get_ident()
        key = stack_key(frames.get(self._loop_thread), self._depth)
        if self._gc_running:
            key = "[gc] " + key
        with self._lock:
            self.late += 1
            self._count(self.loop, key)
            for ident, frame in frames.items():
                if ident not in (me, self._loop_thread):
                    self._count(self.others, stack_key(frame, 1))
        return True

    def report(self, top: int = TOP, *, since_last: bool = False) -> dict[str, Any]:
        """The counts so far (or, `since_last`, since the last such report): looks, late samples,
        the loop's and the other threads' top keys."""
        with self._lock:
            looks, late, loop, others = self.looks, self.late, self.loop, self.others
            if since_last:
                looks0, late0, loop0, others0 = self._since
                self._since = (looks, late, loop.copy(), others.copy())
                looks, late, loop, others = looks - looks0, late - late0, loop - loop0, others - others0
            return {
                "looks": looks,
                "late": late,
                "late_after_ms": round(self.late_after * 1000, 1),
                "since_last": since_last,
                "loop": loop.most_common(top),
                "others": others.most_common(top),
            }

    def start(
        self, log: Callable[[dict[str, Any]], None] | None = None, report_every: float = REPORT_EVERY
    ) -> None:
        """Starts the sampling thread (idempotent); `log` gets the counts of every `report_every`
        seconds (`report(since_last=True)`)."""
        if self._thread is not None:
            return
        gc.callbacks.append(self._gc)
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(log, report_every), name="loop-stall-sampler", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stops the sampling thread (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._thread = None
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)

    def _run(self, log: Callable[[dict[str, Any]], None] | None, report_every: float) -> None:
        next_report = self._now() + report_every
        while not self._stop.wait(self.every):
            self.look()
            if log is not None and self._now() >= next_report:
                next_report = self._now() + report_every
                log(self.report(since_last=True))

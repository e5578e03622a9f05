"""When a pool that stopped sending tokens counts as failed for a request (hung, not dead), on any clock.

A pool that dies is noticed by its broken stream; one that hangs (SIGSTOP, a wedged engine, a lost
network path with no RST) keeps the stream open and says nothing, and keepalive notices only after
tens of seconds. So each admitted stream has its own allowance, tied to the pool's own pace:

- before the first token: a floor plus a multiple of the pool's predicted prefill (uncached prompt
  tokens at the prefill rate it registered). A pool that misses it is treated like one that refused
  the request: the next candidate is asked.
- between messages: a floor, or a multiple of the gap this stream has shown so far (an EWMA),
  whichever is longer, so a slow pool is not cut off at its normal pace and a fast one that stops
  is noticed in seconds. A pool that misses it has failed mid-stream: the request migrates.

A pool that is busy is not a pool that hangs: a request admitted behind full run slots waits its
turn, however long the work ahead of it takes. So the first-token allowance runs from the pool's
last sign of life, not from the ask: a "queued, position N" message (PoolQueued) starts it again,
and when it runs out while the pool is known to be busy (the caller judges that, e.g. from a fresh
load report showing it full), it starts again too. Only silence from a pool not known to be busy
is a stall. A request waits its turn at most `max_queue_wait` in all; past that it gives up on that
pool without blaming it (TurnTooLong).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from meshkit.clock import Clock, SystemClock

# The shortest wait a read is given, so a first token that is due right now still gets a chance.
MIN_WAIT_S = 0.05
# Weight of the newest gap in the pace estimate: a few messages set the pace, one outlier does not.
PACE_EWMA_WEIGHT = 0.2


# Defaults: a fast pool that stops is noticed in seconds, far below keepalive's tens of seconds.
DEFAULT_STALL_TIMEOUT_S = 5.0
DEFAULT_PACE_FACTOR = 10.0
DEFAULT_FIRST_TOKEN_TIMEOUT_S = 10.0
DEFAULT_PREFILL_FACTOR = 3.0
# Long enough for a queue of long requests to drain; a client's own deadline usually comes first.
DEFAULT_MAX_QUEUE_WAIT_S = 120.0
# Tolerance when judging whether an allowance ran out (a real clock's timer may fire a hair early).
_EPSILON_S = 1e-3


@dataclass(frozen=True, slots=True)
class StallPolicy:
    """How long a pool may stay silent on an admitted stream (seconds)."""

    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S
    """Floor of the silence allowed between two messages mid-stream."""
    pace_factor: float = DEFAULT_PACE_FACTOR
    """Silence allowed as a multiple of the stream's own typical gap, when that is longer."""
    first_token_timeout: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S
    """Floor of the wait from admission to the first token."""
    prefill_factor: float = DEFAULT_PREFILL_FACTOR
    """Added to the first-token floor: this many times the predicted prefill time."""
    max_queue_wait: float = DEFAULT_MAX_QUEUE_WAIT_S
    """Longest wait for the first token (from the ask) at a pool that shows it is busy; then the
    request tries another pool, and the busy pool's link is not backed off."""

    def __post_init__(self) -> None:
        for name in ("stall_timeout", "pace_factor", "first_token_timeout", "max_queue_wait"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StallPolicy.{name} must be > 0 (got {getattr(self, name)})")
        if self.prefill_factor < 0:
            raise ValueError(f"StallPolicy.prefill_factor must be >= 0 (got {self.prefill_factor})")


class FirstTokenWait(enum.Enum):
    """What a first-token allowance that ran out means (StallWatch.expired)."""

    WAIT = "the request waits its turn: the allowance starts again"
    STALLED = "the pool is silent: it hangs, for this request"
    TOO_LONG = "the pool is busy, but the request waited its turn past max_queue_wait"


class StallWatch:
    """One admitted stream's allowance: how long the next read may wait, given what came so far."""

    def __init__(
        self, policy: StallPolicy, *, uncached_tokens: int = 0, prefill_rate: float = 0.0, begun: float = 0.0
    ) -> None:
        self.policy = policy
        self.asked = begun
        """Monotonic time the pool was asked (admission and first token share one allowance)."""
        self.begun = begun
        """Start of the current first-token allowance: the ask, or the pool's last sign that the
        request waits its turn (a queue report, or a busy load when the allowance ran out)."""
        prefill = uncached_tokens / prefill_rate if prefill_rate > 0 else 0.0
        self.first_allowance = policy.first_token_timeout + policy.prefill_factor * prefill
        self.wait_cap = max(policy.max_queue_wait, self.first_allowance)
        """Longest wait for the first token in all (a long predicted prefill is never cut short)."""
        self.position = 0
        """The request's place in the pool's line from its last queue report (0: none came)."""
        self.turns = 0
        """How many times the first-token allowance started again because the pool is busy."""
        self.started = False
        """Whether a token arrived on this stream."""
        self.pace = 0.0
        """EWMA of the gaps between token messages, seconds (0 until two have arrived)."""
        self._last: float | None = None

    def allowance(self, now: float | None = None) -> float:
        """Seconds the next message may take (before the first token: what is left of the first
        allowance at `now`, never less than MIN_WAIT_S)."""
        if not self.started:
            if now is None:
                return self.first_allowance
            left = min(self.first_allowance - (now - self.begun), self.wait_cap - (now - self.asked))
            return max(MIN_WAIT_S, left)
        return max(self.policy.stall_timeout, self.policy.pace_factor * self.pace)

    def waiting_turn(self, now: float, position: int) -> None:
        """The pool says the request waits for a run slot (`position` in line) at monotonic `now`:
        it is alive and busy, so the first-token allowance starts again from here."""
        if not self.started:
            self.begun = now
            self.position = position

    def expired(self, now: float, *, busy: bool) -> FirstTokenWait:
        """The first-token allowance ran out at monotonic `now`; `busy`: the pool is known to be
        busy now (e.g. its fresh load shows it full). WAIT starts the allowance again."""
        silent_for = now - self.begun
        if silent_for >= self.first_allowance - _EPSILON_S and not busy:
            return FirstTokenWait.STALLED
        if now - self.asked >= self.wait_cap - _EPSILON_S:
            return FirstTokenWait.TOO_LONG
        if busy:
            self.begun = now
            self.turns += 1
        return FirstTokenWait.WAIT

    def arrived(self, now: float) -> None:
        """A token message arrived at monotonic `now`."""
        if self._last is not None:
            gap = max(0.0, now - self._last)
            self.pace = (
                gap if self.pace == 0.0 else (1 - PACE_EWMA_WEIGHT) * self.pace + PACE_EWMA_WEIGHT * gap
            )
        self._last = now
        self.started = True


class Silent(Exception):
    """Nothing arrived within the allowance."""

    def __init__(self, waited: float) -> None:
        super().__init__(f"no message within {waited:.1f} s")
        self.waited = waited


class TurnTooLong(Silent):
    """No first token, but the pool was busy, not silent: the request waited its turn past
    max_queue_wait (it may try another pool; the busy one is not to blame)."""


T = TypeVar("T")


async def within(clock: Clock, read: Callable[[], Awaitable[T]], seconds: float) -> T:
    """`await read()`, or Silent after `seconds` on `clock` (the read is cancelled then).

    A race of two tasks rather than asyncio.wait_for, so tests drive it with a FakeClock. On the
    real clock, asyncio.timeout around the read instead: no task and no wait per message.
    """
    if type(clock) is SystemClock:
        try:
            async with asyncio.timeout(max(0.0, seconds)) as deadline:
                return await read()
        except TimeoutError:
            if not deadline.expired():
                raise  # the read's own TimeoutError, not the allowance
            raise Silent(seconds) from None
    reader = asyncio.ensure_future(read())
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait((reader, timer), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        reader.cancel()
        raise
    finally:
        timer.cancel()
    if reader.done():
        return reader.result()
    reader.cancel()
    # The read may end cancelled, or fail as it is given up on: silence is the verdict either way.
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await reader
    raise Silent(seconds)

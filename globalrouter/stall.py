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
"""

from __future__ import annotations

import asyncio
import contextlib
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

    def __post_init__(self) -> None:
        for name in ("stall_timeout", "pace_factor", "first_token_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StallPolicy.{name} must be > 0 (got {getattr(self, name)})")
        if self.prefill_factor < 0:
            raise ValueError(f"StallPolicy.prefill_factor must be >= 0 (got {self.prefill_factor})")


class StallWatch:
    """One admitted stream's allowance: how long the next read may wait, given what came so far."""

    def __init__(
        self, policy: StallPolicy, *, uncached_tokens: int = 0, prefill_rate: float = 0.0, begun: float = 0.0
    ) -> None:
        self.policy = policy
        self.begun = begun
        """Monotonic time the pool was asked (admission and first token share one allowance)."""
        prefill = uncached_tokens / prefill_rate if prefill_rate > 0 else 0.0
        self.first_allowance = policy.first_token_timeout + policy.prefill_factor * prefill
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
            return max(MIN_WAIT_S, self.first_allowance - (now - self.begun))
        return max(self.policy.stall_timeout, self.policy.pace_factor * self.pace)

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

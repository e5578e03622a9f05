"""Named, bounded reconnect policies (tenacity) for the relay's long-lived streams."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

# Pool-local streams: the pool is next door, so redial fast; cap the wait at 2 s.
POOL_RECONNECT = wait_exponential_jitter(multiplier=0.1, max=2.0, jitter=0.1)
# Telemetry streams to global frontends: exponential with jitter so that many relays do not redial
# a restarted frontend in lock-step; capped at 5 s.
TELEMETRY_RECONNECT = wait_exponential_jitter(multiplier=0.2, max=5.0, jitter=0.2)


async def reconnect_forever(
    session: Callable[[], Awaitable[None]],
    wait: wait_exponential_jitter,
    on_retry: Callable[[RetryCallState], None] | None = None,
) -> None:
    """Runs `session` again and again until cancelled.

    A session that raises failed without doing useful work: the next one waits out `wait`, which
    grows per consecutive failure. A session that returns ended after it worked (its stream broke
    later): the back-off starts over and the next session starts at once.
    """
    while True:
        async for attempt in AsyncRetrying(
            wait=wait,
            retry=retry_if_exception_type(Exception),
            before_sleep=on_retry,
            reraise=True,
        ):
            with attempt:
                await session()


MAX_CAUSES = 5


def _describe_one(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe_error(exc: BaseException | None) -> str:
    """A short sentence for a failed call, with its chain of causes: "outer <- cause <- root".

    The gRPC code and details for a gRPC error, else the exception's type and message; the chain
    follows __cause__ (or an implicit __context__) so that "no reply within 2 s" still says the
    stream broke with UNAVAILABLE underneath. Bounded, and safe against cycles.
    """
    if exc is None:
        return "None"
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(parts) < MAX_CAUSES:
        seen.add(id(current))
        parts.append(_describe_one(current))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return " <- ".join(parts)

"""The serving event loop's lag: how late a cheap periodic task wakes, for a Prometheus histogram."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

INTERVAL = 0.1
"""Seconds between samples: ten wake-ups a second cost nothing measurable and catch any block
longer than the interval (a shorter one shows as lag on the next sample)."""


async def sample_loop_lag(
    observe: Callable[[float], None],
    interval: float = INTERVAL,
    on_tick: Callable[[], None] | None = None,
) -> None:
    """Observes, forever, how much later than asked the running loop wakes this task: the time
    every other callback on the loop (a Generate, a health check) waited too. `on_tick` is called
    at the start and on every wake-up: the heartbeat that proves the loop turns
    (globalrouter.health_probe)."""
    loop = asyncio.get_running_loop()
    if on_tick is not None:
        on_tick()
    while True:
        start = loop.time()
        await asyncio.sleep(interval)
        observe(max(0.0, loop.time() - start - interval))
        if on_tick is not None:
            on_tick()

"""The serving loop's lag is sampled by a cheap periodic task and exported as a histogram."""

from __future__ import annotations

import asyncio
import time

import pytest

from globalrouter.loop_lag import sample_loop_lag
from tests.router.fakes import eventually, start_router

pytestmark = pytest.mark.timeout(30)


async def test_a_blocked_loop_shows_as_lag():
    seen: list[float] = []
    task = asyncio.create_task(sample_loop_lag(seen.append, interval=0.01))
    await eventually(lambda: len(seen) >= 2)
    time.sleep(0.2)  # noqa: ASYNC251  # something heavy on the loop, on purpose
    count = len(seen)
    await eventually(lambda: len(seen) > count)
    task.cancel()
    assert max(seen) >= 0.15


async def test_the_router_exports_its_loop_lag():
    router, _stub, channel = await start_router()
    try:
        router.start_background()
        registry = router.metrics.registry
        await eventually(
            lambda: (registry.get_sample_value("globalrouter_event_loop_lag_seconds_count") or 0) >= 1
        )
        assert router.metrics.registry.get_sample_value("globalrouter_telemetry_snapshot_blocks_held") == 0
    finally:
        await router.leave()
        await channel.close()
        await router.handle.server.stop(0)

"""The loop-stall sampler: while the serving loop's heartbeat is late it counts where the loop thread
is; off by default, on with --loop-stall-sample, and a frontend started with it samples its loop."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

from globalrouter.cli import build_parser
from globalrouter.config import RouterConfig
from globalrouter.loop_lag import sample_loop_lag
from globalrouter.loop_stalls import StallSampler, stack_key
from globalrouter.serve_cli import router_config
from meshkit import settings
from meshkit.clock import FakeClock
from tests.router.fakes import eventually, start_router

pytestmark = pytest.mark.timeout(60)


def _spin(seconds: float) -> None:
    """Python work on the loop thread, as a long callback would be (the sampler must see it)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_look_samples_only_when_the_heartbeat_is_late():
    clock = FakeClock()
    sampler = StallSampler(interval=0.1, late_after=0.01, now=clock.monotonic)
    here = sys._getframe()
    frames = {threading.get_ident(): here}
    assert not sampler.look(frames)  # no heartbeat yet: nothing to be late for
    sampler.beat()
    clock.set(clock.monotonic() + 0.105)
    assert not sampler.look(frames)  # 5 ms past due: not late
    clock.set(clock.monotonic() + 0.01)
    assert sampler.look(frames)  # 15 ms past due: a sample of the loop thread's frames
    assert sampler.late == 1 and sampler.looks == 3
    [(key, count)] = sampler.report()["loop"]
    assert count == 1 and key.startswith("tests/router/test_loop_stalls.py:test_a_look_samples_only")
    sampler.beat()  # the loop turned: on time again
    assert not sampler.look(frames)
    window = sampler.report(since_last=True)
    assert (window["looks"], window["late"], len(window["loop"])) == (4, 1, 1)
    clock.set(clock.monotonic() + 1.0)
    sampler.look(frames)
    window = sampler.report(since_last=True)  # only what came since the last window
    assert (window["looks"], window["late"], window["loop"][0][1]) == (1, 1, 1)
    assert sampler.report()["late"] == 2  # the whole run's


def test_keys_are_bounded_and_name_the_innermost_frames_first():
    clock = FakeClock()
    sampler = StallSampler(interval=0.1, late_after=0.01, now=clock.monotonic, max_keys=1, depth=2)
    sampler.beat()
    clock.set(clock.monotonic() + 1.0)
    me = threading.get_ident()

    def inner():
        return sys._getframe()

    frame = inner()
    assert (
        stack_key(frame, 2)
        .split(" < ")[0]
        .endswith(
            ":test_keys_are_bounded_and_name_the_innermost_frames_first.<locals>.inner:" + str(frame.f_lineno)
        )
    )
    sampler.look({me: frame})
    sampler.look({me: sys._getframe()})  # a second distinct key: over the bound
    counts = dict(sampler.report()["loop"])
    assert len(counts) == 2 and counts["[other]"] == 1
    with pytest.raises(ValueError, match="late_after"):
        StallSampler(late_after=0)


async def test_a_long_callback_on_the_loop_is_what_the_sampler_counts():
    sampler = StallSampler(interval=0.01, late_after=0.01, every=0.001)
    logged: list[dict] = []
    sampler.start(logged.append, report_every=0.05)
    lag = asyncio.create_task(sample_loop_lag(lambda s: None, interval=0.01, on_tick=sampler.beat))
    try:
        await eventually(lambda: sampler.looks >= 5)
        for _ in range(3):
            _spin(0.3)  # a long turn of the loop: its heartbeat is late meanwhile
            await asyncio.sleep(0.05)
        await eventually(lambda: len(logged) >= 1)
    finally:
        lag.cancel()
        sampler.stop()
        sampler.stop()  # idempotent
    report = sampler.report()
    spun = sum(n for key, n in report["loop"] if key.startswith("tests/router/test_loop_stalls.py:_spin"))
    # Every late sample lands in the spin (about 0.28 s of 0.9 s late, a look a ms): a loaded
    # machine makes fewer looks, never other keys.
    assert spun >= 10 and spun >= 0.8 * report["late"]


def test_the_flag_sets_it_and_it_is_off_by_default():
    assert RouterConfig().loop_stall_sample == 0.0
    args = settings.parse_args(
        build_parser(), ["serve", "--discovery", "h:1", "--loop-stall-sample", "0.01"], environ={}
    )
    args.security = RouterConfig().security
    assert router_config(args).loop_stall_sample == 0.01
    with pytest.raises(ValueError, match="--loop-stall-sample"):
        RouterConfig(loop_stall_sample=float("nan"))


async def test_a_frontend_started_with_it_samples_its_loop_and_stops_it():
    router, _stub, channel = await start_router(loop_stall_sample=0.01)
    try:
        router.start_background()
        assert router.stalls is not None
        await eventually(lambda: router.stalls.looks >= 10)  # the heartbeat reaches the sampler
        _spin(0.2)
        await eventually(lambda: router.stalls.late >= 1)
    finally:
        await router.leave()
        await channel.close()
        await router.handle.server.stop(0)
        await router.close()
    assert router.stalls._thread is None
    off, _stub2, channel2 = await start_router()
    try:
        off.start_background()
        assert off.stalls is None
    finally:
        await off.leave()
        await channel2.close()
        await off.handle.server.stop(0)
        await off.close()

"""Until the frontend is ready the index worker takes more of each loop iteration: its readiness
waits on the snapshots' builds, and it serves nothing but health meanwhile (the probe port answers
off the loop). At one step a turn a restart's builds got about a third of the loop."""

from __future__ import annotations

import asyncio

import pytest

from globalrouter import telemetry_ingest
from globalrouter.telemetry_ingest import STEP_SECONDS, TelemetryServicer

BUILD_FIRST_SECONDS = getattr(telemetry_ingest, "BUILD_FIRST_SECONDS", 0.012)  # (the base code: none)

pytestmark = pytest.mark.timeout(30)


class StepClock:
    """A CPU clock that only the fake ingest's steps advance (STEP_SECONDS each)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Steps:
    """An ingest with `left` steps of queued index work, each taking STEP_SECONDS of `clock`."""

    def __init__(self, clock: StepClock, left: int) -> None:
        self.clock = clock
        self.left = left

    def has_work(self) -> bool:
        return self.left > 0

    def receive(self, stream, msg):  # the pacer's; no message is sent here
        raise AssertionError("no message expected")

    def step(self) -> bool:
        self.clock.t += STEP_SECONDS
        self.left -= 1
        return self.left > 0


async def turns_to_finish(ready: bool, steps: int) -> int:
    """Loop iterations the index worker took for `steps` steps, with the frontend ready or not."""
    clock = StepClock()
    ingest = Steps(clock, steps)
    servicer = TelemetryServicer(ingest, "frontend-test")  # type: ignore[arg-type]
    servicer._cpu_now = clock
    servicer.builds_first = lambda: not ready
    servicer._kick()
    turns = 0
    while ingest.has_work():
        turns += 1
        await asyncio.sleep(0)
        assert turns < 10 * steps, "the worker stalled"
    return turns


async def test_a_ready_frontends_worker_takes_one_step_a_turn():
    assert await turns_to_finish(ready=True, steps=60) >= 59


async def test_an_unready_frontends_worker_takes_steps_up_to_its_budget_a_turn():
    per_turn = round(BUILD_FIRST_SECONDS / STEP_SECONDS)  # 6
    turns = await turns_to_finish(ready=False, steps=60)
    assert turns <= 60 // per_turn + 1, turns
    assert turns >= 60 // per_turn - 1, turns  # bounded: not everything in one turn


async def test_the_worker_goes_back_to_one_step_a_turn_once_ready():
    clock = StepClock()
    ingest = Steps(clock, 60)
    servicer = TelemetryServicer(ingest, "frontend-test")  # type: ignore[arg-type]
    servicer._cpu_now = clock
    ready = [False]
    servicer.builds_first = lambda: not ready[0]
    servicer._kick()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert ingest.left <= 60 - 6  # a turn of build-first steps
    ready[0] = True
    before = ingest.left
    await asyncio.sleep(0)
    assert before - ingest.left <= 1


async def test_the_frontend_puts_builds_first_until_it_is_ready():
    from globalrouter.config import RouterConfig
    from globalrouter.server import create_server

    # A discovery address makes readiness wait for the directory (nothing is dialled here).
    router = create_server(RouterConfig(listen="127.0.0.1:0", discovery="127.0.0.1:1"))
    try:
        assert not router.readiness.ready and router.telemetry.builds_first()
        router.readiness.ready = True
        assert not router.telemetry.builds_first()
    finally:
        await router.handle.server.stop(0)

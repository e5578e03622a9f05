"""meshkit.supervision on a FakeClock: a task that dies is logged with its cause and fails the
service, or is restarted with bounded back-off; owners' cancellations and stop() are not failures."""

from __future__ import annotations

import asyncio

import pytest

from meshkit.clock import FakeClock
from meshkit.supervision import (
    EXIT_TASK_FAILED,
    BackgroundTaskFailed,
    Restart,
    Supervisor,
    TaskFailure,
)

pytestmark = pytest.mark.timeout(10)


def supervisor(clock: FakeClock | None = None) -> tuple[Supervisor, list[TaskFailure]]:
    failures: list[TaskFailure] = []
    return Supervisor("svc", clock=clock or FakeClock(), on_failure=failures.append), failures


async def test_a_task_that_raises_fails_the_service_once_with_its_cause():
    sup, failures = supervisor()

    async def crash() -> None:
        raise ValueError("table corrupt")

    sup.spawn("watch", crash)
    sup.spawn("other", crash)
    await asyncio.sleep(0.01)
    assert [f.task for f in failures] == ["watch"], "on_failure once, for the first"
    assert failures[0].cause == "ValueError: table corrupt"
    with pytest.raises(BackgroundTaskFailed, match="'watch' failed: ValueError: table corrupt") as info:
        sup.raise_if_failed()
    assert info.value.exit_code == EXIT_TASK_FAILED != 1


async def test_a_task_meant_to_run_until_the_stop_that_returns_is_a_failure():
    sup, failures = supervisor()

    async def quits() -> None:
        return

    sup.spawn("watch", quits)
    sup.spawn("start", quits, one_shot=True)
    await asyncio.sleep(0.01)
    assert [(f.task, f.cause) for f in failures] == [("watch", "returned while it should run until the stop")]


async def test_cancellation_by_the_owner_or_stop_is_not_a_failure():
    sup, failures = supervisor()

    async def forever() -> None:
        await asyncio.Event().wait()

    task = sup.spawn("publisher", forever)
    sup.spawn("watch", forever)
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.01)
    assert sup.running == 1
    await sup.stop()
    assert failures == [] and sup.running == 0
    sup.raise_if_failed()


async def test_a_cancellation_from_inside_the_job_is_a_failure():
    sup, failures = supervisor()

    async def inner_cancelled() -> None:
        raise asyncio.CancelledError()  # e.g. an awaited call cancelled by someone else

    sup.spawn("watch", inner_cancelled)
    await asyncio.sleep(0.01)
    assert [f.cause for f in failures] == ["CancelledError"]


async def test_restart_with_bounded_back_off_then_fail_after_too_many_in_a_row():
    clock = FakeClock()
    sup, failures = supervisor(clock)
    runs: list[float] = []

    async def flaky() -> None:
        runs.append(clock.monotonic())
        raise OSError("not now")

    policy = Restart(initial=0.5, maximum=1.0, max_failures=3)
    sup.spawn("prune", flaky, one_shot=True, restart=policy)
    await clock.advance(10)
    # Runs at 0, then after 0.5, 1.0, 1.0 (capped); the fourth failure in a row fails the service.
    assert [round(t - 1000.0, 3) for t in runs] == [0.0, 0.5, 1.5, 2.5]
    assert sup.restarts == 3
    assert [f.cause for f in failures] == ["OSError: not now (4 failures in a row)"]


async def test_a_restarted_task_that_succeeds_is_not_a_failure_and_a_long_run_resets_the_count():
    clock = FakeClock()
    sup, failures = supervisor(clock)
    outcomes = iter(["fail", "fail", "long", "fail", "ok"])

    async def job() -> None:
        outcome = next(outcomes)
        if outcome == "long":
            await clock.sleep(120)  # a healthy run past healthy_after
            raise OSError("later")
        if outcome == "fail":
            raise OSError("soon")

    sup.spawn("prune", job, one_shot=True, restart=Restart(initial=1, maximum=1, max_failures=2))
    await clock.advance(200)
    assert failures == [] and sup.restarts == 4 and sup.running == 0, "without the reset: 3 in a row > 2"


async def test_a_base_exception_that_is_not_an_exit_is_a_failure_too():
    sup, failures = supervisor()

    class Fault(BaseException):
        pass

    async def dies() -> None:
        raise Fault("odd")

    sup.spawn("publisher", dies)
    await asyncio.sleep(0.01)
    assert [f.cause for f in failures] == ["Fault: odd"]


def test_restart_policy_validation():
    assert [Restart(initial=0.5, maximum=3).delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    for bad in ({"initial": 0}, {"initial": 5, "maximum": 1}, {"max_failures": 0}):
        with pytest.raises(ValueError, match="Restart"):
            Restart(**bad)

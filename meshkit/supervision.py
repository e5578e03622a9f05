"""Supervision of a service's background tasks: one that ends unexpectedly is logged with its cause and fails the service, or is restarted with bounded back-off where that is safe."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from meshkit.clock import Clock, SystemClock
from meshkit.logs import get_logger

log = get_logger(module="meshkit.supervision")

# The exit status of a service stopped because a background task failed (BSD's EX_SOFTWARE: an
# internal software error), apart from 1 (could not start) so an operator can tell them apart.
EXIT_TASK_FAILED = 70


@dataclass(frozen=True)
class Restart:
    """Restart a failed task after a back-off (`initial` seconds, doubling up to `maximum`); after
    `max_failures` failures in a row the service fails. A run that lasted `healthy_after` seconds
    starts the count over. Only for tasks whose restart is safe: idempotent, state kept elsewhere."""

    initial: float = 0.5
    maximum: float = 10.0
    max_failures: int = 5
    healthy_after: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"Restart: need 0 < initial <= maximum (got {self.initial}, {self.maximum})")
        if self.max_failures < 1:
            raise ValueError(f"Restart.max_failures must be >= 1 (got {self.max_failures})")

    def delay(self, failures: int) -> float:
        """Seconds before the restart that follows `failures` failures in a row (>= 1)."""
        return float(min(self.initial * 2.0 ** (failures - 1), self.maximum))


@dataclass(frozen=True)
class TaskFailure:
    """Which task failed and why (the exception's type and message, or how it ended)."""

    task: str
    cause: str
    error: BaseException | None = None


class BackgroundTaskFailed(RuntimeError):
    """The service stopped because one of its background tasks failed."""

    exit_code = EXIT_TASK_FAILED

    def __init__(self, service: str, failure: TaskFailure) -> None:
        super().__init__(f"{service}: background task {failure.task!r} failed: {failure.cause}")
        self.failure = failure


def describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Supervisor:
    """Runs a service's background tasks and notices when one ends that should not have.

    A task either runs until the service stops (`one_shot=False`: returning is a failure too) or
    does one job (`one_shot=True`: returning is success). A task that raises, or returns when it
    should not, is logged with its cause and then restarted (under a `Restart` policy) or, by
    default, fails the service: `on_failure` is called once with the first TaskFailure, which the
    service turns into NOT_SERVING and a non-zero exit. Tasks cancelled by their owner or by
    `stop()` are not failures.
    """

    def __init__(
        self,
        service: str,
        *,
        clock: Clock | None = None,
        on_failure: Callable[[TaskFailure], None] | None = None,
    ) -> None:
        self.service = service
        self._clock = clock or SystemClock()
        self._on_failure = on_failure
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.failure: TaskFailure | None = None
        """The first failure (None while every task is well)."""
        self.restarts = 0
        """Restarts made under a Restart policy, over the service's life."""

    @property
    def running(self) -> int:
        """Tasks not yet ended."""
        return len(self._tasks)

    def spawn(
        self,
        name: str,
        job: Callable[[], Awaitable[None]],
        *,
        one_shot: bool = False,
        restart: Restart | None = None,
    ) -> asyncio.Task[None]:
        """Starts `job()` under supervision (needs a running loop); the returned task may be
        cancelled by its owner. `job` is called again for each restart."""
        task = asyncio.get_running_loop().create_task(self._run(name, job, one_shot, restart), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        """Cancels every task and waits for them; what ends from now on is not a failure."""
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(
        self, name: str, job: Callable[[], Awaitable[None]], one_shot: bool, restart: Restart | None
    ) -> None:
        failures = 0
        while True:
            started = self._clock.monotonic()
            error: BaseException | None = None
            try:
                await job()
            except asyncio.CancelledError as exc:
                current = asyncio.current_task()
                if self._stopping or (current is not None and current.cancelling()):
                    raise  # cancelled by its owner or by stop()
                error = exc  # a cancellation from inside the job (not ours): it ended unexpectedly
            except (KeyboardInterrupt, SystemExit):
                raise  # the process is ending anyway
            except BaseException as exc:  # a custom BaseException (not an Exception) is a death too
                error = exc
            else:
                if one_shot:
                    return
            if self._stopping:
                return
            cause = describe(error) if error is not None else "returned while it should run until the stop"
            if restart is None:
                self._fail(TaskFailure(name, cause, error))
                return
            if self._clock.monotonic() - started >= restart.healthy_after:
                failures = 0
            failures += 1
            if failures > restart.max_failures:
                self._fail(TaskFailure(name, f"{cause} ({failures} failures in a row)", error))
                return
            delay = restart.delay(failures)
            self.restarts += 1
            log.warning(
                "background task failed; restarting it",
                service=self.service,
                task=name,
                cause=cause,
                failures=failures,
                restart_in_s=delay,
                exc_info=error,
            )
            await self._clock.sleep(delay)

    def _fail(self, failure: TaskFailure) -> None:
        log.error(
            "background task failed; the service stops",
            service=self.service,
            task=failure.task,
            cause=failure.cause,
            exc_info=failure.error,
        )
        if self.failure is not None:
            return  # the service is already stopping for the first one
        self.failure = failure
        if self._on_failure is not None:
            self._on_failure(failure)

    def raise_if_failed(self) -> None:
        """BackgroundTaskFailed when a task failed (after the service stopped because of it)."""
        if self.failure is not None:
            raise BackgroundTaskFailed(self.service, self.failure)

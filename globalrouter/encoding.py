"""Prompt encoding off the event loop: a few dedicated threads and a bounded number of waiting jobs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from meshkit.limits import LimitExceeded

T = TypeVar("T")

DEFAULT_THREADS = 2
DEFAULT_QUEUE = 64


class EncoderBusy(LimitExceeded):
    """Every encoding thread is busy and the waiting jobs are at their bound: RESOURCE_EXHAUSTED,
    reason LIMIT_EXCEEDED (HTTP 429), naming the bound."""


class Encoder:
    """Runs tokenization (and chat-template rendering) in `threads` worker threads, never on the loop.

    A long prompt takes tens of milliseconds to encode (160 ms for 16k tokens of a trained BPE);
    on the loop that stalls every other stream the frontend serves. The Rust tokenizer releases
    the GIL while it runs (HfTokenizer.encode uses encode_batch), so the loop keeps serving.
    At most `threads + queue` jobs are admitted at once (running or waiting); one more is refused
    at once rather than queued without bound, so a burst of huge prompts cannot build up memory
    and latency for everybody."""

    def __init__(self, threads: int = DEFAULT_THREADS, queue: int = DEFAULT_QUEUE) -> None:
        if threads < 1:
            raise ValueError(f"Encoder threads must be >= 1 (got {threads})")
        if queue < 0:
            raise ValueError(f"Encoder queue must be >= 0 (got {queue})")
        self.threads = threads
        self.queue = queue
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="encode")
        self._lock = threading.Lock()  # the count goes down in worker threads
        self._jobs = 0

    @property
    def jobs(self) -> int:
        """Jobs admitted and not yet done (running or waiting for a thread)."""
        return self._jobs

    def _done(self, _future: Future) -> None:
        with self._lock:
            self._jobs -= 1

    async def run(self, fn: Callable[..., T], /, *args, **kwargs) -> T:
        """fn(*args, **kwargs) in a worker thread; raises EncoderBusy when the bound is reached.

        A job counts until its thread is done with it, even when the caller stopped waiting
        (a cancelled request): the bound is on work, not on waiters."""
        limit = self.threads + self.queue
        with self._lock:
            if self._jobs >= limit:
                raise EncoderBusy(
                    f"the prompt encoder is full ({self.threads} threads busy and {self.queue} prompts "
                    f"waiting; --tokenizer-threads, --tokenizer-queue); retry later"
                )
            self._jobs += 1
        try:
            future = self._executor.submit(fn, *args, **kwargs)
        except BaseException:
            with self._lock:
                self._jobs -= 1
            raise
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Stops the threads once their jobs are done (waiting jobs are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

"""The simulated pool: admission, KV-aware worker choice, request timing, load, drain, counters."""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from meshkit.blocks import adapter_seed, block_hashes
from meshkit.clock import Clock
from mocker.config import Faults, PoolConfig
from mocker.feeds import Changes, KvEventHub
from mocker.tokens import TokenStream
from mocker.workers import TimingModel, Worker, choose_worker

# Tokens due within this window go out together: fewer messages at high decode rates, and no token
# waits longer than this for company.
BATCH_WINDOW_S = 0.005


class RefusalKind(enum.Enum):
    """Why the pool refused a request before admitting it."""

    UNKNOWN_MODEL = "unknown model"
    NOT_READY = "model not ready"
    DRAINING = "draining"
    QUEUE_FULL = "queue full"
    REFUSE_ALL = "refusing all requests"


class Refused(Exception):
    """The pool's admission said no."""

    def __init__(self, kind: RefusalKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class DrainState(enum.Enum):
    ACTIVE = 1
    DRAINING = 2
    DRAINED = 3


class TicketState(enum.Enum):
    WAITING = 1
    RUNNING = 2
    DONE = 3


@dataclass(eq=False)
class Ticket:
    """One admitted request, from admission until it ends."""

    request_id: str
    model: str
    tokens: list[int]
    hashes: list[int]
    max_tokens: int
    worker: Worker
    cached_blocks: int
    state: TicketState = TicketState.WAITING
    prefill_pending: int = 0
    """Uncached prompt tokens whose prefill has not finished."""
    prefill_started: float | None = None
    """When its prefill began (monotonic; None before): the load report counts only what is left."""
    prefill_seconds: float = 0.0
    """How long its prefill takes (set when it begins)."""
    decode_remaining: int = 0
    """Output tokens still to generate."""
    generated: int = 0
    seed: int = 0
    """The request's sampling seed (its output stream depends on it)."""
    stop_token_ids: frozenset[int] = frozenset()
    """Generation ends after the first of these ids (finish reason STOP)."""
    stopped: bool = False
    """Set when a stop token id ended generation."""
    handed_back: bool = False
    """Set when the drain deadline ends this request (its task is cancelled)."""
    task: asyncio.Task | None = None
    adapter: str = ""
    """The LoRA adapter the request runs under ("" = the base model): its blocks chain from its seed."""

    @property
    def prompt_blocks(self) -> int:
        return len(self.hashes)


@dataclass
class PoolStats:
    """Counters of what the pool did since it started."""

    requests_admitted: int = 0
    requests_refused: int = 0
    requests_finished: int = 0
    requests_handed_back: int = 0
    prompt_blocks: int = 0
    cached_blocks: int = 0
    tokens_generated: int = 0


@dataclass(frozen=True)
class PoolLoad:
    """The pool's load summed over workers."""

    requests_waiting: int
    requests_running: int
    prefill_tokens_in_flight: int
    decode_tokens_in_flight: int
    kv_blocks_used: int
    kv_blocks_total: int
    max_running_requests: int
    max_waiting_requests: int


@dataclass
class Drain:
    """The pool's drain life cycle."""

    state: DrainState = DrainState.ACTIVE
    deadline_wall: float | None = None
    deadline_monotonic: float | None = None
    drained: asyncio.Event = field(default_factory=asyncio.Event)


class Pool:
    """A simulated pool of workers serving one or more models. Pure asyncio; knows nothing of gRPC."""

    def __init__(self, config: PoolConfig, clock: Clock, faults: Faults | None = None) -> None:
        self.config = config
        self.clock = clock
        self.faults = faults or Faults()
        self.timing = TimingModel(
            config.prefill_tokens_per_second, config.decode_tokens_per_second, config.speedup
        )
        self.kv_hub = KvEventHub(config.kv_subscriber_queue)
        self.changes = Changes()
        width = len(str(config.workers - 1))
        self.workers = [
            Worker(
                f"worker-{i:0{width}d}",
                config.worker_capacity_blocks,
                config.max_running_per_worker,
                on_event=self.kv_hub.publish,
            )
            for i in range(config.workers)
        ]
        self.models: dict[str, bool] = {m: m not in config.not_ready for m in config.models}
        self.adapters: dict[str, tuple[str, ...]] = (
            {config.models[0]: tuple(sorted(config.adapters))} if config.adapters and config.models else {}
        )
        """Model -> the LoRA adapters served on it."""
        self.stats = PoolStats()
        self.drain = Drain()
        self.tickets: set[Ticket] = set()
        self._deadline_task: asyncio.Task | None = None

    # --- admission -------------------------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        model: str,
        tokens: list[int],
        max_tokens: int,
        *,
        seed: int = 0,
        stop_token_ids: frozenset[int] = frozenset(),
        adapter: str = "",
    ) -> Ticket:
        """Admits a (validated) request or raises Refused. Binds the ticket to the calling task."""
        if model not in self.models:
            raise Refused(RefusalKind.UNKNOWN_MODEL, f"pool {self.config.pool_id} does not serve {model!r}")
        if adapter and adapter not in self.adapters.get(model, ()):
            raise Refused(
                RefusalKind.UNKNOWN_MODEL,
                f"pool {self.config.pool_id} does not serve adapter {adapter!r} of {model!r}",
            )
        if self.drain.state is not DrainState.ACTIVE:
            self.stats.requests_refused += 1
            raise Refused(RefusalKind.DRAINING, f"pool {self.config.pool_id} is draining")
        if not self.models[model]:
            raise Refused(
                RefusalKind.NOT_READY, f"model {model!r} is not ready in pool {self.config.pool_id}"
            )
        if self.faults.refuse_all:
            self.stats.requests_refused += 1
            raise Refused(RefusalKind.REFUSE_ALL, "pool refuses all requests (fault injection)")
        hashes = block_hashes(tokens, self.config.block_size, adapter_seed(adapter))
        worker, cached = choose_worker(self.workers, hashes)
        if not worker.has_free_slot and self.waiting() >= self.config.max_queue:
            self.stats.requests_refused += 1
            raise Refused(
                RefusalKind.QUEUE_FULL,
                f"pool {self.config.pool_id} queue is full ({self.config.max_queue} waiting)",
            )
        ticket = Ticket(
            request_id=request_id,
            model=model,
            tokens=tokens,
            hashes=hashes,
            max_tokens=max_tokens,
            worker=worker,
            cached_blocks=cached,
            prefill_pending=len(tokens) - cached * self.config.block_size,
            decode_remaining=max_tokens,
            seed=seed,
            stop_token_ids=stop_token_ids,
            task=asyncio.current_task(),
            adapter=adapter,
        )
        self.tickets.add(ticket)
        self.stats.requests_admitted += 1
        self.stats.prompt_blocks += ticket.prompt_blocks
        self.stats.cached_blocks += cached
        self.changes.notify()
        return ticket

    # --- running ---------------------------------------------------------------------------------

    def first_tokens_soon(self, ticket: Ticket) -> bool:
        """Whether an admitted request's first tokens are due within BATCH_WINDOW_S (a free slot, a
        short prefill): then its admission may wait for them and go out in the same message."""
        worker = ticket.worker
        if not worker.has_free_slot or worker.waiting or worker.prefill_lock.locked():
            return False
        due = self.timing.prefill_seconds(ticket.prefill_pending) + self.timing.token_interval()
        return due <= BATCH_WINDOW_S

    async def run(
        self, ticket: Ticket, on_queued: Callable[[int], Awaitable[None]] | None = None
    ) -> AsyncGenerator[list[int], None]:
        """Runs an admitted request: waits for a slot, prefills, then yields output token batches.

        While it waits for a slot, `on_queued(position)` is awaited at once and then every
        `queue_report_interval` seconds (the serving link's PoolQueued: busy, not hung)."""
        worker = ticket.worker
        acquired = False
        try:
            if on_queued is None:
                await worker.acquire()
            else:
                await self._acquire_reporting(worker, on_queued)
            acquired = True
            ticket.state = TicketState.RUNNING
            self.changes.notify()
            async with worker.prefill_lock:
                # The cache may have changed while the request waited (an earlier prefill may
                # have stored this very prefix): prefill only what is missing now.
                cached = worker.cache.cached_prefix(ticket.hashes)
                ticket.prefill_pending = len(ticket.tokens) - cached * self.config.block_size
                ticket.prefill_seconds = self.timing.prefill_seconds(ticket.prefill_pending)
                ticket.prefill_started = self.clock.monotonic()
                self.changes.notify()
                await self.clock.sleep(ticket.prefill_seconds)
                worker.store(ticket.hashes)
                ticket.prefill_pending = 0
            self.changes.notify()
            output: list[int] = []
            async for batch in self._decode(ticket):
                output.extend(batch)
                yield batch
            # Like a real prefix cache, the finished sequence's full output blocks stay cached too,
            # so a follow-up turn (prompt + answer + more) finds them.
            worker.store(ticket.hashes + self._output_hashes(ticket, output))
            self.stats.requests_finished += 1
        finally:
            if acquired:
                worker.release()
            self.close(ticket)

    async def _acquire_reporting(self, worker: Worker, on_queued: Callable[[int], Awaitable[None]]) -> None:
        """worker.acquire(), telling `on_queued` the request's place in line while it waits."""
        place = worker.take_or_queue()
        if place is None:
            return
        try:
            while not place.done():
                await on_queued(worker.position(place))
                timer = asyncio.ensure_future(self.clock.sleep(self.config.queue_report_interval))
                try:
                    await asyncio.wait((place, timer), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    timer.cancel()
            place.result()
        except BaseException:
            # Cancelled (hand-back, caller gone) or the report failed: give the place up (and a
            # slot handed over meanwhile passes on), so the line never holds a dead waiter.
            worker.leave(place)
            raise

    async def _decode(self, ticket: Ticket) -> AsyncIterator[list[int]]:
        """Token i is due one interval after token i-1 (the first one interval after prefill)."""
        stream = TokenStream(ticket.tokens, self.config.vocab_size, ticket.seed)
        interval = self.timing.token_interval()
        start = self.clock.monotonic()
        last_sent = -math.inf
        while ticket.generated < ticket.max_tokens and not ticket.stopped:
            next_due = start + (ticket.generated + 1) * interval
            wake = max(next_due, last_sent + BATCH_WINDOW_S)
            await self.clock.sleep(wake - self.clock.monotonic())
            now = self.clock.monotonic()
            last_sent = now
            due = min(ticket.max_tokens, math.floor((now - start) / interval + 1e-9))
            n = max(1, due - ticket.generated)
            batch = stream.next(n)
            if ticket.stop_token_ids:
                cut = next((i for i, t in enumerate(batch) if t in ticket.stop_token_ids), None)
                if cut is not None:
                    batch, n, ticket.stopped = batch[: cut + 1], cut + 1, True
            ticket.generated += n
            ticket.decode_remaining -= n
            self.stats.tokens_generated += n
            self.changes.notify()
            yield batch

    def _output_hashes(self, ticket: Ticket, output: list[int]) -> list[int]:
        """Chained hashes of the full blocks after the prompt's full blocks (prompt tail + output)."""
        bs = self.config.block_size
        tail = ticket.tokens[ticket.prompt_blocks * bs :] + output
        parent = ticket.hashes[-1] if ticket.hashes else adapter_seed(ticket.adapter)
        return block_hashes(tail, bs, parent)

    def close(self, ticket: Ticket) -> None:
        """Forgets an ended request (idempotent); completes a drain when it was the last one."""
        if ticket.state is TicketState.DONE:
            return
        ticket.state = TicketState.DONE
        ticket.prefill_pending = 0
        ticket.decode_remaining = 0
        self.tickets.discard(ticket)
        if ticket.handed_back:
            self.stats.requests_handed_back += 1
        self._maybe_drained()
        self.changes.notify()

    # --- drain -----------------------------------------------------------------------------------

    def start_drain(self, timeout: float) -> None:
        """Refuses new work from now on; at `timeout` seconds hands back whatever still runs.

        A second call keeps the earlier deadline.
        """
        if self.drain.state is not DrainState.ACTIVE:
            return
        self.drain.state = DrainState.DRAINING
        self.drain.deadline_wall = self.clock.wall() + timeout
        self.drain.deadline_monotonic = self.clock.monotonic() + timeout
        self._deadline_task = asyncio.get_running_loop().create_task(
            self._deadline(self.drain.deadline_monotonic)
        )
        self._maybe_drained()
        self.changes.notify()

    async def _deadline(self, deadline_monotonic: float) -> None:
        await self.clock.sleep(deadline_monotonic - self.clock.monotonic())
        self.hand_back_all()

    def hand_back_all(self) -> None:
        """Ends every admitted request with a hand-back (their handlers turn it into UNAVAILABLE)."""
        for ticket in list(self.tickets):
            ticket.handed_back = True
            if ticket.task is not None and not ticket.task.done():
                ticket.task.cancel()
            else:
                self.close(ticket)

    def _maybe_drained(self) -> None:
        if self.drain.state is DrainState.DRAINING and not self.tickets:
            self.drain.state = DrainState.DRAINED
            self.drain.drained.set()
            if self._deadline_task is not None and self._deadline_task is not asyncio.current_task():
                self._deadline_task.cancel()

    async def wait_drained(self) -> None:
        await self.drain.drained.wait()

    # --- state -----------------------------------------------------------------------------------

    def set_model_ready(self, model: str, ready: bool) -> None:
        """Sets a model's readiness; KeyError when the pool has no such model."""
        if model not in self.models:
            raise KeyError(model)
        if self.models[model] != ready:
            self.models[model] = ready
            self.changes.notify()

    def set_faults(self, faults: Faults) -> None:
        self.faults = faults

    def waiting(self) -> int:
        return sum(1 for t in self.tickets if t.state is TicketState.WAITING)

    def load(self) -> PoolLoad:
        running = waiting = prefill = decode = 0
        now = self.clock.monotonic()
        for t in self.tickets:
            if t.state is TicketState.WAITING:
                waiting += 1
            else:
                running += 1
            prefill += _prefill_left(t, now)
            decode += t.decode_remaining
        return PoolLoad(
            requests_waiting=waiting,
            requests_running=running,
            prefill_tokens_in_flight=prefill,
            decode_tokens_in_flight=decode,
            kv_blocks_used=sum(len(w.cache) for w in self.workers),
            kv_blocks_total=sum(w.cache.capacity for w in self.workers),
            max_running_requests=self.config.max_running,
            max_waiting_requests=self.config.max_queue,
        )


def _prefill_left(ticket: Ticket, now: float) -> int:
    """The ticket's uncached prompt tokens still to prefill at `now`: all of them until its prefill
    begins, then what the worker has not yet done at its steady rate (a frontend reads the report
    as work left, as the simulator's pool reports it; counting a long prefill whole until its end
    overstated a busy pool's wait by up to that prefill, issue 20). At least 1 until it ends."""
    pending = ticket.prefill_pending
    started = ticket.prefill_started
    if not pending or started is None or ticket.prefill_seconds <= 0:
        return pending
    done = (now - started) / ticket.prefill_seconds
    return max(1, math.ceil(pending * (1.0 - done))) if done < 1.0 else 1

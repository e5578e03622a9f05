"""The pool on a fake clock: timing, batching, admission limits, load, drain and hand-back."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from meshkit.blocks import block_hashes
from meshkit.clock import FakeClock
from mocker.config import Faults, PoolConfig
from mocker.feeds import SubscriberTooSlow
from mocker.pool import DrainState, Pool, RefusalKind, Refused, Ticket
from mocker.tokens import continue_sequence

BS = 4


def make_pool(clock: FakeClock, **overrides) -> Pool:
    settings: dict[str, Any] = dict(
        pool_id="p",
        models=("m", "cold"),
        workers=2,
        worker_capacity_blocks=64,
        block_size=BS,
        prefill_tokens_per_second=100.0,
        decode_tokens_per_second=10.0,
        max_running_per_worker=1,
        max_queue=1,
        not_ready=("cold",),
    )
    settings.update(overrides)
    return Pool(PoolConfig(**settings), clock)


class Run:
    """One request driven to its end in its own task, recording (time, batch) as tokens arrive."""

    def __init__(self, pool: Pool, tokens: list[int], max_tokens: int) -> None:
        self.pool = pool
        self.batches: list[tuple[float, list[int]]] = []
        self.ticket: Ticket | None = None
        self.admitted = asyncio.Event()
        self.task = asyncio.create_task(self._go(tokens, max_tokens))

    async def _go(self, tokens: list[int], max_tokens: int) -> None:
        self.ticket = self.pool.admit("r", "m", tokens, max_tokens)
        self.admitted.set()
        async for batch in self.pool.run(self.ticket):
            self.batches.append((self.pool.clock.monotonic(), batch))

    @property
    def tokens(self) -> list[int]:
        return [t for _, b in self.batches for t in b]

    @property
    def first_token_at(self) -> float:
        return self.batches[0][0]


async def start(pool: Pool, tokens: list[int], max_tokens: int) -> Run:
    run = Run(pool, tokens, max_tokens)
    await asyncio.wait([run.task, asyncio.ensure_future(run.admitted.wait())], return_when="FIRST_COMPLETED")
    if run.task.done():
        run.task.result()  # raises the refusal
    return run


async def test_prefill_time_grows_with_uncached_tokens_and_tokens_follow_at_decode_rate(fake_clock):
    pool = make_pool(fake_clock)
    t0 = fake_clock.monotonic()
    run = await start(pool, list(range(40)), 3)  # 40 uncached tokens at 100/s: 0.4 s prefill
    await fake_clock.advance(10)
    await run.task
    assert [t - t0 for t, _ in run.batches] == pytest.approx([0.5, 0.6, 0.7])
    assert run.tokens == continue_sequence(list(range(40)), 3)
    assert run.ticket.cached_blocks == 0

    # Same prompt again: its 10 blocks are cached on the worker that ran it, so no prefill.
    t1 = fake_clock.monotonic()
    again = await start(pool, list(range(40)), 1)
    assert again.ticket.worker is run.ticket.worker and again.ticket.cached_blocks == 10
    await fake_clock.advance(10)
    await again.task
    assert again.first_token_at - t1 == pytest.approx(0.1)

    # Half the prompt shared: prefill covers only the other 20 tokens.
    t2 = fake_clock.monotonic()
    half = await start(pool, [*range(20), *range(100, 120)], 1)
    assert half.ticket.cached_blocks == 5
    await fake_clock.advance(10)
    await half.task
    assert half.first_token_at - t2 == pytest.approx(0.2 + 0.1)


async def test_a_finished_sequence_leaves_its_output_blocks_cached(fake_clock):
    pool = make_pool(fake_clock)
    prompt = list(range(10))  # 2 full blocks of 4, and 2 tokens of a third
    run = await start(pool, prompt, 7)
    await fake_clock.settle()
    await fake_clock.advance(0.1 + 0.35)  # prefill done, 3 of 7 tokens out: only the prompt is cached
    assert pool.workers[0].cache.blocks() == block_hashes(prompt, BS)
    await fake_clock.advance(10)
    await run.task
    assert pool.workers[0].cache.blocks() == block_hashes(prompt + run.tokens, BS)  # 17 tokens: 4 blocks
    assert pool.workers[0].event_id == 2


async def test_speedup_divides_every_duration(fake_clock):
    pool = make_pool(fake_clock, speedup=4.0)
    t0 = fake_clock.monotonic()
    run = await start(pool, list(range(40)), 2)
    await fake_clock.advance(10)
    await run.task
    assert [t - t0 for t, _ in run.batches] == pytest.approx([0.5 / 4, 0.6 / 4])


async def test_fast_decode_batches_tokens_within_the_window(fake_clock):
    pool = make_pool(fake_clock, decode_tokens_per_second=1000.0)  # one token per ms
    decode_start = fake_clock.monotonic() + 0.04  # 4 uncached tokens at 100/s
    run = await start(pool, list(range(4)), 20)
    await fake_clock.advance(10)
    await run.task
    assert run.tokens == continue_sequence(list(range(4)), 20)
    assert len(run.batches) < 20
    times = [t for t, _ in run.batches]
    assert all(b - a >= 0.005 - 1e-9 for a, b in itertools.pairwise(times))
    # No token waits more than the window after it is due.
    emitted = 0
    for t, batch in run.batches:
        for _ in batch:
            emitted += 1
            due = decode_start + emitted * 0.001
            assert -1e-9 <= t - due <= 0.005 + 1e-9


async def test_admission_refusals(fake_clock):
    pool = make_pool(fake_clock)
    with pytest.raises(Refused) as e:
        pool.admit("r", "nope", [1], 1)
    assert e.value.kind is RefusalKind.UNKNOWN_MODEL
    with pytest.raises(Refused) as e:
        pool.admit("r", "cold", [1], 1)
    assert e.value.kind is RefusalKind.NOT_READY
    pool.set_model_ready("cold", True)
    assert pool.models["cold"] is True
    pool.set_faults(Faults(refuse_all=True))
    with pytest.raises(Refused) as e:
        pool.admit("r", "m", [1], 1)
    assert e.value.kind is RefusalKind.REFUSE_ALL
    assert pool.stats.requests_refused == 1


async def test_queue_full_after_every_slot_and_the_queue_are_taken(fake_clock):
    pool = make_pool(fake_clock)  # 2 workers x 1 slot, queue 1
    runs = [await start(pool, [i] * 8, 5) for i in range(3)]
    await fake_clock.settle()
    load = pool.load()
    assert (load.requests_running, load.requests_waiting) == (2, 1)
    assert load.decode_tokens_in_flight == 15
    assert load.prefill_tokens_in_flight == 24
    with pytest.raises(Refused) as e:
        await start(pool, [9] * 8, 5)
    assert e.value.kind is RefusalKind.QUEUE_FULL
    await fake_clock.advance(60)
    await asyncio.gather(*(r.task for r in runs))
    assert all(len(r.tokens) == 5 for r in runs)
    assert pool.load().requests_running == 0 and pool.stats.requests_finished == 3


async def test_drain_finishes_accepted_refuses_new_and_hands_back_at_deadline(fake_clock):
    pool = make_pool(fake_clock)
    short = await start(pool, [1] * 8, 2)  # ends at 0.08 + 0.2 s
    long = await start(pool, [2] * 8, 1000)  # would need 100 s
    await fake_clock.settle()
    pool.start_drain(5.0)
    assert pool.drain.state is DrainState.DRAINING
    deadline = pool.drain.deadline_monotonic
    with pytest.raises(Refused) as e:
        pool.admit("r", "m", [1], 1)
    assert e.value.kind is RefusalKind.DRAINING
    pool.start_drain(60.0)  # a second call keeps the earlier deadline
    assert pool.drain.deadline_monotonic == deadline

    await fake_clock.advance(1.0)
    assert short.task.done() and len(short.tokens) == 2
    assert pool.drain.state is DrainState.DRAINING
    await fake_clock.advance(4.5)
    assert long.task.cancelled()
    assert long.ticket.handed_back and 0 < len(long.tokens) < 1000
    assert pool.drain.state is DrainState.DRAINED and pool.drain.drained.is_set()
    assert pool.stats.requests_handed_back == 1 and pool.stats.requests_finished == 1
    assert pool.tickets == set()


async def test_drain_of_an_idle_pool_is_drained_at_once(fake_clock):
    pool = make_pool(fake_clock)
    pool.start_drain(5.0)
    assert pool.drain.state is DrainState.DRAINED
    await asyncio.wait_for(pool.wait_drained(), 1)


async def test_kv_events_reach_subscribers_in_order_and_a_slow_one_overflows(fake_clock):
    pool = make_pool(fake_clock, kv_subscriber_queue=2)
    fast = pool.kv_hub.subscribe()
    slow = pool.kv_hub.subscribe()
    received = []

    async def read() -> None:
        async for ev in fast.events():
            received.append(ev)

    reader = asyncio.create_task(read())
    for i in range(4):
        run = await start(pool, [100 + i] * 8, 1)
        await fake_clock.advance(1)
        await run.task
    assert [(e.worker_id, e.event_id) for e in received] == [
        ("worker-0", 1),
        ("worker-0", 2),
        ("worker-0", 3),
        ("worker-0", 4),
    ]  # one request at a time: the idle worker-0 wins every tie
    assert slow.overflowed and pool.kv_hub.subscribers == 1
    with pytest.raises(SubscriberTooSlow, match="more than 2 KV events"):
        async for _ in slow.events():
            pass
    reader.cancel()


async def test_a_worker_prefills_one_request_at_a_time_and_the_next_reuses_its_blocks(fake_clock):
    pool = make_pool(fake_clock, workers=1, max_running_per_worker=2)
    t0 = fake_clock.monotonic()
    a = await start(pool, list(range(40)), 1)  # 0.4 s prefill
    b = await start(pool, list(range(40)), 1)  # same prompt, admitted while a prefills
    c = await start(pool, [*range(20), *range(500, 540)], 1)  # waits for a slot: 2 running
    assert (a.ticket.cached_blocks, b.ticket.cached_blocks) == (0, 0)
    await fake_clock.settle()
    assert pool.load().prefill_tokens_in_flight == 40 + 40 + 60
    await fake_clock.advance(10)
    await asyncio.gather(a.task, b.task, c.task)
    assert a.first_token_at - t0 == pytest.approx(0.4 + 0.1)
    # b prefilled after a, finding all 10 blocks a stored: no prefill work of its own.
    assert b.first_token_at - t0 == pytest.approx(0.4 + 0.1)
    # c got a's slot at 0.5 s; its first 5 blocks were cached, 40 tokens left to prefill.
    assert c.first_token_at - t0 == pytest.approx(0.5 + 0.4 + 0.1)


async def test_a_request_waiting_for_a_slot_is_told_its_place_at_once_then_every_interval(fake_clock):
    pool = make_pool(fake_clock, workers=1, max_queue=4, queue_report_interval=1.0)
    first = await start(pool, [1] * 8, 25)  # 0.08 s prefill + 2.5 s decode: holds the only slot
    reports: dict[str, list[tuple[float, int]]] = {"second": [], "third": []}

    async def waiter(name: str, tokens: list[int]) -> list[int]:
        ticket = pool.admit(name, "m", tokens, 10)

        async def on_queued(position: int) -> None:
            reports[name].append((fake_clock.monotonic(), position))

        return [t async for batch in pool.run(ticket, on_queued) for t in batch]

    t0 = fake_clock.monotonic()
    second = asyncio.create_task(waiter("second", [2] * 8))
    await fake_clock.settle()
    third = asyncio.create_task(waiter("third", [3] * 8))
    await fake_clock.advance(2.2)
    assert [(round(t - t0, 1), p) for t, p in reports["second"]] == [(0.0, 1), (1.0, 1), (2.0, 1)]
    assert [p for _, p in reports["third"]] == [2, 2, 2], "behind the second in line"
    await fake_clock.advance(0.5)  # the first ends at 2.58 s: the second runs, the third moves up
    assert first.task.done() and pool.load().requests_running == 1
    await fake_clock.advance(0.4)
    assert reports["third"][-1][1] == 1 and len(reports["second"]) == 3, "no report once it runs"
    await fake_clock.advance(10)
    assert await second == continue_sequence([2] * 8, 10) and await third == continue_sequence([3] * 8, 10)


async def test_a_waiter_that_goes_away_gives_up_its_place(fake_clock):
    pool = make_pool(fake_clock, workers=1, max_queue=4)
    first = await start(pool, [1] * 8, 5)
    ticket = pool.admit("gone", "m", [2] * 8, 2)
    reported = asyncio.Event()

    async def on_queued(position: int) -> None:
        reported.set()

    async def wait() -> None:
        async for _ in pool.run(ticket, on_queued):
            pass

    gone = asyncio.create_task(wait())
    await reported.wait()
    worker = pool.workers[0]
    assert worker.waiting == 1
    gone.cancel()
    await fake_clock.settle()
    assert worker.waiting == 0 and pool.tickets == {first.ticket}
    await fake_clock.advance(10)
    await first.task
    assert worker.running == 0, "the slot is free, not held by the waiter that left"


async def test_an_adapter_request_is_cached_apart_from_the_base_model_and_an_unknown_one_refused(fake_clock):
    from meshkit.blocks import adapter_seed
    from mocker.events import pool_status

    pool = make_pool(fake_clock, adapters=("sql",), max_running_per_worker=4, workers=1)
    prompt = list(range(12))
    with pytest.raises(Refused) as e:
        pool.admit("r", "m", prompt, 1, adapter="chat")
    assert e.value.kind is RefusalKind.UNKNOWN_MODEL and "adapter 'chat'" in e.value.message
    with pytest.raises(Refused):
        pool.admit("r", "cold", prompt, 1, adapter="sql")  # adapters are served on the first model

    async def serve() -> None:
        ticket = pool.admit("r", "m", prompt, 1, adapter="sql")
        async for _ in pool.run(ticket):
            pass
        pool.close(ticket)

    task = asyncio.create_task(serve())
    await fake_clock.settle()
    await fake_clock.advance(10)
    await task
    seeded = block_hashes(prompt + continue_sequence(prompt, 1), BS, adapter_seed("sql"))
    assert pool.workers[0].cache.blocks()[: len(seeded)] == seeded
    # The base model finds none of the adapter's blocks cached; the adapter finds all of them.
    base = pool.admit("r2", "m", prompt, 1)
    assert base.cached_blocks == 0
    again = pool.admit("r3", "m", prompt, 1, adapter="sql")
    assert again.cached_blocks == 3
    assert [(m.model, list(m.adapters)) for m in pool_status(pool, 1).models] == [
        ("cold", []),
        ("m", ["sql"]),
    ]


async def test_the_load_report_counts_only_the_prefill_left_so_it_prices_the_real_wait(fake_clock):
    # Issue 20: the report counted a prefill in progress whole until it ended, so a frontend
    # reading it as work left (seconds = tokens / the pool's rate) overstated the wait of a request
    # arriving late in a long prefill by up to that prefill.
    pool = make_pool(fake_clock, workers=1, max_running_per_worker=3)
    rate = pool.config.pool_prefill_tokens_per_second
    t0 = fake_clock.monotonic()
    a = await start(pool, list(range(100)), 1)  # prefills 1.0 s
    b = await start(pool, list(range(200, 240)), 1)  # 0.4 s, after a's
    await fake_clock.settle()
    assert pool.load().prefill_tokens_in_flight == 100 + 40  # nothing done yet
    await fake_clock.advance(0.25)
    assert pool.load().prefill_tokens_in_flight == 75 + 40
    await fake_clock.advance(0.5)
    load = pool.load()
    assert load.prefill_tokens_in_flight == 25 + 40  # was 100 + 40 until a's prefill ended
    estimate = load.prefill_tokens_in_flight / rate
    c = await start(pool, list(range(500, 520)), 1)  # arrives at t0 + 0.75, 0.2 s prefill
    await fake_clock.advance(10)
    await asyncio.gather(a.task, b.task, c.task)
    real_wait = c.first_token_at - (t0 + 0.75) - 0.2 - pool.timing.token_interval()
    assert real_wait == pytest.approx(0.25 + 0.4)
    assert estimate == pytest.approx(real_wait)
    assert pool.load().prefill_tokens_in_flight == 0


async def test_a_prefill_in_progress_reports_at_least_one_token_until_it_ends(fake_clock):
    pool = make_pool(fake_clock, workers=1)
    a = await start(pool, list(range(100)), 1)  # prefills 1.0 s
    await fake_clock.settle()
    await fake_clock.advance(0.999999)
    assert a.ticket.prefill_pending == 100 and pool.load().prefill_tokens_in_flight == 1
    await fake_clock.advance(0.000002)
    assert pool.load().prefill_tokens_in_flight == 0

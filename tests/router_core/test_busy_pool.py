"""A busy pool is not a broken one (issue 18), on a fake clock: GenerateRun waits for the first token
while the pool shows it is busy (queue reports on the stream, or a fresh load report showing it
full), without backing off its link, and the pool stays eligible for others meanwhile; a pool that
is merely silent is still a stall, and its link backs off."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.migration import GenerateError, GenerateRun, Output, RunRecord, known_busy
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import FreshnessLimits, LoadSignal, PoolState
from globalrouter.routing import RoutingCore
from globalrouter.selection import FilterReason, Selector
from globalrouter.serving import Admitted, PoolRequest, PoolResponse, ServingLinks
from globalrouter.stall import FirstTokenWait, StallPolicy, StallWatch
from globalrouter.v1 import pool_frontend_pb2 as pf
from meshkit.clock import FakeClock
from meshkit.errors import Reason

pytestmark = pytest.mark.timeout(30)
POLICY = StallPolicy(first_token_timeout=10.0, prefill_factor=0.0, max_queue_wait=60.0)
PROMPT = list(range(40))
FULL = LoadSignal(requests_waiting=6, requests_running=4, max_running_requests=4)
IDLE = LoadSignal(requests_waiting=0, requests_running=0, max_running_requests=4)


class ScriptedStream:
    """A pool's admitted stream whose messages the test puts in."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[PoolResponse] = asyncio.Queue()
        self.cancelled = False

    async def read(self) -> PoolResponse | None:
        return await self.messages.get()

    def cancel(self) -> None:
        self.cancelled = True

    def queued(self, position: int) -> None:
        self.messages.put_nowait(PoolResponse(queued=pf.PoolQueued(position=position)))

    def finish(self, tokens: list[int]) -> None:
        finish = pf.PoolFinish(reason=pf.POOL_FINISH_REASON_LENGTH, tokens_generated=len(tokens))
        self.messages.put_nowait(PoolResponse(tokens=pf.PoolTokens(token_ids=tokens, finish=finish)))


class ScriptedLinks(ServingLinks):
    """Serving links whose pools admit at once with a ScriptedStream (the back-off logic is real)."""

    def __init__(self) -> None:
        super().__init__(backoff_initial=1.0, backoff_max=15.0)
        self.streams: dict[str, list[ScriptedStream]] = {}
        self.requests: list[PoolRequest] = []
        self.slow_to_admit: set[str] = set()
        """Pools whose admission never comes."""

    async def admit(self, pool: PoolState, request: PoolRequest) -> Admitted:
        self.requests.append(request)
        if pool.pool_id in self.slow_to_admit:
            await asyncio.Event().wait()
        stream = ScriptedStream()
        self.streams.setdefault(pool.pool_id, []).append(stream)
        admission = pf.PoolAdmission(worker_id="w0", prompt_blocks=2)
        return Admitted(pool_id=pool.pool_id, url=pool.frontends[0], stream=stream, admission=admission)

    async def release(self, admitted: Admitted) -> None:
        admitted.stream.cancel()


class Mesh:
    """Two listed pools, a and b, on a fake clock; `a` is asked first."""

    def __init__(self, clock: FakeClock, policy: StallPolicy = POLICY) -> None:
        self.clock = clock
        self.policy = policy
        self.table = PoolTable()
        for name in ("a", "b"):
            self.table.pools[name] = PoolState(
                pool_id=name, listed=True, model="m", frontends=(f"http://{name}:1",), block_size=16
            )
        self.core = RoutingCore(self.table, KvIndex(), Selector(), clock, RouterMetrics())
        self.links = ScriptedLinks()

    def pool(self, name: str) -> PoolState:
        return self.table.pools[name]

    def start(self, request_id: str = "r1", *, b_second: bool = False) -> tuple[GenerateRun, asyncio.Task]:
        """Starts a request whose first decision holds `a` alone (or `a`, then `b`)."""
        run = GenerateRun(
            self.core,
            self.links,
            request_id=request_id,
            model="m",
            prompt=PROMPT,
            max_tokens=4,
            migration_limit=1,
            admission_tries=2,
            stall=self.policy,
        )
        first = self.core.decide("m", PROMPT, 4, exclude=() if b_second else {"b"})
        first = dataclasses.replace(first, candidates=sorted(first.candidates, key=lambda c: c.pool_id))
        task = asyncio.ensure_future(self._collect(run, first))
        return run, task

    @staticmethod
    async def _collect(run: GenerateRun, first) -> Collected:
        return Collected([out async for out in run.stream(first)], run.record)

    async def stream_of(self, name: str, index: int = 0) -> ScriptedStream:
        for _ in range(50):
            streams = self.links.streams.get(name, [])
            if len(streams) > index:
                return streams[index]
            await self.clock.settle()
        raise AssertionError(f"pool {name} was never asked")

    async def wait(self, seconds: float, load: dict[str, LoadSignal] | None = None) -> None:
        """Lets `seconds` pass in steps of 0.5 s; `load` is reported fresh at every step (a relay
        reporting every 0.5 s)."""
        for _ in range(round(seconds / 0.5)):
            for name, signal in (load or {}).items():
                self.pool(name).record_load(signal, self.clock.monotonic())
            await self.clock.advance(0.5)

    def eligible(self) -> list[str]:
        return [c.pool_id for c in self.core.decide("m", PROMPT, 4).candidates]

    def refusals(self, pool: str, code: str) -> float:
        metrics = self.core.metrics
        return metrics.refusals.labels(pool, code)._value.get()


@dataclasses.dataclass
class Collected:
    """A run's whole output and its record (which pools served it, which refused)."""

    outputs: list[Output]
    record: RunRecord


def summary_of(collected: Collected) -> RunRecord:
    return collected.record


async def test_a_pool_whose_fresh_load_shows_it_full_is_waited_for_without_backing_off(fake_clock):
    mesh = Mesh(fake_clock)
    _, task = mesh.start()
    stream = await mesh.stream_of("a")
    await mesh.wait(35.0, load={"a": FULL, "b": IDLE})  # 3.5 first-token timeouts
    assert not task.done(), "still waiting its turn"
    assert mesh.pool("a").link_backoff_until == 0.0, "a busy pool's link does not back off"
    assert "a" in mesh.eligible(), "a stays eligible for others"
    stream.finish([7, 8, 9, 10])
    await fake_clock.settle()
    messages = await task
    summary = summary_of(messages)
    assert list(summary.pools) == ["a"] and not summary.refused_by
    assert [t for m in messages.outputs for t in m.token_ids] == [7, 8, 9, 10]
    assert mesh.refusals("a", "DEADLINE_EXCEEDED") == 0
    assert mesh.links.requests[0].queue_updates, "the frontend asks for queue reports"


async def test_queue_reports_keep_the_wait_going_whatever_the_load_says(fake_clock):
    mesh = Mesh(fake_clock)
    _, task = mesh.start()
    stream = await mesh.stream_of("a")
    for position in (5, 4, 3, 2, 1):  # no load report at all: only the stream says it is busy
        stream.queued(position)
        await mesh.wait(8.0)
    assert not task.done() and mesh.pool("a").link_backoff_until == 0.0
    assert "a" in mesh.eligible()
    stream.finish([1, 2, 3, 4])
    await fake_clock.settle()
    summary = summary_of(await task)
    assert list(summary.pools) == ["a"] and not summary.refused_by


async def test_a_silent_pool_is_still_a_stall_and_its_link_backs_off(fake_clock):
    mesh = Mesh(fake_clock)
    _, task = mesh.start()
    await mesh.stream_of("a")
    await mesh.wait(9.5, load={"a": IDLE, "b": IDLE})  # fresh load with room: silence, not a queue
    assert not task.done()
    await mesh.wait(1.0, load={"a": IDLE, "b": IDLE})
    b = await mesh.stream_of("b")
    assert mesh.pool("a").link_backoff_until > fake_clock.monotonic(), "a silent pool backs off"
    assert mesh.eligible() == ["b"]
    filtered = mesh.core.decide("m", PROMPT, 4).filtered
    assert [(f.pool_id, f.reason) for f in filtered] == [("a", FilterReason.LINK_BACKOFF)]
    b.finish([1, 2, 3, 4])
    await fake_clock.settle()
    summary = summary_of(await task)
    assert list(summary.refused_by) == ["a"] and list(summary.pools) == ["b"]
    assert mesh.refusals("a", "DEADLINE_EXCEEDED") == 1


async def test_a_pool_with_no_fresh_load_that_says_nothing_is_a_stall(fake_clock):
    mesh = Mesh(fake_clock)
    mesh.pool("a").record_load(FULL, fake_clock.monotonic())  # full once, then its reports stop
    _, task = mesh.start()
    await mesh.stream_of("a")
    await mesh.wait(10.5)
    await mesh.stream_of("b")
    assert mesh.pool("a").link_backoff_until > fake_clock.monotonic()
    task.cancel()


async def test_a_pool_that_goes_silent_after_queue_reports_stalls_one_allowance_after_the_last(fake_clock):
    mesh = Mesh(fake_clock)
    _, task = mesh.start()
    stream = await mesh.stream_of("a")
    stream.queued(2)
    await mesh.wait(6.0)
    stream.queued(1)  # at 6 s; then it hangs
    await mesh.wait(9.5)
    assert "b" not in mesh.links.streams, "within the allowance from the last report"
    await mesh.wait(1.0)
    await mesh.stream_of("b")
    assert mesh.pool("a").link_backoff_until > fake_clock.monotonic()
    task.cancel()


async def test_a_request_waits_its_turn_at_most_max_queue_wait_then_moves_without_blaming_the_pool(
    fake_clock,
):
    mesh = Mesh(fake_clock, StallPolicy(first_token_timeout=10.0, prefill_factor=0.0, max_queue_wait=30.0))
    _, task = mesh.start()
    await mesh.stream_of("a")
    await mesh.wait(29.5, load={"a": FULL, "b": IDLE})
    assert "b" not in mesh.links.streams
    await mesh.wait(1.0, load={"a": FULL, "b": IDLE})
    b = await mesh.stream_of("b")
    assert mesh.links.streams["a"][0].cancelled, "the wait at a is given up"
    assert mesh.pool("a").link_backoff_until == 0.0, "a busy pool is not to blame"
    assert set(mesh.eligible()) == {"a", "b"}
    assert mesh.refusals("a", "RESOURCE_EXHAUSTED") == 1 and mesh.refusals("a", "DEADLINE_EXCEEDED") == 0
    b.finish([1, 2, 3, 4])
    await fake_clock.settle()
    summary = summary_of(await task)
    assert list(summary.refused_by) == ["a"] and list(summary.pools) == ["b"]


async def test_waiting_its_turn_everywhere_past_max_queue_wait_ends_with_a_busy_reason(fake_clock):
    mesh = Mesh(fake_clock, StallPolicy(first_token_timeout=10.0, prefill_factor=0.0, max_queue_wait=20.0))
    _, task = mesh.start()
    await mesh.wait(41.0, load={"a": FULL, "b": FULL})
    with pytest.raises(GenerateError) as info:
        await task
    assert info.value.reason == Reason.ALL_POOLS_REFUSED, info.value.message
    assert "busy" in info.value.message
    assert mesh.pool("a").link_backoff_until == 0.0 and mesh.pool("b").link_backoff_until == 0.0


@pytest.mark.parametrize("load", [FULL, IDLE], ids=["busy", "idle"])
async def test_a_pool_slow_to_admit_is_passed_over_and_backs_off_only_when_not_known_busy(fake_clock, load):
    mesh = Mesh(fake_clock)
    mesh.links.slow_to_admit.add("a")
    _, task = mesh.start(b_second=True)
    await mesh.wait(10.5, load={"a": load, "b": IDLE})
    b = await mesh.stream_of("b")
    if load is FULL:
        assert mesh.pool("a").link_backoff_until == 0.0 and "a" in mesh.eligible()
        assert mesh.refusals("a", "RESOURCE_EXHAUSTED") == 1
    else:
        assert mesh.pool("a").link_backoff_until > fake_clock.monotonic()
        assert mesh.refusals("a", "DEADLINE_EXCEEDED") == 1
    b.finish([1, 2, 3, 4])
    await fake_clock.settle()
    summary = summary_of(await task)
    assert list(summary.refused_by) == ["a"] and list(summary.pools) == ["b"]


def test_known_busy_needs_a_fresh_load_showing_the_pool_full():
    limits = FreshnessLimits(load_max_age=3.0)
    pool = PoolState(pool_id="p")
    assert not known_busy(pool, 100.0, limits), "no load: unknown, not busy"
    pool.record_load(FULL, 100.0)
    assert known_busy(pool, 102.0, limits)
    assert not known_busy(pool, 104.0, limits), "a stale report says nothing"
    pool.record_load(LoadSignal(requests_running=3, max_running_requests=4), 110.0)
    assert not known_busy(pool, 110.0, limits), "a slot is free"
    pool.record_sent(100, 10)
    assert known_busy(pool, 110.0, limits), "what this frontend sent since fills it"
    pool.record_load(LoadSignal(requests_running=9), 120.0)
    assert not known_busy(pool, 120.0, limits), "slots not stated, none waiting"


def test_stall_watch_verdicts():
    watch = StallWatch(POLICY, begun=100.0)
    assert watch.allowance(100.0) == 10.0
    assert watch.expired(110.0, busy=False) is FirstTokenWait.STALLED
    assert watch.expired(110.0, busy=True) is FirstTokenWait.WAIT
    assert watch.turns == 1 and watch.allowance(110.0) == 10.0, "the allowance starts again"
    watch.waiting_turn(115.0, 3)
    assert watch.position == 3 and watch.allowance(115.0) == 10.0
    watch.waiting_turn(152.0, 1)
    assert watch.allowance(155.0) == pytest.approx(5.0), "capped by max_queue_wait from the ask"
    assert watch.expired(160.0, busy=False) is FirstTokenWait.TOO_LONG, "alive 8 s ago: not silent"
    assert watch.expired(160.0, busy=True) is FirstTokenWait.TOO_LONG
    long_prefill = StallWatch(StallPolicy(max_queue_wait=1.0), uncached_tokens=10_000, prefill_rate=100)
    assert long_prefill.wait_cap == long_prefill.first_allowance, "a long prefill is never cut short"
    with pytest.raises(ValueError, match="max_queue_wait"):
        StallPolicy(max_queue_wait=0)

"""Late-binding dispatch queue on a fake clock: dispatch only when a pool can start the request,
the affinity hold, bounds and deadlines, priority order, token-weighted fairness between
tenants, and shedding with a machine-readable reason and a retry-after hint."""

from __future__ import annotations

import pytest

from globalrouter.dispatch import (
    DispatchConfig,
    Dispatched,
    DispatchQueue,
    DispatchRequest,
    Outcome,
    Shed,
    ShedReason,
)
from globalrouter.pool_state import LoadSignal, PoolCapacityHint, PoolState
from globalrouter.selection import SelectionConfig, Selector
from meshkit.clock import FakeClock

NOW = 100.0
MODEL = "m"
RATE = 1000  # work tokens per second: 1,000 prefill tokens in flight = 1 s of backlog


def pool(pool_id: str, backlog_tokens: int = 0) -> PoolState:
    p = PoolState(
        pool_id=pool_id,
        listed=True,
        model=MODEL,
        region="r1",
        frontends=("http://127.0.0.1:1",),
        capacity=PoolCapacityHint(prefill_tokens_per_second=RATE),
        block_size=16,
        kv_at=NOW,
    )
    p.record_load(LoadSignal(prefill_tokens_in_flight=backlog_tokens), NOW)
    return p


class Harness:
    def __init__(
        self, pools: list[PoolState], cached: dict[str, int] | None = None, **config: object
    ) -> None:
        self.clock = FakeClock(start=NOW)
        self.pools = pools
        self.cached = cached or {}
        config.setdefault("max_queue_seconds", 3600.0)
        config.setdefault("start_within_seconds", 0.0)
        self.q: DispatchQueue[str] = DispatchQueue(
            DispatchConfig(**config),  # type: ignore[arg-type]
            self.clock,
            Selector(SelectionConfig(hotspot_seconds=0.0)),
            lambda: self.pools,
            lambda req, now: self.cached,
        )

    def req(self, name: str, prompt: int = 100, out: int = 0, **kw: object) -> DispatchRequest[str]:
        return DispatchRequest(name, kw.pop("model", MODEL), prompt, out, **kw)  # type: ignore[arg-type]

    def at(self, t: float) -> list[Outcome[str]]:
        self.clock.set(t)
        return self.q.poll()


def names(outcomes: list[Outcome[str]]) -> list[str]:
    return [o.request.payload for o in outcomes if isinstance(o, Dispatched)]


def test_idle_pool_and_empty_queue_dispatch_at_once_and_count_the_send():
    h = Harness([pool("a")])
    out = h.q.enqueue(h.req("r1", prompt=200, out=10))
    assert isinstance(out, Dispatched)
    assert out.pool.pool_id == "a" and out.queued_seconds == 0.0
    assert h.pools[0].pending_prefill_tokens == 200 and h.pools[0].pending_decode_tokens == 10
    # the pool now has 200 + 4 * 10 tokens of work: 0.24 s before it can take the next
    assert h.q.backlog_seconds(h.pools[0], NOW) == pytest.approx(0.24)


def test_dispatches_only_when_a_pool_can_start_it():
    h = Harness([pool("a", backlog_tokens=2000)])  # 2 s of reported work
    assert h.q.enqueue(h.req("r1")) is None
    assert h.q.queued(MODEL) == 1
    assert h.q.next_wakeup() == pytest.approx(NOW + 2.0)
    assert h.at(NOW + 1.0) == []
    out = h.at(NOW + 2.0)
    assert names(out) == ["r1"]
    assert out[0].queued_seconds == pytest.approx(2.0)
    assert h.q.queued() == 0 and h.q.next_wakeup() is None


def test_start_within_lets_a_pool_queue_a_little():
    h = Harness([pool("a", backlog_tokens=2000)], start_within_seconds=0.5)
    assert h.q.enqueue(h.req("r1")) is None
    assert h.q.next_wakeup() == pytest.approx(NOW + 1.5)
    assert names(h.at(NOW + 1.5)) == ["r1"]


def test_a_new_load_report_replaces_the_estimate():
    a = pool("a", backlog_tokens=5000)
    h = Harness([a])
    assert h.q.enqueue(h.req("r1")) is None
    assert h.at(NOW + 1.0) == []
    a.record_load(LoadSignal(), NOW + 1.0)  # the pool reports it is idle after all
    assert names(h.at(NOW + 1.0)) == ["r1"]


@pytest.mark.parametrize(("hold", "pool_id", "after"), [(4.0, "a", 3.0), (2.0, "b", 0.0)])
def test_holds_out_for_the_cached_pool_only_while_it_can_start_the_request_in_time(
    hold: float, pool_id: str, after: float
):
    # "a" caches the whole 3,200-token prompt but has 3 s of work; "b" is idle and caches nothing
    # (ranked: "a" 3 s of wait, "b" 1.3 x 3.2 s of prefill, so "a" first)
    pools = [pool("a", backlog_tokens=3000), pool("b")]
    h = Harness(pools, cached={"a": 200}, affinity_hold_seconds=hold)
    first = h.q.enqueue(h.req("r1", prompt=3200))
    out = [first] if first is not None else h.at(NOW)
    if after:
        assert out == [] or names(out) == []
        assert h.at(NOW + after - 0.1) == []
        out = h.at(NOW + after)
    assert names(out) == ["r1"]
    assert out[0].pool.pool_id == pool_id


def test_higher_class_dispatches_first():
    h = Harness([pool("a", backlog_tokens=1000)])
    assert h.q.enqueue(h.req("low", priority=0)) is None
    assert h.q.enqueue(h.req("high", priority=5)) is None
    assert h.q.enqueue(h.req("low2", priority=0)) is None
    order: list[str] = []
    t = NOW
    while h.q.queued():
        wake = h.q.next_wakeup()
        assert wake is not None and wake > t
        t = wake
        order += names(h.at(t))
    assert order == ["high", "low", "low2"]


def drain(h: Harness, limit: int) -> list[DispatchRequest[str]]:
    """Dispatches until `limit` requests went out (the pool frees, the queue dispatches, ...)."""
    sent: list[DispatchRequest[str]] = []
    t = h.clock.monotonic()
    while len(sent) < limit:
        wake = h.q.next_wakeup()
        assert wake is not None
        t = max(t, wake)
        sent += [o.request for o in h.at(t) if isinstance(o, Dispatched)]
    return sent


@pytest.mark.parametrize(("weight_b", "share_a"), [(1.0, 0.5), (2.0, 1 / 3)])
def test_tenants_share_tokens_by_weight_whatever_their_request_sizes(weight_b: float, share_a: float):
    h = Harness([pool("a", backlog_tokens=1000)], max_queued=4000)
    # tenant A sends many small requests, tenant B fewer large ones; both stay backlogged
    for k in range(2000):
        assert h.q.enqueue(h.req(f"A{k}", prompt=100, tenant="A")) is None
        if k % 10 == 0:
            assert h.q.enqueue(h.req(f"B{k}", prompt=1000, tenant="B", weight=weight_b)) is None
    sent = drain(h, 400)
    tokens = {"A": 0, "B": 0}
    for r in sent:
        tokens[r.tenant] += r.prompt_tokens + r.max_tokens
    got = tokens["A"] / (tokens["A"] + tokens["B"])
    assert got == pytest.approx(share_a, abs=0.05)
    if weight_b == 1.0:
        assert 0.45 <= got <= 0.55


def test_a_tenant_that_was_idle_does_not_bank_credit():
    h = Harness([pool("a", backlog_tokens=1000)], max_queued=4000)
    for k in range(200):
        assert h.q.enqueue(h.req(f"A{k}", prompt=100, tenant="A")) is None
    drain(h, 100)  # A alone for a while
    for k in range(100):
        assert h.q.enqueue(h.req(f"B{k}", prompt=100, tenant="B")) is None
    sent = drain(h, 40)
    share_b = sum(1 for r in sent if r.tenant == "B") / len(sent)
    # B joins at the current virtual time: an even split from now on, not 100 turns in a row
    assert 0.4 <= share_b <= 0.6


def test_full_queue_refuses_with_reason_and_retry_after():
    h = Harness([pool("a", backlog_tokens=10_000)], max_queued=2)
    assert h.q.enqueue(h.req("r1")) is None
    assert h.q.enqueue(h.req("r2")) is None
    out = h.q.enqueue(h.req("r3"))
    assert isinstance(out, Shed) and out.reason is ShedReason.QUEUE_FULL
    assert out.retry_after_seconds >= 1.0 and out.retry_after_seconds == int(out.retry_after_seconds)
    assert "queued" in out.detail
    assert h.q.queued() == 2


def test_a_higher_class_displaces_the_newest_of_the_lowest():
    h = Harness([pool("a", backlog_tokens=10_000)], max_queued=2)
    assert h.q.enqueue(h.req("old", priority=0)) is None
    h.clock.set(NOW + 1)
    assert h.q.enqueue(h.req("new", priority=0)) is None
    assert h.q.enqueue(h.req("vip", priority=1)) is None
    out = h.q.poll()
    assert len(out) == 1 and isinstance(out[0], Shed)
    assert out[0].reason is ShedReason.DISPLACED and out[0].request.payload == "new"
    assert h.q.queued() == 2


def test_deadline_and_class_shedding():
    h = Harness([pool("a", backlog_tokens=100_000)], shed_after_seconds={0: 5.0})
    assert h.q.enqueue(h.req("batch", priority=0)) is None
    assert h.q.enqueue(h.req("interactive", priority=1, deadline=NOW + 8.0)) is None
    assert h.q.next_wakeup() == pytest.approx(NOW + 5.0)
    out = h.at(NOW + 5.0)
    assert [(o.request.payload, o.reason) for o in out if isinstance(o, Shed)] == [
        ("batch", ShedReason.OVERLOADED)
    ]
    assert h.at(NOW + 7.9) == []
    out = h.at(NOW + 8.0)
    assert [(o.request.payload, o.reason) for o in out if isinstance(o, Shed)] == [
        ("interactive", ShedReason.DEADLINE_EXCEEDED)
    ]
    assert out[0].queued_seconds == pytest.approx(8.0)
    assert h.q.queued() == 0


def test_unserved_model_is_refused_at_once():
    h = Harness([pool("a")])
    out = h.q.enqueue(h.req("r1", model="other"))
    assert isinstance(out, Shed) and out.reason is ShedReason.MODEL_NOT_SERVED


def test_bad_config_and_weight_are_refused_by_name():
    with pytest.raises(ValueError, match="max_queued"):
        Harness([pool("a")], max_queued=0)
    with pytest.raises(ValueError, match="shed_after_seconds\\[3\\]"):
        Harness([pool("a")], shed_after_seconds={3: -1.0})
    h = Harness([pool("a")])
    with pytest.raises(ValueError, match="weight"):
        h.q.enqueue(h.req("r1", weight=0.0))


def test_a_lower_class_leaves_reserved_pools_free_for_higher_ones():
    # two idle pools; class 0 leaves one free: the first class-0 request takes a pool, the next
    # waits although the other pool is idle, and a class-1 request takes that pool at once
    h = Harness([pool("a"), pool("b")], reserved_pools={0: 1})
    first = h.q.enqueue(h.req("low1", prompt=1000, priority=0))
    assert isinstance(first, Dispatched)
    assert h.q.enqueue(h.req("low2", prompt=1000, priority=0)) is None
    assert h.at(NOW) == []
    high = h.q.enqueue(h.req("high", prompt=1000, priority=1))
    assert high is None  # the queue is not empty: decided by the next poll
    out = h.at(NOW)
    assert names(out) == ["high"]
    assert {out[0].pool.pool_id, first.pool.pool_id} == {"a", "b"}
    # low2 goes when a pool frees and another is free again (both free at NOW + 1)
    assert names(h.at(NOW + 1.0)) == ["low2"]
    with pytest.raises(ValueError, match=r"reserved_pools\[0\]"):
        Harness([pool("a")], reserved_pools={0: -1})


def test_tenant_state_is_let_go_whatever_way_requests_leave():
    h = Harness([pool("a", backlog_tokens=10_000)], max_queued=2, shed_after_seconds={0: 1.0})
    assert h.q.enqueue(h.req("r1", tenant="A")) is None
    assert h.q.enqueue(h.req("r2", tenant="B")) is None
    assert isinstance(h.q.enqueue(h.req("r3", tenant="C")), Shed)  # refused at the door
    assert isinstance(h.q.enqueue(h.req("x", tenant="D", model="other")), Shed)
    out = h.at(NOW + 1.0)  # both shed (OVERLOADED)
    assert sorted(o.request.payload for o in out) == ["r1", "r2"]
    cls = h.q._classes[(MODEL, 0)]
    assert cls.queued == {}
    assert set(cls.finish) <= {"A", "B"}


def test_residency_filters_apply_at_dispatch():
    a, b = pool("a"), pool("b")
    b.region = "eu"
    h = Harness([a, b])
    out = h.q.enqueue(h.req("r1", regions=frozenset({"eu"})))
    assert isinstance(out, Dispatched) and out.pool.pool_id == "b"
    assert [f.pool_id for f in out.decision.filtered] == ["a"]


def test_no_eligible_pool_at_arrival_is_refused_with_the_decision():
    h = Harness([pool("a")])
    h.pools[0].directory_draining = True
    out = h.q.enqueue(h.req("r1"))
    assert isinstance(out, Shed) and out.reason is ShedReason.NO_ELIGIBLE_POOL
    assert out.decision is not None and [f.pool_id for f in out.decision.filtered] == ["a"]
    assert h.q.queued() == 0


def test_a_class_that_must_leave_the_free_pools_to_higher_ones_is_not_ranked(monkeypatch):
    # under a flood of class 0 with one pool reserved, most polls find one free pool and a long
    # class-0 queue: nothing can dispatch, so nothing is ranked (it ranked the whole window on
    # every poll, which made the flood simulation hours long)
    h = Harness([pool("a", backlog_tokens=5000), pool("b")], reserved_pools={0: 1})
    for k in range(20):
        assert h.q.enqueue(h.req(f"low{k}", priority=0)) is None
    calls: list[str] = []
    select = Selector.select

    def counted(self: Selector, *args: object, **kwargs: object) -> object:
        calls.append("select")
        return select(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Selector, "select", counted)
    assert h.at(NOW + 0.5) == []
    assert calls == []
    # a class-1 request is ranked and takes the free pool
    assert h.q.enqueue(h.req("high", priority=1)) is None
    assert names(h.at(NOW + 0.5)) == ["high"]


def test_a_lower_class_also_leaves_free_the_pools_higher_ones_used_within_the_window():
    # class 1 used two pools at NOW; one pool reserved for it, but with a 10 s window class 0
    # leaves two free (the pools class 1 has been using) until the window has passed
    h = Harness([pool("a"), pool("b"), pool("c")], reserved_pools={0: 1}, reserve_window_seconds=10.0)
    first = h.q.enqueue(h.req("high1", prompt=100, priority=1))
    assert isinstance(first, Dispatched)
    second = h.q.enqueue(h.req("high2", prompt=100, priority=1))
    assert isinstance(second, Dispatched) and second.pool.pool_id != first.pool.pool_id
    for k in range(3):
        assert h.q.enqueue(h.req(f"low{k}", prompt=100, priority=0)) is None
    # at NOW + 1 all three pools are idle: class 0 takes one, leaving two
    assert names(h.at(NOW + 1.0)) == ["low0"]
    assert names(h.at(NOW + 1.05)) == []
    # after the window only the fixed reserve of one pool holds: of three idle pools, two go
    assert names(h.at(NOW + 10.5)) == ["low1", "low2"]
    with pytest.raises(ValueError, match="reserve_window_seconds"):
        Harness([pool("a")], reserve_window_seconds=-1.0)


# ---- the "match" placement (pool-driven) ----------------------------------------------------


class MatchHarness(Harness):
    """The match placement; each request's cached blocks per pool from `cached_by` (by payload)."""

    def __init__(
        self, pools: list[PoolState], cached_by: dict[str, dict[str, int]], **config: object
    ) -> None:
        super().__init__(pools, None, placement="match", **config)
        self.q.overlaps = lambda req, now: cached_by.get(req.payload, {})


def test_match_gives_a_freed_pool_to_the_queued_request_with_the_longest_prefix_there():
    # both requests hold out for "a" (busy 2 s); "r1" came first but caches 2 blocks there,
    # "r2" 8: when "a" frees it goes to "r2" (the rank placement gives it to "r1", first in
    # line, whose best pool it is too), and "r1" keeps holding out for it
    pools = [pool("a", backlog_tokens=2000), pool("b", backlog_tokens=20_000)]
    h = MatchHarness(pools, {"r1": {"a": 2}, "r2": {"a": 8}}, affinity_hold_seconds=30.0)
    assert h.q.enqueue(h.req("r1", prompt=1000)) is None
    assert h.q.enqueue(h.req("r2", prompt=1000)) is None
    assert h.at(NOW + 1.0) == []
    out = h.at(NOW + 2.0)
    assert names(out) == ["r2"] and out[0].pool.pool_id == "a"
    assert h.q.queued() == 1
    # "a" has r2's 1,000 - 128 tokens to prefill: r1 starts there once they are done
    out = h.at(NOW + 2.0 + 0.872)
    assert names(out) == ["r1"] and out[0].pool.pool_id == "a"


def test_match_keeps_class_priority_over_a_longer_prefix():
    pools = [pool("a", backlog_tokens=2000), pool("b", backlog_tokens=20_000)]
    h = MatchHarness(pools, {"low": {"a": 8}, "high": {"a": 2}}, affinity_hold_seconds=30.0)
    assert h.q.enqueue(h.req("low", prompt=1000, priority=0)) is None
    assert h.q.enqueue(h.req("high", prompt=1000, priority=1)) is None
    assert names(h.at(NOW + 2.0)) == ["high"]


def test_match_a_request_older_than_the_hold_goes_ahead_of_longer_prefixes():
    # "old" (2 blocks on "a") has been queued longer than the 5 s hold when "a" frees at 6 s:
    # it goes first although "new" caches more there, so a short prefix is never starved by a
    # stream of longer ones
    pools = [pool("a", backlog_tokens=6000), pool("b", backlog_tokens=60_000)]
    h = MatchHarness(pools, {"old": {"a": 2}, "new": {"a": 8}}, affinity_hold_seconds=5.0)
    assert h.q.enqueue(h.req("old", prompt=1000)) is None
    h.clock.set(NOW + 3.0)
    assert h.q.enqueue(h.req("new", prompt=1000)) is None
    assert h.at(NOW + 3.0) == []
    out = h.at(NOW + 6.0)
    assert names(out) == ["old"] and out[0].pool.pool_id == "a"


@pytest.mark.parametrize(("blocks", "moves"), [(2, True), (60, False)])
def test_match_a_free_pool_takes_a_held_request_whose_wait_costs_more_than_its_prefix_saves(
    blocks: int, moves: bool
):
    # "a" caches the request's prefix and is busy 1 s, "b" is idle: 2 blocks save 0.032 s of
    # prefill (x 1.3, the ranking's prefill weight), less than the 1 s wait, so the request takes
    # "b" at once; 60 blocks save 0.96 s x 1.3, more than the wait: it holds out for "a"
    pools = [pool("a", backlog_tokens=1000), pool("b")]
    h = MatchHarness(pools, {"r": {"a": blocks}}, affinity_hold_seconds=30.0)
    assert h.q.enqueue(h.req("r", prompt=1000)) is None
    out = h.at(NOW)
    if moves:
        assert names(out) == ["r"] and out[0].pool.pool_id == "b"
    else:
        assert out == []
        out = h.at(NOW + 1.0)
        assert names(out) == ["r"] and out[0].pool.pool_id == "a"


def test_match_a_prompt_no_pool_favours_takes_the_best_ranked_free_pool_at_once():
    h = MatchHarness([pool("a", backlog_tokens=3000), pool("b")], {"r": {"a": 1, "b": 1}})
    out = h.q.enqueue(h.req("r", prompt=1000))
    assert isinstance(out, Dispatched) and out.pool.pool_id == "b"


def test_match_the_cached_pool_free_at_arrival_takes_the_request_at_once():
    h = MatchHarness([pool("a"), pool("b")], {"r": {"a": 3}})
    out = h.q.enqueue(h.req("r", prompt=1000))
    assert isinstance(out, Dispatched) and out.pool.pool_id == "a"


def test_an_unknown_placement_is_refused_by_name():
    with pytest.raises(ValueError, match="placement must be one of rank, match"):
        Harness([pool("a")], placement="best")

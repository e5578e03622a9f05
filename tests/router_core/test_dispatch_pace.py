"""Pacing in the dispatch queue on a fake clock: a paced class leaves the queue no faster than
its rate, a higher (or another) class is never held by its bucket, held requests still shed at
their deadlines, and a held class does not use up the scan for the classes after it."""

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


def pool(pool_id: str) -> PoolState:
    p = PoolState(
        pool_id=pool_id,
        listed=True,
        model=MODEL,
        region="r1",
        frontends=("http://127.0.0.1:1",),
        capacity=PoolCapacityHint(prefill_tokens_per_second=1_000_000),
        block_size=16,
        kv_at=NOW,
    )
    p.record_load(LoadSignal(), NOW)
    return p


class Harness:
    """Pools that can always take work (a start-within far beyond any backlog here), so that
    pacing is the only thing holding a request."""

    def __init__(self, **config: object) -> None:
        self.clock = FakeClock(start=NOW)
        self.pools = [pool("a"), pool("b")]
        config.setdefault("max_queue_seconds", 3600.0)
        config.setdefault("start_within_seconds", 1e6)
        self.q: DispatchQueue[str] = DispatchQueue(
            DispatchConfig(**config),  # type: ignore[arg-type]
            self.clock,
            Selector(SelectionConfig(hotspot_seconds=0.0)),
            lambda: self.pools,
            lambda req, now: {},
        )

    def req(self, name: str, prompt: int = 500, **kw: object) -> DispatchRequest[str]:
        return DispatchRequest(name, MODEL, prompt, 0, **kw)  # type: ignore[arg-type]

    def enqueue(self, request: DispatchRequest[str]) -> list[Outcome[str]]:
        out = self.q.enqueue(request)
        return [out] if out is not None else []

    def at(self, t: float) -> list[Outcome[str]]:
        self.clock.set(t)
        return self.q.poll()


def names(outcomes: list[Outcome[str]]) -> list[str]:
    return [o.request.payload for o in outcomes if isinstance(o, Dispatched)]


def test_a_paced_class_leaves_the_queue_at_its_rate():
    # 1,000 tokens/s with a 1 s bucket, ten 500-token requests at once: the bucket's 1,000
    # tokens and one more request go at once (the last puts the class 500 in debt), then one
    # every 0.5 s, woken by next_wakeup
    h = Harness(pace_tokens_per_second={0: 1000.0}, pace_burst_seconds=1.0)
    sent: dict[str, float] = {}
    for k in range(10):
        for name in names(h.enqueue(h.req(f"r{k}"))):
            sent[name] = NOW
    for name in names(h.at(NOW)):
        sent[name] = NOW
    assert sorted(sent) == ["r0", "r1", "r2"]
    assert h.q.queued() == 7
    while h.q.queued():
        wake = h.q.next_wakeup()
        assert wake is not None and wake > h.clock.monotonic()
        for name in names(h.at(wake)):
            sent[name] = wake
    times = [sent[f"r{k}"] - NOW for k in range(10)]
    assert times == pytest.approx([0, 0, 0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5])
    # over every span, at most rate x (span + burst) tokens plus one request
    for i in range(10):
        for j in range(i, 10):
            assert 500 * (j - i + 1) <= 1000 * (times[j] - times[i] + 1.0) + 500 + 1e-6
    # polled in between, nothing leaves early
    h2 = Harness(pace_tokens_per_second={0: 1000.0}, pace_burst_seconds=0.0)
    for k in range(3):
        h2.enqueue(h2.req(f"r{k}"))
    assert h2.q.queued() == 2  # an empty bucket lets one request go (into debt), not two
    assert names(h2.at(NOW + 0.49)) == []
    assert names(h2.at(NOW + 0.5)) == ["r1"]
    assert names(h2.at(NOW + 0.99)) == []
    assert names(h2.at(NOW + 1.0)) == ["r2"]


def test_an_idle_paced_class_refills_only_up_to_its_burst():
    h = Harness(pace_tokens_per_second={0: 1000.0}, pace_burst_seconds=1.0)
    assert names([o for k in range(3) for o in h.enqueue(h.req(f"r{k}"))]) == ["r0", "r1", "r2"]
    assert h.q.queued() == 0
    h.clock.set(NOW + 100.0)  # idle long since: the bucket has refilled, but only to 1,000 tokens
    later = [o for k in range(10) for o in h.enqueue(h.req(f"s{k}"))]
    assert names(later) == ["s0", "s1", "s2"]


def test_a_higher_class_is_not_held_by_a_lower_classes_bucket():
    # class 0 paced and in debt with requests queued; class 1 (not paced) and class 2 (paced by
    # its own bucket) dispatch at once
    h = Harness(pace_tokens_per_second={0: 100.0, 2: 1000.0}, pace_burst_seconds=0.0)
    assert names(h.enqueue(h.req("low0", prompt=1000, priority=0))) == ["low0"]  # 10 s of debt
    for k in range(1, 4):
        assert h.enqueue(h.req(f"low{k}", prompt=1000, priority=0)) == []
    assert h.q.next_wakeup() == pytest.approx(NOW + 10.0)
    assert h.enqueue(h.req("high", priority=1)) == []  # the queue is not empty: the next poll
    assert h.enqueue(h.req("top", priority=2)) == []
    assert sorted(names(h.at(NOW))) == ["high", "top"]
    assert h.q.queued() == 3
    # class 2's own bucket holds class 2 (500 tokens at 1,000/s: 0.5 s), still not class 1
    assert h.enqueue(h.req("top2", priority=2)) == []
    assert h.enqueue(h.req("high2", priority=1)) == []
    assert names(h.at(NOW)) == ["high2"]
    assert names(h.at(NOW + 0.5)) == ["top2"]
    assert names(h.at(NOW + 10.0)) == ["low1"]


def test_held_requests_still_shed_at_their_deadlines():
    h = Harness(pace_tokens_per_second={0: 100.0}, pace_burst_seconds=0.0, shed_after_seconds={3: 2.0})
    assert names(h.enqueue(h.req("first", prompt=1000))) == ["first"]  # 10 s of debt
    assert h.enqueue(h.req("deadline", deadline=NOW + 4.0)) == []
    assert h.enqueue(h.req("default")) == []  # the config's max_queue_seconds
    assert h.q.next_wakeup() == pytest.approx(NOW + 4.0)
    out = h.at(NOW + 4.0)
    assert [(o.request.payload, o.reason) for o in out if isinstance(o, Shed)] == [
        ("deadline", ShedReason.DEADLINE_EXCEEDED)
    ]
    assert names(h.at(NOW + 10.0)) == ["default"]
    # a held request of a class that sheds under overload goes with OVERLOADED
    h = Harness(pace_tokens_per_second={3: 100.0}, pace_burst_seconds=0.0, shed_after_seconds={3: 2.0})
    assert names(h.enqueue(h.req("first", prompt=1000, priority=3))) == ["first"]
    assert h.enqueue(h.req("batch", priority=3)) == []
    out = h.at(NOW + 2.0)
    assert [(o.request.payload, o.reason) for o in out if isinstance(o, Shed)] == [
        ("batch", ShedReason.OVERLOADED)
    ]
    assert h.q.queued() == 0 and h.q.next_wakeup() is None


def test_a_held_class_does_not_use_up_the_scan_for_lower_classes():
    # class 1 is paced and holds 5 queued requests; with a scan of 2, the unpaced class 0 behind
    # them still dispatches
    h = Harness(pace_tokens_per_second={1: 100.0}, pace_burst_seconds=0.0, scan_limit=2)
    assert names(h.enqueue(h.req("p0", prompt=1000, priority=1))) == ["p0"]
    for k in range(1, 6):
        h.enqueue(h.req(f"p{k}", priority=1))
    h.enqueue(h.req("low", priority=0))
    assert names(h.at(NOW)) == ["low"]
    assert h.q.queued() == 5
    # two held classes above an unpaced one
    h = Harness(pace_tokens_per_second={1: 100.0, 3: 100.0}, pace_burst_seconds=0.0, scan_limit=2)
    for priority in (3, 1):  # each goes at once (nothing queued yet), 10 s into debt
        assert names(h.enqueue(h.req(f"c{priority}", prompt=1000, priority=priority))) == [f"c{priority}"]
    for priority in (3, 1):
        for k in range(3):
            h.enqueue(h.req(f"c{priority}-{k}", priority=priority))
    h.enqueue(h.req("c2", priority=2))
    h.enqueue(h.req("c0", priority=0))
    assert names(h.at(NOW)) == ["c2", "c0"]
    # both out of debt: each class sends one (the window is taken before the round, so class
    # 1's turn may be the next poll's)
    assert names(h.at(NOW + 10.0) + h.at(NOW + 10.0)) == ["c3-0", "c1-0"]
    assert h.q.queued() == 4


def test_withdrawn_held_requests_leave_no_wakeup():
    h = Harness(pace_tokens_per_second={0: 100.0}, pace_burst_seconds=0.0, max_queue_seconds=1e9)
    h.enqueue(h.req("first", prompt=1000))
    held = h.req("held")
    h.enqueue(held)
    assert h.q.next_wakeup() == pytest.approx(NOW + 10.0)
    assert h.q.withdraw(held)
    assert h.q.queued() == 0 and h.q.next_wakeup() is None


def test_bad_pace_settings_are_refused_by_name():
    for rate in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"pace_tokens_per_second\[0\]"):
            Harness(pace_tokens_per_second={0: rate})
    with pytest.raises(ValueError, match="pace_burst_seconds"):
        Harness(pace_tokens_per_second={0: 1.0}, pace_burst_seconds=-1.0)


def test_serve_takes_pace_per_class_and_refuses_bad_ones(capsys):
    from globalrouter.cli import build_parser
    from globalrouter.serve_cli import _dispatch_config

    base = ["serve", "--discovery", "h:1", "--dispatch", "late"]
    args = build_parser().parse_args(
        [*base, "--dispatch-pace", "0=13132.5, 2=100", "--dispatch-pace-burst", "0.5"]
    )
    config = _dispatch_config(args)
    assert config is not None and dict(config.pace_tokens_per_second) == {0: 13132.5, 2: 100.0}
    assert config.pace_burst_seconds == 0.5
    config = _dispatch_config(build_parser().parse_args(base))
    assert (
        config is not None and dict(config.pace_tokens_per_second) == {} and config.pace_burst_seconds == 1.0
    )
    for bad in ("0", "x=1", "10=1", "0=0", "0=-5", "0=nan", "0=inf"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, "--dispatch-pace", bad])
        assert "expected CLASS=TOKENS_PER_S" in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--dispatch-pace-burst", "-1"])


def test_simulate_passes_the_pace_through(capsys):
    from globalrouter.cli import build_parser
    from globalrouter.simulate import late_dispatch_config

    base = ["simulate", "--trace", "t.jsonl", "--dispatch", "late"]
    config = late_dispatch_config(build_parser().parse_args([*base, "--dispatch-pace", "0=250"]))
    assert dict(config.pace_tokens_per_second) == {0: 250.0}
    assert dict(late_dispatch_config(build_parser().parse_args(base)).pace_tokens_per_second) == {}
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--dispatch-pace", "0=0"])
    assert "expected CLASS=TOKENS_PER_S" in capsys.readouterr().err


@pytest.mark.parametrize("placement", ["rank", "match"])
def test_pacing_holds_a_class_in_either_placement(placement):
    # the match placement has its own commit loops: the class's bucket must hold it there too
    h = Harness(pace_tokens_per_second={0: 1000.0}, pace_burst_seconds=1.0, placement=placement)
    sent: list[str] = []
    for k in range(10):
        sent += names(h.enqueue(h.req(f"r{k}")))
    sent += names(h.at(NOW))
    assert sorted(sent) == ["r0", "r1", "r2"]
    sent += names(h.at(NOW + 0.5))
    assert len(sent) == 4

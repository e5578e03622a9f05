"""The dispatch queue's deadline order under a wait SLO (`DispatchConfig.late_after_seconds`) on
a fake clock: requests that can still start within the target go before those that already
missed it, within a class, and a late request takes its place again after `late_limit` times the
target (none starves)."""

from __future__ import annotations

import pytest

from globalrouter.dispatch import DispatchConfig
from tests.router_core.test_dispatch import NOW, Harness, names, pool


@pytest.mark.parametrize("placement", ["rank", "match"])
def test_a_request_that_can_still_meet_the_target_goes_before_one_that_missed_it(placement: str):
    # the pool has 5 s of work; "old" has waited 5 s when it frees (past the 2 s target), "new" 1 s
    h = Harness([pool("a", backlog_tokens=5000)], late_after_seconds=2.0, placement=placement)
    assert h.q.enqueue(h.req("old", prompt=1000)) is None
    h.clock.set(NOW + 4.0)
    assert h.q.enqueue(h.req("new", prompt=1000)) is None
    assert names(h.at(NOW + 5.0)) == ["new"]  # starts within the target; "old" misses it anyway
    assert names(h.at(NOW + 6.0)) == ["old"]  # then the late one (1 s of "new" ahead of it)


@pytest.mark.parametrize("placement", ["rank", "match"])
def test_without_the_deadline_order_the_queue_keeps_arrival_order(placement: str):
    h = Harness([pool("a", backlog_tokens=5000)], placement=placement)
    assert h.q.enqueue(h.req("old", prompt=1000)) is None
    h.clock.set(NOW + 4.0)
    assert h.q.enqueue(h.req("new", prompt=1000)) is None
    assert names(h.at(NOW + 5.0)) == ["old"]


@pytest.mark.parametrize("placement", ["rank", "match"])
def test_a_late_request_takes_its_place_again_after_late_limit_times_the_target(placement: str):
    # target 1 s, limit 3: "old" has waited 5 s (> 3 s) when the pool frees, so it is no longer
    # put behind: a steady stream of on-time requests cannot starve it
    h = Harness([pool("a", backlog_tokens=5000)], late_after_seconds=1.0, late_limit=3.0, placement=placement)
    assert h.q.enqueue(h.req("old", prompt=1000)) is None
    h.clock.set(NOW + 4.5)
    assert h.q.enqueue(h.req("new", prompt=1000)) is None
    assert names(h.at(NOW + 5.0)) == ["old"]


def test_a_late_request_still_goes_before_a_lower_class():
    h = Harness([pool("a", backlog_tokens=5000)], late_after_seconds=2.0)
    assert h.q.enqueue(h.req("old-high", prompt=1000, priority=1)) is None
    h.clock.set(NOW + 4.0)
    assert h.q.enqueue(h.req("new-low", prompt=1000, priority=0)) is None
    assert h.q.enqueue(h.req("new-high", prompt=1000, priority=1)) is None
    assert names(h.at(NOW + 5.0)) == ["new-high"]
    assert names(h.at(NOW + 6.0)) == ["old-high"]
    assert names(h.at(NOW + 7.0)) == ["new-low"]


def test_a_paced_queue_applies_the_deadline_order_too():
    h = Harness(
        [pool("a", backlog_tokens=5000)],
        late_after_seconds=2.0,
        pace_tokens_per_second={0: 1e6},
    )
    assert h.q.enqueue(h.req("old", prompt=1000)) is None
    h.clock.set(NOW + 4.0)
    assert h.q.enqueue(h.req("new", prompt=1000)) is None
    assert names(h.at(NOW + 5.0)) == ["new"]


def test_for_wait_slo_deadline_order_settings():
    fifo = DispatchConfig.for_wait_slo(4.0)
    assert fifo.late_after_seconds == 0.0 and fifo.start_within_seconds == pytest.approx(3.4)
    rank = DispatchConfig.for_wait_slo(4.0, "rank", "deadline")
    assert rank.late_after_seconds == 4.0
    # the frontend, not the pools, holds a burst, so the order decides who waits
    assert rank.start_within_seconds == pytest.approx(0.8)
    assert rank.affinity_hold_seconds == pytest.approx(6.8)
    match = DispatchConfig.for_wait_slo(4.0, "match", "deadline")
    assert match.late_after_seconds == 4.0 and match.placement == "match"
    with pytest.raises(ValueError, match="order must be one of fifo, deadline"):
        DispatchConfig.for_wait_slo(4.0, "rank", "edf")


@pytest.mark.parametrize(
    ("field", "value"),
    [("late_after_seconds", -1.0), ("late_after_seconds", float("nan")), ("late_limit", 0.5)],
)
def test_bad_deadline_order_settings_are_refused_by_name(field: str, value: float):
    with pytest.raises(ValueError, match=field):
        Harness([pool("a")], None, **{field: value})

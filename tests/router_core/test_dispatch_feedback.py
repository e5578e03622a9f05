"""The SLO's feedback on the dispatch queue (`SloFeedback`, `SloController`) on a fake clock: the
scale of the queue depth and the hold falls while the window's wait quantile is over the target
and rises while it is under, within its bounds; the window's memory is bounded; a held request
still leaves once the (scaled) hold has passed."""

from __future__ import annotations

import pytest

from globalrouter.dispatch import DispatchConfig, Dispatched
from globalrouter.pool_state import LoadSignal
from globalrouter.wait_slo import SloController, SloFeedback
from tests.router_core.test_dispatch import NOW, Harness, names, pool


def test_the_scale_tightens_while_the_windows_quantile_is_over_the_target():
    c = SloController(SloFeedback(2.0, min_scale=0.25, max_scale=4.0))
    c.observe(2.0 * 2.718281828459045)  # one log unit over: one full step down
    assert c.scale == pytest.approx(2.718281828459045**-0.1)
    for _ in range(100):
        c.observe(5.0)
    assert c.scale == pytest.approx(0.25)  # at its floor
    assert c.window_quantile() == 5.0


def test_the_scale_relaxes_while_the_windows_quantile_is_under_the_target():
    c = SloController(SloFeedback(2.0, max_scale=4.0))
    for _ in range(100):
        c.observe(0.5)
    assert c.scale == pytest.approx(4.0)  # at its ceiling
    c = SloController(SloFeedback(2.0))
    for _ in range(100):
        c.observe(5.0)
    assert c.scale == 1.0  # the default floor: never below the configured settings


def test_the_window_slides_and_its_memory_is_bounded():
    c = SloController(SloFeedback(2.0, window=100, min_scale=0.25, max_scale=4.0))
    for _ in range(100):
        c.observe(10.0)
    low = c.scale
    assert c.window_quantile() == 10.0
    for _ in range(100):
        c.observe(0.5)  # the old waits leave the window: its p99 is under the target again
    assert c.window_quantile() == 0.5 and c.scale > low
    for _ in range(10_000):
        c.observe(1.0)
    assert c.window_size() == 100 and c.observations == 10_200


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window", 0),
        ("step", 0.0),
        ("min_scale", 2.0),
        ("max_scale", 0.5),
        ("quantile", 1.0),
        ("target_seconds", -1.0),
    ],
)
def test_bad_feedback_settings_are_refused_by_name(field: str, value: float):
    with pytest.raises(ValueError, match=field):
        SloController(SloFeedback(**{"target_seconds": 2.0, field: value}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"slo_feedback: .*{field}"):
        Harness([pool("a")], None, slo_feedback=SloFeedback(**{"target_seconds": 2.0, field: value}))  # type: ignore[arg-type]


def test_waits_under_the_target_let_pools_queue_deeper():
    # 0.1 s of queue at a pool without feedback; after dispatches that started at once (wait 0,
    # far under the 1 s target) the scale has risen, so a pool with 0.5 s of work takes work
    fb = SloFeedback(1.0, step=1.0, max_scale=8.0)
    h = Harness([pool("a")], start_within_seconds=0.1, slo_feedback=fb)
    assert h.q.feedback is not None
    for k in range(3):
        h.clock.set(NOW + 10.0 * k)
        for p in h.pools:  # idle again
            p.record_load(LoadSignal(), NOW + 10.0 * k)
        assert isinstance(h.q.enqueue(h.req(f"r{k}", prompt=10)), Dispatched)
    assert h.q.feedback.scale == pytest.approx(8.0)
    h.clock.set(NOW + 40.0)
    h.pools[0].record_load(LoadSignal(prefill_tokens_in_flight=500), NOW + 40.0)
    assert isinstance(h.q.enqueue(h.req("deep", prompt=10)), Dispatched)  # 0.5 s <= 0.1 x 8
    # without the feedback the same pool waits
    h2 = Harness([pool("a", backlog_tokens=500)], start_within_seconds=0.1)
    assert h2.q.enqueue(h2.req("deep", prompt=10)) is None


def test_waits_over_the_target_shorten_the_hold_and_a_held_request_still_leaves():
    # First three requests wait 10 s at a busy pool (far over the 1 s target): the scale falls
    # to its floor, 0.25. Then "a" caches the prompt but is busy 3 s and "b" is idle: with the
    # configured 4 s hold the request would hold out for "a"; with the scaled 1 s it takes "b".
    fb = SloFeedback(1.0, step=1.0, min_scale=0.25)
    h = Harness(
        [pool("x", backlog_tokens=10_000)],
        {"a": 200},
        affinity_hold_seconds=4.0,
        start_within_seconds=1.0,
        slo_feedback=fb,
    )
    for k in range(3):
        assert h.q.enqueue(h.req(f"w{k}", prompt=10)) is None
    assert names(h.at(NOW + 10.0)) == ["w0", "w1", "w2"]
    assert h.q.feedback is not None and h.q.feedback.scale == pytest.approx(0.25)
    h.pools = [pool("a", backlog_tokens=3000), pool("b")]
    h.clock.set(NOW)  # the new pools' reports are as of NOW
    first = h.q.enqueue(h.req("r1", prompt=3200))
    out = [first] if first is not None else h.at(NOW)
    assert [o.pool.pool_id for o in out if isinstance(o, Dispatched)] == ["b"]
    # without the feedback it holds out for "a"
    h2 = Harness(
        [pool("a", backlog_tokens=3000), pool("b")],
        {"a": 200},
        affinity_hold_seconds=4.0,
        start_within_seconds=1.0,
    )
    first = h2.q.enqueue(h2.req("r1", prompt=3200))
    assert first is None and h2.at(NOW) == []


def test_for_wait_slo_feedback():
    assert DispatchConfig.for_wait_slo(2.0).slo_feedback is None
    config = DispatchConfig.for_wait_slo(2.0, "rank", "deadline", feedback=True)
    assert config.slo_feedback == SloFeedback(2.0)

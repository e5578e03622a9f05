"""Wait-SLO steering of the prefill weight: the quantile tracker, its bounds and validation, and
the Selector steered by it (the same object the live frontend and the simulator run)."""

from __future__ import annotations

import math
import random

import pytest

from globalrouter.pool_state import LoadSignal
from globalrouter.selection import SelectionConfig, Selector
from globalrouter.wait_slo import PrefillWeightSteering, WaitSlo
from tests.router_core.test_selection import MODEL, NOW, order, pool


def test_waits_over_the_target_lower_the_weight_to_its_floor():
    s = PrefillWeightSteering(WaitSlo(2.0, initial_weight=3.0))
    s.observe(5.0)
    assert s.weight == pytest.approx(3.0 * math.exp(-0.1 * 0.99))
    for _ in range(100):
        s.observe(5.0)
    assert s.weight == pytest.approx(1.0)
    assert s.observations == 101


def test_waits_within_the_target_raise_the_weight_to_its_ceiling():
    s = PrefillWeightSteering(WaitSlo(2.0))
    s.observe(2.0)  # at the target is within it
    assert s.weight == pytest.approx(1.3 * math.exp(0.1 * 0.01))
    for _ in range(5_000):
        s.observe(0.5)
    assert s.weight == pytest.approx(5.0)


def test_the_weight_settles_where_the_target_is_exceeded_at_the_quantile():
    # A stand-in for the traffic: the chance that the chosen pool's estimated wait exceeds the
    # target grows with the weight (more affinity, longer queues): 1% at weight 2.
    rng = random.Random(7)
    s = PrefillWeightSteering(WaitSlo(1.0, step=0.05))
    weights = []
    for _ in range(40_000):
        s.observe(2.0 if rng.random() < 0.005 * s.weight else 0.5)
        weights.append(s.weight)
    settled = sum(weights[20_000:]) / 20_000
    assert 1.6 < settled < 2.5


@pytest.mark.parametrize(
    ("slo", "field"),
    [
        (WaitSlo(0.0), "target_seconds"),
        (WaitSlo(float("inf")), "target_seconds"),
        (WaitSlo(1.0, quantile=1.0), "quantile"),
        (WaitSlo(1.0, step=0.0), "step"),
        (WaitSlo(1.0, min_weight=3.0, max_weight=2.0), "min_weight"),
    ],
)
def test_bad_values_are_refused_naming_the_field(slo, field):
    assert any(field in p for p in slo.problems())
    with pytest.raises(ValueError, match=field):
        PrefillWeightSteering(slo)


def _holder_and_idle():
    # "a" holds the whole 16,000-token prompt behind 2 s of queued work; "b" is idle and holds
    # nothing (1.6 s of prefill): a weight above 1.25 ranks "a" first, below it "b".
    return [pool("a", load=LoadSignal(prefill_tokens_in_flight=20_000)), pool("b")]


def test_a_selector_under_an_slo_sheds_affinity_when_the_holder_waits_too_long():
    selector = Selector(SelectionConfig(hotspot_seconds=0.0, drain_reports=False, wait_slo=WaitSlo(1.0)))
    pools = _holder_and_idle()
    assert selector.prefill_weight == pytest.approx(1.3)
    first = selector.select(pools, MODEL, 16_000, 0, {"a": 1000}, NOW)
    assert order(first) == ["a", "b"]  # 2 s of wait estimated there: over the 1 s target
    assert selector.prefill_weight < 1.25
    assert order(selector.select(pools, MODEL, 16_000, 0, {"a": 1000}, NOW)) == ["b", "a"]


def test_a_selector_under_a_loose_slo_keeps_affinity_and_raises_the_weight():
    selector = Selector(SelectionConfig(hotspot_seconds=0.0, drain_reports=False, wait_slo=WaitSlo(3.0)))
    pools = _holder_and_idle()
    for _ in range(2_000):
        assert order(selector.select(pools, MODEL, 16_000, 0, {"a": 1000}, NOW))[0] == "a"
    assert selector.prefill_weight == pytest.approx(5.0)


def test_without_an_slo_the_weight_is_the_fixed_one():
    selector = Selector(SelectionConfig(prefill_weight=2.0))
    assert selector.steering is None
    selector.select(_holder_and_idle(), MODEL, 16_000, 0, {"a": 1000}, NOW)
    assert selector.prefill_weight == 2.0

"""Ranking under a wait SLO: the price of waiting beyond it (dual ascent), its bounds and
validation, and the Selector ranking with it (the same object the live frontend and the
simulator run)."""

from __future__ import annotations

import math
import random

import pytest

from globalrouter.pool_state import LoadSignal
from globalrouter.selection import SelectionConfig, Selector
from globalrouter.wait_slo import WaitPrice, WaitSlo
from tests.router_core.test_selection import MODEL, NOW, order, pool


def test_waits_over_the_target_raise_the_price_to_its_ceiling():
    p = WaitPrice(WaitSlo(2.0))
    p.observe(5.0)
    assert p.excess_weight == pytest.approx(2.0 * math.exp(0.1 * 0.99))
    for _ in range(100):
        p.observe(5.0)
    assert p.excess_weight == pytest.approx(32.0)
    assert p.observations == 101


def test_waits_within_the_target_lower_the_price_to_its_floor():
    p = WaitPrice(WaitSlo(2.0))
    p.observe(2.0)  # at the target is within it
    assert p.excess_weight == pytest.approx(2.0 * math.exp(-0.1 * 0.01))
    for _ in range(5_000):
        p.observe(0.5)
    assert p.excess_weight == pytest.approx(0.25)


def test_the_price_settles_where_the_target_is_exceeded_at_the_quantile():
    # A stand-in for the traffic: the chance that the pick's estimated wait exceeds the target
    # falls as the price rises (queues beyond it get avoided): 1% at a price of 4.
    rng = random.Random(7)
    p = WaitPrice(WaitSlo(1.0, step=0.05))
    prices = []
    for _ in range(40_000):
        p.observe(2.0 if rng.random() < 0.04 / p.excess_weight else 0.5)
        prices.append(p.excess_weight)
    settled = sum(prices[20_000:]) / 20_000
    assert 3.0 < settled < 5.5


@pytest.mark.parametrize(
    ("slo", "field"),
    [
        (WaitSlo(0.0), "target_seconds"),
        (WaitSlo(float("inf")), "target_seconds"),
        (WaitSlo(1.0, quantile=1.0), "quantile"),
        (WaitSlo(1.0, prefill_weight=0.0), "prefill_weight"),
        (WaitSlo(1.0, step=0.0), "step"),
        (WaitSlo(1.0, min_excess_weight=3.0, max_excess_weight=2.0), "min_excess_weight"),
        (WaitSlo(1.0, initial_excess_weight=0.0), "initial_excess_weight"),
    ],
)
def test_bad_values_are_refused_naming_the_field(slo, field):
    assert any(field in p for p in slo.problems())
    with pytest.raises(ValueError, match=field):
        WaitPrice(slo)


def _holder_and_idle():
    # "a" holds the whole 16,000-token prompt behind 2 s of queued work; "b" is idle and holds
    # nothing: 1.6 s of prefill, 8 s at the SLO's prefill weight of 5.
    return [pool("a", load=LoadSignal(prefill_tokens_in_flight=20_000)), pool("b")]


def test_under_an_slo_affinity_holds_until_the_price_of_the_excess_wait_outgrows_it():
    selector = Selector(
        SelectionConfig(
            hotspot_seconds=0.0,
            drain_reports=False,
            wait_slo=WaitSlo(1.0, initial_excess_weight=1.0, step=0.5),
        )
    )
    assert selector.prefill_weight == 5.0
    assert selector.wait_excess_weight == pytest.approx(1.0)
    # a: 2 s of wait + 1.0 x 1 s beyond the target = 3 < b: 8. The pick waits over the target,
    # so the price rises (by e^0.495 a decision) until the excess outweighs the prefill saved.
    picks = [
        order(selector.select(_holder_and_idle(), MODEL, 16_000, 0, {"a": 1000}, NOW))[0] for _ in range(8)
    ]
    assert picks[0] == "a"
    assert "b" in picks
    flip = picks.index("b")
    assert picks[:flip] == ["a"] * flip
    assert 2.0 + selector.wait_excess_weight * 1.0 > 8.0


def test_without_an_slo_nothing_is_priced():
    selector = Selector(SelectionConfig(prefill_weight=2.0))
    assert selector.wait_price is None and selector.wait_excess_weight == 0.0
    selector.select(_holder_and_idle(), MODEL, 16_000, 0, {"a": 1000}, NOW)
    assert selector.prefill_weight == 2.0


def test_a_dry_run_leaves_the_price_as_it_is():
    selector = Selector(SelectionConfig(wait_slo=WaitSlo(1.0)))
    for _ in range(3):
        selector.select(_holder_and_idle(), MODEL, 16_000, 0, {"a": 1000}, NOW, observe=False)
    assert selector.wait_price is not None and selector.wait_price.observations == 0
    assert selector.wait_excess_weight == pytest.approx(2.0)
    selector.select(_holder_and_idle(), MODEL, 16_000, 0, {"a": 1000}, NOW)
    assert selector.wait_price.observations == 1

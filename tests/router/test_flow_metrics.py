"""Flow control per tenant and priority class (metrics.FlowStats): bounded labels, the figures
/metrics exports, what the late-binding queue counts in them, and the status page's section."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from globalrouter.budgets import Kind, Quota
from globalrouter.dispatch import DispatchConfig
from globalrouter.dispatch_live import LateBinder
from globalrouter.http_api.status_page import PAGE, status
from globalrouter.metrics import FlowStats, RouterMetrics
from globalrouter.tenancy import TenantRefusal
from tests.router.test_dispatch_live import NOW, core_with


def key(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


def samples(metrics: RouterMetrics, name: str) -> dict[frozenset[tuple[str, str]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            if s.name == name:
                out[frozenset(s.labels.items())] = s.value
    return out


def test_series_are_per_tenant_and_class_and_bounded():
    flow = FlowStats(max_series=3)
    a0, a5 = flow.series("client/alice", 0), flow.series("client/alice", 5)
    assert a0 is not a5 and flow.series("client/alice", 0) is a0
    flow.series("client/bob", 0)
    # past the cap a new tenant counts as "other" in its class: a client cannot grow the label set
    assert flow.series("client/carol", 0).tenant == "other"
    assert flow.series("client/dave", 0) is flow.series("client/carol", 0)
    assert len(flow.snapshot()) == 4  # three kept + the one "other" of class 0


def test_exported_families_carry_tenant_and_class():
    metrics = RouterMetrics()
    hi, lo = metrics.flow.series("client/alice", 5), metrics.flow.series("other", 0)
    for f in (hi, lo):
        f.admitted()
    hi.finished(150)
    hi.dispatched(0.0)
    lo.dispatched(2.0)
    lo.dispatched(0.3)
    lo.enqueued()
    lo.shed("OVERLOADED")
    hi.budget_refused("tokens_per_minute")
    alice = key(tenant="client/alice", **{"class": "5"})
    other = key(tenant="other", **{"class": "0"})
    assert samples(metrics, "globalrouter_flow_requests_total") == {alice: 1, other: 1}
    assert samples(metrics, "globalrouter_flow_tokens_total") == {alice: 150, other: 0}
    assert samples(metrics, "globalrouter_flow_queued") == {alice: 0, other: 1}
    assert samples(metrics, "globalrouter_flow_queue_seconds_count") == {alice: 1, other: 2}
    assert samples(metrics, "globalrouter_flow_queue_seconds_sum")[other] == pytest.approx(2.3)
    buckets = samples(metrics, "globalrouter_flow_queue_seconds_bucket")
    assert buckets[other | key(le="0.25")] == 0 and buckets[other | key(le="0.5")] == 1
    assert buckets[other | key(le="+Inf")] == 2
    assert samples(metrics, "globalrouter_flow_sheds_total") == {other | key(reason="OVERLOADED"): 1}
    assert samples(metrics, "globalrouter_flow_budget_refusals_total") == {
        alice | key(limit="tokens_per_minute"): 1
    }


def test_the_status_page_has_a_row_per_tenant_and_class(fake_clock):
    core = core_with(("a", 0))
    flow = core.metrics.flow
    alice = flow.series("client/alice", 5)
    alice.admitted([Quota(Kind.TOKENS_PER_MINUTE, 10_000, 7_500, 30.0)])
    for i in range(100):
        alice.dispatched(i / 100)
    flow.series("other", 0).shed("QUEUE_FULL")
    rows = status(core, "f")["flow"]
    assert [(r["class"], r["tenant"]) for r in rows] == [(5, "client/alice"), (0, "other")]
    top = rows[0]
    assert (top["requests"], top["dispatched"], top["queue_p50_s"], top["queue_p99_s"]) == (1, 100, 0.5, 0.99)
    assert top["queue_mean_s"] == pytest.approx(0.495)
    (quota,) = top["budget"]
    assert (quota["limit"], quota["max"], quota["remaining"]) == ("tokens_per_minute", 10_000, 7_500)
    assert 29 <= quota["resets_in_s"] <= 30
    assert rows[1]["sheds"] == {"QUEUE_FULL": 1} and rows[1]["queue_p50_s"] is None
    assert 'id="flow"' in PAGE and "s.flow.map" in PAGE


async def _until(condition) -> None:
    """Lets the loop run (no wall-clock wait: the clock is fake) until `condition` holds."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_the_late_binding_queue_counts_queue_length_time_and_sheds():
    core = core_with(("a", 3000))  # 3 s of work at the only pool
    binder = LateBinder(
        core, DispatchConfig(start_within_seconds=0.0, max_queued=2, shed_after_seconds={0: 10.0})
    )
    flow = core.metrics.flow.series("client/bob", 0)
    waiting = asyncio.create_task(binder.decide("m", list(range(32)), 0, tenant="client/bob", flow=flow))
    leaving = asyncio.create_task(binder.decide("m", list(range(40)), 0, tenant="client/bob", flow=flow))
    await _until(lambda: flow.queued == 2)  # both queued (the tasks ran to their wait)
    with pytest.raises(TenantRefusal):  # the queue is full: refused at the door, never queued
        await binder.decide("m", list(range(50)), 0, tenant="client/bob", flow=flow)
    assert flow.sheds == {"QUEUE_FULL": 1} and flow.queued == 2
    leaving.cancel()  # its client left: out of the queue, neither dispatched nor shed
    await asyncio.gather(leaving, return_exceptions=True)
    assert flow.queued == 1
    core.clock.set(NOW + 3.0)  # type: ignore[attr-defined]
    decision = await asyncio.wait_for(waiting, 5)
    assert decision.candidates[0].pool_id == "a"
    assert flow.queued == 0 and list(flow.recent) == [pytest.approx(3.0)]
    assert flow.sheds == {"QUEUE_FULL": 1}
    # a request queued past its class's shed_after is dropped: counted as OVERLOADED (the pool
    # holds the work just sent there, so it queues; the clock then jumps past its shed time)
    late = asyncio.create_task(binder.decide("m", list(range(60)), 100_000, tenant="client/bob", flow=flow))
    await _until(lambda: flow.queued == 1)
    core.clock.set(NOW + 14.0)  # type: ignore[attr-defined]
    with pytest.raises(TenantRefusal) as caught:
        await asyncio.wait_for(late, 5)
    assert caught.value.metadata["shed_reason"] == "OVERLOADED"
    assert flow.sheds == {"QUEUE_FULL": 1, "OVERLOADED": 1} and flow.queued == 0
    await binder.close()


def test_serve_takes_a_shed_time_per_class_and_refuses_a_bad_one(capsys):
    from globalrouter.cli import build_parser
    from globalrouter.serve_cli import _dispatch_config

    base = ["serve", "--discovery", "h:1", "--dispatch", "late"]
    args = build_parser().parse_args([*base, "--dispatch-shed-after", "0=2.5, 3=10"])
    config = _dispatch_config(args)
    assert config is not None and dict(config.shed_after_seconds) == {0: 2.5, 3: 10.0}
    args = build_parser().parse_args(base)
    assert dict(_dispatch_config(args).shed_after_seconds) == {}
    for bad in ("0", "x=1", "10=1", "0=-1", "0=nan"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, "--dispatch-shed-after", bad])
        assert "expected CLASS=SECONDS" in capsys.readouterr().err, bad


def test_serve_takes_reserved_pools_per_class_and_a_window_and_refuses_bad_ones(capsys):
    from globalrouter.cli import build_parser
    from globalrouter.serve_cli import _dispatch_config

    base = ["serve", "--discovery", "h:1", "--dispatch", "late"]
    args = build_parser().parse_args(
        [*base, "--dispatch-reserve", "0=2, 1=1", "--dispatch-reserve-window", "10"]
    )
    config = _dispatch_config(args)
    assert config is not None and dict(config.reserved_pools) == {0: 2, 1: 1}
    assert config.reserve_window_seconds == 10.0
    config = _dispatch_config(build_parser().parse_args(base))
    assert config is not None and dict(config.reserved_pools) == {} and config.reserve_window_seconds == 0.0
    for bad in ("0", "x=1", "10=1", "0=-1", "0=1.5"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, "--dispatch-reserve", bad])
        assert "expected CLASS=POOLS" in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--dispatch-reserve-window", "-1"])


async def test_a_budget_refusal_counts_in_the_tenants_class():
    from globalrouter.budgets import MemoryStore, TenantBudgets
    from globalrouter.policy import PolicyFile, parse
    from globalrouter.tenancy import TenantGate
    from meshkit.clock import FakeClock
    from meshkit.identity import Identity, Role

    clock = FakeClock(start=0.0, wall_offset=1_700_000_000.0)
    held = PolicyFile(None)
    held.current = parse('[identity."client/alice"]\npriority = 3\nrequests_per_minute = 1\n')
    metrics = RouterMetrics()
    gate = TenantGate(held, TenantBudgets(MemoryStore(clock), held.current.budget, clock), metrics)
    alice = Identity(Role.CLIENT, "alice")
    await gate.admit(alice, "m", 10, 10)
    with pytest.raises(TenantRefusal):
        await gate.admit(alice, "m", 10, 10)
    assert metrics.flow.series("client/alice", 3).budget_refusals == {"requests_per_minute": 1}
    assert samples(metrics, "globalrouter_flow_budget_refusals_total") == {
        key(tenant="client/alice", limit="requests_per_minute", **{"class": "3"}): 1
    }

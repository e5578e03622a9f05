"""Simulator with tenant budgets at arrival (`simulate(..., budgets=SimBudgets(...))`,
`simulate --tenant-policy FILE`): a request over its tenant's budget is refused by the same
`TenantBudgets` a frontend runs (counted, never queued nor served), on the trace's clock."""

from __future__ import annotations

import asyncio
import json

import pytest

from globalrouter.budgets import BudgetExceeded, MemoryStore, TenantBudgets
from globalrouter.cli import main
from globalrouter.dispatch import DispatchConfig
from globalrouter.policy import parse
from globalrouter.simulate import SimBudgets, SimConfig, simulate
from globalrouter.trace import TraceRequest, write_trace
from meshkit.clock import FakeClock

LIMIT = 5_000
POLICY = parse(
    f'[identity."client/flood"]\npriority = 0\ntokens_per_minute = {LIMIT}\n\n'
    '[identity."client/vip"]\npriority = 1\n'
)


def _trace(seconds: float, step: float, every_vip: int = 0) -> list[TraceRequest]:
    """One 100-token request (80 prompt + 20 output) every `step` seconds, distinct blocks; every
    `every_vip`-th of them vip's (0: none)."""
    n = round(seconds / step)
    return [TraceRequest(i * step, 80, 20, (i + 1,)) for i in range(n)] + [
        TraceRequest(i * step + step / 2, 80, 20, ((1 << 40) + i,))
        for i in range(n)
        if every_vip and i % every_vip == 0
    ]


def _sorted(trace: list[TraceRequest]) -> list[TraceRequest]:
    return sorted(trace, key=lambda r: r.arrival)


def _tenant(r: TraceRequest) -> str:
    return "client/vip" if r.hash_ids[0] >= 1 << 40 else "client/flood"


def _class(r: TraceRequest) -> int:
    return 1 if _tenant(r) == "client/vip" else 0


BUDGETS = SimBudgets(POLICY, _tenant)
CONFIG = SimConfig(pools=2, capacity_blocks=10_000, rate=100_000.0, timeline=True)


def test_requests_over_their_tenants_budget_are_refused_at_arrival_and_the_others_served():
    # 30 s of the flood at 1,000 tokens/s (12x its 5,000 tokens per minute) and vip's requests
    trace = _sorted(_trace(30.0, 0.1, every_vip=10))
    out = simulate(trace, CONFIG, "default", priority=_class, budgets=BUDGETS)
    # nothing leaves the 66 s horizon within 30 s: exactly the limit is admitted, the rest refused
    assert out.refused_by_class == {0: 300 - LIMIT // 100}
    assert out.refused == 250
    admitted = [a for a, _pool, _work in out.placements]
    assert len(admitted) == 50 + 30
    # the refused requests never reach a pool (work per pool counts the admitted ones only)
    assert sum(out.requests_per_pool) == 80
    assert set(out.wait_p99_by_class) == {0, 1}
    # without budgets everyone is served
    free = simulate(trace, CONFIG, "default", priority=_class)
    assert (free.refused, free.refused_by_class, sum(free.requests_per_pool)) == (0, {}, 330)


def test_the_admitted_flood_stays_within_its_limit_in_every_window_and_uses_most_of_it():
    trace = _trace(240.0, 0.1)  # 1,000 tokens/s for 4 minutes: 12x the limit
    out = simulate(trace, CONFIG, "default", budgets=BUDGETS)
    admitted = sorted(a for a, _pool, _work in out.placements)
    assert out.refused == len(trace) - len(admitted)
    for start in [i * 0.5 for i in range(int(240 / 0.5))]:
        tokens = 100 * sum(1 for a in admitted if start <= a < start + 60.0)
        assert tokens <= LIMIT, start
    # a steady tenant gets buckets / (buckets + 1) of its limit per window (budgets.py)
    assert len(admitted) * 100 >= 4 * LIMIT * 10 / 11 - 100


def test_the_simulator_admits_exactly_what_the_frontends_tenant_budgets_admits():
    trace = _sorted(_trace(150.0, 0.25, every_vip=4))
    out = simulate(trace, CONFIG, "default", priority=_class, budgets=BUDGETS)

    async def frontend() -> list[float]:
        clock = FakeClock(start=0.0, wall_offset=0.0)
        budgets = TenantBudgets(MemoryStore(clock), POLICY.budget, clock)
        admitted = []
        for r in trace:
            clock.set(r.arrival)
            tenant = _tenant(r)
            try:
                await budgets.admit(tenant, POLICY.entries[tenant], r.input_length + r.output_length)
            except BudgetExceeded:
                continue
            admitted.append(r.arrival)
        return admitted

    expected = asyncio.run(frontend())
    assert sorted(a for a, _pool, _work in out.placements) == expected
    assert out.refused == len(trace) - len(expected) > 0


def test_with_late_binding_a_refused_request_is_never_queued():
    trace = _sorted(_trace(30.0, 0.1, every_vip=10))
    late = simulate(
        trace,
        CONFIG,
        "default",
        dispatch=DispatchConfig(start_within_seconds=0.0, max_queue_seconds=1e9),
        priority=_class,
        budgets=BUDGETS,
    )
    early = simulate(trace, CONFIG, "default", priority=_class, budgets=BUDGETS)
    assert late.refused_by_class == early.refused_by_class == {0: 250}
    assert late.shed == 0 and sum(late.requests_per_pool) == 80
    # the share's ideal counts only the requests served (the refused are in no figure)
    assert late.ideal_hit_rate == early.ideal_hit_rate


def test_cli_tenant_policy(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace(20.0, 0.1))
    policy = tmp_path / "policy.toml"
    policy.write_text(f"[identity.unchecked]\ntokens_per_minute = {LIMIT}\n")
    assert main(["simulate", "--trace", str(trace), "--tenant-policy", str(policy), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["refused"], out["requests"]) == (150, 200)
    assert (
        main(
            [
                "simulate",
                "--trace",
                str(trace),
                "--dispatch",
                "late",
                "--tenant-policy",
                str(policy),
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["refused"] == 150


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[identity.unchecked]\ntokens_per_minute = -1\n", "tokens_per_minute must be a whole number"),
        ("x = 1\n", "unknown top-level key 'x'"),
    ],
)
def test_cli_refuses_a_bad_tenant_policy_naming_the_file_and_key(tmp_path, capsys, text, message):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace(1.0, 0.1))
    policy = tmp_path / "bad.toml"
    policy.write_text(text)
    assert main(["simulate", "--trace", str(trace), "--tenant-policy", str(policy)]) == 2
    err = capsys.readouterr().err
    assert str(policy) in err and message in err, err

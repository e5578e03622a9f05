"""Simulator: the issue-5 pool model on hand-made traces with exact hits and waits, every
policy, the JSON of `globalrouter simulate`, and trace loading errors."""

from __future__ import annotations

import json

import pytest

from globalrouter.cli import main
from globalrouter.policies import POLICIES
from globalrouter.selection import SelectionConfig
from globalrouter.simulate import LruCache, SimConfig, simulate
from globalrouter.trace import (
    SyntheticTraceSpec,
    TraceError,
    TraceRequest,
    load_trace,
    synthetic_trace,
    write_trace,
)
from globalrouter.wait_slo import WaitSlo

TINY = [
    TraceRequest(0.0, 1024, 10, (1, 2)),  # miss; work 1024 + 40 -> busy until 1.064
    TraceRequest(0.5, 1536, 0, (1, 2, 3)),  # hit 2; work 512; starts at 1.064 (wait 0.564)
    TraceRequest(2.0, 1500, 5, (4, 5, 6)),  # miss; evicts 1 and 2 (LRU of 4); work 1520
    TraceRequest(3.0, 600, 1, (1, 7)),  # miss (1 evicted); starts at 3.52 (wait 0.52)
]


def test_pool_model_exact_hits_and_waits():
    r = simulate(TINY, SimConfig(pools=1, capacity_blocks=4, rate=1000.0), "round_robin")
    assert r.requests == 4
    assert r.hit_rate == pytest.approx(2 / 10)
    assert r.ideal_hit_rate == pytest.approx(2 / 10)
    assert r.share_of_ideal == pytest.approx(1.0)
    assert r.work_per_pool == [pytest.approx(1064 + 512 + 1520 + 604)]
    assert r.imbalance == pytest.approx(1.0)
    # waits 0, 0.564, 0, 0.52 -> linear-interpolated percentiles
    assert r.wait_p50 == pytest.approx(0.26)
    assert r.wait_p99 == pytest.approx(0.52 + 0.97 * 0.044)
    assert r.wait_mean == pytest.approx((0.564 + 0.52) / 4)


def test_two_pools_round_robin_split_the_cache_and_ideal_does_not():
    trace = [
        TraceRequest(0.0, 1024, 0, (1, 2)),
        TraceRequest(1.0, 1024, 0, (1, 2)),  # goes to the other pool: miss
        TraceRequest(2.0, 1024, 0, (1, 2)),  # back to the first: hit 2
    ]
    r = simulate(trace, SimConfig(pools=2, capacity_blocks=2, rate=1000.0), "round_robin")
    assert r.hit_rate == pytest.approx(2 / 6)
    assert r.ideal_hit_rate == pytest.approx(4 / 6)
    assert r.share_of_ideal == pytest.approx(0.5)
    assert r.requests_per_pool == [2, 1]
    assert r.work_per_pool == [1024 + 0, 1024]
    assert r.imbalance == pytest.approx(1.0)


def test_lru_inserts_in_list_order_and_reports_net_transitions():
    cache = LruCache(4)
    cache.insert([1, 2, 3, 4, 5])  # longer than the cache: its own first block goes
    assert list(cache.blocks) == [2, 3, 4, 5]
    stored, removed = cache.take_transitions()
    # 1 came and went within the batch: in neither list (net transitions, as a relay sends)
    assert sorted(stored) == [2, 3, 4, 5] and removed == []
    cache.insert([2, 9])  # 2 becomes most recent, 3 is evicted
    assert list(cache.blocks) == [4, 5, 2, 9]
    assert cache.take_transitions() == ([9], [3])
    assert cache.prefix_hit([4, 5, 7]) == 2 and cache.prefix_hit([7, 4]) == 0


def test_default_policy_keeps_prefixes_together_through_the_real_selector():
    # Two prefixes in the pattern A A B B A A B B ..., spaced beyond the KV and load intervals:
    # the Selector (fed by KvIndex deltas and load reports) sends each prefix back to the pool
    # holding it, so only the first request of each prefix misses; round robin misses four times.
    a, b = (100, 101, 102, 103), (200, 201, 202, 203)
    trace = [TraceRequest(float(i), 2048, 1, a if (i // 2) % 2 == 0 else b) for i in range(20)]
    cfg = SimConfig(pools=2, capacity_blocks=100, rate=100_000.0)
    default = simulate(trace, cfg, "default")
    assert default.hit_rate == pytest.approx((20 - 2) * 4 / 80)
    assert default.share_of_ideal == pytest.approx(1.0)
    assert simulate(trace, cfg, "round_robin").hit_rate == pytest.approx((20 - 4) * 4 / 80)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs(policy):
    trace = synthetic_trace(SyntheticTraceSpec(requests=300, seed=5))
    r = simulate(trace, SimConfig(pools=4, capacity_blocks=500, rate=20_000.0), policy)
    assert r.requests == 300 and sum(r.requests_per_pool) == 300
    assert 0.0 <= r.hit_rate <= 1.0 and 0.0 <= r.wait_p50 <= r.wait_p99
    assert r.imbalance >= 1.0


def test_simulate_json_fields_present_and_consistent(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, synthetic_trace(SyntheticTraceSpec(requests=200, seed=9)))
    argv = ["simulate", "--trace", str(path), "--pools", "3", "--pool-capacity-blocks", "300"]
    assert main([*argv, "--pool-rate", "15000", "--policy", "dynamo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "requests",
        "hit_rate",
        "ideal_hit_rate",
        "share_of_ideal",
        "wait_p50",
        "wait_p99",
        "imbalance",
    ):
        assert key in out
    assert out["requests"] == 200 and out["policy"] == "dynamo"
    assert out["share_of_ideal"] == pytest.approx(out["hit_rate"] / out["ideal_hit_rate"])
    assert out["imbalance"] == pytest.approx(max(out["work_per_pool"]) * 3 / sum(out["work_per_pool"]))
    assert main([*argv, "--policy", "all", "--json"]) == 0
    many = json.loads(capsys.readouterr().out)
    assert [m["policy"] for m in many] == list(POLICIES)
    assert main([*argv, "--policy", "default"]) == 0
    assert "share" in capsys.readouterr().out


def test_trace_errors_name_the_line_and_field(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": -3, "output_length": 1, "hash_ids": [1]}\n'
    )
    with pytest.raises(TraceError, match=r"bad.jsonl:2: field 'input_length'"):
        load_trace(bad)
    assert main(["simulate", "--trace", str(bad)]) == 2
    assert "input_length" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(bad), "--pools", "0"])


def test_simulate_wait_slo_flag_runs_the_steered_selector(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    trace = synthetic_trace(SyntheticTraceSpec(requests=300, seed=9))
    write_trace(path, trace)
    argv = ["simulate", "--trace", str(path), "--pools", "3", "--pool-capacity-blocks", "300"]
    assert main([*argv, "--pool-rate", "15000", "--wait-slo", "0.2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = SimConfig(pools=3, capacity_blocks=300, rate=15_000.0)
    steered = simulate(load_trace(path), cfg, "default", SelectionConfig(wait_slo=WaitSlo(0.2)))
    assert (out["hit_rate"], out["wait_p99"]) == (steered.hit_rate, steered.wait_p99)

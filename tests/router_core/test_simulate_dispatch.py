"""Simulator with late binding (`simulate --dispatch late`): the frontend's queue time counts in
the wait, a queue that never holds places exactly as early binding does, a freed pool goes to
the queued request whose prefix it holds, and the CLI."""

from __future__ import annotations

import json

import pytest

from globalrouter.cli import main
from globalrouter.dispatch import DispatchConfig
from globalrouter.simulate import SimConfig, simulate
from globalrouter.trace import SyntheticTraceSpec, TraceRequest, synthetic_trace, write_trace

NEVER_HOLD = DispatchConfig(start_within_seconds=1e9, affinity_hold_seconds=1e9, max_queue_seconds=1e9)


def test_a_queue_that_never_holds_places_exactly_as_early_binding():
    trace = synthetic_trace(SyntheticTraceSpec(seed=5, requests=400))
    config = SimConfig(pools=4, capacity_blocks=200, rate=8000.0, timeline=True)
    early = simulate(trace, config, "default")
    late = simulate(trace, config, "default", dispatch=NEVER_HOLD)
    assert late.policy == "default (late)"
    assert late.placements == early.placements
    assert (late.hit_rate, late.wait_p99, late.shed, late.queue_p99) == (
        early.hit_rate,
        early.wait_p99,
        0,
        0.0,
    )


def test_the_wait_counts_the_time_in_the_frontend_queue():
    trace = [
        TraceRequest(0.0, 1000, 0, (1, 2)),  # busy until 1.0
        TraceRequest(0.5, 100, 0, (3,)),  # queued at the frontend until 1.0
    ]
    config = SimConfig(pools=1, capacity_blocks=10, rate=1000.0)
    early = simulate(trace, config, "default")
    late = simulate(trace, config, "default", dispatch=DispatchConfig(start_within_seconds=0.0))
    assert late.wait_p99 == pytest.approx(early.wait_p99)
    assert late.wait_mean == pytest.approx(0.25)
    assert late.queue_p99 == pytest.approx(0.5 * 0.99)


def test_a_freed_pool_goes_to_the_request_whose_prefix_it_holds():
    # Pools A and B are busy until 2.048 s (one 2,048-token prompt each). At 0.1 s an uncached
    # 500-token request arrives, at 0.2 s the follow-up of A's prompt (its 4 blocks + 1).
    # Early binding commits the uncached one at 0.1 s to A (ties go by hash), so the follow-up
    # waits behind it there (or would lose its hit at B). Late binding holds both; when the pools
    # free, A goes to the follow-up (it saves 2,048 tokens there) and B to the uncached one.
    trace = [
        TraceRequest(0.0, 2048, 0, (1, 2, 3, 4)),
        TraceRequest(0.0, 2048, 0, (20, 21, 22, 23)),
        TraceRequest(0.1, 500, 0, (30,)),
        TraceRequest(0.2, 2560, 0, (1, 2, 3, 4, 5)),
    ]
    config = SimConfig(pools=2, capacity_blocks=100, rate=1000.0, kv_interval=0.05, timeline=True)
    early = simulate(trace, config, "default")
    late = simulate(
        trace,
        config,
        "default",
        dispatch=DispatchConfig(start_within_seconds=0.0, affinity_hold_seconds=10.0),
    )
    holder = early.placements[0][1]
    assert early.placements[2][1] == holder  # the uncached request took the holder's queue
    by_arrival = {arrival: pool for arrival, pool, _ in late.placements}
    assert by_arrival[0.2] == holder and by_arrival[0.1] != holder
    assert late.hit_rate == early.hit_rate == pytest.approx(4 / 14)
    # the follow-up starts at 2.048 instead of 2.548; the uncached one at 2.048 instead of 2.048
    assert late.wait_mean == pytest.approx(early.wait_mean - 0.5 / 4)
    assert late.wait_p99 < early.wait_p99


def test_cli_dispatch_late(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, synthetic_trace(SyntheticTraceSpec(seed=5, requests=200)))
    assert main(["simulate", "--trace", str(path), "--dispatch", "late", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "default (late)" and out["requests"] == 200 and "queue_p99" in out
    assert main(["simulate", "--trace", str(path), "--dispatch", "late", "--policy", "all", "--json"]) == 0
    names = [r["policy"] for r in json.loads(capsys.readouterr().out)]
    assert names[-1] == "default (late)" and "dynamo" in names
    assert main(["simulate", "--trace", str(path), "--dispatch", "late", "--policy", "dynamo"]) == 2
    assert "default policy only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(path), "--dispatch", "late", "--affinity-hold", "-1"])


def test_dispatch_with_another_policy_is_refused():
    with pytest.raises(ValueError, match="default policy only"):
        simulate([TraceRequest(0.0, 10, 0, (1,))], SimConfig(), "dynamo", dispatch=DispatchConfig())


def test_a_higher_class_overtakes_the_queue_and_a_bounded_queue_sheds_the_lower():
    # one pool, 1 s per request; 6 class-0 requests at 0 s, one class-1 request at 0.5 s
    low = [TraceRequest(0.0, 1000, 0, (k,)) for k in range(1, 7)]
    high = TraceRequest(0.5, 1000, 0, (99,))
    trace = [*low, high]
    config = SimConfig(pools=1, capacity_blocks=100, rate=1000.0)

    def prio(r: TraceRequest) -> int:
        return 1 if r is high else 0

    early = simulate(trace, config, "default", priority=prio)
    assert early.wait_p99_by_class[1] == pytest.approx(5.5)  # behind all six
    late = simulate(
        trace, config, "default", dispatch=DispatchConfig(start_within_seconds=0.0), priority=prio
    )
    assert late.wait_p99_by_class[1] == pytest.approx(0.5)  # next when the pool frees at 1 s
    assert late.shed == 0
    bounded = simulate(
        trace,
        config,
        "default",
        dispatch=DispatchConfig(start_within_seconds=0.0, max_queued=3),
        priority=prio,
    )
    # the first is sent at once, 3 queue, 2 are refused (QUEUE_FULL); then class 1 displaces one
    assert bounded.shed_by_class == {0: 3}
    assert bounded.requests - bounded.shed == 4
    assert bounded.wait_p99_by_class[1] == pytest.approx(0.5)
    # the ideal is that of the requests served (all misses here)
    assert bounded.ideal_hit_rate == 0.0 and bounded.share_of_ideal == 1.0


def test_cli_dispatch_placement_match(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, synthetic_trace(SyntheticTraceSpec(seed=5, requests=200)))
    argv = ["simulate", "--trace", str(path), "--dispatch", "late", "--json"]
    assert main([*argv, "--dispatch-placement", "match", "--wait-slo", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "default (late)" and out["requests"] == 200 and out["shed"] == 0
    with pytest.raises(SystemExit):
        main([*argv, "--dispatch-placement", "best"])


def test_serve_takes_the_dispatch_placement():
    from globalrouter.cli import build_parser
    from globalrouter.serve_cli import _dispatch_config

    base = ["serve", "--discovery", "h:1", "--dispatch", "late"]
    config = _dispatch_config(build_parser().parse_args(base))
    assert config is not None and config.placement == "rank"
    config = _dispatch_config(build_parser().parse_args([*base, "--dispatch-placement", "match"]))
    assert config is not None and config.placement == "match"
    # under a wait SLO the queue's timing follows it, for the placement
    config = _dispatch_config(
        build_parser().parse_args([*base, "--dispatch-placement", "match", "--wait-slo", "2"])
    )
    assert config is not None
    assert (config.placement, config.start_within_seconds, config.affinity_hold_seconds) == (
        "match",
        0.4,
        4.0,
    )


def test_serve_and_simulate_take_the_dispatch_order(tmp_path, capsys):
    from globalrouter.cli import build_parser
    from globalrouter.serve_cli import _dispatch_config

    base = ["serve", "--discovery", "h:1", "--dispatch", "late", "--wait-slo", "2"]
    config = _dispatch_config(build_parser().parse_args(base))
    assert config is not None and config.late_after_seconds == 0.0  # fifo unless asked
    config = _dispatch_config(build_parser().parse_args([*base, "--dispatch-order", "deadline"]))
    assert config is not None
    assert (config.late_after_seconds, config.start_within_seconds, config.affinity_hold_seconds) == (
        2.0,
        0.4,
        3.4,
    )
    with pytest.raises(ValueError, match="--dispatch-order deadline needs --wait-slo"):
        _dispatch_config(
            build_parser().parse_args(
                ["serve", "--discovery", "h:1", "--dispatch", "late", "--dispatch-order", "deadline"]
            )
        )
    path = tmp_path / "t.jsonl"
    write_trace(path, synthetic_trace(SyntheticTraceSpec(seed=5, requests=200)))
    argv = ["simulate", "--trace", str(path), "--dispatch", "late", "--json", "--dispatch-order", "deadline"]
    assert main([*argv, "--wait-slo", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "default (late)" and out["requests"] == 200
    assert main(argv) == 2
    assert "--dispatch-order deadline needs --wait-slo" in capsys.readouterr().err


def test_serve_and_simulate_take_the_slo_feedback(tmp_path, capsys):
    from globalrouter.cli import build_parser
    from globalrouter.serve_cli import _dispatch_config
    from globalrouter.wait_slo import SloFeedback

    base = ["serve", "--discovery", "h:1", "--dispatch", "late"]
    config = _dispatch_config(build_parser().parse_args([*base, "--wait-slo", "2"]))
    assert config is not None and config.slo_feedback is None  # off unless asked
    config = _dispatch_config(
        build_parser().parse_args([*base, "--wait-slo", "2", "--dispatch-slo-feedback"])
    )
    assert config is not None and config.slo_feedback == SloFeedback(2.0)
    with pytest.raises(ValueError, match="--dispatch-slo-feedback needs --wait-slo"):
        _dispatch_config(build_parser().parse_args([*base, "--dispatch-slo-feedback"]))
    path = tmp_path / "t.jsonl"
    write_trace(path, synthetic_trace(SyntheticTraceSpec(seed=5, requests=200)))
    argv = ["simulate", "--trace", str(path), "--dispatch", "late", "--json", "--dispatch-slo-feedback"]
    assert main([*argv, "--wait-slo", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 200
    assert main(argv) == 2
    assert "--dispatch-slo-feedback needs --wait-slo" in capsys.readouterr().err

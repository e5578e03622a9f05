"""bench_replay's mode plumbing (no mesh): the flags the frontend and the simulator get, the
combinations it refuses, the results file per mode and the live wait from the replay's outcomes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import bench_replay
from globalrouter.cli import build_parser
from globalrouter.simulate import late_dispatch_config
from meshlaunch.mesh import router_argv

CONV = bench_replay.TRACE.with_name("mooncake_conversation_first_half.jsonl")


def args_of(*argv: str, trace: Path = bench_replay.TRACE) -> argparse.Namespace:
    return bench_replay.parse_args(["--trace", str(trace), *argv])


def serve_args(flags: list[str]):
    """`globalrouter serve` parses the frontend flags as the bench starts it."""
    return build_parser().parse_args(router_argv("127.0.0.1:1", "127.0.0.1:2", *flags)[1:])


def simulate_args(argv: list[str]):
    """`globalrouter simulate` parses the argv the bench runs."""
    return build_parser().parse_args(argv[1:])


def test_late_binding_reaches_the_frontend_and_the_simulator_with_the_slo_in_each_ones_seconds():
    args = args_of(
        "--speedup", "4", "--dispatch", "late", "--dispatch-order", "deadline", "--dispatch-slo-feedback"
    )
    front = serve_args(bench_replay.frontend_flags(args, 3.6))
    assert front.dispatch == "late"
    assert front.dispatch_placement == "rank"
    assert front.dispatch_order == "deadline"
    assert front.dispatch_slo_feedback
    assert front.wait_slo == pytest.approx(0.9)  # T / S: real seconds
    sim = simulate_args(bench_replay.simulate_argv(args, Path("capped.jsonl"), "all", 3.6))
    assert sim.policy == "all"
    assert sim.wait_slo == pytest.approx(3.6)  # trace seconds
    assert (sim.dispatch, sim.dispatch_placement, sim.dispatch_order) == ("late", "rank", "deadline")
    assert sim.dispatch_slo_feedback
    assert sim.load_interval == pytest.approx(bench_replay.RELAY_REPORT_INTERVAL * 4)
    config = late_dispatch_config(sim)  # the simulator accepts the combination
    assert config.slo_feedback
    assert config.late_after_seconds == pytest.approx(3.6)


def test_match_placement_and_late_binding_without_an_slo():
    args = args_of("--dispatch", "late", "--dispatch-placement", "match")
    front = serve_args(bench_replay.frontend_flags(args, None))
    assert (front.dispatch, front.dispatch_placement, front.wait_slo) == ("late", "match", None)
    sim = simulate_args(bench_replay.simulate_argv(args, Path("capped.jsonl"), "all", None))
    assert (sim.dispatch, sim.dispatch_placement, sim.wait_slo) == ("late", "match", None)


def test_early_binding_gives_the_frontend_no_dispatch_flags():
    args = args_of("--wait-slo", "0.6")
    assert bench_replay.frontend_flags(args, 0.6) == ["--wait-slo", "0.15"]
    assert bench_replay.frontend_flags(args_of(), None) == []
    sim = simulate_args(bench_replay.simulate_argv(args, Path("capped.jsonl"), "all", 0.6))
    assert (sim.dispatch, sim.wait_slo) == ("early", pytest.approx(0.6))


def test_the_dynamo_run_that_sets_the_target_takes_none_of_the_modes_flags():
    args = args_of("--wait-slo", "dynamo", "--dispatch", "late", "--dispatch-order", "deadline")
    assert args.wait_slo == bench_replay.DYNAMO
    argv = bench_replay.simulate_argv(args, Path("capped.jsonl"), "dynamo", None)
    sim = simulate_args(argv)
    assert (sim.policy, sim.dispatch, sim.wait_slo, sim.dispatch_order) == ("dynamo", "early", None, "fifo")


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--dispatch-order", "deadline", "--wait-slo", "1"], "--dispatch-order need --dispatch late"),
        (["--dispatch-slo-feedback", "--wait-slo", "1"], "--dispatch-slo-feedback need --dispatch late"),
        (["--dispatch-placement", "match"], "--dispatch-placement need --dispatch late"),
        (
            ["--dispatch", "late", "--dispatch-order", "deadline"],
            "--dispatch-order deadline needs --wait-slo",
        ),
        (["--dispatch", "late", "--dispatch-slo-feedback"], "--dispatch-slo-feedback needs --wait-slo"),
    ],
)
def test_bad_combinations_are_refused_naming_the_flag(argv, error, capsys):
    assert error in (bench_replay.check_args(args_of(*argv)) or "")
    # main refuses before it starts anything
    assert bench_replay.main(["--trace", str(bench_replay.TRACE), *argv]) == 2
    assert error in capsys.readouterr().err


def test_a_missing_trace_and_a_bad_target_are_refused(tmp_path, capsys):
    missing = tmp_path / "none.jsonl"
    assert bench_replay.main(["--trace", str(missing)]) == 2
    assert f"trace not found: {missing}" in capsys.readouterr().err
    for bad in ("0", "-1", "fast"):
        with pytest.raises(SystemExit):
            bench_replay.parse_args(["--wait-slo", bad])
    with pytest.raises(SystemExit):
        bench_replay.parse_args(["--dispatch-order", "lifo"])


def test_each_mode_writes_its_own_results_file_and_the_existing_ones_keep_their_names():
    results = bench_replay.RESULT.parent
    assert bench_replay.result_path(args_of()) == results / "bench_replay.md"
    assert bench_replay.result_path(args_of("--wait-slo", "0.6")) == results / "bench_replay_wait_slo.md"
    modes = [
        args_of("--wait-slo", "dynamo", trace=CONV),
        args_of("--wait-slo", "dynamo", "--dispatch", "late", trace=CONV),
        args_of("--wait-slo", "dynamo", "--dispatch", "late", "--dispatch-order", "deadline", trace=CONV),
        args_of(
            "--wait-slo",
            "dynamo",
            "--dispatch",
            "late",
            "--dispatch-order",
            "deadline",
            "--dispatch-slo-feedback",
            trace=CONV,
        ),
        args_of("--wait-slo", "dynamo", "--dispatch", "late"),
    ]
    names = [bench_replay.result_path(a).name for a in modes]
    assert names == [
        "bench_replay_wait_slo_dynamo_conversation.md",
        "bench_replay_late_rank_wait_slo_dynamo_conversation.md",
        "bench_replay_late_rank_deadline_wait_slo_dynamo_conversation.md",
        "bench_replay_late_rank_deadline_feedback_wait_slo_dynamo_conversation.md",
        "bench_replay_late_rank_wait_slo_dynamo.md",
    ]
    assert bench_replay.result_path(args_of("--result", "/tmp/x.md")) == Path("/tmp/x.md")


def test_live_wait_is_first_token_from_arrival_less_the_mockers_time_from_start(tmp_path):
    from globalrouter.trace import TraceRequest

    trace = [TraceRequest(0.0, 2048, 16, (1, 2, 3, 4)), TraceRequest(1.0, 1024, 16, (1, 2))]
    outcomes = tmp_path / "outcomes.jsonl"
    outcomes.write_text(
        "\n".join(
            json.dumps(o)
            for o in (
                # 64 of 128 mesh blocks cached: 1,024 tokens to prefill
                {"index": 0, "code": "OK", "ttft": 0.4, "lag": 0.1, "cached_blocks": 64},
                {"index": 1, "code": "DEADLINE_EXCEEDED", "ttft": None, "lag": 0.0, "cached_blocks": 0},
            )
        )
    )
    waits, ttfts = bench_replay.live_waits(trace, outcomes, rate=10_000, speedup=4)
    # (0.1 + 0.4) x 4 = 2.0 trace s to first token; prefill 1,024 / 10,000; one decode interval
    # 20,000 / (50 x 10,000) = 0.04 (the mocker's speed-up R x S / 20,000 cancels out)
    assert ttfts == [pytest.approx(2.0)]
    assert waits == [pytest.approx(2.0 - 0.1024 - 0.04)]


def test_the_live_dynamo_baseline_runs_the_dynamo_ranking_without_the_modes_flags():
    args = args_of("--wait-slo", "dynamo", "--dispatch", "late", "--live-dynamo", trace=CONV)
    front = serve_args(bench_replay.DYNAMO_FRONTEND)
    assert (front.ranking, front.wait_slo, front.dispatch) == ("dynamo", None, "early")
    sim = simulate_args(bench_replay.simulate_argv(args, Path("capped.jsonl"), "default", None, "dynamo"))
    assert (sim.policy, sim.ranking, sim.wait_slo, sim.dispatch) == ("default", "dynamo", None, "early")
    assert (
        bench_replay.result_path(args).name
        == "bench_replay_late_rank_wait_slo_dynamo_conversation_live_dynamo.md"
    )
    assert bench_replay.command_line(args).endswith("--live-dynamo")


def test_the_goal_is_judged_live_against_the_live_dynamo_runs():
    def run(share, p99):
        return {"share_of_ideal": share}, {"wait_p99": p99, "wait_p50": 0.1, "ttft_p99": p99 + 1}

    sim = {"share_of_ideal": 0.84, "wait_p99": 3.6}
    mode = [run(0.96, 6.0), run(0.95, 6.4)]
    lines = bench_replay.live_dynamo_lines(
        mode, [run(0.83, 6.5), run(0.85, 6.3)], sim, sim, 0.95, "conversation"
    )
    text = "\n".join(lines)
    assert "| 1 | 0.9600 / 6.000 | 0.8300 / 6.500 |" in text
    assert "live against live dynamo on the same host: met (share met, p99 met" in text
    slower = bench_replay.live_dynamo_lines(
        mode, [run(0.83, 5.0), run(0.85, 5.2)], sim, sim, 0.95, "conversation"
    )
    assert "host: not met (share met, p99 not met" in "\n".join(slower)


def test_a_target_from_the_live_dynamo_run_comes_first_and_sets_the_modes_slo(monkeypatch, tmp_path):
    args = args_of("--wait-slo", "live-dynamo", "--requests", "3", "--runs", "2", trace=CONV)
    assert args.live_dynamo  # implied
    assert bench_replay.result_path(args).name == "bench_replay_wait_slo_live_dynamo_conversation.md"
    assert "--wait-slo live-dynamo" in bench_replay.command_line(args)
    started: list[list[str]] = []
    p99s = iter([8.0, 4.0, 7.0, 5.0])  # dynamo-0, mode-0, dynamo-1, mode-1

    def live_run(args, speedup, outcomes, flags):
        started.append(flags)
        return {"share_of_ideal": 0.9, "ok": 3, "requests": 3, "errors": {}, "lag_p99": 0.0, "ttft_p50": 0.1}

    def placement_split(*a):
        return {
            "model_share": 0.9,
            "misses": 0,
            "lost_share": 0.0,
            "known": 0,
            "holder_wait": 0.0,
            "chosen_wait": 0.0,
        }

    sims: list[list[str]] = []

    def run_json(argv, timeout):
        sims.append(argv)
        row = {"hit_rate": 0.1, "share_of_ideal": 0.8, "wait_p99": 3.0}
        return (
            row | {"policy": "default"}
            if "--ranking" in argv
            else [row | {"policy": p} for p in ("default", "dynamo")]
        )

    monkeypatch.setattr(bench_replay, "live_run", live_run)
    monkeypatch.setattr(bench_replay, "placement_split", placement_split)
    monkeypatch.setattr(bench_replay, "live_waits", lambda *a: ([next(p99s)], [1.0]))
    monkeypatch.setattr(bench_replay, "run_json", run_json)
    monkeypatch.setattr(bench_replay, "RESULT", tmp_path / "bench_replay.md")
    assert (
        bench_replay.main(
            ["--trace", str(CONV), "--wait-slo", "live-dynamo", "--requests", "3", "--runs", "2"]
        )
        == 0
    )
    # dynamo first, then the mode under T = that run's p99 (8 trace s, the frontend T / S = 2 real s)
    assert started[0] == bench_replay.DYNAMO_FRONTEND
    assert (
        started[1] == ["--wait-slo", "2"] and started[2] == bench_replay.DYNAMO_FRONTEND and len(started) == 4
    )
    sim_all = next(a for a in sims if "all" in a)
    assert sim_all[sim_all.index("--wait-slo") + 1] == "8"
    text = (tmp_path / "bench_replay_wait_slo_live_dynamo_conversation.md").read_text()
    assert "T = 8.000 trace seconds, the wait p99 of the first live dynamo run" in text
    assert "live dynamo 0.9000 / 7.500 s" in text  # the mean of both dynamo runs


def test_routed_prefixes_reach_the_modes_frontend_and_simulator_only():
    args = args_of("--wait-slo", "dynamo", "--routed-prefix-ttl", "10", "--speedup", "4", "--live-dynamo")
    front = serve_args(bench_replay.frontend_flags(args, 3.6))
    assert front.routed_prefix_ttl == pytest.approx(2.5)  # T / S: real seconds
    sim = simulate_args(bench_replay.simulate_argv(args, Path("capped.jsonl"), "all", 3.6))
    assert sim.routed_prefix_ttl == pytest.approx(10)
    for argv in (
        bench_replay.simulate_argv(args, Path("capped.jsonl"), "dynamo", None),
        bench_replay.simulate_argv(args, Path("capped.jsonl"), "default", None, "dynamo"),
    ):
        assert simulate_args(argv).routed_prefix_ttl == 0
    assert serve_args(bench_replay.DYNAMO_FRONTEND).routed_prefix_ttl == 0
    assert bench_replay.result_path(args).name == "bench_replay_wait_slo_dynamo_routed_live_dynamo.md"
    assert "routed prefixes 10 s" in bench_replay.mode_label(args)

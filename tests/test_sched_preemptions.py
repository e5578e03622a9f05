"""bench.sched_preemptions: a thread's preemptions (not its blocking) are counted per preempting task."""

from __future__ import annotations

from bench.sched_preemptions import waits


def _switch(t: float, prev: int, state: str, nxt: int, comm: str = "sim") -> str:
    return (
        f"  perf 1 [000] {t:.6f}: sched:sched_switch: prev_comm=x prev_pid={prev} prev_prio=120 "
        f"prev_state={state} ==> next_comm={comm} next_pid={nxt} next_prio=120"
    )


def test_only_preemptions_count_and_each_wait_lasts_until_the_thread_runs_again():
    lines = [
        _switch(1.000, 10, "R", 20),  # preempted by sim 20
        _switch(1.004, 20, "S", 10),  # back after 4 ms
        _switch(2.000, 10, "S", 30, "engine"),  # blocked (waits for I/O or the GIL): not counted
        _switch(2.500, 30, "S", 10),
        _switch(3.000, 10, "R+", 30, "engine"),  # preempted by engine 30
        _switch(3.001, 30, "S", 40, "other"),  # another task runs before it: still waiting
        _switch(3.003, 40, "S", 10),  # back after 3 ms
        "not a switch line",
    ]
    got = waits(lines, "10")
    assert set(got) == {"sim 20", "engine 30"}
    assert [round(w, 6) for w in got["sim 20"]] == [0.004]
    assert [round(w, 6) for w in got["engine 30"]] == [0.003]

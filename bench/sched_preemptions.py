"""Who takes the CPU from a thread that was running (preempted, not blocked), and how long it waits to run again.

Reads the text of `perf script` over `sched:sched_switch` events, e.g. of a bench frontend's loop
thread (its TID is the process id) in bench_scale's steady window (BENCHMARKS.md, "Loop lag at
1,000 pools: the collector on a timer, telemetry in 2 ms slices"):

    perf record -e sched:sched_switch -a -o sched.data -- sleep 10
    perf script -i sched.data > sched.txt
    python -m bench.sched_preemptions sched.txt TID

Prints the preemptions, the waits until the thread ran again (p50, p99, max, sum) and, per
preempting task (comm and TID), how many and how long the thread waited after them.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

SWITCH = re.compile(
    r"\s(\d+\.\d+):\s+sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=\d+ "
    r"prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)"
)


def waits(lines, tid: str) -> dict[str, list[float]]:
    """Per preempting task ("comm tid"), the seconds `tid` waited after each preemption by it."""
    out: dict[str, list[float]] = defaultdict(list)
    by: str | None = None
    since = 0.0
    for line in lines:
        m = SWITCH.search(line)
        if not m:
            continue
        t, _, prev, state, next_comm, nxt = m.groups()
        if prev == tid and state.startswith("R"):  # still runnable: preempted
            by, since = f"{next_comm} {nxt}", float(t)
        elif nxt == tid and by is not None:
            out[by].append(float(t) - since)
            by = None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("script", help="the text of `perf script` over sched:sched_switch events")
    p.add_argument("tid", help="the thread's id (a process's main thread: its pid)")
    a = p.parse_args()
    with open(a.script) as f:
        per = waits(f, a.tid)
    every = sorted(w for ws in per.values() for w in ws)
    if not every:
        print("no preemption of", a.tid)
        return
    n = len(every)
    print(
        f"{n} preemptions; waits until it ran again: p50 {every[n // 2] * 1e3:.2f} ms, "
        f"p99 {every[min(n - 1, int(n * 0.99))] * 1e3:.2f} ms, max {every[-1] * 1e3:.2f} ms, "
        f"{sum(every) * 1e3:.0f} ms in all"
    )
    for who, ws in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(
            f"  {who:32s} {len(ws):6d} preemptions, {sum(ws) * 1e3:7.1f} ms waited, longest {max(ws) * 1e3:6.2f} ms"
        )


if __name__ == "__main__":
    main()

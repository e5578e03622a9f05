"""What the serving loop's long turns are made of, in a bench's frontend: put this directory first on PYTHONPATH.

Active in a process with LOOP_TURNS_ARGV (default `--max-telemetry-streams`: the frontend that
bench_scale starts) among its arguments. From LOOP_TURNS_FROM seconds after the start (default
60: past bench_scale's first load at 1,000 pools) for LOOP_TURNS_FOR seconds (default 50: inside
its 60 s steady window) it times every turn of the asyncio loop (from the selector's return to the
end of the turn's callbacks) and writes to LOOP_TURNS_OUT.<pid> (default /tmp/loop-turns.txt.<pid>)
every 5 s:
- turns by wall time (1 ms buckets from 4 ms);
- for the turns over 10 ms: their wall time, the loop thread's CPU time in them (the rest is the
  thread off its CPU: preempted, or waiting for the GIL), the collector's time in them, and the
  callbacks of over 1 ms they ran, by task name;
- the loop thread's involuntary context switches a second (preemptions);
- the collector's pauses by generation and the size of the young generation at every 7th
  young collection's start;
- KvSummary folds, wall and thread CPU.
It patches asyncio's pure-Python loop (`BaseEventLoop._run_once`, `Handle._run`), so the figures
carry its own overhead (two clock reads a callback). E.g. (BENCHMARKS.md, "Loop lag at 1,000
pools: the collector on a timer, telemetry in 2 ms slices"):

    PYTHONPATH=bench/loop_turns:. python -m bench.bench_scale --pools 1000 --blocks 10000 \\
        --rate 200 --skip relay,discovery --no-etcd --steady 60 --frontend-flag=--kv-state \\
        --frontend-flag=summary --frontend-flag=--telemetry-batch-interval --frontend-flag=1
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import Counter
from typing import Any

LONG = 0.01
"""Turns at least this long (seconds, wall) are broken down (the lag goal's bound)."""


def _install() -> None:
    out = os.environ.get("LOOP_TURNS_OUT", "/tmp/loop-turns.txt") + f".{os.getpid()}"
    start = time.monotonic() + float(os.environ.get("LOOP_TURNS_FROM", "60"))
    until = start + float(os.environ.get("LOOP_TURNS_FOR", "50"))
    pc, cpu = time.perf_counter, time.thread_time
    turns: Counter[int] = Counter()
    long_cb: Counter[str] = Counter()
    st: dict[str, Any] = {"on": False, "t0": 0.0, "c0": 0.0, "gc": 0.0, "cbs": [], "gc_t": 0.0}
    long_n = {"turns": 0, "wall": 0.0, "cpu": 0.0, "gc": 0.0}
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    young_sizes: list[int] = []
    folds: list[tuple[float, float, int]] = []
    switches: dict[str, float] = {}
    tid = threading.get_native_id()

    def nonvoluntary() -> int:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("nonvoluntary_ctxt_switches"):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if not st["on"]:
            return
        if phase == "start":
            if info["generation"] == 0 and sum(len(p) for p in pauses.values()) % 7 == 0:
                young_sizes.append(len(gc.get_objects(0)))
            st["gc_t"] = pc()
        else:
            d = pc() - st["gc_t"]
            pauses[min(int(info["generation"]), 2)].append(d)
            st["gc"] += d

    gc.callbacks.append(on_gc)
    import asyncio.base_events as base_events
    import asyncio.events as events

    handle_run = events.Handle._run

    def name_of(handle: Any) -> str:
        cb = getattr(handle, "_callback", None)
        task = getattr(cb, "__self__", None)
        if task is not None and hasattr(task, "get_name"):
            name = task.get_name()
            if name.startswith("Task-"):
                name = "task " + str(getattr(task.get_coro(), "__qualname__", "?"))
            return str(name)
        return repr(cb)[:70]

    def run(self: Any) -> None:
        if not st["on"]:
            handle_run(self)
            return
        t = pc()
        handle_run(self)
        d = pc() - t
        if d > 0.001:
            st["cbs"].append((self, d))

    events.Handle._run = run  # type: ignore[method-assign]
    run_once = base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]

    def turn(self: Any) -> None:
        sel = self._selector
        if not getattr(sel, "_loop_turns", False):
            select = sel.select

            def timed_select(timeout: float | None = None) -> Any:
                r = select(timeout)
                st["t0"], st["c0"] = pc(), cpu()
                return r

            sel.select = timed_select
            sel._loop_turns = True
        now = time.monotonic()
        if not st["on"] and start <= now < until:
            st["on"] = True
            switches["from"] = nonvoluntary()
            switches["t"] = now
        elif st["on"] and now >= until:
            st["on"] = False
            switches["to"] = nonvoluntary()
            switches["s"] = now - switches["t"]
        st["gc"], st["cbs"] = 0.0, []
        run_once(self)
        if not st["on"]:
            return
        d = pc() - st["t0"]
        turns[min(int(d * 1000), 200)] += 1
        if d >= LONG:
            long_n["turns"] += 1
            long_n["wall"] += d
            long_n["cpu"] += cpu() - st["c0"]
            long_n["gc"] += st["gc"]
            for handle, x in st["cbs"]:
                long_cb[name_of(handle)] += x

    base_events.BaseEventLoop._run_once = turn  # type: ignore[attr-defined]

    def patch_fold() -> None:
        while "globalrouter.kv_summary" not in sys.modules:
            time.sleep(0.5)
        time.sleep(1)  # its import finished
        summary = sys.modules["globalrouter.kv_summary"].KvSummary
        fold = summary._fold

        def timed_fold(self: Any) -> None:
            n = len(self._log_keys)
            if not n or not st["on"]:
                fold(self)
                return
            t, c = pc(), cpu()
            fold(self)
            folds.append((pc() - t, cpu() - c, n))

        summary._fold = timed_fold

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(len(xs) * p))] * 1e3 if xs else 0.0

    def dump() -> None:
        while True:
            time.sleep(5)
            if not turns:
                continue
            lines = [
                f"turns: {sum(turns.values())}; from 4 ms, by ms: "
                + " ".join(f"{k}:{v}" for k, v in sorted(turns.items()) if k >= 4)
            ]
            lines.append(
                f"turns of {LONG * 1e3:.0f} ms or more: {long_n['turns']}, {long_n['wall'] * 1e3:.0f} ms wall in all, "
                f"the loop thread's CPU {long_n['cpu'] * 1e3:.0f} ms, the collector {long_n['gc'] * 1e3:.0f} ms; "
                "their callbacks over 1 ms:"
            )
            lines += [f"    {v * 1e3:.0f} ms: {k}" for k, v in long_cb.most_common(12)]
            if "s" in switches:
                lines.append(
                    f"loop thread involuntary context switches: {(switches['to'] - switches['from']) / switches['s']:.0f}/s"
                )
            for g, p in pauses.items():
                if p:
                    lines.append(
                        f"gc generation {g}: {len(p)} pauses, p50 {q(p, 0.5):.2f} p99 {q(p, 0.99):.2f} max {q(p, 1.0):.2f} ms"
                    )
            if young_sizes:
                y = sorted(young_sizes)
                lines.append(
                    f"young generation at a collection's start: p50 {y[len(y) // 2]} p90 {y[int(len(y) * 0.9)]} max {y[-1]} objects"
                )
            if folds:
                w, c = [f[0] for f in folds], [f[1] for f in folds]
                lines.append(
                    f"folds: {len(folds)}, {sum(f[2] for f in folds) / len(folds):.0f} blocks on average; wall p50 {q(w, 0.5):.2f} "
                    f"p99 {q(w, 0.99):.2f} max {q(w, 1.0):.2f} ms; CPU p50 {q(c, 0.5):.2f} p99 {q(c, 0.99):.2f} max {q(c, 1.0):.2f} ms"
                )
            with open(out, "w") as f:
                f.write("\n".join(lines) + "\n")

    threading.Thread(target=dump, daemon=True, name="loop-turns-dump").start()
    threading.Thread(target=patch_fold, daemon=True, name="loop-turns-fold").start()


if os.environ.get("LOOP_TURNS_ARGV", "--max-telemetry-streams") in sys.argv:
    _install()

"""What young gc collections walk in a bench's server process: put this directory first on PYTHONPATH.

Active in a process whose argv has `--serve` (bench.bench_batch_ingest's server) or with
GC_SAMPLE=1. After GC_SAMPLE_FREEZE_AFTER seconds (default 25) it collects, freezes what is alive
(as the frontend's refreeze does) and sets GC_SAMPLE_THRESHOLD ("700,10,10") if given, then
freezes again every GC_SAMPLE_FREEZE_EVERY seconds if given; from then
on every collection is timed, wall and thread CPU, and at the start of every 4th generation-1
collection (not timed) the objects of generations 0 and 1 are counted by type with the references
their traversal visits (GC_SAMPLE_GEN=0 and GC_SAMPLE_EVERY=N: at every Nth young collection's
start instead). With GC_SAMPLE_ARGV=ARG only a process with ARG among its arguments samples (a
frontend started by bench_scale: GC_SAMPLE=1 GC_SAMPLE_ARGV=--max-telemetry-streams). With
GC_SAMPLE_GARBAGE=1 the cyclic garbage young collections find is counted by type (kept by
DEBUG_SAVEALL for the count, then left for a later collection to free). The summary is rewritten to GC_SAMPLE_OUT (default /tmp/gc-sample.txt) at
each sample. E.g. (BENCHMARKS.md, "Loop lag at 1,000 pools"):

    GC_SAMPLE_FREEZE_AFTER=30 PYTHONPATH=bench/gc_sample:. python -m bench.bench_batch_ingest \\
        --streams 1000 --seconds 40 --rounds 1 --modes batched
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import Counter
from typing import Any

LONG = 0.005
"""Collections at least this long (seconds, wall) are listed with the objects they freed (the 20 longest)."""


def _install() -> None:
    out = os.environ.get("GC_SAMPLE_OUT", "/tmp/gc-sample.txt")
    freeze_after = float(os.environ.get("GC_SAMPLE_FREEZE_AFTER", "25"))
    wall: dict[int, list[float]] = {0: [], 1: [], 2: []}
    cpu: dict[int, list[float]] = {0: [], 1: [], 2: []}
    seen: Counter[str] = Counter()
    refs: Counter[str] = Counter()
    state: dict[str, Any] = {"samples": 0, "young": 0, "gen": -1, "t": 0.0, "c": 0.0, "frozen": False}
    sample_gen = int(os.environ.get("GC_SAMPLE_GEN", "1"))
    longest: list[tuple[float, int, int, int]] = []
    save_garbage = bool(os.environ.get("GC_SAMPLE_GARBAGE"))
    garbage: Counter[str] = Counter()
    sample_every = int(os.environ.get("GC_SAMPLE_EVERY", "4"))

    def dump() -> None:
        with open(out, "w") as f:
            f.write(f"frozen {gc.get_freeze_count()}, threshold {gc.get_threshold()}\n")
            for g in wall:
                w, c = sorted(wall[g]), sorted(cpu[g])
                if w:
                    f.write(
                        f"gen {g}: {len(w)} collections, wall p50 {w[len(w) // 2] * 1e3:.2f} ms max "
                        f"{w[-1] * 1e3:.2f} ms sum {sum(w):.2f} s; CPU p50 {c[len(c) // 2] * 1e3:.2f} ms "
                        f"max {c[-1] * 1e3:.2f} ms sum {sum(c):.2f} s\n"
                    )
            for took, g, collected, uncollectable in longest:
                f.write(
                    f"long: gen {g} {took * 1e3:.2f} ms, {collected} collected, {uncollectable} uncollectable\n"
                )
            if garbage:
                f.write("cyclic garbage the young collections found, by type (GC_SAMPLE_GARBAGE)\n")
                for k, count in garbage.most_common(30):
                    f.write(f"  {k:60s} {count:9d}\n")
            n = max(1, state["samples"])
            f.write(
                f"objects in generations 0+1 at a generation-{sample_gen} start (mean of {state['samples']}), "
                "references\n"
            )
            for k, count in seen.most_common(25):
                f.write(f"  {k:60s} {count / n:9.0f} {refs[k] / n:11.0f}\n")
            f.write(f"  {'all':60s} {sum(seen.values()) / n:9.0f} {sum(refs.values()) / n:11.0f}\n")

    def callback(phase: str, info: dict[str, Any]) -> None:
        g = info["generation"]
        if phase == "start":
            state["gen"] = -1
            if not state["frozen"]:
                return
            if g == 0 and save_garbage:
                gc.set_debug(gc.DEBUG_SAVEALL)  # what this collection finds is kept in gc.garbage
            if g == sample_gen:
                state["young"] += 1
                if state["young"] % sample_every == 0:
                    state["samples"] += 1
                    for gen in (0, 1):
                        for o in gc.get_objects(generation=gen):
                            t = type(o)
                            k = f"{t.__module__}.{t.__qualname__}"
                            seen[k] += 1
                            refs[k] += len(gc.get_referents(o))
                    dump()
                    return
            state.update(gen=g, t=time.perf_counter(), c=time.thread_time())
        elif state["gen"] == g:
            took = time.perf_counter() - state["t"]
            wall[g].append(took)
            cpu[g].append(time.thread_time() - state["c"])
            if took >= LONG:  # the long ones, with what they freed
                longest.append((took, g, info.get("collected", 0), info.get("uncollectable", 0)))
                longest.sort(reverse=True)
                del longest[20:]
        if phase == "stop" and save_garbage:
            gc.set_debug(0)
            for o in gc.garbage:  # saved, not freed: counted, then left to a later collection
                t = type(o)
                garbage[f"{t.__module__}.{t.__qualname__}"] += 1
            gc.garbage.clear()

    def freezer() -> None:
        time.sleep(freeze_after)
        gc.collect()
        gc.freeze()
        threshold = os.environ.get("GC_SAMPLE_THRESHOLD")
        if threshold:
            young, older, oldest = (int(x) for x in threshold.split(","))
            gc.set_threshold(young, older, oldest)
        state["frozen"] = True
        every = float(os.environ.get("GC_SAMPLE_FREEZE_EVERY", "0"))
        while every > 0:  # what the frontend's tick could do: freeze the young survivors too
            time.sleep(every)
            gc.freeze()

    gc.callbacks.append(callback)
    threading.Thread(target=freezer, daemon=True).start()


_ARGV = os.environ.get("GC_SAMPLE_ARGV")
if "--serve" in sys.argv or (os.environ.get("GC_SAMPLE") and (not _ARGV or _ARGV in sys.argv)):
    _install()

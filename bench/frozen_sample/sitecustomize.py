"""The collector's frozen objects and the RSS of every global frontend a bench starts, every 2 s: put this directory first on PYTHONPATH.

Active in a process whose arguments hold `serve`, `--discovery` and `--listen` (a `globalrouter
serve`, however started). Appends `<unix time> frozen <gc.get_freeze_count()> gen <gc.get_count()>
rss_mb <MB>` to FROZEN_SAMPLE_OUT.<pid> (default /tmp/frozen-sample.<pid>), after a first line with
the process's arguments. A count that keeps growing under steady load would be cycles frozen alive
and left for the planned full collection (`--gc-full-every`). E.g. (BENCHMARKS.md, "Loop lag at
1,000 pools: the collector on a timer, telemetry in 2 ms slices"):

    PYTHONPATH=bench/frozen_sample:. python -m bench.bench_frontend --baseline-src OLD_TREE --no-profile
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

EVERY = 2.0
"""Seconds between samples."""


def _sample(out: str) -> None:
    while True:
        time.sleep(EVERY)
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20
        with open(out, "a") as f:
            f.write(f"{time.time():.0f} frozen {gc.get_freeze_count()} gen {gc.get_count()} rss_mb {rss}\n")


if {"serve", "--discovery", "--listen"} <= set(sys.argv):
    _out = os.environ.get("FROZEN_SAMPLE_OUT", "/tmp/frozen-sample") + f".{os.getpid()}"
    with open(_out, "a") as _f:
        _f.write(" ".join(sys.argv)[:300] + "\n")
    threading.Thread(target=_sample, args=(_out,), daemon=True, name="frozen-sample").start()

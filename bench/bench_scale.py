"""Scale harness: many simulated pools against a real global frontend and discovery; writes SCALE.md.

Run: `make scale` (or `python -m bench.bench_scale`, `--quick` for a two-minute smoke run). Not part
of CI nor of `make bench`. For each pool count it starts a real discovery (memory store) and a real
`globalrouter serve`, then worker processes of simulated pools (bench/scale_sim.py: two relay
replicas each, speaking the relay's registration and telemetry protocols), and measures:

- frontend CPU (cores, /proc/PID/stat over a steady window) and RSS, idle and loaded;
- KV block events per second the relays wrote into the frontend's streams in that window;
- serving-loop lag, seen from outside: the latency of a tight loop of gRPC health checks (and
  `globalrouter_event_loop_lag_seconds` when the frontend exports it);
- decision latency of Route dry runs for 1k- and 16k-token trace prompts (hashing timed apart);
- a mass redial: every relay's stream cut at once (SIGUSR1 to the simulators), the time until each
  relay sent its fresh snapshot and every pool's KV state is back, and the slowest health check;
- a restart: the frontend is killed (SIGKILL) and started again on its port; the time to health
  SERVING and to every pool's KV state (ListPools), and the slowest health check meanwhile;
- the time SIGTERM takes to end the loaded frontend (bounded);
then relay CPU per frontend stream (poolrelay's TelemetryHub to 1, 10 and 50 counting sinks), and
discovery watch fan-out to 50 WatchPools streams with etcd's writes per second (3-member etcd).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import scale_sim
from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.blocks import block_hashes
from meshlaunch import LaunchError, Mesh, Proc, ProcessGroup, free_port, process_group
from meshlaunch.etcd_cluster import EtcdCluster
from poolrelay.lease_stream import KeepAliveClient

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_first_half.jsonl"
SCALE_MD = ROOT / "SCALE.md"
PLOT = ROOT / "docs" / "scale.png"
RESULTS_JSON = ROOT / "bench" / "results" / "scale.json"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Probe channels redial at once when a restarted frontend comes back (the default back-off waits
# up to seconds, which would be counted as the frontend's).
PROBE_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.max_receive_message_length", 64 << 20),
]
DISCOVERY_TIMING = ("--heartbeat-interval", "5", "--lease-duration", "15")
"""Discovery's production lease timing (its defaults), not meshlaunch's short test leases."""


@dataclass(frozen=True)
class Config:
    """One harness run."""

    pools: tuple[int, ...]
    blocks: tuple[int, ...]
    relays: int
    rate: float
    workers: int
    steady: float
    route_seconds: float
    routes: int
    ready_timeout: float
    sigterm_cap: float
    fanouts: tuple[int, ...]
    relay_rate: float
    relay_events: int
    watchers: int
    discovery_pools: int
    fanout_changes: int
    etcd: bool
    trace_requests: int
    ramp_from: int
    """Fleets of at least this many pools bring their pools up in turn for the first load."""
    ramp_per_pool: float
    quick: bool
    log_dir: Path
    frontend_flags: tuple[str, ...]
    """Extra `globalrouter serve` flags of the measured frontend (e.g. --kv-state summary)."""
    batch: bool
    """Simulated relays batch what they queue when the frontend accepts batches (--no-batch: never)."""
    command: str
    out: str
    """Where SCALE.md goes ('' writes no file)."""
    sim_nice: int = 0
    """Niceness added to the simulated pools' processes, so that they take only the CPU the measured
    frontend leaves (on this machine they share its cores; in a fleet the relays run elsewhere)."""
    frontend_nice: int = 0
    """Niceness of the measured frontend's process and session (-20..19; below 0 needs root): a
    fleet's frontend has cores of its own, here it shares 2 with the load it is measured under."""
    discovery_nice: int = 0
    """Niceness of the discovery process and session (0..19): in a fleet it runs on other hosts."""
    frontend_cpu: int | None = None
    """A CPU kept for the frontend: the simulated pools run on the others (None: anywhere)."""
    route_candidates: int = 0
    """RouteRequest.max_candidates of the Route dry runs: 0 asks for every eligible pool (a reply
    then lists all of them), 1 for the choice alone."""
    steady_routes: float = 0.0
    """Route dry runs a second sent during the steady window (open loop, 1k- and 16k-token prompts
    alternating; 0: none): the ingest and decisions together, as issue 19's "200,000 events/s plus
    200 decisions/s in <= 1 core" asks."""
    profile: bool = False
    """py-spy records the frontend in the steady window, the mass redial and the restart (raw
    collapsed stacks in the log directory; off by default: the sampler takes CPU of its own)."""


# ---- small measuring helpers ------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident set size of a process now."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank on the sorted values); None without values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


def scrape(port: int) -> str:
    """The frontend's /metrics text ('' when unreadable)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())
    except OSError:
        return ""


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def samples(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of metric family `name` (its _bucket/_sum/_count too)."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1).startswith(name):
            out.append((m.group(1) + (m.group(2) or ""), float(m.group(3))))
    return out


def gc_generations(before: str, after: str) -> dict[str, dict[str, float]] | None:
    """Per generation of the garbage collector, its collections between two scrapes, their seconds
    in all and `over_s`, the largest bucket bound some collection took longer than (None when the
    frontend does not export globalrouter_gc_pause_seconds)."""
    name = "globalrouter_gc_pause_seconds"
    a, b = dict(samples(after, name)), dict(samples(before, name))
    out: dict[str, dict[str, float]] = {}
    for gen in ("0", "1", "2"):
        count = f'{name}_count{{generation="{gen}"}}'
        if count not in a:
            continue
        total = f'{name}_sum{{generation="{gen}"}}'
        n = a[count] - b.get(count, 0.0)
        slowest = 0.0
        for key, value in a.items():
            m = re.match(rf'{name}_bucket\{{generation="{gen}",le="([^"]+)"\}}', key)
            if m and value - b.get(key, 0.0) < n:  # some collections were slower than this bound
                slowest = max(slowest, float(m.group(1)))
        out[gen] = {
            "count": n,
            "seconds": round(a.get(total, 0.0) - b.get(total, 0.0), 4),
            "over_s": slowest,
        }
    return out or None


def histogram_quantiles(before: str, after: str, name: str) -> dict[str, Any] | None:
    """p50/p99 (bucket upper bounds) and mean of a histogram between two scrapes, or the last value
    of a gauge; None when the frontend does not export `name`."""
    a = dict(samples(after, name))
    if not a:
        return None
    b = dict(samples(before, name))
    by_le: dict[float, float] = {}  # a labelled histogram's series added up per bucket
    for key, value in a.items():
        m = re.match(rf'{name}_bucket\{{.*le="([^"]+)".*\}}', key)
        if m:
            le = float(m.group(1))
            by_le[le] = by_le.get(le, 0.0) + value - b.get(key, 0.0)
    if not by_le:  # a gauge or a summary: report what is there
        return {"values": {k: v for k, v in a.items()}}
    buckets = sorted(by_le.items())
    total = buckets[-1][1]

    def added(suffix: str) -> float:
        keys = [k for k in a if k == f"{name}{suffix}" or k.startswith(f"{name}{suffix}{{")]
        return sum(a[k] - b.get(k, 0.0) for k in keys)

    count, ssum = added("_count"), added("_sum")

    def q(p: float) -> float | None:
        if total <= 0:
            return None
        for le, c in buckets:
            if c >= p * total:
                return le
        return None

    out = {
        "p50_s": q(0.5),
        "p99_s": q(0.99),
        "max_le_s": q(1.0),
        "mean_s": ssum / count if count else None,
        "count": count,
    }
    if 0.01 in by_le:  # the lag goal's bound: how many samples were past it (p99 <= 10 ms: under 1%)
        out["over_10ms"] = total - by_le[0.01]
    return out


SERVING_GRACE = 5.0
"""Seconds a restart's health checks go on after ListPools showed every pool, until one sees SERVING."""


def _lag_line(lag: dict | None) -> str:
    """The loop-lag metric's window in a few words (empty without the metric)."""
    if not lag or not lag.get("count"):
        return ""
    over = f", {lag['over_10ms']:.0f} of {lag['count']:.0f} samples over 10 ms" if "over_10ms" in lag else ""
    return f"loop lag p99 bucket {lag['p99_s']} s{over}; "


# ---- processes ------------------------------------------------------------------------------
class Sims:
    """The `pools` worker processes of one fleet and their counters."""

    def __init__(
        self,
        group: ProcessGroup,
        cfg: Config,
        nodes: Path,
        frontend: str,
        discovery: str,
        pools: int,
        blocks: int,
        tag: str,
        **extra: Any,
    ) -> None:
        workers = max(1, min(cfg.workers, pools))
        self.files: list[Path] = []
        self.procs: list[Proc] = []
        self.lease_files: list[Path] = []
        self.lease_procs: list[Proc] = []
        per = -(-pools // workers)
        for w in range(workers):
            first, count = w * per, min(per, pools - w * per)
            if count <= 0:
                break
            stats = cfg.log_dir / f"sim-{tag}-{w}.json"
            stats.unlink(missing_ok=True)
            self.files.append(stats)
            # The worker's relays' leases are kept by a process of their own at the harness's priority:
            # a worker streaming 500 relays' snapshots at a low priority on a shared machine was starved
            # past the 15 s lease (6,000 renewals a worker missed their 10 s reply at 1,000 pools x
            # 100,000 blocks), and discovery dropped the pools mid-storm, which real relays would not see.
            leases = cfg.log_dir / f"sim-{tag}-{w}-leases.json"
            leases.unlink(missing_ok=True)
            self.lease_files.append(leases)
            incarnation = str(int(time.time() * 1000) + w)
            # The pools both processes stand for: the same discovery, range, relays, blocks, incarnation.
            fleet = ["--discovery", discovery, "--first", str(first), "--count", str(count)]
            fleet += ["--relays", str(cfg.relays), "--blocks", str(blocks), "--incarnation", incarnation]
            lease_argv = [
                sys.executable,
                "-m",
                "bench.scale_sim",
                "leases",
                *fleet,
                "--stats",
                str(leases),
                *(("--cpus", ",".join(map(str, cpus))) if (cpus := sim_cpus(cfg)) else ()),
            ]
            self.lease_procs.append(group.start(f"leases-{tag}-{w}", lease_argv))
            argv = [
                sys.executable,
                "-m",
                "bench.scale_sim",
                "pools",
                *fleet,
                "--frontend",
                frontend,
                "--nodes",
                str(nodes),
                "--rate",
                str(cfg.rate),
                "--stats",
                str(stats),
                "--register-first",
                "--leases-apart",
                str(leases),
                *(() if cfg.batch else ("--no-batch",)),
                *sim_placement_flags(cfg),
            ]
            for k, v in extra.items():
                argv += [f"--{k.replace('_', '-')}", str(v)]
            self.procs.append(group.start(f"sim-{tag}-{w}", argv))

    def stats(self) -> dict[str, Any]:
        """Counters summed over the workers (workers that have not written yet count as zero)."""
        total: dict[str, Any] = {"workers_reporting": 0, "errors": []}
        for f in self.files:
            for p in self.procs:
                p.check_alive()
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            total["workers_reporting"] += 1
            for code, count in data.get("breaks", {}).items():
                total.setdefault("breaks", {})[code] = total.get("breaks", {}).get(code, 0) + count
            for k, v in data.items():
                if isinstance(v, (int, float)) and k not in ("time", "pid", "blocks_per_pool", "nice"):
                    total[k] = total.get(k, 0) + v
            total["blocks_per_pool"] = data.get("blocks_per_pool", 0)
            # What each worker runs at, as it reports it (the same for all: the last one's).
            total["placement"] = {k: data.get(k) for k in ("nice", "autogroup", "cpus")}
            if data.get("last_error"):
                total["errors"].append(data["last_error"])
        # The lease processes' counters (registered, register_errors) count as the workers' own.
        for f in self.lease_files:
            for p in self.lease_procs:
                p.check_alive()
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            for k in ("registered", "register_errors"):
                total[k] = total.get(k, 0) + int(data.get(k, 0))
            if data.get("last_error"):
                total["errors"].append(data["last_error"])
        return total

    def cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs if p.alive())

    def stop(self) -> None:
        for p in self.procs + self.lease_procs:
            p.stop(5.0)


def sim_cpus(cfg: Config) -> list[int]:
    """The CPUs the simulated pools may use: all this process may, less the frontend's ([]: any)."""
    if cfg.frontend_cpu is None:
        return []
    return sorted(os.sched_getaffinity(0) - {cfg.frontend_cpu})


def sim_placement_text(cfg: Config) -> str:
    """How the simulators were placed beside the frontend, for SCALE.md."""
    nice = (
        f"at nice {cfg.sim_nice} (their sessions' autogroups too), so they take the CPU the frontend leaves"
        if cfg.sim_nice
        else "at the frontend's own priority (--sim-nice 0), so they compete with it for the cores"
    )
    cpus = sim_cpus(cfg)
    where = (
        f", on CPUs {', '.join(map(str, cpus))} (CPU {cfg.frontend_cpu} kept for the frontend)"
        if cpus
        else ""
    )
    text = f"they ran {nice}{where}."
    if cfg.frontend_nice:
        text += (
            f" The frontend ran at nice {cfg.frontend_nice} (--frontend-nice, its session's autogroup too), "
            "standing in for cores of its own."
        )
    if cfg.discovery_nice:
        text += f" Discovery ran at nice {cfg.discovery_nice} (--discovery-nice)."
    return text


def set_nice(pid: int, nice: int) -> str:
    """Sets the niceness of every thread of process `pid` and of its session's autogroup (with
    autogroup scheduling the CPU is shared between sessions first, and meshlaunch starts each
    process in a session of its own); what was applied, for SCALE.md. Threads started later inherit
    their creator's niceness. Raises OSError when not allowed (a negative one without root)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
    group = scale_sim.set_autogroup_nice(pid, nice)
    return f"nice {nice}, {group}" if group is not None else f"nice {nice}"


def sim_placement_flags(cfg: Config) -> list[str]:
    """scale_sim flags lowering the simulators' priority and keeping them off the frontend's CPU."""
    flags = ["--nice", str(cfg.sim_nice)] if cfg.sim_nice else []
    if cpus := sim_cpus(cfg):
        flags += ["--cpus", ",".join(map(str, cpus))]
    return flags


def profile(cfg: Config, group: ProcessGroup, pid: int, phase: str, seconds: float) -> Path | None:
    """With --profile, starts py-spy recording process `pid` for `seconds` (without pausing it) into
    `<log dir>/profile-<phase>.txt` (collapsed stacks, one `frames count` a line); the path, or None."""
    if not cfg.profile:
        return None
    spy = shutil.which(
        "py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    if spy is None:
        raise LaunchError("--profile needs py-spy (pip install py-spy)")
    out = cfg.log_dir / f"profile-{phase}.txt"
    argv = [spy, "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", "100", "--nonblocking"]
    group.start(f"py-spy-{phase}", [*argv, "--format", "raw", "-o", str(out)])
    return out


def start_frontend(mesh: Mesh, cfg: Config, pools: int) -> tuple[str, Proc, int, list[str]]:
    """A global frontend allowing every simulated stream; (address, proc, metrics port, extra flags)."""
    streams = max(1024, pools * cfg.relays + 256)
    # The probe port (globalrouter.health_probe): health from its own thread, measured beside the main port's.
    probe = ["--probe-listen", f"127.0.0.1:{free_port()}"]
    extra = ["--max-telemetry-streams", str(streams), *probe, *cfg.frontend_flags]
    router = mesh.start_router(*extra)
    return router.address, router.proc, router.metrics_port, extra


def flag_value(flags: list[str], name: str) -> str | None:
    """The value given to `name` in a flag list (`--name VALUE`), or None."""
    return flags[flags.index(name) + 1] if name in flags[:-1] else None


def aio(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=PROBE_OPTIONS)


async def list_pools(address: str, limit: float) -> dict[str, router_pb2.PoolView]:
    """Every pool the frontend lists (all pages, 1,000 a page), within `limit` seconds."""
    out: dict[str, router_pb2.PoolView] = {}
    token = ""
    end = time.monotonic() + limit
    async with aio(address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        for _ in range(1000):  # bounded: a page holds at least one pool
            reply = await stub.ListPools(
                router_pb2.ListPoolsRequest(page_size=1000, page_token=token),
                timeout=max(0.5, end - time.monotonic()),
            )
            out.update((p.pool_id, p) for p in reply.pools)
            token = reply.next_page_token
            if not token:
                break
    return out


SIM_NICE = 10
"""The simulators' default niceness. Against the frontend's session (nice 0, weight 1,024) four
simulator sessions at nice 10 weigh 4 x 110, so the frontend's one busy thread gets the core it
wants; at 19 (weight 15 each) other work on a shared machine starved the simulators outright (no
snapshot resent in 100 s after a mass redial, with three other nice-0 processes busy)."""

RATE_MET = 0.95
"""Share of the target block-event rate the simulators must write for the load to count as given."""

READY_SHARE = 0.999
"""A pool counts as ready holding this share of its blocks: under `--kv-state summary` a pool's
indexed_blocks is its table's entries, which a table that overflows before it doubles leaves a few
short (now one entry per stored block; when a colliding store added none, 38 of 100 summary pools
never reached their full count). The exact index swaps a whole snapshot in at once: 0, then all."""


def ready_count(views: dict[str, router_pb2.PoolView], pools: int, blocks: int) -> int:
    """Simulated pools the frontend lists with fresh KV holding (READY_SHARE of) all their blocks."""
    need = math.floor(blocks * READY_SHARE)
    return sum(
        1
        for i in range(pools)
        if (v := views.get(f"scale-{i:04d}")) is not None
        and v.listed
        and v.kv_freshness.fresh
        and v.indexed_blocks >= need
    )


async def wait_ready(address: str, pools: int, blocks: int, limit: float, alive) -> tuple[float | None, int]:
    """Seconds until every pool is ready at the frontend (None: not within `limit`), and how many were."""
    start = time.monotonic()
    best = 0
    while time.monotonic() - start < limit:
        alive()
        try:
            views = await list_pools(address, max(1.0, limit - (time.monotonic() - start)))
            best = ready_count(views, pools, blocks)
            if best == pools:
                return time.monotonic() - start, best
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.5)
    return None, best


class HealthProbe:
    """A tight loop of gRPC health checks (one at a time, `gap` apart): their latencies."""

    def __init__(self, address: str, gap: float = 0.02, timeout: float = 60.0) -> None:
        self.address = address
        self.gap = gap
        self.timeout = timeout
        self.latencies: list[float] = []
        self.first_serving: float | None = None
        self.serving = asyncio.Event()
        """Set at the first SERVING answer (of this process's checks)."""
        self.failures = 0
        self.started = time.monotonic()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> HealthProbe:
        self.started = time.monotonic()
        self._task = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        async with aio(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout)
                    lat = time.monotonic() - t0
                    if self.first_serving is None and reply.status == health_pb2.HealthCheckResponse.SERVING:
                        self.first_serving = time.monotonic() - self.started
                        self.serving.set()
                    self.latencies.append(lat)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        self.latencies.append(self.timeout)
                    self.failures += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.gap)

    def halt(self) -> None:
        """No further check starts (stop collects)."""
        self._stop.set()

    async def stop(self) -> dict[str, Any]:
        self.halt()
        if self._task is not None:
            await self._task
        return {
            "checks": len(self.latencies),
            "p50_ms": ms(pct(self.latencies, 50)),
            "p99_ms": ms(pct(self.latencies, 99)),
            "max_ms": ms(max(self.latencies) if self.latencies else None),
        }


def _health_checks(address: str, gap: float, timeout: float, started: Any, halt: Any, out: Any) -> None:
    """ProcessHealthProbe's checks, in a process of their own; the figures go back through `out`."""
    latencies: list[float] = []
    first: float | None = None
    dropped = failures = 0
    with grpc.insecure_channel(address, options=PROBE_OPTIONS) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        out.send("checking")
        while not halt.is_set():
            t0 = time.monotonic()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
                # Read after the answer: a check begun before ProcessHealthProbe.count_from's time
                # is not counted, even if its answer came after (CLOCK_MONOTONIC: one clock for
                # both processes).
                since = started.value
                counted = t0 >= since
                if counted:
                    latencies.append(time.monotonic() - t0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        if first is None:
                            first = time.monotonic() - since
                    elif first is not None:
                        dropped += 1
            except grpc.RpcError as exc:
                if t0 >= started.value:
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        latencies.append(timeout)
                    failures += 1
            halt.wait(gap)
    out.send({"latencies": latencies, "first_serving": first, "dropped": dropped, "failures": failures})


class ProcessHealthProbe(HealthProbe):
    """The same loop of health checks from a process of its own (spawned: a fresh interpreter), so
    that neither the harness's event loop (parsing 1,000-pool ListPools pages) nor its GIL delays
    them: for the frontend's probe port, whose answer does not wait for the frontend's loop, and
    for its main port in the storms, so that the figure is the frontend's and not the harness's."""

    def start(self) -> HealthProbe:
        self.spawn()
        self.wait_checking()
        return self

    def spawn(self, counting: bool = True) -> ProcessHealthProbe:
        """Start the checking process without waiting for it (see `start_probes`); with `counting`
        False its checks count only from `count_from`'s time."""
        self.started = time.monotonic() if counting else math.inf
        # Answers other than SERVING after the first SERVING (the loop silent past --probe-ready-within).
        self.dropped = 0
        ctx = multiprocessing.get_context("spawn")
        self._halt = ctx.Event()
        self._since = ctx.Value("d", self.started)
        self._results, sender = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_health_checks,
            args=(self.address, self.gap, self.timeout, self._since, self._halt, sender),
            name=f"health-checks-{self.address}",
            daemon=True,
        )
        self._proc.start()
        sender.close()
        return self

    def wait_checking(self) -> None:
        """Until the process checks (a fresh interpreter takes a second or so): a short storm is not missed."""
        if not self._results.poll(60) or self._results.recv() != "checking":
            raise LaunchError(f"the health checker of {self.address} did not start")

    def count_from(self, when: float) -> None:
        """Only checks begun at `when` (time.monotonic) or later count, and the first SERVING is
        timed from it: a checker started before a restart then says nothing of the old process."""
        self.started = when
        self._since.value = when

    def halt(self) -> None:
        self._halt.set()

    async def stop(self) -> dict[str, Any]:
        self.halt()

        def collect() -> dict[str, Any] | None:
            got = self._results.recv() if self._results.poll(self.timeout + 10) else None
            self._proc.join(5)
            return got

        data = await asyncio.to_thread(collect)
        if data is not None:
            self.latencies, self.first_serving = data["latencies"], data["first_serving"]
            self.dropped, self.failures = data["dropped"], data["failures"]
        self._task = None
        return {**await super().stop(), "not_ready_after_ready": self.dropped}


async def stop_probes(*probes: HealthProbe | None) -> list[dict[str, Any] | None]:
    """Stops every checker at once (so that each covers the same window), then collects each's
    figures (None for a checker not started)."""
    for p in probes:
        if p is not None:
            p.halt()
    return [None if p is None else await p.stop() for p in probes]


def start_probes(*probes: ProcessHealthProbe | None, counting: bool = True) -> None:
    """Start checking processes side by side (each interpreter takes a second or so to start) and
    return once every one checks (counting from now, or with `counting` False from `count_from`)."""
    started = [p.spawn(counting) for p in probes if p is not None]
    for p in started:
        p.wait_checking()


def route_requests(
    tokens: list[list[int]], max_candidates: int = 0
) -> dict[str, list[router_pb2.RouteRequest]]:
    """Route dry runs of trace prompts cut to 1k and 16k tokens (those long enough), asking for at
    most `max_candidates` candidates (0: all)."""
    out: dict[str, list[router_pb2.RouteRequest]] = {}
    for label, n in (("1k", 1024), ("16k", 16384)):
        out[label] = [
            router_pb2.RouteRequest(
                model=scale_sim.MODEL,
                prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=t[:n])),
                max_candidates=max_candidates,
            )
            for t in tokens
            if len(t) >= n
        ][:64]
    return out


def hashing_seconds(tokens: list[list[int]]) -> dict[str, float | None]:
    """Median seconds meshkit.blocks takes to hash a 1k- and a 16k-token prompt, in this process."""
    out: dict[str, float | None] = {}
    for label, n in (("1k", 1024), ("16k", 16384)):
        prompts = [t[:n] for t in tokens if len(t) >= n][:32]
        times = []
        for _ in range(3):
            for p in prompts:
                t0 = time.perf_counter()
                block_hashes(p, scale_sim.BLOCK_SIZE)
                times.append(time.perf_counter() - t0)
        out[label] = statistics.median(times) if times else None
    return out


async def route_latencies(
    address: str, requests: dict[str, list[router_pb2.RouteRequest]], seconds: float, limit: int
) -> dict[str, Any]:
    """Route dry runs one at a time, sizes alternating, bounded by `seconds` and `limit` per size."""
    lat: dict[str, list[float]] = {k: [] for k in requests}
    candidates: dict[str, list[int]] = {k: [] for k in requests}
    end = time.monotonic() + seconds
    async with aio(address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        i = 0
        while time.monotonic() < end and any(len(v) < limit for v in lat.values()):
            for label, reqs in requests.items():
                if not reqs or len(lat[label]) >= limit:
                    continue
                t0 = time.monotonic()
                reply = await stub.Route(reqs[i % len(reqs)], timeout=60)
                lat[label].append(time.monotonic() - t0)
                candidates[label].append(max((c.cached_blocks for c in reply.candidates), default=0))
            i += 1
            await asyncio.sleep(0.005)
    return {
        label: {
            "n": len(v),
            "p50_ms": ms(pct(v, 50)),
            "p99_ms": ms(pct(v, 99)),
            "best_cached_blocks_median": statistics.median(candidates[label]) if candidates[label] else None,
        }
        for label, v in lat.items()
    }


ROUTES_IN_FLIGHT = 64
"""Paced Route dry runs in flight at most; one due past it is counted as skipped, not sent."""


async def paced_routes(
    address: str, requests: dict[str, list[router_pb2.RouteRequest]], rate: float, seconds: float
) -> dict[str, Any]:
    """Route dry runs at `rate` a second for `seconds` (open loop: each on its own schedule, sizes
    alternating), at most ROUTES_IN_FLIGHT at once: how many were sent, answered and failed, and
    their latencies."""
    reqs = [r for pair in zip(*(v for v in requests.values() if v), strict=False) for r in pair]
    lat: list[float] = []
    failed = skipped = 0
    if not reqs or rate <= 0:
        return {"rate": rate, "sent": 0}
    async with aio(address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        slots = asyncio.Semaphore(ROUTES_IN_FLIGHT)
        tasks: set[asyncio.Task] = set()

        async def one(req: router_pb2.RouteRequest) -> None:
            nonlocal failed
            t0 = time.monotonic()
            try:
                await stub.Route(req, timeout=30)
                lat.append(time.monotonic() - t0)
            except grpc.aio.AioRpcError:
                failed += 1
            finally:
                slots.release()

        start = time.monotonic()
        n = int(rate * seconds)
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            if slots.locked():
                skipped += 1
                continue
            await slots.acquire()
            task = asyncio.ensure_future(one(reqs[i % len(reqs)]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        took = time.monotonic() - start
    return {
        "rate": rate,
        "sent": n - skipped,
        "answered": len(lat),
        "failed": failed,
        "skipped": skipped,
        "answered_per_s": round(len(lat) / took, 1),
        "p50_ms": ms(pct(lat, 50)),
        "p99_ms": ms(pct(lat, 99)),
    }


async def mass_redial(
    address: str,
    sims: Sims,
    pools: int,
    blocks: int,
    cfg: Config,
    alive,
    probe_address: str | None = None,
    metrics_port: int | None = None,
) -> dict[str, Any]:
    """Every simulated relay's stream cut at once (SIGUSR1 to each simulator process): seconds until
    every relay sent its fresh snapshot, and until every pool is listed fresh with its blocks again,
    with the health checks meanwhile. The second may also count a pool whose other relay's set
    still answered (ListPools shows a pool, not its streams): the first is the stricter bound."""
    before = sims.stats()
    want = before.get("snapshots", 0) + pools * cfg.relays
    main = ProcessHealthProbe(address, timeout=60)
    off_loop = ProcessHealthProbe(probe_address, timeout=60) if probe_address else None
    start_probes(main, off_loop)
    probe = HealthProbe(address, timeout=60).start()
    m0 = scrape(metrics_port) if metrics_port else ""
    t0, sc0 = time.monotonic(), sims.cpu()
    for p in sims.procs:
        p.signal(signal.SIGUSR1)
    resent: float | None = None
    while time.monotonic() - t0 < cfg.ready_timeout:
        alive()
        if sims.stats().get("snapshots", 0) >= want:
            resent = time.monotonic() - t0
            break
        await asyncio.sleep(0.2)
    ready, n = await wait_ready(
        address, pools, blocks, max(1.0, cfg.ready_timeout - (time.monotonic() - t0)), alive
    )
    took = None if ready is None or resent is None else time.monotonic() - t0
    sim_cores = (sims.cpu() - sc0) / (time.monotonic() - t0)
    health, main_health, probe_health = await stop_probes(probe, main, off_loop)
    after = sims.stats()
    return {
        "resent_s": None if resent is None else round(resent, 1),
        "ready_s": None if took is None else round(took, 1),
        "ready_pools": n,
        "health": health,
        "main_health": main_health,
        "probe_health": probe_health,
        "cuts": after.get("breaks", {}).get("CUT", 0) - before.get("breaks", {}).get("CUT", 0),
        "snapshot_requests": after.get("snapshot_requests", 0) - before.get("snapshot_requests", 0),
        "sim_cores": round(sim_cores, 3),
        # The serving loop's own lag over the storm (the frontend's histogram, between two scrapes).
        "loop_lag_metric": histogram_quantiles(
            m0, scrape(metrics_port), "globalrouter_event_loop_lag_seconds"
        )
        if metrics_port
        else None,
    }


# ---- the fleet measurement --------------------------------------------------------------------
async def run_fleet(
    cfg: Config, group: ProcessGroup, nodes: Path, tokens: list[list[int]], pools: int, blocks: int
) -> dict[str, Any]:
    """One pool count: steady state, decisions, a restart storm and a SIGTERM."""
    out: dict[str, Any] = {"pools": pools, "blocks_per_pool": blocks, "relays": cfg.relays, "rate": cfg.rate}
    out["distinct_blocks"] = distinct_of(out, cfg.trace_requests)
    mesh = Mesh(group)
    mesh.start_discovery(None, *DISCOVERY_TIMING, "--log-level", "warning")
    if cfg.discovery_nice:
        assert mesh.discovery_proc is not None
        out["discovery_priority"] = set_nice(mesh.discovery_proc.pid, cfg.discovery_nice)
    address, proc, metrics_port, flags = start_frontend(mesh, cfg, pools)
    out["frontend_flags"] = flags
    pid = proc.pid
    if cfg.frontend_nice:
        out["frontend_priority"] = set_nice(pid, cfg.frontend_nice)
    # Idle: before any relay dials.
    probe = HealthProbe(address).start()
    await asyncio.sleep(2.0)
    out["idle_health"] = await probe.stop()
    out["idle_rss_mb"] = round(rss_bytes(pid) / 2**20, 1)
    print(
        f"  [{pools} pools] frontend idle: rss {out['idle_rss_mb']} MB, health p99 {out['idle_health']['p99_ms']} ms",
        flush=True,
    )

    # Past ramp_from pools the first load is spread (ramp_per_pool s a pool): the current frontend
    # does not converge when every relay of such a fleet dials at once (the restart below shows it).
    ramp = round(pools * cfg.ramp_per_pool, 1) if pools >= cfg.ramp_from else 0.0
    out["first_load_ramp_s"] = ramp
    sims = Sims(group, cfg, nodes, f"http://{address}", mesh.discovery, pools, blocks, f"p{pools}", ramp=ramp)
    try:
        # The first storm: every relay's snapshot arrives at once.
        t0 = time.monotonic()
        while (s := sims.stats()).get("registered", 0) < pools * cfg.relays:
            if time.monotonic() - t0 > cfg.ready_timeout:
                raise LaunchError(
                    f"only {s.get('registered', 0)} of {pools * cfg.relays} relays registered: {s['errors'][:3]}"
                )
            await asyncio.sleep(0.2)
        out["register_s"] = round(time.monotonic() - t0, 1)
        cpu0 = cpu_seconds(pid)
        probe = HealthProbe(address, timeout=60).start()
        out["first_load_limit_s"] = cfg.ready_timeout + ramp
        ready, n = await wait_ready(address, pools, blocks, cfg.ready_timeout + ramp, proc.check_alive)
        storm = await probe.stop()
        out["first_load"] = {
            "ready_s": None if ready is None else round(ready, 1),
            "ready_pools": n,
            "frontend_cpu_s": round(cpu_seconds(pid) - cpu0, 1),
            "health": storm,
            "relay_connects": (s1 := sims.stats()).get("connects", 0),
            "stream_breaks": s1.get("breaks", {}),
        }
        print(
            f"  [{pools} pools] first load: ready {out['first_load']['ready_s']} s ({n}/{pools}), "
            f"health max {storm['max_ms']} ms",
            flush=True,
        )
        if ready is None:  # measured on regardless: what a frontend that cannot catch up does
            out["gave_up"] = f"not every pool ready within {cfg.ready_timeout + ramp:g} s ({n}/{pools})"
            out["sim_errors"] = sims.stats()["errors"][:3]
        await asyncio.sleep(min(5.0, cfg.steady / 4))  # let the storm's stragglers settle

        # Steady ingest: CPU, RSS, events, loop lag.
        m0, s0, c0, sc0, t_0 = (
            scrape(metrics_port),
            sims.stats(),
            cpu_seconds(pid),
            sims.cpu(),
            time.monotonic(),
        )
        probe = HealthProbe(address).start()
        profile(cfg, group, pid, f"steady-{pools}", cfg.steady)
        if cfg.steady_routes > 0:  # the decisions beside the ingest, inside the same window
            routes = await paced_routes(
                address, route_requests(tokens, cfg.route_candidates), cfg.steady_routes, cfg.steady
            )
        else:
            await asyncio.sleep(cfg.steady)
        health = await probe.stop()
        m1, s1, c1, sc1, t_1 = (
            scrape(metrics_port),
            sims.stats(),
            cpu_seconds(pid),
            sims.cpu(),
            time.monotonic(),
        )
        window = t_1 - t_0
        # Written into the streams, not just produced: a starved simulator queues what it cannot
        # write (and drops it past its queue's bound), which the produced figure would hide.
        events = (s1.get("written_events", 0) - s0.get("written_events", 0)) / window
        produced = (s1["delta_events"] - s0["delta_events"]) / window

        def taken(name: str) -> float:  # what the frontend read (not what the relays wrote)
            return sum(v for k, v in samples(m1, name) if k == name) - sum(
                v for k, v in samples(m0, name) if k == name
            )

        ingested = taken("globalrouter_telemetry_messages_total")
        msgs = (s1["deltas"] + s1["reports"] - s0["deltas"] - s0["reports"]) / window
        out["steady"] = {
            "window_s": round(window, 1),
            "frontend_cores": round((c1 - c0) / window, 3),
            "rss_mb": round(rss_bytes(pid) / 2**20, 1),
            "events_per_s": round(events),
            "produced_events_per_s": round(produced),
            "target_events_per_s": round(pools * cfg.relays * cfg.rate),
            "messages_per_s": round(msgs),
            "writes_per_s": round((s1.get("writes", 0) - s0.get("writes", 0)) / window),
            "ingested_messages_per_s": round(ingested / window),
            "ingested_batches_per_s": round(taken("globalrouter_telemetry_batches_total") / window),
            "frontend_cpu_us_per_message": round((c1 - c0) / ingested * 1e6, 1) if ingested else None,
            "sim_cores": round((sc1 - sc0) / window, 3),
            "sim_placement": s1.get("placement"),
            # Whether the simulators produced the load asked of them (they run at a lower priority,
            # on what the frontend leaves): below RATE_MET the frontend was measured at less.
            "rate_share": round(events / (pools * cfg.relays * cfg.rate), 3) if cfg.rate else None,
            "health": health,
            "loop_lag_metric": histogram_quantiles(m0, m1, "globalrouter_event_loop_lag_seconds"),
            # The garbage collector's pauses (all generations together), and per generation.
            "gc_pause_metric": histogram_quantiles(m0, m1, "globalrouter_gc_pause_seconds"),
            "gc_generations": gc_generations(m0, m1),
            "snapshot_requests": s1["snapshot_requests"] - s0["snapshot_requests"],
            "machine_load_1min": round(os.getloadavg()[0], 1),
            "dropped": s1["dropped"] - s0["dropped"],
        }
        st = out["steady"]
        if cfg.steady_routes > 0:
            st["routes"] = routes
            st["decision_metric"] = histogram_quantiles(m0, m1, "globalrouter_decision_latency_seconds")
        print(
            f"  [{pools} pools] steady: {st['frontend_cores']} cores, rss {st['rss_mb']} MB, "
            f"{st['events_per_s']} events/s (target {st['target_events_per_s']}), {st['messages_per_s']} "
            f"messages/s in {st['writes_per_s']} gRPC writes/s (frontend read {st['ingested_messages_per_s']} "
            f"messages/s in {st['ingested_batches_per_s']} batches/s, {st['frontend_cpu_us_per_message']} us CPU "
            f"a message), health p50/p99 "
            f"{health['p50_ms']}/{health['p99_ms']} ms; {_lag_line(st.get('loop_lag_metric'))}simulators {st['sim_cores']} cores at "
            f"{st['sim_placement']}{'' if (st['rate_share'] or 1) >= RATE_MET else ' SHORT OF THE TARGET RATE'}",
            flush=True,
        )
        if cfg.steady_routes > 0:
            print(f"  [{pools} pools] steady Route dry runs alongside: {st['routes']}", flush=True)

        # Decisions.
        profile(cfg, group, pid, f"route-{pools}", cfg.route_seconds)
        probe = HealthProbe(address).start()
        c0 = cpu_seconds(pid)
        t_0 = time.monotonic()
        m0 = scrape(metrics_port)
        # One size after the other (half the window each), the metrics scraped between, so that
        # the frontend's decision histograms are read per prompt size.
        out["route"], cuts = {}, [m0]
        for label, reqs in route_requests(tokens, cfg.route_candidates).items():
            out["route"].update(
                await route_latencies(address, {label: reqs}, cfg.route_seconds / 2, cfg.routes)
            )
            cuts.append(scrape(metrics_port))
        m1 = cuts[-1]
        out["route_decision_by_size"] = {
            label: {
                "wall": histogram_quantiles(a, b, "globalrouter_decision_latency_seconds"),
                "cpu": histogram_quantiles(a, b, "globalrouter_decision_cpu_seconds"),
            }
            for label, a, b in zip(out["route"], cuts[:-1], cuts[1:], strict=True)
        }
        out["route_window_cores"] = round((cpu_seconds(pid) - c0) / (time.monotonic() - t_0), 3)
        out["route_health"] = await probe.stop()
        out["route_candidates"] = cfg.route_candidates
        # In the frontend: the decision's own time (hashing, filter, rank: no wait for the loop,
        # no reply), and the loop's lag while the Routes ran.
        out["route_decision_metric"] = histogram_quantiles(m0, m1, "globalrouter_decision_latency_seconds")
        # Its own CPU apart (a frontend without the metric: None): what the decision costs, against
        # the wall time above, which also holds the thread's waits for a CPU or the GIL.
        out["route_decision_cpu_metric"] = histogram_quantiles(m0, m1, "globalrouter_decision_cpu_seconds")
        out["route_loop_lag_metric"] = histogram_quantiles(m0, m1, "globalrouter_event_loop_lag_seconds")
        r = out["route"]
        by_size = "; ".join(
            f"{label} p50/p99 {(v['wall'] or {}).get('p50_s')}/{(v['wall'] or {}).get('p99_s')} s wall, "
            f"{(v['cpu'] or {}).get('p50_s')}/{(v['cpu'] or {}).get('p99_s')} s CPU"
            for label, v in out["route_decision_by_size"].items()
        )
        print(
            f"  [{pools} pools] Route (max_candidates {cfg.route_candidates}) 1k p50/p99 "
            f"{r['1k']['p50_ms']}/{r['1k']['p99_ms']} ms, 16k {r['16k']['p50_ms']}/{r['16k']['p99_ms']} ms; "
            f"the frontend's decision metrics: {by_size}",
            flush=True,
        )

        # A mass redial (a network blip): every relay's stream ends at once and redials at once
        # with a fresh snapshot, the frontend up throughout.
        probe_address = flag_value(flags, "--probe-listen")
        profile(cfg, group, pid, f"redial-{pools}", 40)
        out["redial"] = await mass_redial(
            address, sims, pools, blocks, cfg, proc.check_alive, probe_address, metrics_port
        )
        rd = out["redial"]
        print(
            f"  [{pools} pools] mass redial: every relay's snapshot resent after {rd['resent_s']} s, every pool "
            f"ready after {rd['ready_s']} s ({rd['ready_pools']}/{pools}); harness-loop health max {rd['health']['max_ms']} ms"
            f"{probe_line(rd)}",
            flush=True,
        )

        # A restart: SIGKILL, then the same command on the same port; relays redial and resend.
        # The checkers in processes of their own start first (a second or so each, side by side),
        # so that none misses the start of the storm; their checks fail uncounted while it is down.
        main = ProcessHealthProbe(address, gap=0.02, timeout=60)
        off_loop = ProcessHealthProbe(probe_address, gap=0.02, timeout=60) if probe_address else None
        start_probes(main, off_loop, counting=False)
        t_kill = time.monotonic()
        for checker in (main, off_loop):
            if checker is not None:
                checker.count_from(t_kill)
        proc.kill9()
        proc = group.start("router", proc.args)
        pid = proc.pid
        if cfg.frontend_nice:
            set_nice(pid, cfg.frontend_nice)
        probe = HealthProbe(address, gap=0.02, timeout=60).start()
        c0, sc0 = cpu_seconds(pid), sims.cpu()
        # A second in: py-spy cannot attach before the new interpreter is up.
        asyncio.get_running_loop().call_later(1.0, profile, cfg, group, pid, f"restart-{pools}", 60)
        ready, n = await wait_ready(address, pools, blocks, cfg.ready_timeout, proc.check_alive)
        t_ready = time.monotonic() - t_kill
        restart_sim_cores = (sims.cpu() - sc0) / t_ready
        # The frontend says SERVING about when ListPools shows every pool's KV: checks go on until
        # one saw it (or SERVING_GRACE passed), so that a flip just before ListPools' answer is
        # not missed by probes stopped at once (three runs reported no SERVING that way).
        if ready is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(probe.serving.wait(), SERVING_GRACE)
        restart_storm, main_storm, off_storm = await stop_probes(probe, main, off_loop)
        assert restart_storm is not None
        storm = restart_storm
        streams_back = sims.stats().get("streaming", 0)
        out["restart"] = {
            "ready_s": None if ready is None else round(t_ready, 1),
            "ready_pools": n,
            "health_serving_s": None if probe.first_serving is None else round(probe.first_serving, 2),
            "health": storm,
            "main_health": main_storm,
            "probe_health": off_storm,
            "probe_serving_s": None  # from the kill (count_from)
            if off_loop is None or off_loop.first_serving is None
            else round(off_loop.first_serving, 2),
            "frontend_cpu_s": round(cpu_seconds(pid) - c0, 1),
            "sim_cores": round(restart_sim_cores, 3),
            # The restarted process's loop lag from its start until every pool was back.
            "loop_lag_metric": histogram_quantiles(
                "", scrape(metrics_port), "globalrouter_event_loop_lag_seconds"
            ),
            "streams_back": streams_back,
            "relay_connects_total": (s2 := sims.stats()).get("connects", 0),
            "stream_breaks_total": s2.get("breaks", {}),
        }
        rs = out["restart"]
        print(
            f"  [{pools} pools] restart: health SERVING after {rs['health_serving_s']} s, every pool ready "
            f"after {rs['ready_s']} s ({n}/{pools}); harness-loop health max {storm['max_ms']} ms{probe_line(rs)}",
            flush=True,
        )

        # SIGTERM under load, bounded.
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        proc.signal(15)
        while proc.alive() and time.monotonic() - t0 < cfg.sigterm_cap:  # noqa: ASYNC110 (a process, not an event)
            await asyncio.sleep(0.1)
        exited = not proc.alive()
        out["sigterm"] = {
            "exit_s": round(time.monotonic() - t0, 1) if exited else None,
            "cap_s": cfg.sigterm_cap,
            "exit_code": proc.popen.returncode if exited else None,
        }
        print(
            f"  [{pools} pools] SIGTERM: {'exit ' + str(proc.popen.returncode) + ' after ' + str(out['sigterm']['exit_s']) + ' s' if exited else f'still running after {cfg.sigterm_cap} s (killed)'}",
            flush=True,
        )
        if proc.alive():
            proc.kill9()
    finally:
        # The frontend goes first: every stream it still holds would cost it a pass over its index.
        for p in group.procs:
            if p.name == "router" and p.alive():
                p.kill9()
        sims.stop()
        for p in group.procs:
            p.stop(5.0)
    return out


def probe_line(part: dict[str, Any]) -> str:
    """The health figures measured from processes of their own, main port and probe port, for a
    progress line ('' for each that was not measured)."""
    out = ""
    for key, label in (("main_health", "main port (own process)"), ("probe_health", "probe port")):
        h = part.get(key)
        if h:
            out += f"; {label} p50/p99/max {h['p50_ms']}/{h['p99_ms']}/{h['max_ms']} ms"
    return out


def main_port_health(part: dict[str, Any]) -> dict[str, Any]:
    """A storm's main-port health figures: from the checker's own process where it ran (runs before
    it had only the harness loop's)."""
    return part.get("main_health") or part["health"]


def probe_cells(part: dict[str, Any], key: str = "probe_health") -> str:
    """A port's health p50 / p99 / max from a process of its own (`key`: probe_health for the probe
    port, main_health for the main port) for a SCALE.md cell."""
    h = part.get(key)
    if not h:
        return "not measured"
    dropped = h.get("not_ready_after_ready")
    flaps = f" ({dropped:,} of {h['checks']:,} not ready after ready)" if dropped else ""
    return f"{_f(h['p50_ms'])} / {_f(h['p99_ms'])} / {_f(h['max_ms'])} ms{flaps}"


# ---- relay cost per frontend stream -------------------------------------------------------------
async def run_relay(cfg: Config, group: ProcessGroup) -> list[dict[str, Any]]:
    """poolrelay's TelemetryHub to 1, 10, 50 counting sinks: CPU at a fixed rate, and the top rate."""
    out = []
    for fanout in cfg.fanouts:
        row: dict[str, Any] = {"frontends": fanout}
        for mode in ("paced", "max"):
            sink_stats = cfg.log_dir / f"sinks-{fanout}-{mode}.json"
            relay_stats = cfg.log_dir / f"relay-{fanout}-{mode}.json"
            for f in (sink_stats, relay_stats):
                f.unlink(missing_ok=True)
            window = 4.0 if cfg.quick else 8.0
            sinks = group.start(
                "sinks",
                [
                    sys.executable,
                    "-m",
                    "bench.scale_sim",
                    "sinks",
                    "--count",
                    str(fanout),
                    "--stats",
                    str(sink_stats),
                    "--seconds",
                    "300",
                ],
            )
            try:
                deadline = time.monotonic() + 30
                while not sink_stats.exists():
                    sinks.check_alive()
                    if time.monotonic() > deadline:
                        raise LaunchError("sinks did not start")
                    await asyncio.sleep(0.1)
                ports = json.loads(sink_stats.read_text())["ports"]
                urls = ",".join(f"http://127.0.0.1:{p}" for p in ports)
                rate = cfg.relay_rate if mode == "paced" else 0
                relay = group.start(
                    "relay",
                    [
                        sys.executable,
                        "-m",
                        "bench.scale_sim",
                        "relay",
                        "--frontends",
                        urls,
                        "--rate",
                        str(rate),
                        "--events",
                        str(cfg.relay_events),
                        "--seconds",
                        str(window + 30),
                        "--stats",
                        str(relay_stats),
                    ],
                )
                try:
                    deadline = time.monotonic() + 30

                    def rstats(path: Path = relay_stats) -> dict[str, Any]:
                        try:
                            return dict(json.loads(path.read_text()))
                        except (OSError, ValueError):
                            return {}

                    while rstats().get("phase") not in ("feeding", "done"):
                        relay.check_alive()
                        if time.monotonic() > deadline:
                            raise LaunchError(f"relay to {fanout} sinks never started feeding")
                        await asyncio.sleep(0.05)
                    if mode == "paced":
                        await asyncio.sleep(1.0)
                        c0, t0, f0 = cpu_seconds(relay.pid), time.monotonic(), rstats().get("fed_events", 0)
                        await asyncio.sleep(window)
                        c1, t1, f1 = cpu_seconds(relay.pid), time.monotonic(), rstats().get("fed_events", 0)
                        row["paced_rate"] = round((f1 - f0) / (t1 - t0))
                        row["cores"] = round((c1 - c0) / (t1 - t0), 3)
                        row["cores_per_stream"] = round(row["cores"] / fanout, 4)
                    else:
                        while rstats().get("phase") != "done":
                            relay.check_alive()
                            if time.monotonic() > deadline + window + 30:
                                raise LaunchError("relay max-rate run did not finish")
                            await asyncio.sleep(0.1)
                        s = rstats()
                        row["max_rate"] = round(s["rate"])
                        row["max_dropped"] = s["dropped"]
                    await asyncio.sleep(0.6)
                    got = json.loads(sink_stats.read_text())
                    row[f"{mode}_sink_events_min"] = min(got["delta_events"]) if got["delta_events"] else 0
                finally:
                    relay.stop(3.0)
            finally:
                sinks.stop(3.0)
        print(
            f"  relay -> {fanout} sinks: {row.get('cores')} cores at {row.get('paced_rate')} events/s "
            f"({row.get('cores_per_stream')} per stream); top rate {row.get('max_rate')} events/s",
            flush=True,
        )
        out.append(row)
    base = out[0].get("max_rate") or 0
    for row in out:
        row["max_rate_vs_one"] = round(row.get("max_rate", 0) / base, 3) if base else None
    return out


# ---- discovery ---------------------------------------------------------------------------------
def etcd_writes(endpoints: list[str]) -> dict[str, float]:
    """etcd's write counters: puts, deletes, txns and committed proposals (the most any member
    reports: every member applies every write). etcd 3.4 names them etcd_mvcc_* and, older,
    etcd_debugging_mvcc_*; the first found of each is used."""
    names = {
        "put": ("etcd_mvcc_put_total", "etcd_debugging_mvcc_put_total"),
        "delete": ("etcd_mvcc_delete_total", "etcd_debugging_mvcc_delete_total"),
        "txn": ("etcd_mvcc_txn_total", "etcd_debugging_mvcc_txn_total"),
        "proposals": ("etcd_server_proposals_committed_total",),
    }
    out: dict[str, float] = {}
    for ep in endpoints:
        try:
            with urllib.request.urlopen(f"http://{ep}/metrics", timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            continue
        values = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and not line.startswith("#"):
                values[parts[0]] = parts[1]
        for short, candidates in names.items():
            for name in candidates:
                if name in values:
                    out[short] = max(out.get(short, 0.0), float(values[name]))
                    break
    return out


async def run_discovery(cfg: Config, group: ProcessGroup, store: str) -> dict[str, Any]:
    """`discovery_pools` pools x relays leases renewed over KeepAlivePools, `watchers` WatchPools
    streams; CPU and etcd writes per second; fan-out time of registration changes to every watcher."""
    out: dict[str, Any] = {
        "store": store,
        "pools": cfg.discovery_pools,
        "relays": cfg.relays,
        "watchers": cfg.watchers,
    }
    mesh = Mesh(group)
    extra: list[str] = [*DISCOVERY_TIMING, "--log-level", "warning"]
    etcd = None
    if store == "etcd":
        etcd = EtcdCluster(group, 3).start()
        extra += ["--store", "etcd", "--etcd-endpoints", etcd.endpoints_flag]
    mesh.start_discovery(None, *extra)
    assert mesh.discovery_proc is not None
    dpid = mesh.discovery_proc.pid
    channel = aio(mesh.discovery)
    stub = dpb_grpc.DiscoveryServiceStub(channel)
    stop = asyncio.Event()
    seen: list[dict[str, float]] = [{} for _ in range(cfg.watchers)]
    synced = [asyncio.Event() for _ in range(cfg.watchers)]

    async def watch(k: int) -> None:
        async with aio(mesh.discovery) as ch:
            call = dpb_grpc.DiscoveryServiceStub(ch).WatchPools(dpb.WatchPoolsRequest())
            async for ev in call:
                if ev.type == dpb.WATCH_EVENT_TYPE_SNAPSHOT_DONE or ev.complete:
                    synced[k].set()
                if ev.pool.pool_id and ev.pool.pool_id not in seen[k]:
                    seen[k][ev.pool.pool_id] = time.monotonic()
                if stop.is_set():
                    return

    registered = 0

    async def renew(first: int, count: int) -> None:
        nonlocal registered
        # One KeepAlivePools stream per relay, as relays keep them.
        clients = [
            (i, r, KeepAliveClient(stub, unary_timeout=10))
            for i in range(first, first + count)
            for r in range(cfg.relays)
        ]
        await asyncio.sleep(np.random.random() * 2)
        once = set()
        while not stop.is_set():
            for i, r, client in clients:
                req = dpb.RegisterPoolRequest(
                    pool_id=f"disc-{i:05d}",
                    model=scale_sim.MODEL,
                    region=f"r{i % 4}",
                    frontends=[f"http://127.0.0.1:{10_000 + i}"],
                    relay_id=f"relay-{r}",
                    incarnation=1,
                )
                with contextlib.suppress(Exception):
                    await client.register(req, within=10)
                    if (i, r) not in once:
                        once.add((i, r))
                        registered += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 5.0)
        for _, _, c in clients:
            await c.close()

    watchers = [asyncio.ensure_future(watch(k)) for k in range(cfg.watchers)]
    groups = 20
    per = -(-cfg.discovery_pools // groups)
    renewers = [
        asyncio.ensure_future(renew(g * per, min(per, cfg.discovery_pools - g * per)))
        for g in range(groups)
        if g * per < cfg.discovery_pools
    ]
    try:
        t0 = time.monotonic()
        while registered < cfg.discovery_pools * cfg.relays:
            if time.monotonic() - t0 > 120:
                raise LaunchError(f"discovery: only {registered} leases registered")
            await asyncio.sleep(0.2)
        out["register_all_s"] = round(time.monotonic() - t0, 1)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in synced)), 60)
        await asyncio.sleep(2.0)
        window = 6.0 if cfg.quick else 15.0
        w0, c0, e0, t0 = (
            etcd_writes(etcd.endpoints) if etcd else {},
            cpu_seconds(dpid),
            (sum(cpu_seconds(m.proc.pid) for m in etcd.members if m.proc) if etcd else 0.0),
            time.monotonic(),
        )
        await asyncio.sleep(window)
        w1, c1, e1, t1 = (
            etcd_writes(etcd.endpoints) if etcd else {},
            cpu_seconds(dpid),
            (sum(cpu_seconds(m.proc.pid) for m in etcd.members if m.proc) if etcd else 0.0),
            time.monotonic(),
        )
        span = t1 - t0
        out["renewals_per_s"] = round(cfg.discovery_pools * cfg.relays / 5.0, 1)
        out["discovery_cores"] = round((c1 - c0) / span, 3)
        out["discovery_rss_mb"] = round(rss_bytes(dpid) / 2**20, 1)
        if etcd:
            out["etcd_cores"] = round((e1 - e0) / span, 3)
            out["etcd_writes_per_s"] = {k: round((w1[k] - w0.get(k, 0)) / span, 1) for k in w1}
        # Fan-out: a new registration, timed until every watcher has seen it.
        lat = []
        for k in range(cfg.fanout_changes):
            pool_id = f"fanout-{k:03d}"
            t_call = time.monotonic()
            await stub.RegisterPool(
                dpb.RegisterPoolRequest(
                    pool_id=pool_id,
                    model=scale_sim.MODEL,
                    region="r0",
                    frontends=["http://127.0.0.1:9"],
                    relay_id="relay-0",
                    incarnation=1,
                ),
                timeout=10,
            )
            deadline = time.monotonic() + 30
            while not all(pool_id in s for s in seen):
                if time.monotonic() > deadline:
                    raise LaunchError(f"{pool_id} not seen by every watcher within 30 s")
                await asyncio.sleep(0.001)
            lat.append(max(s[pool_id] for s in seen) - t_call)
            await asyncio.sleep(0.1)
        out["fanout"] = {
            "changes": len(lat),
            "p50_ms": ms(pct(lat, 50)),
            "p99_ms": ms(pct(lat, 99)),
            "max_ms": ms(max(lat)),
        }
        print(
            f"  discovery ({store}): {out['pools']} pools x {cfg.relays} leases, {out['discovery_cores']} cores"
            + (f", etcd {out['etcd_cores']} cores, writes/s {out['etcd_writes_per_s']}" if etcd else "")
            + f"; fan-out to {cfg.watchers} watchers p50/p99 {out['fanout']['p50_ms']}/{out['fanout']['p99_ms']} ms",
            flush=True,
        )
    finally:
        stop.set()
        for t in watchers + renewers:
            t.cancel()
        await asyncio.gather(*watchers, *renewers, return_exceptions=True)
        await channel.close()
        for p in reversed(group.procs):
            p.stop(5.0)
        if etcd:
            etcd.remove_data()
    return out


# ---- the capacity model and SCALE.md ----------------------------------------------------------
def fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of y = a + b x; None with fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    b, a = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)
    return float(a), float(b)


_NODES: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def distinct_of(f: dict[str, Any], trace_requests: int) -> int:
    """Distinct blocks a fleet's pools held at their start (computed again from the trace when a
    run's JSON predates the field)."""
    if "distinct_blocks" in f:
        return int(f["distinct_blocks"])
    if trace_requests not in _NODES:
        hashes, uses, _ = scale_sim.prefix_nodes(TRACE, trace_requests)
        _NODES[trace_requests] = (hashes, uses)
    hashes, uses = _NODES[trace_requests]
    return scale_sim.distinct_blocks(hashes, uses, f["pools"], f["blocks_per_pool"], 0.5)


def capacity_model(
    fleets: list[dict[str, Any]],
    relay: list[dict[str, Any]],
    disc: list[dict[str, Any]],
    trace_requests: int = 300,
) -> dict[str, Any]:
    """Fits from the measured points: cores per event/s, bytes per (pool, block) against index
    words per block (one 64-bit word per 64 streams), relay cores per stream, discovery per lease."""
    model: dict[str, Any] = {}
    # A fleet whose first load never completed holds part of its blocks: no memory or ready point.
    ok = [f for f in fleets if "steady" in f and "gave_up" not in f]
    words = [-(-f["pools"] * f["relays"] // 64) for f in ok]
    bpb = [
        (f["steady"]["rss_mb"] - f["idle_rss_mb"]) * 2**20 / (f["pools"] * f["blocks_per_pool"]) for f in ok
    ]
    distinct = [distinct_of(f, trace_requests) for f in ok]
    bpd = [(f["steady"]["rss_mb"] - f["idle_rss_mb"]) * 2**20 / d for f, d in zip(ok, distinct, strict=True)]
    model["bytes_per_pool_block"] = [
        {
            "pools": f["pools"],
            "index_words": w,
            "bytes": round(b, 1),
            "distinct_blocks": d,
            "bytes_per_distinct": round(e, 1),
        }
        for f, w, b, d, e in zip(ok, words, bpb, distinct, bpd, strict=True)
    ]
    # A frontend that never caught up takes whatever CPU the machine gives it: not a point either.
    measured = ok
    if len(measured) >= 2:
        ev = [f["steady"]["events_per_s"] for f in measured]
        cores = [f["steady"]["frontend_cores"] for f in measured]
        msgs = [f["steady"]["messages_per_s"] for f in measured]
        c = fit(msgs, cores)
        if c:
            model["cores_vs_messages"] = {
                "intercept": c[0],
                "per_message_per_s": c[1],
                "fleets": len(measured),
            }
        c = fit(ev, cores)
        if c:
            model["cores_vs_events"] = {"intercept": c[0], "per_event_per_s": c[1]}
        c = fit(words, bpd)
        if c:
            model["bytes_vs_words"] = {"intercept": c[0], "per_word": c[1]}
        rd = [
            (f["pools"] * f["blocks_per_pool"], f["restart"]["ready_s"])
            for f in ok
            if f.get("restart", {}).get("ready_s")
        ]
        if len(rd) >= 2:
            c = fit([x for x, _ in rd], [y for _, y in rd])
            if c:
                model["ready_vs_pool_blocks"] = {"intercept_s": c[0], "per_million_pool_blocks_s": c[1] * 1e6}
    if relay:
        xs = [r["frontends"] for r in relay if "cores" in r]
        ys = [r["cores"] for r in relay if "cores" in r]
        c = fit(xs, ys)
        if c:
            model["relay_cores"] = {
                "intercept": c[0],
                "per_stream": c[1],
                "at_events_per_s": relay[0].get("paced_rate"),
            }
    for d in disc:
        leases = d["pools"] * d["relays"]
        model[f"discovery_{d['store']}"] = {
            "cores_per_1000_leases": round(d["discovery_cores"] / leases * 1000, 4),
            **(
                {"etcd_cores_per_1000_leases": round(d["etcd_cores"] / leases * 1000, 4)}
                if "etcd_cores" in d
                else {}
            ),
        }
    return model


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _ms(seconds: float | None, digits: int | None = None) -> str:
    """Seconds as milliseconds: a bucket bound as is, a mean to `digits` ('—' without samples)."""
    if seconds is None:
        return "—"
    return f"{seconds * 1000:g}" if digits is None else f"{seconds * 1000:.{digits}f}"


def plot(fleets: list[dict[str, Any]], path: Path, ready_timeout: float) -> None:
    """Cost against pools: frontend cores, RSS, restart ready time (and the slowest health check
    meanwhile), Route p99; a restart not ready in time is drawn at the bound, marked '>'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [f for f in fleets if "steady" in f]
    x = [f["pools"] for f in ok]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [
        ("frontend CPU, cores (steady ingest)", [f["steady"]["frontend_cores"] for f in ok], None),
        ("frontend RSS, MB", [f["steady"]["rss_mb"] for f in ok], None),
        (
            "after a restart: every pool ready / slowest health check, s",
            [f["restart"].get("ready_s") or ready_timeout for f in ok],
            [(main_port_health(f["restart"])["max_ms"] or 0) / 1000 for f in ok],
        ),
        (
            "Route p99, ms",
            [f["route"]["16k"]["p99_ms"] or np.nan for f in ok],
            [f["route"]["1k"]["p99_ms"] or np.nan for f in ok],
        ),
    ]
    labels = [
        None,
        None,
        ("every pool ready", "slowest health check"),
        ("16k-token prompt", "1k-token prompt"),
    ]
    for ax, (title, ys, ys2), lab in zip(axes.ravel(), panels, labels, strict=True):
        ax.plot(x, ys, "o-", label=lab[0] if lab else None)
        if ys2:
            ax.plot(x, ys2, "s--", label=lab[1] if lab else None)
            ax.legend()
        ax.set_xscale("log")
        if lab:  # latencies and times span orders of magnitude
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("pools (x2 relay streams)")
        ax.grid(True, which="both", alpha=0.3)
        for f, xi, yi in zip(ok, x, ys, strict=True):
            late = lab is labels[2] and not f["restart"].get("ready_s")
            ax.annotate(
                (">" if late else "") + _f(yi, 2),
                (xi, yi),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
    blocks = ", ".join(
        f"{f['pools']}x{f['blocks_per_pool']:,}" + (" (first load incomplete)" if "gave_up" in f else "")
        for f in ok
    )
    fig.suptitle(
        f"One global frontend against simulated pools, {ok[0]['rate'] if ok else 0:g} block events/s per pool\n"
        f"(pools x blocks: {blocks})",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def first_ready(f: dict[str, Any]) -> str:
    """When the first load was complete, or how far it got."""
    fl = f["first_load"]
    if fl["ready_s"] is not None:
        return f"{fl['ready_s']:g} s"
    return f"**not complete**: {fl['ready_pools']:,}/{f['pools']:,} pools after {f.get('first_load_limit_s', '?')} s"


def ramped(f: dict[str, Any]) -> str:
    """' (pools started in turn over N s)' for a fleet whose first load was ramped."""
    r = f.get("first_load_ramp_s") or 0
    return f" (pools started in turn over {r:g} s)" if r else ""


def scale_md(result: dict[str, Any], cfg: Config) -> str:
    """SCALE.md from a run's figures: tables, the fitted capacity model, where each part breaks."""
    fleets = [f for f in result["fleets"] if "steady" in f]
    relay = result["relay"]
    disc = result["discovery"]
    model = result["model"]
    L: list[str] = []
    add = L.append
    add("# Scale: one global frontend against a fleet of simulated pools\n")
    add(
        f"Every figure here was printed by `{cfg.command}` on {result['machine']} ({result['date']}); "
        "`make scale` runs the default configuration and rewrites SCALE.md and "
        f"[`{PLOT.relative_to(ROOT)}`]({PLOT.relative_to(ROOT)}), then the goal's load with the settings for a "
        "fleet (1,000 pools at 200 block events/s, `--kv-state summary`, `--telemetry-batch-interval 1`; "
        'docs/operations.md, "Settings for a fleet"), written in the same form to '
        "[`bench/results/scale_fleet.md`](bench/results/scale_fleet.md). The machine is shared, so absolute "
        "figures move between runs; the shape does not.\n"
    )
    add("## What runs\n")
    add(
        f"- A real discovery (`globaldiscovery serve`, memory store, leases {DISCOVERY_TIMING[1]} s / {DISCOVERY_TIMING[3]} s) and a real "
        "`globalrouter serve`, started with meshlaunch. The frontend runs with "
        f"`--max-telemetry-streams max(1024, pools x {cfg.relays} + 256)`: its default (1,024) refuses the streams of "
        f"more than {1024 // cfg.relays} pools of {cfg.relays} relays."
    )
    add(
        f"- Simulated pools (`bench/scale_sim.py pools`, {cfg.workers} worker processes, asyncio), {cfg.relays} relay "
        "replicas each. Every replica registers over KeepAlivePools with poolrelay's own client (from a process "
        "of each worker's own, `bench/scale_sim.py leases`, at the harness's priority: a worker streaming 500 "
        "relays' snapshots on one loop at a low priority missed renewals past the 15 s lease on a busy machine) "
        "and speaks the "
        "relay's telemetry protocol on its own connection: hello, a snapshot in 16,384-block chunks, numbered "
        "deltas, load / readiness / drain / heartbeat every second, a fresh snapshot on SnapshotRequest, and a "
        "redial with the relay's back-off (`poolrelay.retry.TELEMETRY_RECONNECT`) when the stream breaks or the "
        "frontend refuses it."
    )
    add(
        f"- KV traffic: {cfg.rate:g} block events/s per pool (stores and evictions, half each) in deltas every "
        "0.2 s. Half of each pool's blocks, and half of its churn, are 512-token prefix nodes of the first "
        f"{cfg.trace_requests} prompts of `{TRACE.name}` (chained hashes as the trace shares them, so pools share "
        "blocks); the other half are blocks of its own. A pool's block count stays constant."
    )
    add(
        "- Loop lag is measured from outside: a loop of gRPC health checks 20 ms apart, one at a time. Route "
        "dry runs are sent one at a time; their latency includes hashing the prompt at the frontend and a reply "
        "listing every pool.\n"
    )
    add("## Frontend against pools\n")
    add(
        "| pools x blocks | streams | block events/s written (target) | frontend cores | RSS idle → loaded | bytes per pool-block | health p50 / p99 / max (loop lag) | Route 1k p50 / p99 | Route 16k p50 / p99 | first load ready |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    bpb = {b["pools"]: b["bytes"] for b in model.get("bytes_per_pool_block", [])}
    for f in result["fleets"]:
        if "steady" not in f:
            fl = f.get("first_load", {})
            add(
                f"| {f['pools']:,} x {f['blocks_per_pool']:,} | {f['pools'] * f['relays']:,} | {f.get('gave_up', 'failed')}: "
                f"not measured further; health max {_f(fl.get('health', {}).get('max_ms'))} ms during the load |||||||"
            )
            continue
        s, r = f["steady"], f["route"]
        add(
            f"| {f['pools']:,} x {f['blocks_per_pool']:,} | {f['pools'] * f['relays']:,} | {s['events_per_s']:,} ({s['target_events_per_s']:,}) "
            f"| {s['frontend_cores']:.2f} | {f['idle_rss_mb']:,.0f} → {s['rss_mb']:,.0f} MB | {_f(bpb.get(f['pools']))} "
            f"| {_f(s['health']['p50_ms'])} / {_f(s['health']['p99_ms'])} / {_f(s['health']['max_ms'])} ms "
            f"| {_f(r['1k']['p50_ms'])} / {_f(r['1k']['p99_ms'])} ms | {_f(r['16k']['p50_ms'])} / {_f(r['16k']['p99_ms'])} ms "
            f"| {first_ready(f)}{ramped(f)} |"
        )
    lag = [(f["pools"], f["steady"]["loop_lag_metric"]) for f in fleets if f["steady"].get("loop_lag_metric")]
    if lag:
        add(
            "\n`globalrouter_event_loop_lag_seconds` over the steady window: "
            + "; ".join(f"{p} pools: {json.dumps(v)}" for p, v in lag)
            + "."
        )
    else:
        add(
            "\nThe frontend measured exports no `globalrouter_event_loop_lag_seconds`; the health-check loop is the lag measure."
        )
    add(
        "\nBlock events are counted as the relays write them into their streams (both relays of a pool: each "
        "stream is ingested). A write completes once gRPC flow control accepts it, so for a frontend that falls "
        "behind the figure overstates what it has applied by what sits in the connections' windows."
    )
    add(
        "\nThe simulated relays themselves used "
        + ", ".join(f"{f['steady']['sim_cores']:.2f} cores at {f['pools']:,} pools" for f in fleets)
        + f" in the same windows, on the same {os.cpu_count()} cores: "
        + sim_placement_text(cfg)
        + " In a fleet the relays run on other hosts."
    )
    short = [f for f in fleets if (f["steady"].get("rate_share") or 1.0) < RATE_MET]
    if short:
        add(
            "\n**The simulators did not write the target rate** (so the frontend was measured at less): "
            + ", ".join(
                f"{f['steady']['rate_share']:.0%} of it at {f['pools']:,} pools "
                f"({f['steady'].get('produced_events_per_s', 0):,} block events/s produced, "
                f"{f['steady']['events_per_s']:,} written)"
                for f in short
            )
            + "; the machine was busier than the simulators' priority allows for (its load average is below)."
        )
    loads = [(f["pools"], f["steady"].get("machine_load_1min")) for f in fleets]
    if any(v is not None for _, v in loads):
        add(
            f"\nThe machine's 1-minute load average at the end of each steady window ({os.cpu_count()} cores, shared with "
            "other work): " + ", ".join(f"{v} at {p:,} pools" for p, v in loads if v is not None) + "."
        )
    decisions = [
        (f["pools"], label, v["wall"], v["cpu"])
        for f in fleets
        for label, v in (f.get("route_decision_by_size") or {}).items()
        if v.get("wall")
    ]
    if decisions:
        add(
            "\nThe frontend's own decisions in the Route window, by prompt size (`globalrouter_decision_latency_seconds`, "
            "wall, and `globalrouter_decision_cpu_seconds`, the serving thread's CPU: hashing, filter and rank, no wait "
            "for the loop and no reply; p50 / p99 as bucket bounds, mean): "
            + "; ".join(
                f"{p:,} pools, {label}: {_ms(w.get('p50_s'))} / {_ms(w.get('p99_s'))} ms wall "
                f"(mean {_ms(w.get('mean_s'), 2)}), "
                + (
                    f"{_ms(c.get('p50_s'))} / {_ms(c.get('p99_s'))} ms CPU (mean {_ms(c.get('mean_s'), 2)})"
                    if c
                    else "CPU not exported"
                )
                for p, label, w, c in decisions
            )
            + ". Where the wall time is above the CPU time, the thread waited for a CPU or the GIL inside "
            "the decision."
        )
    h = result.get("hashing_ms", {})
    add(
        f"\nHashing a prompt (meshkit.blocks, in the harness's process, median): 1k tokens {_f(h.get('1k'), 3)} ms, "
        f"16k tokens {_f(h.get('16k'), 3)} ms; it is part of every Route latency above.\n"
    )
    add("### A restarted frontend (SIGKILL, then the same command on the same port)\n")
    add(
        "| pools x blocks | health SERVING after | every pool's KV back after | slowest health check meanwhile (harness loop) | health p99 meanwhile (harness loop) | main port health p50 / p99 / max meanwhile (own process) | probe port health p50 / p99 / max meanwhile | frontend CPU in the storm | relay dials so far (streams) | SIGTERM under load exits after |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in fleets:
        rs, st = f["restart"], f["sigterm"]
        term = f"{_f(st['exit_s'])} s" if st["exit_s"] is not None else f"> {st['cap_s']:g} s (killed)"
        add(
            f"| {f['pools']:,} x {f['blocks_per_pool']:,} | {_f(rs['health_serving_s'], 2)} s | {_f(rs['ready_s'])} s ({rs['ready_pools']:,}/{f['pools']:,}) "
            f"| {_f(rs['health']['max_ms'])} ms | {_f(rs['health']['p99_ms'])} ms | {probe_cells(rs, 'main_health')} "
            f"| {probe_cells(rs)} | {_f(rs['frontend_cpu_s'])} s "
            f"| {_f(rs.get('relay_connects_total'))} ({f['pools'] * f['relays']:,}) | {term} |"
        )
    add(
        "\nHealth answers SERVING once the frontend is ready (its directory synced and every listed pool's KV "
        "snapshot arrived from a relay, or `--ready-timeout` passed, 30 s by default); "
        "'every pool's KV back' is when ListPools shows every pool listed, with fresh KV and all its blocks "
        f"(given up after {cfg.ready_timeout:g} s). A relay redials at once after a stream that had sent its snapshot "
        "breaks and backs off after a failed dial; the dials counted include those that failed while the "
        "frontend was down or refused them. Streams broken after their snapshot went out, by the status the relay "
        "saw: "
        + "; ".join(
            f"{f['pools']:,} pools: {json.dumps(f['restart'].get('stream_breaks_total', {}))}" for f in fleets
        )
        + ".\n"
    )
    add(
        "Health is checked in a loop, one check at a time, 20 ms apart, three ways: the main port from the "
        "harness's own event loop (the 'harness loop' columns; that loop also parses the 1,000-pool ListPools pages "
        "and scrapes metrics meanwhile, so its figures include the harness's own waits), and the main port and the "
        "probe port each from a process of its own (so that the harness's loop and GIL do not delay them). The "
        "probe port (`--probe-listen`, `globalrouter.health_probe`) answers from a thread of its own that reads the "
        "status the serving loop publishes (a tick every 0.1 s, readiness, stopping), so it does not wait for "
        "the loop; the main port's answer waits for the serving loop. Failed checks while the restarted process "
        "was not yet listening are not counted.\n"
    )
    redials = [f for f in fleets if f.get("redial")]
    if redials:
        add("### Every relay redialling at once (the frontend up throughout)\n")
        add(
            "| pools x blocks | every relay's snapshot resent after | every pool's KV back after | slowest health check meanwhile (harness loop) | health p99 meanwhile (harness loop) | main port health p50 / p99 / max meanwhile (own process) | probe port health p50 / p99 / max meanwhile |"
        )
        add("|---|---:|---:|---:|---:|---:|---:|")
        for f in redials:
            rd = f["redial"]
            add(
                f"| {f['pools']:,} x {f['blocks_per_pool']:,} | {_f(rd['resent_s'])} s | {_f(rd['ready_s'])} s "
                f"({rd['ready_pools']:,}/{f['pools']:,}) | {_f(rd['health']['max_ms'])} ms | {_f(rd['health']['p99_ms'])} ms "
                f"| {probe_cells(rd, 'main_health')} | {probe_cells(rd)} |"
            )
        add(
            "\nSIGUSR1 makes every simulator process end all its relays' streams at once (a network blip); each "
            "relay redials at once and sends a fresh snapshot. 'Resent' reads the simulators' counters, written "
            "once a second; 'KV back' is ListPools as above, and may count a pool whose other relay's set still "
            "answered.\n"
        )
    storms = [
        (f["pools"], part, f[key]["loop_lag_metric"])
        for f in fleets
        for key, part in (("restart", "restart"), ("redial", "mass redial"))
        if f.get(key, {}).get("loop_lag_metric")
    ]
    if storms:
        add(
            "`globalrouter_event_loop_lag_seconds` in the storms (the restarted process's from its start; the "
            "redial's between two scrapes; bucket bounds, `max_le_s` the bucket of the worst sample): "
            + "; ".join(f"{p:,} pools, {part}: {json.dumps(v)}" for p, part, v in storms)
            + ".\n"
        )
    add("## Relay cost per frontend stream\n")
    add(
        "poolrelay's own `TelemetryHub` and `PoolBlocks` in one process (not a simulation), 10,000 blocks, fed "
        f"worker events (4 blocks stored, 4 evicted) at {cfg.relay_rate:g} block events/s, streaming to N counting "
        "sink frontends in another process (`bench/scale_sim.py sinks`). CPU of the relay process over the "
        f"window; then {cfg.relay_events * 8:,} block events as fast as it goes (top rate, until every stream's queue is written).\n"
    )
    add(
        "| frontends | relay cores at the paced rate | cores per stream | top rate, block events/s | vs one frontend | deltas dropped (overflow) |"
    )
    add("|---:|---:|---:|---:|---:|---:|")
    for r in relay:
        add(
            f"| {r['frontends']} | {_f(r.get('cores'), 3)} | {_f(r.get('cores_per_stream'), 4)} | {_f(r.get('max_rate'))} "
            f"| {_f(r.get('max_rate_vs_one'), 2)} | {_f(r.get('max_dropped'))} |"
        )
    add("\n## Discovery: leases, watch fan-out, etcd\n")
    add(
        "Leases renewed over KeepAlivePools (poolrelay's client, one stream per lease holder) every 5 s; "
        f"{cfg.watchers} WatchPools streams stand for {cfg.watchers} frontends; a fan-out is the time from a "
        f"RegisterPool of a new pool to the last of the {cfg.watchers} watchers seeing it ({cfg.fanout_changes} changes).\n"
    )
    add(
        "| store | pools x relays | renewals/s | discovery cores | etcd cores (3 members) | etcd writes/s | fan-out p50 / p99 / max |"
    )
    add("|---|---:|---:|---:|---:|---:|---:|")
    for d in disc:
        w = d.get("etcd_writes_per_s")
        ws = ", ".join(f"{k} {v:g}" for k, v in w.items()) if w else "—"
        add(
            f"| {d['store']} | {d['pools']:,} x {d['relays']} | {d['renewals_per_s']:g} | {d['discovery_cores']:.3f} | {_f(d.get('etcd_cores'), 3)} | {ws} "
            f"| {_f(d['fanout']['p50_ms'])} / {_f(d['fanout']['p99_ms'])} / {_f(d['fanout']['max_ms'])} ms |"
        )
    add("\n## Capacity model (fitted from the figures above)\n")
    cm = model.get("cores_vs_messages")
    ce = model.get("cores_vs_events")
    if cm and ce:
        add(
            f"- **Frontend CPU** is driven by telemetry messages (deltas plus the four periodic reports per stream per "
            f"second) and the block events inside them. Least squares over the {cm.get('fleets', len(fleets))} fleets that completed their load: cores ≈ {cm['intercept']:.3f} + "
            f"{cm['per_message_per_s'] * 1e6:.1f} µs x messages/s, or equivalently at this mix "
            f"cores ≈ {ce['intercept']:.3f} + {ce['per_event_per_s'] * 1e6:.2f} µs x block events/s."
        )
        if ce["per_event_per_s"] > 0:
            add(
                f"  One core then ingests about {(1 - ce['intercept']) / ce['per_event_per_s']:,.0f} block events/s at "
                f"this mix (each stream counted: a pool's events arrive once per relay), i.e. "
                f"{(1 - ce['intercept']) / ce['per_event_per_s'] / (cfg.rate * cfg.relays):,.0f} pools of {cfg.relays} relays at {cfg.rate:g} events/s "
                f"or {(1 - ce['intercept']) / ce['per_event_per_s'] / (200 * cfg.relays):,.0f} at 200 events/s"
                + (
                    " (an extrapolation: the largest fleet measured here did not keep up on this shared machine)."
                    if any("gave_up" in f for f in result["fleets"])
                    else "."
                )
            )
    bw = model.get("bytes_vs_words")
    points = model.get("bytes_per_pool_block", [])
    if points:
        fitted = bw is not None and len(points) >= 3 and bw["per_word"] > 0
        at32 = bw["intercept"] + 32 * bw["per_word"] if bw else 0.0
        add(
            "- **Frontend memory** (RSS growth over the idle frontend) per distinct block held, against the index's "
            "mask width (one 64-bit word per 64 streams)"
            + (f": bytes ≈ {bw['intercept']:.0f} + {bw['per_word']:.1f} x words" if fitted and bw else "")
            + "; measured "
            + ", ".join(
                f"{b['bytes_per_distinct']:.0f} B per distinct block ({b['distinct_blocks']:,} distinct; {b['bytes']:.0f} B per pool-block) "
                f"at {b['pools']:,} pools ({b['index_words']} words)"
                for b in model["bytes_per_pool_block"]
            )
            + (
                f". At 1,000 pools x 2 relays (32 words) the fit gives {at32:.0f} B per distinct block: 1,000 pools x "
                f"1,000,000 blocks, if few were shared, would need about {at32 * 1e9 / 2**30:,.0f} GiB."
                if fitted
                else ". RSS moves in steps (the index's table is rebuilt with headroom as it grows, and freed memory is "
                "not always returned to the system), so these points are not fitted against "
                "the mask width; a fleet with more streams per block has to be measured complete for that."
            )
        )
    rv = model.get("ready_vs_pool_blocks")
    if rv:
        add(
            f"- **Ready after a restart** grows with the state to load: ≈ {rv['intercept_s']:.1f} s + "
            f"{rv['per_million_pool_blocks_s']:.2f} s per million (pool, block) pairs over the complete fleets; 1,000 pools "
            f"x 100,000 blocks would take {rv['intercept_s'] + rv['per_million_pool_blocks_s'] * 100:.0f} s by that line"
            + (
                ". It is a lower bound: "
                + ", ".join(
                    f"{f['pools']:,} pools x {f['blocks_per_pool']:,} blocks was not back within {cfg.ready_timeout:g} s "
                    f"({f['restart']['ready_pools']:,}/{f['pools']:,})"
                    for f in result["fleets"]
                    if "restart" in f and f["restart"]["ready_s"] is None
                )
                + ", so the number of streams, not only the blocks, sets the time."
                if any("restart" in f and f["restart"]["ready_s"] is None for f in result["fleets"])
                else "."
            )
        )
    rc = model.get("relay_cores")
    if rc:
        add(
            f"- **Relay**: cores ≈ {rc['intercept']:.3f} + {rc['per_stream']:.4f} x frontend streams at "
            f"{_f(rc['at_events_per_s'])} block events/s."
        )
    for d in disc:
        k = model.get(f"discovery_{d['store']}", {})
        add(
            f"- **Discovery ({d['store']})**: {k.get('cores_per_1000_leases')} cores per 1,000 leases renewed every 5 s"
            + (
                f"; etcd {k.get('etcd_cores_per_1000_leases')} cores per 1,000 leases (all three members)"
                if "etcd_cores_per_1000_leases" in k
                else ""
            )
            + f"; fan-out to {d['watchers']} watchers p99 {_f(d['fanout']['p99_ms'])} ms."
        )
    add("\n## Where it breaks, and what to do past it\n")
    big = fleets[-1] if fleets else None
    if big:
        rs = big["restart"]
        add(
            f"- **The serving loop** stalls while snapshots are applied: at {big['pools']:,} pools a restart left health "
            f"checks waiting up to {_f(main_port_health(rs)['max_ms'])} ms (the main port's, from a checker of its own where it ran), and the first load up to {_f(big['first_load']['health']['max_ms'])} ms (checked from the harness's loop); "
            + (
                f"every pool's KV was back {_f(rs['ready_s'])} s after the restart. "
                if rs["ready_s"] is not None
                else f"not every pool's KV was back {cfg.ready_timeout:g} s after the restart ({rs['ready_pools']:,}/{big['pools']:,}). "
            )
            + "A liveness probe with a shorter timeout kills the frontend, whose restart starts the same storm. "
            "Snapshots are already applied in bounded steps and health waits for the KV state (readiness); what is "
            "left is the number of streams: each stream's hello, snapshot chunks and messages are handled on the one "
            "loop (gRPC's read of each message is the largest single cost in the profile). Past it: fewer frontends "
            "per relay fleet (each frontend holding a shard of the pools), or several ingest processes per frontend."
        )
        add(
            f"- **Steady-state lag**: at {big['pools']:,} pools the health loop's p99 is {_f(big['steady']['health']['p99_ms'])} ms "
            f"and a 16k-token Route p99 {_f(big['route']['16k']['p99_ms'])} ms: every call waits behind telemetry "
            "messages on the same loop (the ingest is paced to 4 ms a loop turn, but the loop has no idle time left). "
            "Past it: fewer, larger deltas per stream (a longer delta interval at the relays), and the per-pool "
            "summary (`--kv-state summary`) whose fold is cheaper per event."
        )
        add(
            f"- **Memory**: the index keeps a mask bit per stream for every distinct block (one 64-bit word per 64 "
            f"streams); at {big['pools']:,} pools x {big['blocks_per_pool']:,} blocks the frontend's RSS reached "
            f"{big['steady']['rss_mb']:,.0f} MB"
            + (" with its load incomplete" if "gave_up" in big else "")
            + " with the exact index (the default). Holding 1,000,000 blocks a pool at 1,000 pools takes "
            "`--kv-state summary`, whose state does not grow with the streams per block (about 2.7 bytes per "
            "(pool, block): BENCHMARKS.md, KV summary at fleet scale)."
        )
        st = big["sigterm"]
        add(
            f"- **Stop**: SIGTERM at {big['pools']:,} pools "
            + (
                f"exited after {_f(st['exit_s'])} s."
                if st["exit_s"] is not None
                else f"had not exited after {st['cap_s']:g} s (every stream's end costs a pass over the index)."
            )
        )
    if relay:
        last = relay[-1]
        add(
            f"- **Relay fan-out**: feeding {last['frontends']} frontends the relay reaches {_f(last.get('max_rate_vs_one'), 2)} of its "
            "one-frontend top rate (each delta is serialized once for all streams; the rest is per-stream writes). "
            "Past it: relay replicas per group of frontends."
        )
    for d in disc:
        add(
            f"- **Discovery ({d['store']})**: {d['pools']:,} pools x {d['relays']} leases cost "
            f"{d['discovery_cores']:.2f} cores"
            + (f" and {d['etcd_cores']:.2f} etcd cores" if "etcd_cores" in d else "")
            + f" with leases renewed every {DISCOVERY_TIMING[1]} s; fan-out to {d['watchers']} watchers p99 "
            f"{_f(d['fanout']['p99_ms'])} ms."
        )
    if result.get("errors"):
        add("\n## Parts that failed in this run\n")
        for e in result["errors"]:
            add(f"- {e}")
    gave_up = [f for f in result["fleets"] if "gave_up" in f]
    for f in gave_up:
        add(
            f"- {f['pools']:,} pools: {f['gave_up']}; streams broken meanwhile {json.dumps(f['first_load'].get('stream_breaks', {}))}."
        )
    add("\n## Raw results\n")
    add(f"`{RESULTS_JSON.relative_to(ROOT)}` holds every figure of the last run as JSON.\n")
    return "\n".join(L) + "\n"


# ---- main ---------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a ~2-minute smoke run (small fleets)")
    p.add_argument("--pools", default=None, help="comma-separated pool counts (default 10,100,1000)")
    p.add_argument(
        "--blocks", default=None, help="blocks per pool, one per pool count (default 100000,100000,10000)"
    )
    p.add_argument("--relays", type=int, default=2, help="relay replicas per pool")
    p.add_argument("--rate", type=float, default=50.0, help="block events/s per pool")
    p.add_argument("--workers", type=int, default=4, help="simulator processes")
    p.add_argument("--steady", type=float, default=None, help="seconds of the steady ingest window")
    p.add_argument("--fanouts", default=None, help="relay fan-outs (default 1,10,50)")
    p.add_argument(
        "--relay-events",
        type=int,
        default=None,
        help="worker events of the relay's top-rate run (default 20,000)",
    )
    p.add_argument("--watchers", type=int, default=50)
    p.add_argument("--discovery-pools", type=int, default=None)
    p.add_argument("--no-etcd", action="store_true", help="skip the 3-member etcd run")
    p.add_argument(
        "--ramp-from",
        type=int,
        default=500,
        help="fleets of this many pools or more start their pools in turn",
    )
    p.add_argument("--ramp-per-pool", type=float, default=0.05, help="seconds between pools in such a start")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: fleet, relay, discovery")
    p.add_argument("--out", default=None, help="SCALE.md path (default: SCALE.md, or none with --quick)")
    p.add_argument("--log-dir", default=None)
    p.add_argument(
        "--frontend-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="an extra flag of the measured frontend, repeatable, e.g. --frontend-flag=--kv-state "
        "--frontend-flag=summary",
    )
    p.add_argument(
        "--no-batch", action="store_true", help="simulated relays send one message per write (no batches)"
    )
    p.add_argument(
        "--sim-nice",
        type=int,
        default=SIM_NICE,
        help=f"niceness of the simulated pools' processes, 0..19 (default {SIM_NICE}: they take the CPU the "
        "measured frontend leaves, as relays on other hosts would)",
    )
    p.add_argument(
        "--frontend-nice",
        type=int,
        default=0,
        help="niceness of the measured frontend and its session, -20..19 (below 0 needs root; default 0): "
        "emulates a frontend with cores of its own, which this shared machine cannot give it",
    )
    p.add_argument(
        "--discovery-nice",
        type=int,
        default=0,
        help="niceness of the discovery process and its session, 0..19 (default 0; in a fleet it runs elsewhere)",
    )
    p.add_argument(
        "--frontend-cpu",
        type=int,
        default=None,
        metavar="K",
        help="keep CPU K for the frontend: the simulated pools run on the other CPUs (default: anywhere)",
    )
    p.add_argument(
        "--route-candidates",
        type=int,
        default=0,
        metavar="K",
        help="RouteRequest.max_candidates of the Route dry runs (default 0: every eligible pool listed; "
        "1: the choice alone)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the frontend in the steady window, the Route window, the mass redial and the restart (files in --log-dir)",
    )
    p.add_argument(
        "--steady-routes",
        type=float,
        default=0.0,
        metavar="RATE",
        help="Route dry runs a second sent during the steady window, 1k and 16k tokens alternating "
        "(default 0: none; 200 for issue 19's decisions beside the ingest)",
    )
    p.add_argument(
        "--render", default=None, help="rewrite SCALE.md and the plot from a run's JSON (--render=FILE)"
    )
    a = p.parse_args(argv)
    quick = a.quick
    pools = tuple(int(x) for x in (a.pools or ("3,20" if quick else "10,100,1000")).split(","))
    blocks_s = a.blocks or ("2000,2000" if quick else "100000,100000,10000")
    blocks = tuple(int(x) for x in blocks_s.split(","))
    if len(blocks) == 1:
        blocks = blocks * len(pools)
    if len(blocks) != len(pools):
        p.error(f"--blocks needs one value or one per pool count ({len(pools)}), got {len(blocks)}")
    if any(n <= 0 for n in pools + blocks) or a.relays <= 0 or a.rate < 0 or a.workers <= 0:
        p.error("--pools, --blocks, --relays and --workers must be > 0, --rate >= 0")
    if not 0 <= a.sim_nice <= 19:
        p.error(f"--sim-nice must be 0..19, got {a.sim_nice}")
    if not -20 <= a.frontend_nice <= 19:
        p.error(f"--frontend-nice must be -20..19, got {a.frontend_nice}")
    if not 0 <= a.discovery_nice <= 19:
        p.error(f"--discovery-nice must be 0..19, got {a.discovery_nice}")
    if a.route_candidates < 0:
        p.error(f"--route-candidates must be >= 0, got {a.route_candidates}")
    if not 0 <= a.steady_routes <= 10_000:
        p.error(f"--steady-routes must be 0..10000 a second, got {a.steady_routes}")
    if a.frontend_cpu is not None:
        allowed = os.sched_getaffinity(0)
        if a.frontend_cpu not in allowed or len(allowed) < 2:
            p.error(
                f"--frontend-cpu {a.frontend_cpu}: must be one of the CPUs this process may use, "
                f"{sorted(allowed)}, with at least one other left for the simulators"
            )
    skip = {s for s in a.skip.split(",") if s}
    if skip - {"fleet", "relay", "discovery"}:
        p.error(f"--skip takes fleet, relay, discovery; got {sorted(skip)}")
    log_dir = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="bench-scale-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = (
        "python -m bench.bench_scale" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    )
    cfg = Config(
        pools=() if "fleet" in skip else pools,
        blocks=() if "fleet" in skip else blocks,
        relays=a.relays,
        rate=a.rate,
        workers=a.workers,
        steady=a.steady or (5.0 if quick else 20.0),
        route_seconds=4.0 if quick else 15.0,
        routes=50 if quick else 300,
        ready_timeout=120.0 if quick else 150.0,
        sigterm_cap=10.0 if quick else 30.0,
        fanouts=()
        if "relay" in skip
        else tuple(int(x) for x in (a.fanouts or ("1,5" if quick else "1,10,50")).split(",")),
        relay_rate=2000.0,
        relay_events=a.relay_events or (5000 if quick else 20000),
        watchers=0 if "discovery" in skip else (min(a.watchers, 10) if quick else a.watchers),
        discovery_pools=a.discovery_pools or (50 if quick else 1000),
        fanout_changes=5 if quick else 20,
        etcd=not a.no_etcd,
        trace_requests=300,
        ramp_from=a.ramp_from,
        ramp_per_pool=a.ramp_per_pool,
        quick=quick,
        log_dir=log_dir,
        frontend_flags=tuple(a.frontend_flag),
        batch=not a.no_batch,
        command=cmd.strip(),
        out=a.out if a.out is not None else ("" if quick else str(SCALE_MD)),
        sim_nice=a.sim_nice,
        frontend_nice=a.frontend_nice,
        discovery_nice=a.discovery_nice,
        frontend_cpu=a.frontend_cpu,
        route_candidates=a.route_candidates,
        steady_routes=a.steady_routes,
        profile=a.profile,
    )
    return cfg


def table(result: dict[str, Any]) -> str:
    """The headline figures as a plain-text table."""
    rows = [
        (
            "pools",
            "blocks",
            "events/s",
            "cores",
            "rss MB",
            "lag p50/p99 ms",
            "route16k p99",
            "restart ready s",
            "health max ms",
        )
    ]
    for f in result["fleets"]:
        if "steady" not in f:
            continue
        s = f["steady"]
        rows.append(
            (
                str(f["pools"]),
                str(f["blocks_per_pool"]),
                str(s["events_per_s"]),
                f"{s['frontend_cores']:.2f}",
                f"{s['rss_mb']:.0f}",
                f"{s['health']['p50_ms']}/{s['health']['p99_ms']}",
                str(f["route"]["16k"]["p99_ms"]),
                str(f["restart"]["ready_s"]),
                str(main_port_health(f["restart"])["max_ms"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


async def amain(cfg: Config) -> dict[str, Any]:
    nodes_path = cfg.log_dir / "nodes.npz"
    hashes, uses, tokens = scale_sim.prefix_nodes(TRACE, cfg.trace_requests)
    np.savez(nodes_path, hashes=hashes, uses=uses)
    print(
        f"shared prefixes: {len(hashes):,} nodes, {hashes.size:,} blocks from {cfg.trace_requests} prompts of {TRACE.name}",
        flush=True,
    )
    result: dict[str, Any] = {
        "machine": f"{platform.node() or 'this machine'}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "command": cfg.command,
        "hashing_ms": {k: ms(v) for k, v in hashing_seconds(tokens).items()},
        "fleets": [],
        "relay": [],
        "discovery": [],
        "errors": [],
    }
    for pools, blocks in zip(cfg.pools, cfg.blocks, strict=True):
        started = time.monotonic()
        print(
            f"== {pools} pools x {blocks:,} blocks, {cfg.relays} relays each, {cfg.rate:g} block events/s per pool",
            flush=True,
        )
        with process_group(cfg.log_dir / f"fleet-{pools}") as group:
            (cfg.log_dir / f"fleet-{pools}").mkdir(exist_ok=True)
            try:
                result["fleets"].append(await run_fleet(cfg, group, nodes_path, tokens, pools, blocks))
            except Exception as exc:
                print(f"{pools} pools failed: {exc!r}", flush=True)
                result["errors"].append(f"{pools} pools: {exc!r}"[:500])
        (cfg.log_dir / "partial.json").write_text(json.dumps(result, indent=1))
        print(f"== {pools} pools done in {time.monotonic() - started:.0f} s", flush=True)
    if cfg.fanouts:
        print(f"== relay cost per frontend stream ({', '.join(map(str, cfg.fanouts))} frontends)", flush=True)
        (cfg.log_dir / "relay").mkdir(exist_ok=True)
        try:
            with process_group(cfg.log_dir / "relay") as group:
                result["relay"] = await run_relay(cfg, group)
        except Exception as exc:  # recorded: the other parts' figures still stand
            print(f"relay part failed: {exc!r}", flush=True)
            result["errors"].append(f"relay: {exc!r}"[:500])
    if cfg.watchers:
        for store in ("memory", "etcd") if cfg.etcd else ("memory",):
            print(f"== discovery ({store}): {cfg.discovery_pools} pools, {cfg.watchers} watchers", flush=True)
            (cfg.log_dir / f"discovery-{store}").mkdir(exist_ok=True)
            try:
                with process_group(cfg.log_dir / f"discovery-{store}") as group:
                    result["discovery"].append(await run_discovery(cfg, group, store))
            except Exception as exc:
                print(f"discovery ({store}) part failed: {exc!r}", flush=True)
                result["errors"].append(f"discovery {store}: {exc!r}"[:500])
    result["model"] = capacity_model(
        result["fleets"], result["relay"], result["discovery"], cfg.trace_requests
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    # Both spellings, "--render=FILE" and "--render FILE": the second used to fall through to a
    # whole new run (argparse took it, nothing read it).
    render = [a.split("=", 1)[1] for a in args if a.startswith("--render=")] + [
        args[i + 1] for i, a in enumerate(args[:-1]) if a == "--render"
    ]
    if render:  # SCALE.md and the plot again from a run's JSON (its figures, nothing measured)
        result = json.loads(Path(render[0]).read_text())
        saved = result["config"]
        cfg = Config(**{**saved, "log_dir": Path(saved["log_dir"])})
        result["model"] = capacity_model(
            result["fleets"], result["relay"], result["discovery"], cfg.trace_requests
        )
    else:
        cfg = parse(argv)
        started = time.monotonic()
        print(f"logs in {cfg.log_dir}", flush=True)
        result = asyncio.run(amain(cfg))
        result["elapsed_s"] = round(time.monotonic() - started)
        result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    print(json.dumps(result, indent=1))
    print(table(result))
    for k, v in result["model"].items():
        print(f"model {k}: {json.dumps(v)}")
    out = cfg.out
    if out:
        text = scale_md(result, cfg)
        Path(out).write_text(text)
        # The default SCALE.md keeps its JSON in bench/results; another --out gets it beside.
        raw = RESULTS_JSON if Path(out).resolve() == SCALE_MD else Path(out).with_suffix(".json")
        raw.parent.mkdir(exist_ok=True)
        if not render:
            raw.write_text(json.dumps(result, indent=1) + "\n")
        if result["fleets"]:
            plot(
                result["fleets"],
                png := PLOT if raw == RESULTS_JSON else Path(out).with_suffix(".png"),
                cfg.ready_timeout,
            )
        print(text)
        print(
            f"wrote {out}, {png if result['fleets'] else 'no plot'} and {raw} (the run took {result['elapsed_s']} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

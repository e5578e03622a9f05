"""Benchmark of the global frontend: added latency against calling the pool directly, throughput, CPU.

One real mesh on 127.0.0.1 (discovery, one mocker pool with a high speed-up and its relay, global
frontends). In the same run and interleaved (the order rotates every round), so all see the same
machine noise:
- TTFT (time from the call to the first token message) direct to the pool's PoolFrontendService
  vs through a global frontend's Generate: p50/p99 and the added latency;
- requests per second with 16-token outputs, a closed loop of concurrent clients: direct, through
  one frontend, and through two frontend processes (the client spreads its requests over both:
  the scale-out), repeated rounds, the median of the per-round ratios to direct;
- CPU time per request of each process (frontend, pool, this client) read from /proc: on a shared
  2-core machine the cores are the bottleneck, so this says where the throughput goes, and it is
  much less noisy than wall-clock rates;
- where the frontend spends its time: a py-spy profile (when py-spy is installed) of the frontend
  under the same load, its top entries.
`--baseline-src DIR` adds a frontend run from another source tree (e.g. `git archive main`), measured
and profiled beside this tree's: a before/after in one run.
Writes bench/results/bench_frontend.md.

Run: .venv/bin/python -m bench.bench_frontend [--ttft-requests N] [--seconds S] [--rounds R]
     [--concurrency C] [--baseline-src DIR] [--no-profile]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.measure import FAST_POOL
from globalrouter.v1 import pool_frontend_pb2, pool_frontend_pb2_grpc, router_pb2, router_pb2_grpc
from meshlaunch import MODEL, Mesh, RouterProc, free_port, process_group, wait_healthy

ROOT = Path(__file__).resolve().parent.parent

RESULT = ROOT / "bench" / "results" / "bench_frontend.md"
OUTPUT_TOKENS = 16
TICKS = os.sysconf("SC_CLK_TCK")
PROFILE_RATE = 200
TOP = 12


def prompt(i: int) -> list[int]:
    """A 128-token prompt, distinct for every i (its first two tokens spell i), so no request finds
    a cached prefix whatever ran before."""
    return [i % 30_000, i // 30_000 % 30_000] + [(i * 7919 + k * 31) % 30_000 for k in range(2, 128)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (utime and stime of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Target:
    """Issues one streaming request and returns (ttft seconds, tokens, messages of any kind).

    Requests ask for combined messages (combine_messages): a pool or frontend that knows the field
    may put the first tokens in the admission and the finish or summary in the last tokens.

    Through frontends, requests go round-robin over `channels` (one per frontend process)."""

    def __init__(
        self, name: str, channels: list[grpc.aio.Channel], via_router: bool, pids: tuple[int, ...] = ()
    ) -> None:
        self.name = name
        self.via_router = via_router
        self.pids = pids
        self._next = 0
        if via_router:
            self._stubs = [router_pb2_grpc.RouterServiceStub(c) for c in channels]
        else:
            self._pool = pool_frontend_pb2_grpc.PoolFrontendServiceStub(channels[0])

    async def one(self, i: int, max_tokens: int) -> tuple[float, int, int]:
        tokens = prompt(i)
        started = time.perf_counter()
        ttft = None
        count = messages = 0
        call: grpc.aio.UnaryStreamCall[Any, Any]
        if self.via_router:
            self._next += 1
            call = self._stubs[self._next % len(self._stubs)].Generate(
                router_pb2.GenerateRequest(
                    model=MODEL,
                    prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
                    max_tokens=max_tokens,
                    combine_messages=True,
                ),
                timeout=30,
            )
        else:
            call = self._pool.Generate(
                pool_frontend_pb2.PoolFrontendServiceGenerateRequest(
                    request_id=f"bench-{i}",
                    model=MODEL,
                    token_ids=tokens,
                    max_tokens=max_tokens,
                    combine_messages=True,
                ),
                timeout=30,
            )
        async for msg in call:
            messages += 1
            kind = msg.WhichOneof("payload")
            if kind == "tokens":
                ids = msg.tokens.token_ids
            elif kind == "admission":  # only the pool's own stream has admissions
                ids = cast(
                    "pool_frontend_pb2.PoolFrontendServiceGenerateResponse", msg
                ).admission.tokens.token_ids
            else:
                continue
            if ids and ttft is None:
                ttft = time.perf_counter() - started
            count += len(ids)
        return ttft or float("nan"), count, messages


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def rotated(targets: list[Target], k: int) -> list[Target]:
    k %= len(targets)
    return targets[k:] + targets[:k]


async def ttft_run(targets: list[Target], n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {t.name: [] for t in targets}
    for t in targets:  # warm-up: channels, caches, code paths
        for i in range(20):
            await t.one(10_000_000 + 1000 * len(out[t.name]) + i, 1)
    for i in range(n):
        for k, target in enumerate(rotated(targets, i)):
            ttft, _, _ = await target.one(20_000_000 + i * len(targets) + k, 1)
            out[target.name].append(ttft)
    return out


async def empty_round_trips(channel: grpc.aio.Channel, n: int) -> list[float]:
    """Seconds per grpc.health.v1 Check on `channel`: one gRPC round trip to a Python aio server
    whose handler does next to nothing (the floor of what any extra hop costs here)."""
    stub = health_pb2_grpc.HealthStub(channel)
    out = []
    for _ in range(n):
        started = time.perf_counter()
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        out.append(time.perf_counter() - started)
    return out


async def idle_cpu_rate(pid: int, seconds: float) -> float:
    """CPU seconds per second `pid` spends with no request in flight."""
    before = cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


_RUNS = itertools.count()


@dataclass
class Run:
    """One closed-loop throughput run of one target."""

    rate: float
    requests: int
    messages: int
    cpu_us: dict[str, float] = field(default_factory=dict)
    """CPU microseconds per request by process role."""


async def throughput_run(
    target: Target,
    seconds: float,
    concurrency: int,
    max_requests: int,
    pids: dict[str, tuple[int, ...]] | None = None,
) -> Run:
    done = messages = 0
    deadline = time.perf_counter() + seconds
    first = 30_000_000 + next(_RUNS) * max_requests  # prompts no earlier run sent
    counter = iter(range(first, first + max_requests))

    async def worker() -> None:
        nonlocal done, messages
        for i in counter:
            if time.perf_counter() >= deadline:
                return
            _, n, m = await target.one(i, OUTPUT_TOKENS)
            assert n == OUTPUT_TOKENS
            done += 1
            messages += m

    pids = pids or {}
    before = {role: sum(cpu_seconds(p) for p in ps) for role, ps in pids.items()}
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    cpu = {
        role: (sum(cpu_seconds(p) for p in ps) - before[role]) / max(1, done) * 1e6
        for role, ps in pids.items()
    }
    return Run(done / elapsed, done, messages, cpu)


def py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


async def profile(spy: str, target: Target, pid: int, seconds: float, concurrency: int, out: Path) -> None:
    """Records py-spy (sampling, non-blocking) on `pid` while `target` runs the throughput load."""
    proc = await asyncio.create_subprocess_exec(
        *(spy, "record", "--pid", str(pid), "--duration", f"{seconds:g}", "--rate", str(PROFILE_RATE)),
        *("--nonblocking", "--format", "raw", "--output", str(out)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    await asyncio.sleep(0.3)  # let py-spy attach before the load starts
    await throughput_run(target, seconds, concurrency, 1_000_000)
    await asyncio.wait_for(proc.wait(), 60)


def top_entries(collapsed: Path) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """(samples, top self entries, top inclusive entries of the project's own code) of py-spy's
    raw (collapsed) output; entries are functions, their lines merged."""
    self_n: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [f.rsplit(":", 1)[0] + ")" if f.endswith(")") and ":" in f else f for f in stack.split(";")]
        total += int(n)
        self_n[frames[-1]] += int(n)
        for f in set(frames):
            if ("(globalrouter/" in f or "(meshkit/" in f) and "cli.py)" not in f:  # not the entry point
                incl[f] += int(n)
    return total, self_n.most_common(TOP), incl.most_common(TOP)


async def python_work(requests: int, repeats: int) -> float:
    """CPU microseconds per request of the frontend's own Python work (validation, decision, the
    run loop, metrics): RouterServicer.Generate with the pool link and the client replaced by
    in-memory doubles, so no gRPC at all; the best of `repeats`."""
    from globaldiscovery.v1 import discovery_pb2
    from globalrouter.config import RouterConfig
    from globalrouter.router_api import RouterServicer
    from globalrouter.server import create_server
    from globalrouter.serving import Admitted, ServingLinks

    first = pool_frontend_pb2.PoolTokens(token_ids=[7])
    rest = list(range(OUTPUT_TOKENS - 1))
    finish = pool_frontend_pb2.PoolFinish(reason=pool_frontend_pb2.POOL_FINISH_REASON_LENGTH)
    admission = pool_frontend_pb2.PoolAdmission(worker_id="w0", prompt_blocks=8)
    # A tree whose protocol combines messages gets them as the mocker sends them then (admission
    # with the first token, the other 15 with the finish); an older tree gets them separately.
    combined = "finish" in pool_frontend_pb2.PoolTokens.DESCRIPTOR.fields_by_name
    if combined:
        messages = [
            pool_frontend_pb2.PoolFrontendServiceGenerateResponse(
                tokens=pool_frontend_pb2.PoolTokens(token_ids=rest, finish=finish)
            )
        ]
    else:
        messages = [
            pool_frontend_pb2.PoolFrontendServiceGenerateResponse(tokens=first),
            pool_frontend_pb2.PoolFrontendServiceGenerateResponse(
                tokens=pool_frontend_pb2.PoolTokens(token_ids=rest)
            ),
            pool_frontend_pb2.PoolFrontendServiceGenerateResponse(finish=finish),
        ]

    class Stream:  # the pool's messages after the admission, as the gRPC link delivers them
        def __init__(self) -> None:
            self._left = iter(messages)

        async def read(self):
            return next(self._left, None)

        def cancel(self) -> None:
            pass

    class Links(ServingLinks):
        async def admit(self, pool, request):
            url = self.next_frontend(pool)
            self._in_flight[url] = self._in_flight.get(url, 0) + 1
            if combined:
                return Admitted(
                    pool_id=pool.pool_id, url=url, stream=Stream(), admission=admission, first=first
                )
            return Admitted(pool_id=pool.pool_id, url=url, stream=Stream(), admission=admission)

    class Context:
        def invocation_metadata(self) -> tuple:
            return ()

        async def send_initial_metadata(self, metadata) -> None:
            pass

        def set_trailing_metadata(self, metadata) -> None:
            pass

        async def abort(self, *args) -> None:
            raise AssertionError(args)

    router = create_server(RouterConfig(listen="127.0.0.1:0"))
    router.core.table.apply_listed(
        discovery_pb2.Pool(pool_id="bench-pool", model=MODEL, region="r1", frontends=["http://127.0.0.1:1"])
    )
    servicer = RouterServicer(router.core, Links(0.1, 1.0), router.config)
    context = Context()
    requests_ = [
        router_pb2.GenerateRequest(
            model=MODEL,
            prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=prompt(i))),
            max_tokens=OUTPUT_TOKENS,
        )
        for i in range(requests)
    ]
    if combined:
        for request in requests_:
            request.combine_messages = True
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for request in requests_:
            async for _ in servicer.Generate(request, cast("grpc.aio.ServicerContext[Any, Any]", context)):
                pass
        best = min(best, (time.process_time() - started) / requests * 1e6)
    await router.handle.server.stop(0)
    return best


def python_work_of(src: Path | None) -> float:
    """python_work() of the source tree `src` (this one when None), in a child process."""
    # This file run as __main__ with `src` first on the path: its globalrouter is the one measured.
    code = (
        f"import runpy, sys; sys.path.insert(0, {str(src or ROOT)!r}); sys.argv[1:] = ['--python-work']; "
        f"runpy.run_path({__file__!r}, run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"--python-work failed: {out.stderr[-2000:]}")
    return float(out.stdout.split()[-1])


_SERVE = "from globalrouter.cli import main; sys.exit(main())"


def start_frontend(mesh: Mesh, name: str, src: Path, *extra: str) -> RouterProc:
    """A global frontend process running the source tree `src` (with `extra` flags); every frontend
    of the run is started this same way (no /metrics endpoint), so they differ only in their code."""
    address = f"127.0.0.1:{free_port()}"
    proc = mesh.group.start(
        name,
        [
            # `src` first on sys.path: PYTHONPATH alone would come after the working directory
            # (this tree), so a baseline frontend would silently run this tree's code.
            *(sys.executable, "-c", f"import sys; sys.path.insert(0, {str(src)!r}); {_SERVE}"),
            *("serve", "--listen", address, "--discovery", mesh.discovery, "--grace", "1"),
            *("--log-level", "warning"),
            *extra,
        ],
    )
    wait_healthy(address, proc=proc)
    return RouterProc(address, proc, 0)


async def measure(
    pool_pid: int, pool_address: str, frontends: dict[str, RouterProc], args, tmp: Path
) -> dict:
    channels = {"direct": grpc.aio.insecure_channel(pool_address)} | {
        name: grpc.aio.insecure_channel(f.address) for name, f in frontends.items()
    }
    fe = frontends["frontend"]
    targets = [
        Target("direct", [channels["direct"]], False),
        Target("frontend", [channels["frontend"]], True, (fe.proc.pid,)),
        Target(
            "two frontends",
            [channels["frontend"], channels["second"]],
            True,
            (fe.proc.pid, frontends["second"].proc.pid),
        ),
    ]
    if "baseline" in frontends:
        targets.append(
            Target("baseline frontend", [channels["baseline"]], True, (frontends["baseline"].proc.pid,))
        )
    all_frontends = tuple(f.proc.pid for f in frontends.values())
    try:
        ttft = await ttft_run(targets, args.ttft_requests)
        round_trips = await empty_round_trips(channels["frontend"], args.ttft_requests)
        runs: dict[str, list[Run]] = {t.name: [] for t in targets}
        pool_idle = await idle_cpu_rate(pool_pid, 2.0)
        for r in range(args.rounds):
            for target in rotated(targets, r):
                idle = tuple(p for p in all_frontends if p not in target.pids)
                pids = {"frontend": target.pids, "pool": (pool_pid,), "client": (os.getpid(),)}
                if idle:  # frontends not serving this run only ingest its telemetry
                    pids["telemetry"] = idle
                run = await throughput_run(target, args.seconds, args.concurrency, 1_000_000, pids)
                # What serving these requests cost a frontend: its CPU less what a frontend that
                # served none spent meanwhile (its background work and the telemetry ingest, which
                # weigh more per request when the rate is low).
                if idle:
                    run.cpu_us["telemetry"] /= len(idle)
                    run.cpu_us["serving"] = run.cpu_us["frontend"] - run.cpu_us["telemetry"] * len(
                        target.pids
                    )
                # The pool's own background (its relay feeds, load reports) likewise.
                run.cpu_us["pool"] -= pool_idle / run.rate * 1e6
                runs[target.name].append(run)
        profiles = {}
        spy = py_spy() if args.profile else None
        if spy is not None:
            for target in [targets[1], *targets[3:]]:
                out = tmp / f"profile-{target.name.replace(' ', '-')}.txt"
                await profile(spy, target, target.pids[0], args.profile_seconds, args.concurrency, out)
                profiles[target.name] = out
        return {"ttft": ttft, "runs": runs, "profiles": profiles, "round_trips": round_trips}
    finally:
        for c in channels.values():
            await c.close()


def summarize(result: dict, args) -> tuple[list[str], str]:
    ttft, runs = result["ttft"], result["runs"]
    d50 = pct(ttft["direct"], 50)
    direct_rates = [r.rate for r in runs["direct"]]
    rows, lines = [], []
    for name, values in ttft.items():
        rs = runs[name]
        ratio = statistics.median(r.rate / d for r, d in zip(rs, direct_rates, strict=True))
        cpu = {role: statistics.median(r.cpu_us[role] for r in rs) for role in rs[0].cpu_us}
        msgs = sum(r.messages for r in rs) / max(1, sum(r.requests for r in rs))
        p50, p99 = pct(values, 50), pct(values, 99)
        rates = " / ".join(f"{r.rate:.0f}" for r in rs)
        rows.append(
            f"| {name} | {p50 * 1e3:.2f} ms | {p99 * 1e3:.2f} ms | {(p50 - d50) * 1e3:+.2f} ms | {rates} | "
            f"{ratio:.2f} | {cpu['frontend']:.0f} | {_us(cpu.get('serving'))} | {cpu['pool']:.0f} | "
            f"{cpu['client']:.0f} | "
            f"{_us(cpu.get('telemetry'))} | {msgs:.2f} |"
        )
        lines.append(
            f"{name:18s} TTFT p50 {p50 * 1e3:.2f} ms p99 {p99 * 1e3:.2f} ms (added p50 {(p50 - d50) * 1e3:+.2f} ms); "
            f"req/s {rates} (ratio to direct {ratio:.2f}); CPU us/request frontend {cpu['frontend']:.0f} "
            f"(serving {_us(cpu.get('serving'))}) "
            f"pool {cpu['pool']:.0f} client {cpu['client']:.0f}; messages/request {msgs:.2f}"
        )
    table = (
        "| path | TTFT p50 | TTFT p99 | added TTFT p50 | req/s per round | req/s ratio to direct (median) "
        "| frontend CPU µs/req | of which serving | pool CPU µs/req (less idle) | client CPU µs/req "
        "| CPU µs/req of an idle frontend | messages/req (all kinds) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    return lines, table


def _us(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def profile_section(profiles: dict) -> str:
    out = []
    for name, (total, self_top, incl_top) in profiles.items():
        out.append(
            f"**{name}**: {total} samples at {PROFILE_RATE} Hz over the run (idle time not sampled, so "
            f"{total / PROFILE_RATE:.1f} s of busy time); top entries by own time, then the project's own "
            "functions by inclusive time:\n"
        )
        out.append("| own time | function |\n|---|---|")
        out += [f"| {n / total:.1%} | `{f}` |" for f, n in self_top]
        out.append("\n| inclusive | project function |\n|---|---|")
        out += [f"| {n / total:.1%} | `{f}` |" for f, n in incl_top]
        out.append("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ttft-requests", type=int, default=300, help="requests per path for TTFT")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per throughput run")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (each path once per round)")
    parser.add_argument(
        "--concurrency", type=int, default=16, help="concurrent clients in the throughput loop"
    )
    parser.add_argument(
        "--baseline-src", type=Path, default=None, help="also run a frontend from this source tree"
    )
    parser.add_argument("--profile-seconds", type=float, default=6.0, help="seconds of py-spy sampling")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the py-spy profile")
    parser.add_argument("--python-work", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.python_work:
        print(f"{asyncio.run(python_work(3000, 5)):.1f}")
        return 0
    work = {"this tree": python_work_of(None)}
    if args.baseline_src is not None:
        work["baseline"] = python_work_of(args.baseline_src.resolve())
    with tempfile.TemporaryDirectory(prefix="bench-frontend-") as tmp, process_group(Path(tmp)) as group:
        mesh = Mesh(group)
        mesh.start_discovery()
        pool = mesh.start_pool("bench-pool", "local", *FAST_POOL)
        frontends = {"frontend": start_frontend(mesh, "frontend", ROOT)}
        frontends["second"] = start_frontend(mesh, "second", ROOT)
        if args.baseline_src is not None:
            frontends["baseline"] = start_frontend(mesh, "baseline", args.baseline_src.resolve())
        for f in frontends.values():
            mesh.wait_routable(f, mesh.pools)
        result = asyncio.run(measure(pool.pool.pid, pool.address, frontends, args, Path(tmp)))
        profiles = {n: top_entries(out) for n, out in result["profiles"].items() if out.exists()}
    lines, table = summarize(result, args)
    rt = result["round_trips"]
    lines.append(f"empty gRPC round trip to the frontend (health Check): p50 {pct(rt, 50) * 1e3:.2f} ms")
    lines.append(
        "frontend's own Python work per request (no gRPC): "
        + ", ".join(f"{name} {us:.0f} us CPU" for name, us in work.items())
    )
    for line in lines:
        print(line)
    cmd = (
        f".venv/bin/python -m bench.bench_frontend --ttft-requests {args.ttft_requests} --seconds {args.seconds:g} "
        f"--rounds {args.rounds} --concurrency {args.concurrency}"
        + (f" --baseline-src {args.baseline_src}" if args.baseline_src else "")
        + ("" if args.profile else " --no-profile")
    )
    profile_text = profile_section(profiles) if profiles else "(py-spy not installed: no profile)\n"
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(
        "## Global frontend: added latency, throughput and CPU per request (`bench_frontend`)\n\n"
        f"Command: `{cmd}` on {platform.machine()} with {os.cpu_count()} cores (shared with other work; the\n"
        "client, the mocker, its relay, discovery and the frontends all run on this machine). One mocker\n"
        "pool (4 workers, speed-up 1000) with its relay; the direct baseline calls the pool's\n"
        "PoolFrontendService.Generate. All paths are measured in the same run, interleaved, the order\n"
        f"rotating every round; {OUTPUT_TOKENS}-token outputs, {args.concurrency} concurrent clients for the "
        "request rates.\n"
        "'two frontends' is the scale-out: two frontend processes, the client spreading its requests\n"
        "over both. CPU µs per request come from /proc (utime+stime) over each throughput run. A\n"
        "frontend's CPU includes work that does not scale with its own requests (telemetry ingest of all\n"
        "traffic, its background tasks): 'of which serving' subtracts what a frontend that served none\n"
        "of the run's requests spent meanwhile (the 'idle frontend' column); the pool's figure\n"
        "subtracts its CPU rate with no request in flight, measured before the rounds.\n"
        "Every request sets combine_messages (the pool's first tokens may ride in its admission and\n"
        "its finish in the last tokens; a frontend's summary in its last chunk, the request id in its\n"
        "trailers): 'messages/req' counts every message the client received, so it shows how many a\n"
        "path needs (a baseline tree that predates the field sends them separately).\n\n"
        + table
        + "\nOn 2 shared cores the request rate is set by CPU: through a frontend, every request costs the\n"
        "client's and the pool's CPU plus the frontend's, which is one more gRPC server stream and one\n"
        "more gRPC client stream. The frontend CPU per request is the figure to compare between versions,\n"
        "over repeated runs: other work on the machine moves it between rounds and paths (the per-round\n"
        "rates show how much).\n\n"
        "The frontend's own Python work per request (validation, routing decision, the run loop,\n"
        "metrics; RouterServicer.Generate over in-memory doubles of the pool link and the client, no\n"
        "gRPC, best of 5 × 3,000 requests, CPU time): "
        + ", ".join(f"{name} **{us:.0f} µs**" for name, us in work.items())
        + ". The rest of the frontend's CPU per request above is gRPC's machinery (a server call\n"
        "and a client call, their messages, their asyncio integration) and telemetry ingest.\n"
        f"An empty gRPC round trip to the frontend (grpc.health.v1 Check, same server stack) takes\n"
        f"p50 **{pct(rt, 50) * 1e3:.2f} ms** here. Through a frontend the first token makes four\n"
        "one-way gRPC hops instead of two (client → frontend → pool → frontend → client), so the added\n"
        "TTFT is one such round trip plus the frontend's turn (opening its call to the pool) and\n"
        "cannot fall much below this floor on this machine.\n\n"
        "### Where a frontend spends its time (py-spy under the throughput load)\n\n" + profile_text
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

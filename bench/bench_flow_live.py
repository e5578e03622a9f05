"""Live flood at 10x a tenant's budget: a high class's TTFT with and without it, on real processes.

One mesh on 127.0.0.1: etcd, discovery, two slow mocker pools with their relays, and two global
frontends with `--dispatch late`, `--api-keys`, one `--policy` and the budget counters shared
through etcd (`--budget-etcd-endpoints`). The policy gives `client/flood` class 0 and a
tokens-per-minute budget (the "minute" shortened to WINDOW seconds), `client/high` class 1 and
no budget. Two phases of the same length, open loop, requests spread over both frontends:
class 1 alone, then class 1 with class 0 sending FACTOR times what its budget admits (a flood
does not slow down when refused). Class 1's TTFT (call to its first token, client side) per
phase; class 0's requests refused (RESOURCE_EXHAUSTED, BUDGET_EXCEEDED, QuotaFailure) and served.
Writes bench/results/bench_flow_live.md. tests/router/test_e2e_flow.py runs a short phase of it
and asserts the behaviour (flood mostly refused, class 1 all served); the TTFT ratio is a bench
figure, not an assertion.

    .venv/bin/python bench/bench_flow_live.py [--seconds 45]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import platform
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.rpc import error_details_pb2

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.errors import detail_of, reason_of
from meshkit.identity import hash_api_key, new_api_key
from meshlaunch import MODEL, Mesh, free_port, process_group, wait_until
from meshlaunch.etcd_cluster import EtcdCluster
from meshlaunch.mesh import RouterProc, router_argv, sees_with_telemetry

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "bench_flow_live.md"
PROMPT = 64
MAX_TOKENS = 16
TOKENS = PROMPT + MAX_TOKENS
"""What a request reserves against its budget (prompt + max_tokens; every token is generated)."""
POOLS = 2
# One worker, two run slots, 16 tokens at 50/s: ~0.35 s per request, so the two pools serve about
# 10 requests/s. The stated prefill rate makes the frontend's backlog estimate match (as in the
# flow e2e).
POOL_FLAGS = (
    "--workers",
    "1",
    "--max-running-per-worker",
    "2",
    "--prefill-tokens-per-second",
    "800",
    "--decode-tokens-per-second",
    "50",
)


@dataclass(frozen=True, slots=True)
class FloodSpec:
    """The scenario's rates (requests/s) and the budget's window."""

    high_rate: float = 2.0
    """Class 1's requests per second (about a fifth of what the pools serve)."""
    budget_rate: float = 1.0
    """Class 0's budget in requests per second of TOKENS each."""
    factor: float = 10.0
    """Class 0 sends this many times its budget."""
    window: float = 10.0
    """[budget] minute_seconds: the "minute" of tokens_per_minute, shortened so a run spans several."""
    pace: bool = False
    """Each frontend paces class 0 out of its dispatch queue at its half of the budget's rate
    (`--dispatch-pace 0=...`): what the budget admits in bursts reaches the pools spread out."""

    @property
    def pace_flags(self) -> tuple[str, ...]:
        if not self.pace:
            return ()
        return ("--dispatch-pace", f"0={self.tokens_per_minute / self.window / 2:g}")

    @property
    def tokens_per_minute(self) -> int:
        return round(self.budget_rate * TOKENS * self.window)

    @property
    def flood_rate(self) -> float:
        return self.factor * self.budget_rate

    def policy(self) -> str:
        return (
            f"[budget]\nminute_seconds = {self.window:g}\n\n"
            f'[identity."client/flood"]\npriority = 0\ntokens_per_minute = {self.tokens_per_minute}\n\n'
            '[identity."client/high"]\npriority = 1\n'
        )


@dataclass
class BudgetMesh:
    """Two frontends sharing budgets through etcd; callers identified by API key."""

    routers: list[RouterProc]
    keys: dict[str, str]
    channels: list[grpc.Channel] = field(default_factory=list)

    def generate(self, tenant: str, which: int, timeout: float = 60.0) -> float:
        """One Generate of a fresh prompt as `tenant` on frontend `which`: seconds to the first
        token; raises grpc.RpcError."""
        prompt = [random.randrange(1, 30_000) for _ in range(PROMPT)]
        started = time.perf_counter()
        call = router_pb2_grpc.RouterServiceStub(self.channels[which]).Generate(
            router_pb2.GenerateRequest(
                model=MODEL,
                prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=prompt)),
                max_tokens=MAX_TOKENS,
            ),
            timeout=timeout,
            metadata=(("authorization", f"Bearer {self.keys[tenant]}"),),
        )
        first = None
        generated = 0
        for reply in call:
            if reply.WhichOneof("payload") == "tokens" and reply.tokens.token_ids:
                if first is None:
                    first = time.perf_counter() - started
                generated += len(reply.tokens.token_ids)
        if first is None or generated != MAX_TOKENS:
            raise RuntimeError(f"{tenant}: {generated} tokens generated, {MAX_TOKENS} asked")
        return first


@contextlib.contextmanager
def budget_mesh(tmp: Path, spec: FloodSpec) -> Iterator[BudgetMesh]:
    """etcd, discovery, POOLS slow mocker pools whose relays authenticate by key, and two
    frontends with the scenario's policy, `--dispatch late` and budgets in etcd."""
    keys = {name: new_api_key() for name in ("flood", "high")}
    relay_keys = {f"pool-{i}": new_api_key() for i in range(POOLS)}
    lines = [f"{name} {hash_api_key(key)}" for name, key in keys.items()]
    lines += [f"relay/{p}/relay-{p} {hash_api_key(k)}" for p, k in relay_keys.items()]
    (tmp / "api-keys").write_text("\n".join(lines) + "\n")
    policy = tmp / "policy.toml"
    policy.write_text(spec.policy())
    with process_group(tmp) as group:
        # one member, the budgets' store; its data in `tmp`, which the caller removes
        etcd = EtcdCluster(group, size=1, data_root=tmp / "etcd").start().endpoints_flag
        m = Mesh(group)
        m.start_discovery()
        routers = []
        for _ in range(2):
            address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
            args = router_argv(
                address,
                m.discovery,
                *("--metrics-listen", f"127.0.0.1:{metrics_port}", "--grace", "1"),
                *("--api-keys", str(tmp / "api-keys"), "--policy", str(policy)),
                *("--dispatch", "late", "--budget-etcd-endpoints", etcd),
                *spec.pace_flags,
            )
            routers.append(RouterProc(address, group.start("router", args), metrics_port))
        for pool_id, key in relay_keys.items():
            key_file = tmp / f"{pool_id}.apikey"
            key_file.write_text(key + "\n")
            m.start_pool(pool_id, "eu", *POOL_FLAGS, relay_flags=("--api-key-file", str(key_file)))
        mesh = BudgetMesh(routers, keys)
        with contextlib.ExitStack() as channels:
            for router in routers:
                mesh.channels.append(channels.enter_context(grpc.insecure_channel(router.address)))

            def routable(which: int) -> bool:
                routers[which].proc.check_alive()
                try:
                    reply = router_pb2_grpc.RouterServiceStub(mesh.channels[which]).ListPools(
                        router_pb2.ListPoolsRequest(),
                        timeout=5,
                        metadata=(("authorization", f"Bearer {keys['high']}"),),
                    )
                except grpc.RpcError:
                    return False
                return sees_with_telemetry({p.pool_id: p for p in reply.pools}, relay_keys)

            for which in range(2):
                wait_until(
                    functools.partial(routable, which), 60, message=f"frontend {which} sees every pool"
                )
            yield mesh


@dataclass
class Phase:
    """What one phase's callers saw."""

    seconds: float
    ttfts: list[float] = field(default_factory=list)
    """Class 1's seconds to the first token, one per request served."""
    high_errors: list[BaseException] = field(default_factory=list)
    flood_sent: int = 0
    flood_served: int = 0
    refusals: list[grpc.RpcError] = field(default_factory=list)
    """Class 0's RESOURCE_EXHAUSTED replies."""
    flood_errors: list[BaseException] = field(default_factory=list)
    """Class 0's other failures."""
    flood_span: tuple[float, float] = (math.inf, -math.inf)
    """(first call, last answer) of class 0, monotonic: its admissions fall within."""
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_phase(mesh: BudgetMesh, spec: FloodSpec, seconds: float, flood: bool) -> Phase:
    """Open loop for `seconds`: class 1 at spec.high_rate and, with `flood`, class 0 at
    spec.flood_rate, each request alternating between the frontends; waits for every answer."""
    phase = Phase(seconds)
    sends = [(i / spec.high_rate, "high", i % 2) for i in range(round(seconds * spec.high_rate))]
    if flood:
        step = 1.0 / spec.flood_rate
        sends += [(j * step + step / 3, "flood", j % 2) for j in range(round(seconds * spec.flood_rate))]
    sends.sort()

    def call(tenant: str, which: int) -> None:
        if tenant == "flood":
            with phase.lock:
                phase.flood_span = (min(phase.flood_span[0], time.monotonic()), phase.flood_span[1])
        try:
            ttft = mesh.generate(tenant, which)
        except grpc.RpcError as exc:
            with phase.lock:
                if tenant == "high":
                    phase.high_errors.append(exc)
                elif exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    phase.refusals.append(exc)
                else:
                    phase.flood_errors.append(exc)
            return
        except Exception as exc:  # a short answer: counted as a failure of its class
            with phase.lock:
                (phase.high_errors if tenant == "high" else phase.flood_errors).append(exc)
            return
        with phase.lock:
            if tenant == "high":
                phase.ttfts.append(ttft)
            else:
                phase.flood_served += 1

    def answered(tenant: str, which: int) -> None:
        try:
            call(tenant, which)
        finally:
            if tenant == "flood":
                with phase.lock:
                    phase.flood_span = (phase.flood_span[0], max(phase.flood_span[1], time.monotonic()))

    # one executor per class: flood calls held in the frontend's queue never delay class 1's sends
    with ThreadPoolExecutor(max_workers=32) as high, ThreadPoolExecutor(max_workers=160) as low:
        start = time.monotonic()
        for at, tenant, which in sends:
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            (high if tenant == "high" else low).submit(answered, tenant, which)
            if tenant == "flood":
                phase.flood_sent += 1
    return phase


def drop_budget(mesh: BudgetMesh, policy: Path, spec: FloodSpec) -> None:
    """Rewrites the policy without class 0's budget and reloads it on both frontends (SIGHUP);
    returns once each admits a flood request without x-ratelimit metadata (no budget applies)."""
    policy.write_text(spec.policy().replace(f"tokens_per_minute = {spec.tokens_per_minute}\n", ""))
    for router in mesh.routers:
        router.proc.signal(signal.SIGHUP)

    def unlimited(which: int) -> bool:
        try:
            call = router_pb2_grpc.RouterServiceStub(mesh.channels[which]).Generate(
                router_pb2.GenerateRequest(
                    model=MODEL,
                    prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=[which + 1] * PROMPT)),
                    max_tokens=1,
                ),
                timeout=30,
                metadata=(("authorization", f"Bearer {mesh.keys['flood']}"),),
            )
            for _reply in call:
                pass
            trailers = call.trailing_metadata() or ()
        except grpc.RpcError:
            return False
        return not any(k.startswith("x-ratelimit") for k, _v in trailers)

    for which in range(2):
        wait_until(
            functools.partial(unlimited, which),
            60,
            interval=0.5,
            message=f"frontend {which} drops the budget",
        )


def refusal_shape(error: grpc.RpcError) -> str | None:
    """None when a refusal is the budget's (RESOURCE_EXHAUSTED, reason BUDGET_EXCEEDED, a
    QuotaFailure naming tenant client/flood); else what is wrong with it."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return f"code {error.code()}"
    if reason_of(error) != "BUDGET_EXCEEDED":
        return f"reason {reason_of(error)}"
    quota = detail_of(error, error_details_pb2.QuotaFailure)
    if quota is None or not quota.violations:
        return "no QuotaFailure"
    if quota.violations[0].subject != "tenant:client/flood":
        return f"QuotaFailure subject {quota.violations[0].subject}"
    return None


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of `values`; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=45.0, help="length of each phase (default 45)")
    parser.add_argument(
        "--skip-no-budget",
        action="store_true",
        help="without the third phase (the same flood after the budget is removed from the policy)",
    )
    parser.add_argument(
        "--pace",
        action="store_true",
        help="each frontend paces class 0 at half its budget's rate (--dispatch-pace); "
        "writes bench/results/bench_flow_live_paced.md",
    )
    args = parser.parse_args()
    spec = FloodSpec(pace=args.pace)
    result = RESULT.with_name("bench_flow_live_paced.md") if args.pace else RESULT
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-flow-live-") as tmp, budget_mesh(Path(tmp), spec) as mesh:
        for which in range(2):  # warm both frontends' paths
            mesh.generate("high", which)
        quiet = run_phase(mesh, spec, args.seconds, flood=False)
        time.sleep(spec.window * 1.2)  # the budget's horizon is empty when the flood starts
        flooded = run_phase(mesh, spec, args.seconds, flood=True)
        refused_by = [
            r.metric(
                "globalrouter_tenant_budget_refusals_total", limit="tokens_per_minute", tenant="client/flood"
            )
            for r in mesh.routers
        ]
        unbudgeted = None
        if not args.skip_no_budget:
            drop_budget(mesh, Path(tmp) / "policy.toml", spec)
            unbudgeted = run_phase(mesh, spec, args.seconds, flood=True)
    bad = [s for s in map(refusal_shape, flooded.refusals) if s]
    rows = []
    phases = [("class 1 alone", quiet), (f"class 1 + class 0 at {spec.factor:g}x its budget", flooded)]
    if unbudgeted is not None:
        phases.append((f"class 1 + class 0 at {spec.flood_rate:g}/s, budget removed (SIGHUP)", unbudgeted))
    for label, p in phases:
        rows.append(
            f"| {label} | {len(p.ttfts)} | {len(p.high_errors)} | {pct(p.ttfts, 50) * 1000:.0f} | "
            f"{pct(p.ttfts, 90) * 1000:.0f} | {pct(p.ttfts, 99) * 1000:.0f} | {max(p.ttfts, default=0) * 1000:.0f} | "
            f"{p.flood_sent} | {len(p.refusals)} | {p.flood_served} | {len(p.flood_errors)} |"
        )
    ratio = pct(flooded.ttfts, 99) / pct(quiet.ttfts, 99) if quiet.ttfts else float("nan")
    lines = [
        f"Command: `.venv/bin/python bench/bench_flow_live.py --seconds {args.seconds:g}"
        f"{' --pace' if args.pace else ''}{' --skip-no-budget' if args.skip_no_budget else ''}` (ran "
        f"{time.monotonic() - started:.0f} s; {platform.machine()}, Python {platform.python_version()}, "
        "2 cores shared with other work).",
        "",
        f"Two frontends (`--dispatch late`, budgets in etcd), {POOLS} mocker pools (one worker, two run "
        f"slots, 50 tokens/s: about 10 requests/s together). Requests of {PROMPT} + {MAX_TOKENS} tokens, "
        f"open loop over both frontends, {args.seconds:g} s per phase. `client/high`: class 1, "
        f"{spec.high_rate:g}/s, no budget. `client/flood`: class 0, `tokens_per_minute = "
        f"{spec.tokens_per_minute}` with `minute_seconds = {spec.window:g}` ({spec.budget_rate:g} request/s), "
        f"sending {spec.flood_rate:g}/s. TTFT: call to the first token, client side."
        + (f" Each frontend paces class 0: `{' '.join(spec.pace_flags)}`." if spec.pace else ""),
        "",
        "| phase | class 1 served | class 1 failed | TTFT p50 (ms) | p90 | p99 | max | class 0 sent "
        "| refused (budget) | served | other errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Class 1 TTFT p99 under the flood / alone: **{ratio:.2f}x** (goal 1.2x). Refusals that were not "
        f"BUDGET_EXCEEDED with a QuotaFailure: {len(bad)}; the frontends counted "
        f"{' + '.join(f'{v:.0f}' for v in refused_by)} budget refusals.",
        "",
    ]
    result.parent.mkdir(exist_ok=True)
    result.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

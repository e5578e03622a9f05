"""End to end, real processes: flow control at a global frontend with `--dispatch late` and a
`--policy` giving tenants classes and weights (callers identified by API key on loopback).

(a) priority: with the pools saturated by a low class, a high-class request dispatches before the
low-class requests queued ahead of it; (b) shedding: a low class queued past its
`--dispatch-shed-after` gets 429 + Retry-After over HTTP and RESOURCE_EXHAUSTED with an ErrorInfo
reason over gRPC, while the high class is served; (c) fairness: two tenants of equal weight
flooding with 2:1 demand each get 0.45-0.55 of the requests (all of one size: the tokens) the
queue dispatches while both are backlogged. The figures are read from the frontend's own flow
metrics and status page (metrics.FlowStats), not from how fast the processes ran.

The pools are slow on purpose (one worker, two run slots, 50 output tokens/s) and state a prefill
rate that makes the frontend's estimate of their backlog match what they really take, so the
pools hold about a second of work each and the rest waits in the frontend's dispatch queue.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.errors import detail_of, reason_of
from meshkit.identity import hash_api_key, new_api_key
from meshlaunch import MODEL, Mesh, free_port, process_group, wait_until
from meshlaunch.mesh import RouterProc, router_argv, sees_with_telemetry

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROMPT = 64
MAX_TOKENS = 16
HIGH = 5
# One worker, two run slots, 16 tokens at 50/s: ~0.33 s per request, two at a time. The frontend
# prices a request at prompt + 4 x max_tokens = 128 work tokens; at 800 tokens/s that is 0.16 s,
# what the pool really takes per request, so "can start within 1 s" means ~6 requests at the pool.
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
TENANTS = ("alice", "bob", "vip")
VIP_BUDGET = 1_000_000
"""vip's tokens per minute (never reached: the status page shows what is left of it)."""


@dataclass
class FlowMesh:
    """A mesh whose frontend identifies callers by API key and applies a policy."""

    router: RouterProc
    http: str
    keys: dict[str, str]

    def metadata(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.keys[tenant]}"),)

    def status(self, who: str = "ops") -> dict:
        """/status.json as `who` (the operator by default: a client sees its own flow rows only)."""
        request = urllib.request.Request(
            f"http://{self.http}/status.json", headers={"authorization": f"Bearer {self.keys[who]}"}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    def flow(self, tenant: str) -> dict:
        """The status page's row of client/`tenant` (zeros before its first request)."""
        for row in self.status()["flow"]:
            if row["tenant"] == f"client/{tenant}":
                return row
        return {"requests": 0, "tokens": 0, "queued": 0, "dispatched": 0, "sheds": {}}

    def tokens(self, tenant: str, cls: int = 0) -> float:
        return self.router.metric(
            "globalrouter_flow_tokens_total", tenant=f"client/{tenant}", **{"class": str(cls)}
        )

    def generate(self, tenant: str, *, timeout: float = 60) -> int:
        """One gRPC Generate of a fresh prompt as `tenant`: tokens generated; raises grpc.RpcError."""
        prompt = [random.randrange(1, 30_000) for _ in range(PROMPT)]
        with grpc.insecure_channel(self.router.address) as channel:
            call = router_pb2_grpc.RouterServiceStub(channel).Generate(
                router_pb2.GenerateRequest(
                    model=MODEL,
                    prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=prompt)),
                    max_tokens=MAX_TOKENS,
                ),
                timeout=timeout,
                metadata=self.metadata(tenant),
            )
            return sum(len(r.tokens.token_ids) for r in call if r.WhichOneof("payload") == "tokens")

    def post(self, tenant: str) -> tuple[int, dict[str, str], dict]:
        """(status, headers, body) of one POST /v1/completions as `tenant`."""
        body = {"model": MODEL, "prompt": f"flow {random.random()} " * 8, "max_tokens": MAX_TOKENS}
        request = urllib.request.Request(
            f"http://{self.http}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json", "authorization": f"Bearer {self.keys[tenant]}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return (
                    reply.status,
                    {k.lower(): v for k, v in reply.headers.items()},
                    json.loads(reply.read()),
                )
        except urllib.error.HTTPError as exc:
            return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read())


@contextlib.contextmanager
def flow_mesh(tmp_path: Path, pools: int, *router_flags: str) -> Iterator[FlowMesh]:
    """Discovery, `pools` slow mocker pools whose relays authenticate by key, and one frontend with
    `--api-keys`, `--policy` (alice and bob class 0 weight 1, vip class HIGH), `--dispatch late`."""
    keys = {name: new_api_key() for name in (*TENANTS, "ops")}
    relay_keys = {f"pool-{i}": new_api_key() for i in range(pools)}
    lines = [
        f"{name if name in TENANTS else 'admin/' + name} {hash_api_key(key)}" for name, key in keys.items()
    ]
    lines += [f"relay/{p}/relay-{p} {hash_api_key(k)}" for p, k in relay_keys.items()]
    (tmp_path / "api-keys").write_text("\n".join(lines) + "\n")
    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[identity."client/alice"]\npriority = 0\nweight = 1.0\n\n'
        '[identity."client/bob"]\npriority = 0\nweight = 1.0\n\n'
        f'[identity."client/vip"]\npriority = {HIGH}\ntokens_per_minute = {VIP_BUDGET}\n'
    )
    with process_group(tmp_path) as group:
        m = Mesh(group)
        m.start_discovery()
        http = f"127.0.0.1:{free_port()}"
        address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
        args = router_argv(
            address,
            m.discovery,
            "--metrics-listen",
            f"127.0.0.1:{metrics_port}",
            "--grace",
            "1",
            "--api-keys",
            str(tmp_path / "api-keys"),
            "--policy",
            str(policy),
            "--dispatch",
            "late",
            "--http-listen",
            http,
            *router_flags,
        )
        router = RouterProc(address, group.start("router", args), metrics_port)
        for pool_id, key in relay_keys.items():
            key_file = tmp_path / f"{pool_id}.apikey"
            key_file.write_text(key + "\n")
            m.start_pool(pool_id, "eu", *POOL_FLAGS, relay_flags=("--api-key-file", str(key_file)))
        mesh = FlowMesh(router, http, keys)

        def routable() -> bool:
            router.proc.check_alive()
            try:
                with grpc.insecure_channel(address) as ch:
                    reply = router_pb2_grpc.RouterServiceStub(ch).ListPools(
                        router_pb2.ListPoolsRequest(), timeout=5, metadata=mesh.metadata("alice")
                    )
            except grpc.RpcError:
                return False
            return sees_with_telemetry({p.pool_id: p for p in reply.pools}, relay_keys)

        wait_until(routable, 60, message="the frontend sees every pool with telemetry (relays by key)")
        yield mesh


@dataclass
class Flood:
    """`threads` callers of one tenant, each sending one request after another until stopped."""

    mesh: FlowMesh
    tenant: str
    threads: int
    done: list[tuple[float, float]] = field(default_factory=list)
    """(sent, finished) monotonic times of the requests served."""
    errors: list[grpc.RpcError] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Flood:
        for _ in range(self.threads):
            t = threading.Thread(target=self._loop, daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def _loop(self) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                self.mesh.generate(self.tenant)
            except grpc.RpcError as exc:
                with self.lock:
                    self.errors.append(exc)
                time.sleep(0.2)  # a shed caller backs off a little, as a client would
                continue
            with self.lock:
                self.done.append((sent, time.monotonic()))

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._workers:
            t.join(timeout=90)


def test_a_high_class_request_dispatches_before_the_low_class_queued_ahead_of_it(tmp_path):
    with flow_mesh(tmp_path, 1) as mesh, Flood(mesh, "alice", 20) as flood:
        wait_until(
            lambda: mesh.flow("alice")["queued"] >= 10, 60, message="alice's flood queues at the frontend"
        )
        queued_before = mesh.flow("alice")["queued"]
        sent = time.monotonic()
        assert mesh.generate("vip") == MAX_TOKENS
        finished = time.monotonic()
        # FIFO would serve vip after every alice request sent before it; by class it overtakes
        # the ones waiting in the frontend's queue (only those already at the pool finish first).

        def overtaken() -> int:
            with flood.lock:
                return sum(1 for s, f in flood.done if s < sent and f > finished)

        wait_until(
            lambda: overtaken() >= 5,
            60,
            interval=0.2,
            message="alice's requests sent before vip's finish after it",
        )
        vip = mesh.flow("vip")
        alice = mesh.flow("alice")
        print(
            f"alice queued at the frontend when vip arrived: {queued_before}; vip took {finished - sent:.2f} s, "
            f"queued {vip['queue_p50_s']} s; alice queue p50 {alice['queue_p50_s']} s p99 {alice['queue_p99_s']} s"
        )
        assert vip["dispatched"] == 1 and vip["sheds"] == {}
        assert not flood.errors, flood.errors[:1]


def _detail(error: grpc.RpcError, kind):
    """The detail of type `kind` a failed call's status carries."""
    message = detail_of(error, kind)
    assert message is not None, f"no {kind.__name__} in {error}"
    return message


def test_a_low_class_past_its_shed_time_gets_429_and_resource_exhausted_while_the_high_class_is_served(
    tmp_path,
):
    with flow_mesh(tmp_path, 1, "--dispatch-shed-after", "0=1") as mesh, Flood(mesh, "alice", 24) as flood:
        wait_until(lambda: len(flood.errors) >= 3, 60, message="alice's flood is shed over gRPC")
        error = flood.errors[0]
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert reason_of(error) == "QUEUE_FULL"
        info = _detail(error, error_details_pb2.ErrorInfo)
        assert info.metadata["shed_reason"] == "OVERLOADED", info
        assert float(info.metadata["queued_seconds"]) >= 1.0
        assert _detail(error, error_details_pb2.RetryInfo).retry_delay.seconds >= 1
        # over HTTP, alice's request queued past 1 s behind her own flood: 429 with Retry-After in
        # OpenAI's shape (a request of bob's would not wait: fair queueing puts an idle tenant's
        # first request ahead of alice's backlog)
        statuses = []

        def http_shed() -> bool:
            status, headers, body = mesh.post("alice")
            statuses.append(status)
            if status != 429:
                return False
            assert body["error"]["code"] == "QUEUE_FULL", body
            assert "OVERLOADED" in body["error"]["message"], body
            assert int(headers["retry-after"]) >= 1, headers
            return True

        wait_until(http_shed, 90, interval=0.1, message="an HTTP request of class 0 is shed with 429")
        # the high class meanwhile is served, and never shed
        for _ in range(3):
            assert mesh.generate("vip") == MAX_TOKENS
        alice, vip = mesh.flow("alice"), mesh.flow("vip")
        # a client reads its own row of the status page's flow section only
        assert [row["tenant"] for row in mesh.status("vip")["flow"]] == ["client/vip"]
        print(f"alice {alice['sheds']} (HTTP statuses {statuses}), vip {vip}")
        assert alice["sheds"].get("OVERLOADED", 0) >= 4
        assert vip["sheds"] == {} and vip["dispatched"] == 3
        # what the budget had left after vip's last admission: three requests' reservations fewer
        (budget,) = vip["budget"]
        assert (budget["limit"], budget["max"]) == ("tokens_per_minute", VIP_BUDGET), budget
        assert VIP_BUDGET - 3 * (PROMPT + MAX_TOKENS) <= budget["remaining"] < VIP_BUDGET, budget
        assert (
            mesh.router.metric(
                "globalrouter_flow_sheds_total", tenant="client/alice", reason="OVERLOADED", **{"class": "0"}
            )
            >= 3
        )
        # alice's flood is served too, up to what the pools take (waited for: a slow pool may not
        # have finished one of hers yet when the checks above are done)
        wait_until(lambda: flood.done, 60, message="a request of alice's flood is served")


def _dispatch_state(mesh: FlowMesh, tenants: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Tenant -> (its requests dispatched so far, its requests queued now), from one status snapshot."""
    rows = {row["tenant"]: row for row in mesh.status()["flow"]}
    none = {"dispatched": 0, "queued": 0}
    return {t: ((r := rows.get(f"client/{t}", none))["dispatched"], r["queued"]) for t in tenants}


def test_two_tenants_of_equal_weight_share_the_tokens_evenly_under_unequal_floods(tmp_path):
    # The share is of the dispatch queue's own decisions, counted only over the spans in which
    # both tenants were backlogged throughout, so neither the pool's pace nor how soon the
    # floods' callers send again (both slower on a loaded machine) moves it. A span (one status
    # read to the next) counts when each tenant had more requests queued at its start than the
    # queue dispatched in it, to anyone: a queue drains only by dispatch, so neither ran dry in
    # between, and which spans count does not depend on who got their dispatches (no bias).
    # Every request is PROMPT + MAX_TOKENS tokens: requests dispatched measure tokens handed out.
    tenants = ("alice", "bob")
    counted = dict.fromkeys(tenants, 0)
    spans = skipped = 0
    # one pool holds ~6 requests (3 of bob's), so bob's 10 callers keep several in the queue
    with flow_mesh(tmp_path, 1) as mesh, Flood(mesh, "alice", 20), Flood(mesh, "bob", 10):

        def both_queued() -> dict[str, tuple[int, int]]:
            state = _dispatch_state(mesh, tenants)
            return state if all(queued >= 3 for _, queued in state.values()) else {}

        before = wait_until(both_queued, 60, message="both tenants queue at the frontend")
        deadline = time.monotonic() + 150
        while sum(counted.values()) < 100:
            assert time.monotonic() < deadline, f"not 100 dispatches with both backlogged in 150 s: {counted}"
            time.sleep(0.2)
            after = _dispatch_state(mesh, tenants)
            moved = {t: after[t][0] - before[t][0] for t in tenants}
            if min(queued for _, queued in before.values()) > sum(moved.values()):
                spans += 1
                for t in tenants:
                    counted[t] += moved[t]
            else:
                skipped += sum(moved.values())
            before = after
        served = {t: mesh.tokens(t) for t in tenants}
    share = counted["alice"] / sum(counted.values())
    print(
        f"dispatched while both were backlogged ({spans} spans): {counted}; alice's share {share:.3f}; "
        f"dispatched in spans not proven backlogged: {skipped}; tokens served in all: {served}"
    )
    assert 0.45 <= share <= 0.55, counted


FLOW_ROWS = (
    "[...document.querySelectorAll('#flow tr')].slice(1).map(r => [...r.cells].map(c => c.textContent))"
)


def test_the_status_page_shows_a_row_per_tenant_and_class(procs, browser, tmp_path):
    from tests.router.test_e2e_status_quality import shown

    m = Mesh(procs)
    m.start_discovery()
    m.start_pool("pool-a", "eu", "--speedup", "50")
    http = f"127.0.0.1:{free_port()}"
    router = m.start_router("--dispatch", "late", "--http-listen", http)  # no policy: tenant "other", class 0
    m.wait_routable(router, m.pools)
    for i in range(3):
        with grpc.insecure_channel(router.address) as channel:
            call = router_pb2_grpc.RouterServiceStub(channel).Generate(
                router_pb2.GenerateRequest(
                    model=MODEL,
                    prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=[i + 1] * PROMPT)),
                    max_tokens=4,
                ),
                timeout=30,
            )
            assert sum(len(r.tokens.token_ids) for r in call if r.WhichOneof("payload") == "tokens") == 4
    browser.open(f"http://{http}/")
    (row,) = shown(browser, FLOW_ROWS, lambda rows: len(rows) == 1 and rows[0][2] == "3", 20, "the flow row")
    # class, tenant, requests, tokens, queued now, queue p50, p99, mean, shed, budget refusals, budget left
    assert row[:5] == ["0", "other", "3", str(3 * (PROMPT + 4)), "0"], row
    assert all(re.fullmatch(r"\d+ ms|\d+\.\d\d s", t) for t in row[5:8]), row
    assert row[8:] == ["0", "0", "–"], row
    assert router.metric("globalrouter_flow_queue_seconds_count", tenant="other", **{"class": "0"}) == 3
    browser.screenshot(tmp_path / "status-flow.png")


def test_a_flood_at_ten_times_its_budget_is_mostly_refused_while_the_high_class_is_all_served(tmp_path):
    """bench/bench_flow_live.py's scenario, short: two frontends sharing class 0's budget through
    etcd; class 0 sends 10x what its budget admits, class 1 (no budget) alongside. The budget
    refuses the flood at admission (RESOURCE_EXHAUSTED, BUDGET_EXCEEDED, QuotaFailure) and class 1
    is all served; its TTFT ratio is the bench's figure (BENCHMARKS.md), not asserted here."""
    from bench.bench_flow_live import FloodSpec, budget_mesh, refusal_shape, run_phase

    spec = FloodSpec()
    seconds = 15.0
    with budget_mesh(tmp_path, spec) as mesh:
        phase = run_phase(mesh, spec, seconds, flood=True)
        counted = sum(
            r.metric(
                "globalrouter_tenant_budget_refusals_total", limit="tokens_per_minute", tenant="client/flood"
            )
            for r in mesh.routers
        )
    print(
        f"class 1: {len(phase.ttfts)} served, TTFT max {max(phase.ttfts, default=0):.3f} s; class 0: "
        f"{phase.flood_sent} sent, {len(phase.refusals)} refused, {phase.flood_served} served"
    )
    assert not phase.high_errors, phase.high_errors[:1]
    assert len(phase.ttfts) == round(seconds * spec.high_rate)
    assert not phase.flood_errors, phase.flood_errors[:1]
    assert phase.flood_served + len(phase.refusals) == phase.flood_sent == round(seconds * spec.flood_rate)
    assert [s for s in map(refusal_shape, phase.refusals) if s] == []
    assert counted == len(phase.refusals)
    # What the budget lets through: at most the limit in any window, so over the span of the
    # flood's calls (15 s unless the machine lagged) one window's worth per window it meets, plus
    # a chunk (one request) per frontend for slack; the flood asks 10x that.
    window_requests = spec.tokens_per_minute // (PROMPT + MAX_TOKENS)
    windows = math.ceil((phase.flood_span[1] - phase.flood_span[0]) / spec.window)
    assert phase.flood_served >= 1, "the budget admits some of the flood"
    assert phase.flood_served <= windows * window_requests + 2, (phase.flood_served, windows)
    assert len(phase.refusals) >= 0.75 * phase.flood_sent

"""Real vLLM servers behind the mesh: two CPU vLLM pools, their relays, discovery, one global frontend.

Run by `make test-engines`, which installs vLLM into its own virtualenv and sets ENGINES_PYTHON to
its interpreter and GR_TEST_ENGINES=1. Under plain `make test` (no ENGINES_PYTHON) this module is
skipped; under `make test-engines` a missing or broken vLLM fails it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent import futures
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.blocks import block_hashes
from meshlaunch.vllm_engine import ENGINE_BLOCK, MODEL, Engine
from poolrelay.engine.events import AllBlocksCleared as Cleared
from poolrelay.engine.events import BlockRemoved, BlockStored, decode_batch
from poolrelay.v1 import telemetry_pb2 as tm
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc
from tests.engines.vllm_support import make_engine_files, start_vllm_relay, wait_vllm
from tests.router.mesh import Mesh, RouterProc
from tests.support import ProcessGroup, free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

ENGINES_PYTHON = os.environ.get("ENGINES_PYTHON", "")
REQUIRED = os.environ.get("GR_TEST_ENGINES") == "1"
MESH_BLOCK = 16
LOAD_WINDOW_S = 8.0


def _engines_or_skip() -> str:
    problem = ""
    if not ENGINES_PYTHON or not Path(ENGINES_PYTHON).exists():
        problem = "ENGINES_PYTHON does not name the engines virtualenv's python"
    else:
        probe = subprocess.run(
            [ENGINES_PYTHON, "-c", "import vllm, transformers, tokenizers"], capture_output=True, timeout=300
        )
        if probe.returncode:
            problem = f"vLLM does not import there: {probe.stderr.decode()[-2000:]}"
    if problem:
        if REQUIRED:
            pytest.fail(f"make test-engines needs vLLM: {problem}")
        pytest.skip(f"engine tests run under `make test-engines` ({problem})")
    return ENGINES_PYTHON


class EventLog:
    """The test's own subscriber to one vLLM's KV events: what it reported, stored minus removed.

    Each engine block's whole prefix is kept (its parent's prefix + its tokens), and its mesh
    hashes are computed from the start of the prefix: independent of the relay's incremental chain.
    """

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.prefix: dict[object, tuple[int, ...]] = {}
        self.held: set[object] = set()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        while not self._stop.is_set():
            if not sub.poll(200):
                continue
            _topic, _seq, payload = sub.recv_multipart()
            with self.lock:
                for ev in decode_batch(payload).events:
                    if isinstance(ev, BlockStored):
                        parent = () if ev.parent_block_hash is None else self.prefix.get(ev.parent_block_hash)
                        for i, h in enumerate(ev.block_hashes):
                            if parent is not None:
                                parent = parent + tuple(
                                    ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
                                )
                                self.prefix[h] = parent
                            self.held.add(h)
                    elif isinstance(ev, BlockRemoved):
                        self.held.difference_update(ev.block_hashes)
                    elif isinstance(ev, Cleared):
                        self.held.clear()
        sub.close(linger=0)
        ctx.term()

    def mesh_blocks(self) -> set[int]:
        with self.lock:
            out: set[int] = set()
            for h in self.held:
                prefix = self.prefix.get(h)
                assert prefix is not None, "the test saw a block whose prefix it never saw"
                out.update(block_hashes(list(prefix), MESH_BLOCK)[-(ENGINE_BLOCK // MESH_BLOCK) :])
            return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class TelemetrySink(tm_grpc.TelemetryServiceServicer):
    """A second telemetry receiver the relays stream to: each pool's block set as the relay publishes it."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}
        self._snap: dict[str, set[int]] = {}
        self.lock = threading.Lock()

    def PublishPoolTelemetry(self, request_iterator, context):
        pool = ""
        for msg in request_iterator:
            kind = msg.WhichOneof("payload")
            with self.lock:
                if kind == "hello":
                    pool = msg.hello.pool_id
                    yield tm.PublishPoolTelemetryResponse(hello_ack=tm.TelemetryHelloAck(frontend_id="sink"))
                elif kind == "kv_snapshot":
                    snap = self._snap.setdefault(pool, set())
                    if msg.kv_snapshot.chunk_index == 0:
                        snap.clear()
                    snap.update(msg.kv_snapshot.block_hashes)
                    if msg.kv_snapshot.last:
                        self.blocks[pool] = set(snap)
                elif kind == "kv_delta":
                    held = self.blocks.setdefault(pool, set())
                    held.difference_update(msg.kv_delta.removed)
                    held.update(msg.kv_delta.stored)

    def of(self, pool: str) -> set[int]:
        with self.lock:
            return set(self.blocks.get(pool, ()))


@dataclass
class EngineMesh:
    group: ProcessGroup
    mesh: Mesh
    router: RouterProc
    engines: dict[str, Engine]
    logs: dict[str, EventLog]
    sink: TelemetrySink
    python: str
    model_dir: Path

    def start_engine(self, pool: str) -> None:
        e = self.engines[pool]
        e.proc = self.group.start(
            f"vllm-{pool}", e.args(self.python, self.model_dir), env={"VLLM_CPU_KVCACHE_SPACE": "1"}
        )

    def wait_engine(self, pool: str) -> None:
        wait_vllm(self.engines[pool], f"vLLM {pool}")

    def ensure_up(self) -> None:
        """Both pools serve and the frontend routes to both (a test that killed one restarts it)."""
        for pool, e in self.engines.items():
            if e.proc is None or not e.proc.alive():
                self.start_engine(pool)
        for pool in self.engines:
            self.wait_engine(pool)
        self.mesh.wait_routable(self.router, list(self.engines), timeout=120)


@pytest.fixture(scope="module")
def em(tmp_path_factory):
    python = _engines_or_skip()
    tmp = tmp_path_factory.mktemp("engines")
    model_dir = make_engine_files(python, tmp / "model")
    group = ProcessGroup(tmp)
    sink = TelemetrySink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    tm_grpc.add_TelemetryServiceServicer_to_server(sink, server)
    sink_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    logs: dict[str, EventLog] = {}
    try:
        engines = {p: Engine(p, free_port(), free_port(), free_port()) for p in ("pool-a", "pool-b")}
        mesh = Mesh(group)
        # Leases of 10 s, not the suites' 1.5 s: two vLLMs on two shared cores under a burst can
        # hold a relay's or discovery's loop past a second, and a lapsed lease takes a serving pool
        # out of the listing (NOT_FOUND) though nothing failed.
        mesh.start_discovery(None, "--heartbeat-interval", "2", "--lease-duration", "10")
        router = mesh.start_router()
        em = EngineMesh(group, mesh, router, engines, logs, sink, python, model_dir)
        for pool, e in engines.items():
            logs[pool] = EventLog(f"tcp://127.0.0.1:{e.events}")
            em.start_engine(pool)
        for pool, e in engines.items():
            start_vllm_relay(
                group, e, pool, mesh.discovery, "--global-frontends", f"http://127.0.0.1:{sink_port}"
            )
        em.ensure_up()
        yield em
    except BaseException:
        print(group.dump_logs())
        raise
    finally:
        for log in logs.values():
            log.stop()
        group.stop_all()
        server.stop(grace=None)


@pytest.fixture(autouse=True)
def _logs_on_failure(request, em):
    """A failed test prints the tail of every mesh process's log (vLLM, relays, frontend, discovery):
    on a shared CI machine that is the only record of what the mesh saw."""
    yield
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(em.group.dump_logs(6000))


def generate(router: RouterProc, prompt: list[int], max_tokens: int, on_chunk=None):
    """Generate through the global frontend: (tokens, pools per token, summary)."""
    tokens: list[int] = []
    pools: list[str] = []
    summary = None
    with grpc.insecure_channel(router.address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        req = router_pb2.GenerateRequest(
            model=MODEL,
            prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=prompt)),
            max_tokens=max_tokens,
        )
        for msg in stub.Generate(req, timeout=600):
            if msg.HasField("tokens"):
                assert msg.tokens.offset == len(tokens), "a token was lost or repeated"
                tokens.extend(msg.tokens.token_ids)
                pools.extend([msg.tokens.pool_id] * len(msg.tokens.token_ids))
                if on_chunk is not None:
                    on_chunk(tokens, pools)
            else:
                summary = msg.summary
    return tokens, pools, summary


def prompt_of(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 2000 + 3 for i in range(n)]


def blocks_match(em: EngineMesh, pool: str) -> bool:
    return em.sink.of(pool) == em.logs[pool].mesh_blocks()


def test_relay_block_set_equals_what_vllm_reported(em):
    em.ensure_up()
    expected: dict[str, set[int]] = {}
    for i, pool in enumerate(("pool-a", "pool-b")):
        expected[pool] = set()
        for j in range(3):
            prompt = prompt_of(100 * i + j, 200 + 40 * j)
            em.engines[pool].complete(prompt, 40)
            # The prompt's full engine blocks are cached once it is prefilled (generated tokens may add more).
            expected[pool].update(
                block_hashes(prompt[: len(prompt) // ENGINE_BLOCK * ENGINE_BLOCK], MESH_BLOCK)
            )
    for pool in em.engines:
        # vLLM publishes a step's events after the step; the completion can return first.
        wait_until(
            partial(lambda p: expected[p] <= em.logs[p].mesh_blocks(), pool),
            30,
            message=f"{pool}: vLLM reported the prompts' blocks",
        )
        wait_until(partial(blocks_match, em, pool), 30, message=f"{pool}: relay blocks == vLLM's report")
        assert expected[pool] <= em.sink.of(pool)


def test_shared_prefix_goes_to_the_pool_holding_it_and_hits_its_cache(em):
    em.ensure_up()
    prefix = prompt_of(7, 512)
    _, first_pools, _ = generate(em.router, prefix + prompt_of(8, 40), 8)
    holder = first_pools[0]
    wait_until(lambda: blocks_match(em, holder), 30, message="the first request's blocks published")
    wait_until(
        lambda: set(block_hashes(prefix, MESH_BLOCK)) <= em.sink.of(holder), 30, message="prefix indexed"
    )
    hits_before = em.engines[holder].metric("vllm:prefix_cache_hits_total")
    _, pools, summary = generate(em.router, prefix + prompt_of(9, 40), 8)
    assert set(pools) == {holder} and summary.pools == [holder]
    hits_after = em.engines[holder].metric("vllm:prefix_cache_hits_total")
    assert hits_after - hits_before >= 512 - ENGINE_BLOCK  # the prefix's tokens came from its cache


def _sample_until(stop: threading.Event, read, out: list, every: float) -> None:
    """Appends read() to out every `every` seconds until stop is set; a read that fails (a busy
    server) is skipped."""
    while not stop.is_set():
        try:
            out.append(read())
        except (OSError, grpc.RpcError):
            pass
        stop.wait(every)


def test_load_the_frontend_sees_follows_vllm_running_and_waiting(em):
    """Per pool: the running + waiting the frontend sees rises with what that vLLM reports, then
    falls back to 0. Compared per pool and by peak: two vLLMs on two shared cores take turns
    (one pool's requests can wait seconds for their first token while the other's run), so a
    sum across pools at one instant is not what either engine ever held."""
    em.ensure_up()
    front_seen: list[dict[str, int]] = []
    engine_seen: list[dict[str, int]] = []
    stop = threading.Event()

    def front_load() -> dict[str, int]:
        return {p: v.load.requests_running + v.load.requests_waiting for p, v in em.router.pools().items()}

    def engine_load() -> dict[str, int]:
        return {
            p: int(e.metric("vllm:num_requests_running") + e.metric("vllm:num_requests_waiting"))
            for p, e in em.engines.items()
        }

    # Twelve clients each send requests back to back for a fixed window: the engines hold about
    # twelve requests the whole window however fast this machine runs them (and whichever
    # answers the tiny random model ends early), so the slow /metrics scrapes catch the load.
    deadline = time.monotonic() + LOAD_WINDOW_S

    def client(i: int) -> int:
        sent = 0
        while time.monotonic() < deadline and sent < 200:
            generate(em.router, prompt_of(1000 + 200 * i + sent, 64), 300)
            sent += 1
        return sent

    # Each sampler runs on its own thread: a slow /metrics scrape must not hide the frontend's view.
    samplers = [
        threading.Thread(target=_sample_until, args=(stop, front_load, front_seen, 0.05), daemon=True),
        # vLLM renders every histogram on /metrics: scraped gently, beside its relay's own polls.
        threading.Thread(target=_sample_until, args=(stop, engine_load, engine_seen, 0.25), daemon=True),
    ]
    for t in samplers:
        t.start()
    try:
        with futures.ThreadPoolExecutor(max_workers=12) as pool:
            jobs = [pool.submit(client, i) for i in range(12)]
            for j in jobs:
                j.result(timeout=300)
    finally:
        stop.set()
        for t in samplers:
            t.join(timeout=10)
    assert engine_seen and front_seen, "no load sample was read"
    engine_peak = {p: max(s.get(p, 0) for s in engine_seen) for p in em.engines}
    front_peak = {p: max(s.get(p, 0) for s in front_seen) for p in em.engines}
    busiest = max(engine_peak, key=lambda p: engine_peak[p])
    # Twelve clients over two pools: one pool holds about six of their requests at a time.
    assert engine_peak[busiest] >= 3, f"the burst did not load vLLM: {engine_seen}"
    assert front_peak[busiest] >= engine_peak[busiest] // 2, (
        f"{busiest}: the frontend saw {front_seen}, vLLM said {engine_seen}"
    )
    # Once the burst is over, the frontend sees the engines idle again.
    wait_until(lambda: not any(front_load().values()), 30, message="idle load at the frontend")


def _freeze_then_kill(em: EngineMesh, prompt: list[int], max_tokens: int):
    """Generates through the frontend and kills the serving vLLM once tokens reached the client.

    vLLM on two shared cores delivers tokens in bursts (its API server merges the outputs it
    could not send in time), so the first tokens can reach the client only after the engine has
    finished. The serving vLLM is therefore frozen (SIGSTOP) at the first tokens; if the stream
    still has not ended two seconds later, the request is provably mid-stream and the vLLM is
    killed (kill -9). Returns (tokens, pools, summary, victim), or None when the answer had
    already been complete (the vLLM is thawed and nothing was killed).
    """
    first = threading.Event()
    served: dict[str, Any] = {}

    def on_chunk(tokens, pools):
        served.setdefault("pool", pools[0])
        first.set()

    def run():
        try:
            served["result"] = generate(em.router, prompt, max_tokens, on_chunk)
        finally:
            first.set()

    with futures.ThreadPoolExecutor(max_workers=1) as ex:
        job = ex.submit(run)
        assert first.wait(120), "no tokens in 120 s"
        if "pool" not in served:  # the request ended without a token: its error (the mesh's logs follow)
            job.result()
            raise AssertionError(f"the request ended without a token: {served}")
        victim = str(served["pool"])
        proc = em.engines[victim].proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGSTOP)  # the API server and its engine core processes
        try:
            job.result(timeout=2.0)
        except futures.TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.popen.wait(timeout=30)
            job.result(timeout=300)
            tokens, pools, summary = served["result"]
            return tokens, pools, summary, victim
        os.killpg(proc.pid, signal.SIGCONT)
        return None


def test_kill_mid_stream_continues_on_the_other_pool_then_restart_resyncs(em):
    em.ensure_up()
    max_tokens = 1500
    prompt = None
    for seed in range(2000, 2020):  # a prompt whose greedy continuation does not stop early
        candidate = prompt_of(seed, 96)
        if em.engines["pool-b"].complete(candidate, max_tokens)[1] == "length":
            prompt = candidate
            break
    assert prompt is not None
    outcome = None
    for _attempt in range(5):
        outcome = _freeze_then_kill(em, prompt, max_tokens)
        if outcome is not None:
            break
    assert outcome is not None, "in five tries the whole answer reached the frontend before its first token"
    tokens, pools, summary, victim = outcome
    other = next(p for p in em.engines if p != victim)
    assert len(tokens) == max_tokens and summary.tokens_generated == max_tokens
    assert summary.migrations == 1 and summary.pools == [victim, other]
    cut = pools.index(other)
    assert set(pools[:cut]) == {victim} and set(pools[cut:]) == {other}
    expected, _ = em.engines[other].complete(prompt + tokens[:cut], max_tokens - cut)
    assert tokens[cut:] == expected

    # Restart the killed vLLM: its relay drops the dead engine's blocks and re-syncs from the new one.
    stale = em.sink.of(victim)
    wait_until(lambda: not em.sink.of(victim), 60, message=f"{victim}'s stale blocks dropped")
    with em.logs[victim].lock:
        em.logs[victim].held.clear()  # the restarted engine starts empty; the test's log follows it
    em.ensure_up()
    em.engines[victim].complete(prompt_of(3000, 300), 20)
    wait_until(lambda: blocks_match(em, victim) and em.sink.of(victim), 60, message="re-synced")
    assert not (stale - em.logs[victim].mesh_blocks()) & em.sink.of(victim)
    # The restarted engine's first tokens agree with what the killed one streamed.
    again, _ = em.engines[victim].complete(prompt, cut)
    assert again == tokens[:cut]


def _chat(url: str, messages: list[dict[str, str]], stream: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """A chat completion through the HTTP front: (usage, response headers); a streamed one asks
    for the usage chunk and reads the cached-tokens source from the SSE comment before it."""
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        headers = {k.lower(): v for k, v in resp.headers.items()}
        text = resp.read().decode()
    if not stream:
        return json.loads(text)["usage"], headers
    usage = None
    for line in text.splitlines():
        if line.startswith(": x-cached-tokens-source: "):
            headers["x-cached-tokens-source"] = line.rsplit(" ", 1)[1]
        elif line.startswith("data: {") and '"usage":{' in line:
            usage = json.loads(line[6:])["usage"]
    assert usage is not None, text[-2000:]
    return usage, headers


def _indexed(url: str, pool: str) -> int:
    """The blocks this frontend's KV index holds for `pool` (its status data)."""
    status = json.loads(urllib.request.urlopen(url + "/status.json", timeout=5).read())
    return next(p["indexed_blocks"] for r in status["regions"] for p in r["pools"] if p["pool_id"] == pool)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_usage_reports_the_prefix_vllm_reused(em, stream):
    """Two chat requests sharing a long prefix through the HTTP front: the second's
    usage.prompt_tokens_details.cached_tokens is what vLLM reused (its prefix-cache hit counter
    rose by as many tokens), stated by the pool (x-cached-tokens-source: pool)."""
    em.ensure_up()
    http = f"127.0.0.1:{free_port()}"
    router = em.mesh.start_router("--http-listen", http, "--tokenizer", f"{MODEL}={em.model_dir}")
    try:
        em.mesh.wait_routable(router, list(em.engines), timeout=120)
        url = f"http://{http}"
        seed = 11 if stream else 12
        system = " ".join(
            f"rule {seed}-{i}: answer plainly and cite item {i * 7 % 97}." for i in range(38)
        )  # about 1,000 tokens
        first, headers = _chat(
            url, [{"role": "system", "content": system}, {"role": "user", "content": "hi"}], stream
        )
        assert first["prompt_tokens"] >= 900, first
        holder = headers.get("x-pools", "").split(",")[0] if not stream else None
        for pool in em.engines:  # the first request's blocks reached the relays, then this frontend
            wait_until(partial(blocks_match, em, pool), 30, message=f"{pool}: blocks published")
            wait_until(
                partial(lambda p: _indexed(url, p) >= len(em.sink.of(p)), pool), 30, message=f"{pool} indexed"
            )
        hits = {p: e.metric("vllm:prefix_cache_hits_total") for p, e in em.engines.items()}
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "and now?"}]
        usage, headers = _chat(url, msgs, stream)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # vLLM counts a step's hits as the step ends; the answer can come first.
        rose: dict[str, float] = {}

        def counted() -> bool:
            rose.update(
                {p: e.metric("vllm:prefix_cache_hits_total") - hits[p] for p, e in em.engines.items()}
            )
            return sum(rose.values()) >= cached

        wait_until(counted, 10, message="vLLM counted the hits")
        assert headers["x-cached-tokens-source"] == "pool"
        assert cached >= first["prompt_tokens"] // 2, (usage, rose)
        assert cached == sum(rose.values()), (usage, rose)  # what vLLM counted as hits, token for token
        if holder:
            assert rose[holder] == cached and headers["x-pools"].split(",")[0] == holder
    finally:
        router.proc.stop()

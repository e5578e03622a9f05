"""Benchmark of the OpenAI-compatible HTTP front against the gRPC Generate path, and of tokenization.

One real mesh on 127.0.0.1 (discovery, one mocker pool with a high speed-up and its relay, one
global frontend serving gRPC and HTTP with a locally trained tokenizer). In the same run and
interleaved, so both see the same machine noise:
- TTFT (call to the first token) through HTTP (streamed /v1/completions with a token-id prompt,
  a lean keep-alive HTTP/1.1 client) vs gRPC Generate (same prompt ids): p50/p99 and the ratio;
- requests per second with 16-token outputs, a closed loop of concurrent clients, each path
  (bounded by time and request count);
- the cost of rendering the chat template and tokenizing a ~16k-token chat prompt (in process),
  against the byte tokenizer on the same conversation as the baseline.
Writes bench/results/bench_http.md.

`--baseline-src DIR` instead compares this tree's HTTP front with the one of another source tree
(e.g. `git archive main`) in one mesh and one run: the frontend's CPU per HTTP request, and the
time to first token of short requests while long text prompts are being encoded (event-loop lag).
Writes bench/results/bench_http_baseline.md.

Run: .venv/bin/python -m bench.bench_http [--ttft-requests N] [--seconds S] [--concurrency C]
     [--baseline-src DIR [--rounds R] [--lag-seconds S] [--long-clients K]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.bench_frontend import cpu_seconds, start_frontend
from bench.bench_frontend import python_work_of as grpc_work_of
from bench.measure import FAST_POOL, closed_loop, pct, ttft_interleaved
from globalrouter.tokenizer import ByteTokenizer, HfTokenizer
from globalrouter.tokenizer_train import train_tokenizer
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch import MODEL, Mesh, free_port, process_group

ROOT = Path(__file__).resolve().parent.parent

RESULT = ROOT / "bench" / "results" / "bench_http.md"
RESULT_COMPARE = ROOT / "bench" / "results" / "bench_http_baseline.md"
OUTPUT_TOKENS = 16
VOCAB = 400
CHAT_TOKENS = 16_000


def prompt(i: int) -> list[int]:
    """A 128-token prompt of ids below VOCAB; distinct per request so no run is a pure cache hit."""
    return [(i * 7919 + k * 31) % VOCAB for k in range(128)]


class Grpc:
    name = "gRPC Generate"

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = router_pb2_grpc.RouterServiceStub(channel)

    async def one(self, i: int, max_tokens: int) -> tuple[float, int]:
        started = time.perf_counter()
        ttft, count = None, 0
        call = self._stub.Generate(
            router_pb2.GenerateRequest(
                model=MODEL,
                prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=prompt(i))),
                max_tokens=max_tokens,
            ),
            timeout=30,
        )
        async for msg in call:
            if msg.WhichOneof("payload") == "tokens":
                ttft = ttft or time.perf_counter() - started
                count += len(msg.tokens.token_ids)
        return ttft or float("nan"), count


class Http:
    """Streams /v1/completions over one keep-alive HTTP/1.1 connection per client, parsing the
    chunked SSE body by hand: a lean client, so that the figures are the server's (the openai
    SDK spends milliseconds per request transforming a token-id prompt in Python)."""

    name = "HTTP /v1/completions"

    def __init__(
        self,
        address: str,
        tls: ssl.SSLContext | None = None,
        name: str = "",
        prompt_of: Callable[[int], Any] = prompt,
    ) -> None:
        """`tls`: HTTPS with this client context (bench_security); `name` overrides the label;
        `prompt_of(i)`: the prompt of request i (token ids, or a text)."""
        self.name = name or self.name
        self._prompt_of = prompt_of
        self._tls = tls
        self._host, port = address.rsplit(":", 1)
        self._port = int(port)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def one(self, i: int, max_tokens: int) -> tuple[float, int]:
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": self._prompt_of(i),
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        request = (
            b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        started = time.perf_counter()
        status = b""
        if self._idle:  # the server closes keep-alive connections idle for 5 s: then open a new one
            reader, writer = self._idle.pop()
            writer.write(request)
            try:
                status = await reader.readline()
            except ConnectionError:
                status = b""
        if not status:
            reader, writer = await asyncio.open_connection(self._host, self._port, ssl=self._tls)
            writer.write(request)
            status = await reader.readline()
        assert status.startswith(b"HTTP/1.1 200"), status
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        ttft, count, data = None, 0, b""
        while True:  # chunked transfer encoding
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            data += chunk[:-2]
            if ttft is None and b'"text":"' in data and b'"choices":[]' not in data:
                ttft = time.perf_counter() - started
        for line in data.split(b"\n"):
            if line.startswith(b"data: {") and b'"usage":{' in line:
                count = json.loads(line[6:])["usage"]["completion_tokens"]
        self._idle.append((reader, writer))
        return ttft or float("nan"), count


async def measure(grpc_address: str, http_address: str, args) -> dict:
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        g, h = Grpc(channel), Http(http_address)
        ttft = await ttft_interleaved(g, h, args.ttft_requests)
        rps: dict[str, tuple[float, int]] = {}
        for target in (g, h, g, h):  # twice each, alternating; keep the better
            rate, n = await closed_loop(target, args.seconds, args.concurrency, 100_000, OUTPUT_TOKENS)
            rps[target.name] = max(rps.get(target.name, (0.0, 0)), (rate, n))
    return {"ttft": ttft, "rps": rps}


def chat_of(tokenizer: HfTokenizer, target: int) -> list[dict[str, str]]:
    """A multi-turn conversation whose rendered prompt is about `target` tokens."""
    turn = (
        "The global router picks the pool; the pool picks the worker. Prefix-aware routing sends a "
        "prompt to the pool that already caches its prefix — café, naïve, 日本語, 🙂. "
    )
    per_turn = len(tokenizer.encode(turn, add_special_tokens=False))
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for k in range(target // per_turn):
        messages.append({"role": "user" if k % 2 == 0 else "assistant", "content": f"{k}: {turn}"})
    return messages


def time_prompt(tokenizer, messages, repeats: int) -> tuple[float, float, int]:
    """(median template seconds, median template+encode seconds, tokens)."""
    render, total = [], []
    n = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        text = tokenizer.render_chat(messages)
        t1 = time.perf_counter()
        n = len(tokenizer.encode(text, add_special_tokens=False))
        t2 = time.perf_counter()
        render.append(t1 - t0)
        total.append(t2 - t0)
    return statistics.median(render), statistics.median(total), n


async def python_work(requests: int, repeats: int, stream: bool) -> float:
    """CPU microseconds per request of the HTTP front's own Python work (body parse and validation,
    routing decision, the run loop, detokenization, SSE or JSON shaping, metrics): the ASGI app
    called directly with the pool link replaced by an in-memory double (the messages a mocker
    sends for 16 tokens), so no sockets and no uvicorn; the best of `repeats`."""
    from globaldiscovery.v1 import discovery_pb2
    from globalrouter.config import RouterConfig
    from globalrouter.http_api.config import HttpConfig
    from globalrouter.server import create_server
    from globalrouter.serving import Admitted, ServingLinks
    from globalrouter.v1 import pool_frontend_pb2 as pf

    first = pf.PoolTokens(token_ids=[7])
    finish = pf.PoolFinish(reason=pf.POOL_FINISH_REASON_LENGTH)
    rest = pf.PoolFrontendServiceGenerateResponse(
        tokens=pf.PoolTokens(token_ids=list(range(40, 40 + OUTPUT_TOKENS - 1)), finish=finish)
    )
    admission = pf.PoolAdmission(worker_id="w0", prompt_blocks=8)

    class Stream:
        def __init__(self) -> None:
            self._left = iter([rest])

        async def read(self):
            return next(self._left, None)

        def cancel(self) -> None:
            pass

    class Links(ServingLinks):
        async def admit(self, pool, request):
            url = self.next_frontend(pool)
            self._in_flight[url] = self._in_flight.get(url, 0) + 1
            return Admitted(pool_id=pool.pool_id, url=url, stream=Stream(), admission=admission, first=first)

    router = create_server(RouterConfig(listen="127.0.0.1:0", http=HttpConfig(listen="127.0.0.1:0")))
    router.core.table.apply_listed(
        discovery_pb2.Pool(pool_id="bench-pool", model=MODEL, region="r1", frontends=["http://127.0.0.1:1"])
    )
    assert router.http is not None
    front = router.http.front
    links = Links(0.1, 1.0)
    if hasattr(front, "path"):  # one request path for both fronts
        front.path.links = links
    else:  # a tree from before the shared request path
        setattr(front, "links", links)  # noqa: B010
    app = front.app()
    never = asyncio.get_running_loop().create_future()  # no disconnect
    bodies = [
        json.dumps(
            {"model": MODEL, "prompt": prompt(i), "max_tokens": OUTPUT_TOKENS, "stream": stream}
        ).encode()
        for i in range(requests)
    ]

    async def call(body: bytes) -> None:
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never
            return {"type": "http.disconnect"}

        status = 0

        async def send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        await app(scope, receive, send)
        assert status == 200, status

    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for body in bodies:
            await call(body)
        best = min(best, (time.process_time() - started) / requests * 1e6)
    await router.handle.server.stop(0)
    return best


def python_work_of(src: Path, stream: bool) -> float:
    """python_work() of the source tree `src`, in a child process."""
    flag = "--python-work-stream" if stream else "--python-work"
    code = (
        f"import runpy, sys; sys.path.insert(0, {str(src)!r}); sys.argv[1:] = [{flag!r}]; "
        f"runpy.run_path({__file__!r}, run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{flag} failed: {out.stderr[-2000:]}")
    return float(out.stdout.split()[-1])


LONG_GRPC_CHARS = 60_000
"""A gRPC text prompt of about 16k tokens of the trained tokenizer (~160 ms to encode)."""
LONG_HTTP_CHARS = 8_000
"""An HTTP text prompt just below the 8,192 characters from which the old front encoded in a thread."""
SHORT_PROMPT_TOKENS = 128


def long_text(chars: int, i: int) -> str:
    turn = (
        f"{i}: The global router picks the pool; the pool picks the worker. Prefix-aware routing sends "
        "a prompt to the pool that already caches its prefix — café, naïve, 日本語, 🙂. "
    )
    return (turn * (chars // len(turn) + 1))[:chars]


async def http_cpu_round(address: str, pid: int, seconds: float, concurrency: int) -> tuple[float, float]:
    """(requests/s, frontend CPU µs per request) of a closed loop of streamed /v1/completions."""
    before = cpu_seconds(pid)
    rate, n = await closed_loop(Http(address), seconds, concurrency, 100_000, OUTPUT_TOKENS)
    return rate, (cpu_seconds(pid) - before) / max(1, n) * 1e6


async def lag_round(grpc_address: str, http_address: str, seconds: float, long_clients: int) -> list[float]:
    """Seconds to the first token of short requests (128 token ids, gRPC) sent one after another
    while `long_clients` gRPC clients send ~16k-token text prompts and as many HTTP clients send
    8,000-character text prompts, each one request after another: what prompt encoding on the
    frontend's event loop costs every other request."""
    deadline = time.perf_counter() + seconds
    out: list[float] = []
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        short = Grpc(channel)
        http = Http(http_address, prompt_of=lambda i: long_text(LONG_HTTP_CHARS, i))

        async def long_grpc(k: int) -> None:
            i = 0
            while time.perf_counter() < deadline:
                i += 1
                text = long_text(LONG_GRPC_CHARS, k * 1_000_000 + i)
                call = stub.Generate(
                    router_pb2.GenerateRequest(
                        model=MODEL, prompt=router_pb2.Prompt(text=text), max_tokens=1
                    ),
                    timeout=60,
                )
                async for _ in call:
                    pass

        async def long_http(k: int) -> None:
            i = 0
            while time.perf_counter() < deadline:
                i += 1
                await http.one(k * 1_000_000 + i, 1)

        async def shorts() -> None:
            i = 0
            await asyncio.sleep(0.5)  # the long clients are under way
            while time.perf_counter() < deadline:
                i += 1
                ttft, _ = await short.one(40_000_000 + i, 1)
                out.append(ttft)

        await asyncio.gather(
            *(long_grpc(k) for k in range(long_clients)),
            *(long_http(k) for k in range(long_clients)),
            shorts(),
        )
    return out


async def compare(frontends: dict[str, tuple[str, str, int]], args) -> dict:
    """Both trees' frontends, interleaved round by round (the order alternating)."""
    names = list(frontends)
    cpu: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    lag: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up: connections, caches, code paths
        grpc_address, http_address, _pid = frontends[name]
        await closed_loop(Http(http_address), 1.0, args.concurrency, 100_000, OUTPUT_TOKENS)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            _grpc, http_address, pid = frontends[name]
            cpu[name].append(await http_cpu_round(http_address, pid, args.seconds, args.concurrency))
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            grpc_address, http_address, _pid = frontends[name]
            lag[name] += await lag_round(grpc_address, http_address, args.lag_seconds, args.long_clients)
    return {"cpu": cpu, "lag": lag}


def run_compare(args) -> int:
    """--baseline-src: this tree's frontend and the baseline tree's, in one mesh and one run."""
    trees = {"this tree": ROOT, "baseline": args.baseline_src.resolve()}
    # In-process Python work first (child processes, alternating, the best of three each).
    work: dict[str, dict[str, list[float]]] = {n: {"stream": [], "json": [], "grpc": []} for n in trees}
    for _ in range(3):
        for name, src in trees.items():
            work[name]["stream"].append(python_work_of(src, True))
            work[name]["json"].append(python_work_of(src, False))
            work[name]["grpc"].append(grpc_work_of(src))
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp, process_group(Path(tmp)) as group:
        tok_dir = train_tokenizer(Path(tmp) / "tokenizer", vocab_size=VOCAB)
        mesh = Mesh(group)
        mesh.start_discovery()
        mesh.start_pool("bench-pool", "local", *FAST_POOL, "--vocab-size", str(VOCAB))
        frontends = {}
        for name, src in trees.items():
            http = f"127.0.0.1:{free_port()}"
            f = start_frontend(
                mesh, name.replace(" ", "-"), src, "--http-listen", http, "--tokenizer", f"{MODEL}={tok_dir}"
            )
            mesh.wait_routable(f, mesh.pools)
            frontends[name] = (f.address, http, f.proc.pid)
        result = asyncio.run(compare(frontends, args))
    cmd = (
        f".venv/bin/python -m bench.bench_http --baseline-src {args.baseline_src} --seconds {args.seconds:g} "
        f"--rounds {args.rounds} --concurrency {args.concurrency} --lag-seconds {args.lag_seconds:g} "
        f"--long-clients {args.long_clients}"
    )
    rows, lag_rows, work_rows, lines = [], [], [], []
    for name in trees:
        w = {k: min(v) for k, v in work[name].items()}
        work_rows.append(f"| {name} | {w['stream']:.0f} | {w['json']:.0f} | {w['grpc']:.0f} |")
        lines.append(
            f"{name:10s} Python work per request: HTTP streamed {w['stream']:.0f} us, HTTP JSON {w['json']:.0f} us, "
            f"gRPC Generate {w['grpc']:.0f} us"
        )
        runs = result["cpu"][name]
        us = statistics.median(u for _, u in runs)
        rates = " / ".join(f"{r:.0f}" for r, _ in runs)
        rows.append(f"| {name} | {us:.0f} | {' / '.join(f'{u:.0f}' for _, u in runs)} | {rates} |")
        lines.append(f"{name:10s} HTTP front CPU {us:.0f} us/request (rounds {rates} req/s)")
        waits = result["lag"][name]
        p50, p99, worst = pct(waits, 50), pct(waits, 99), max(waits)
        lag_rows.append(
            f"| {name} | {p50 * 1e3:.1f} ms | {p99 * 1e3:.1f} ms | {worst * 1e3:.1f} ms | {len(waits)} |"
        )
        lines.append(
            f"{name:10s} short requests under long prompts: TTFT p50 {p50 * 1e3:.1f} ms p99 {p99 * 1e3:.1f} ms "
            f"max {worst * 1e3:.1f} ms ({len(waits)} requests)"
        )
    for line in lines:
        print(line)
    text = (
        "## HTTP front before/after in one run (`bench_http --baseline-src`)\n\n"
        f"Command: `{cmd}` on {platform.machine()} with {os.cpu_count()} cores (shared). One mesh: one\n"
        "mocker pool (4 workers, speed-up 1000) with its relay and two global frontends, this tree's and\n"
        "the baseline tree's, started alike (`--http-listen`, the trained tokenizer); the rounds alternate\n"
        "between them.\n\n"
        f"CPU of the frontend process (/proc utime+stime) per streamed /v1/completions request (128 token\n"
        f"ids in, {OUTPUT_TOKENS} tokens out), {args.concurrency} concurrent lean keep-alive clients, "
        f"{args.rounds} rounds of {args.seconds:g} s:\n\n"
        "| frontend | CPU µs/request (median) | per round | req/s per round |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nThe fronts' own Python work per request, in process with the pool link replaced by an\n"
        "in-memory double (no sockets, no uvicorn, no gRPC; CPU time, best of 3 × 5 × 2,000 requests for\n"
        "HTTP, bench_frontend's measure for gRPC Generate), µs:\n\n"
        "| frontend | HTTP streamed | HTTP JSON | gRPC Generate |\n|---|---|---|---|\n"
        + "\n".join(work_rows)
        + "\n\nEvent-loop lag as other requests see it: time to the first token of short gRPC requests (128\n"
        f"token ids, one after another) while {args.long_clients} gRPC clients send ~16k-token text prompts "
        f"({LONG_GRPC_CHARS:,} characters)\nand {args.long_clients} HTTP clients send {LONG_HTTP_CHARS:,}-character "
        f"text prompts, back to back, {args.rounds} rounds of {args.lag_seconds:g} s:\n\n"
        "| frontend | short TTFT p50 | p99 | max | requests |\n|---|---|---|---|---|\n"
        + "\n".join(lag_rows)
        + "\n"
    )
    RESULT_COMPARE.parent.mkdir(exist_ok=True)
    RESULT_COMPARE.write_text(text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ttft-requests", type=int, default=300, help="requests per side for TTFT")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per throughput run")
    parser.add_argument(
        "--concurrency", type=int, default=16, help="concurrent clients in the throughput loop"
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed runs of the 16k-token prompt")
    parser.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="instead: this tree's HTTP front against the one of this source tree (e.g. `git archive main`), "
        "CPU per request and event-loop lag, in one run",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--baseline-src: rounds per measure and tree")
    parser.add_argument(
        "--lag-seconds", type=float, default=6.0, help="--baseline-src: seconds per lag round"
    )
    parser.add_argument(
        "--long-clients", type=int, default=2, help="--baseline-src: clients sending long prompts, per API"
    )
    parser.add_argument("--python-work", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--python-work-stream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.python_work or args.python_work_stream:
        print(f"{asyncio.run(python_work(2000, 5, args.python_work_stream)):.1f}")
        return 0
    if args.baseline_src is not None:
        return run_compare(args)
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp, process_group(Path(tmp)) as group:
        tok_dir = train_tokenizer(Path(tmp) / "tokenizer", vocab_size=VOCAB)
        hf = HfTokenizer.load(tok_dir)
        messages = chat_of(hf, CHAT_TOKENS)
        hf_render, hf_total, hf_tokens = time_prompt(hf, messages, args.repeats)
        by_render, by_total, by_tokens = time_prompt(ByteTokenizer(), messages, args.repeats)
        mesh = Mesh(group)
        mesh.start_discovery()
        mesh.start_pool("bench-pool", "local", *FAST_POOL, "--vocab-size", str(VOCAB))
        http = f"127.0.0.1:{free_port()}"
        router = mesh.start_router(
            "--log-level", "warning", "--http-listen", http, "--tokenizer", f"{MODEL}={tok_dir}"
        )
        mesh.wait_routable(router, mesh.pools)
        result = asyncio.run(measure(router.address, http, args))
    g, h = result["ttft"][Grpc.name], result["ttft"][Http.name]
    g50, g99, h50, h99 = pct(g, 50), pct(g, 99), pct(h, 50), pct(h, 99)
    (grps, gn), (hrps, hn) = result["rps"][Grpc.name], result["rps"][Http.name]
    lines = [
        f"TTFT gRPC Generate:     p50 {g50 * 1e3:.2f} ms  p99 {g99 * 1e3:.2f} ms  ({len(g)} requests)",
        f"TTFT HTTP /v1/completions: p50 {h50 * 1e3:.2f} ms  p99 {h99 * 1e3:.2f} ms  ({len(h)} requests)",
        f"ratio HTTP/gRPC p50 {h50 / g50:.2f}x, p99 {h99 / g99:.2f}x",
        f"throughput, {OUTPUT_TOKENS}-token outputs, {args.concurrency} clients: gRPC {grps:.0f} req/s ({gn}), "
        f"HTTP {hrps:.0f} req/s ({hn}), ratio {hrps / grps:.2f}",
        f"chat prompt of {hf_tokens} tokens (trained BPE): template {hf_render * 1e3:.2f} ms, template+encode "
        f"{hf_total * 1e3:.2f} ms; byte tokenizer ({by_tokens} tokens): {by_total * 1e3:.2f} ms "
        f"(ratio {hf_total / by_total:.2f}x)",
    ]
    for line in lines:
        print(line)
    cmd = (
        f".venv/bin/python -m bench.bench_http --ttft-requests {args.ttft_requests} --seconds {args.seconds:g} "
        f"--concurrency {args.concurrency} --repeats {args.repeats}"
    )
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(
        "## OpenAI HTTP front vs gRPC Generate, and tokenization (`bench_http`)\n\n"
        f"Command: `{cmd}` on {platform.machine()} with {os.cpu_count()} cores (shared; clients, the mocker,\n"
        "its relay, discovery and the frontend all run on this machine). One mocker pool (4 workers,\n"
        "speed-up 1000) with its relay, one global frontend serving both APIs; the same 128-token\n"
        "prompts (token ids) go through each path, interleaved in the same run. The HTTP side streams\n"
        "/v1/completions (SSE, JSON per chunk, detokenization) to a lean keep-alive HTTP/1.1 client;\n"
        "the gRPC side is a grpc.aio stub, so each ratio compares whole paths, client included.\n\n"
        "| measure | gRPC Generate | HTTP /v1/completions | ratio HTTP/gRPC |\n|---|---|---|---|\n"
        f"| TTFT p50 | {g50 * 1e3:.2f} ms | {h50 * 1e3:.2f} ms | {h50 / g50:.2f}x |\n"
        f"| TTFT p99 | {g99 * 1e3:.2f} ms | {h99 * 1e3:.2f} ms | {h99 / g99:.2f}x |\n"
        f"| requests/s ({OUTPUT_TOKENS}-token outputs, {args.concurrency} clients) | {grps:.0f} | {hrps:.0f} | "
        f"{hrps / grps:.2f} |\n\n"
        f"Chat prompt of {hf_tokens} tokens ({len(messages)} messages), median of {args.repeats} runs in\n"
        "process: what the HTTP front does once per chat request before routing.\n\n"
        "| tokenizer | template | template + encode | tokens |\n|---|---|---|---|\n"
        f"| trained byte-level BPE (`tokenizers`, sandboxed Jinja template) | {hf_render * 1e3:.2f} ms | "
        f"{hf_total * 1e3:.2f} ms | {hf_tokens} |\n"
        f"| byte tokenizer (baseline, same conversation) | {by_render * 1e3:.2f} ms | {by_total * 1e3:.2f} ms | "
        f"{by_tokens} |\n\n"
        f"Ratio BPE / bytes for template + encode: {hf_total / by_total:.2f}x.\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

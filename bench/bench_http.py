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

Run: .venv/bin/python -m bench.bench_http [--ttft-requests N] [--seconds S] [--concurrency C]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.measure import FAST_POOL, closed_loop, pct, ttft_interleaved
from globalrouter.tokenizer import ByteTokenizer, HfTokenizer
from globalrouter.tokenizer_train import train_tokenizer
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch import MODEL, Mesh, free_port, process_group

ROOT = Path(__file__).resolve().parent.parent

RESULT = ROOT / "bench" / "results" / "bench_http.md"
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

    def __init__(self, address: str, tls: ssl.SSLContext | None = None, name: str = "") -> None:
        """`tls`: HTTPS with this client context (bench_security); `name` overrides the label."""
        self.name = name or self.name
        self._tls = tls
        self._host, port = address.rsplit(":", 1)
        self._port = int(port)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def one(self, i: int, max_tokens: int) -> tuple[float, int]:
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": prompt(i),
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
    args = parser.parse_args()
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

"""End to end, real processes: the openai client against `globalrouter serve --http-listen` in front of
mocker pools (with relays and discovery), including a pool killed mid-stream."""

from __future__ import annotations

import json
import signal
import urllib.request

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from globalrouter.detokenizer import TextStream
from globalrouter.tokenizer import prompt_context
from mocker.tokens import continue_sequence
from tests.openai.conftest import VOCAB
from tests.router.mesh import MODEL, Mesh
from tests.support import free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are the mesh. Answer in full sentences, naïvely if you must."},
    {"role": "user", "content": "Tell me about prefix-aware routing across pools 🙂"},
]


def start(procs, tokenizer_dir, *pool_flags: str):
    """Discovery, pools pool-a and pool-b (vocabulary of the trained tokenizer) and one frontend."""
    mesh = Mesh(procs)
    mesh.start_discovery()
    for name in ("pool-a", "pool-b"):
        mesh.start_pool(name, "eu", "--vocab-size", str(VOCAB), *pool_flags)
    http = f"127.0.0.1:{free_port()}"
    router = mesh.start_router("--http-listen", http, "--tokenizer", f"{MODEL}={tokenizer_dir}")
    mesh.wait_routable(router, mesh.pools)
    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=30)
    return mesh, router, http, client


def expected(tokenizer, n: int) -> tuple[list[int], str]:
    """The prompt ids and the text an uninterrupted mocker run gives for MESSAGES."""
    prompt = tokenizer.encode(tokenizer.render_chat(MESSAGES), add_special_tokens=False)
    stream = TextStream(tokenizer, prompt_context(prompt))
    return prompt, stream.push(continue_sequence(prompt, n, VOCAB)).text + stream.finish()


def test_sdk_chat_and_completions_through_a_real_mesh(procs, tokenizer_dir, hf_tokenizer):
    _mesh, router, http, client = start(procs, tokenizer_dir, "--speedup", "20")
    prompt, text = expected(hf_tokenizer, 24)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == len(prompt) and chunks[-1].usage.completion_tokens == 24
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=24)
    reply = raw.parse()
    assert reply.choices[0].message.content == text
    # The second run found the first one's prompt blocks cached (telemetry steered it there), as
    # the mocker pool's admission said.
    assert reply.usage.prompt_tokens_details.cached_tokens == len(prompt) // 16 * 16
    assert raw.headers["x-cached-tokens-source"] == "pool"
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", top_p=0)
    # One set of metrics: the HTTP requests counted where gRPC Generate counts its own.
    assert router.metric("globalrouter_requests_total", model=MODEL, outcome="OK") == 2
    metrics = urllib.request.urlopen(f"http://{http}/metrics", timeout=5).read().decode()
    assert "globalrouter_decisions_total" in metrics and "globalrouter_http_responses_total" in metrics


def test_pool_killed_mid_stream_is_invisible_to_the_sdk(procs, tokenizer_dir, hf_tokenizer):
    mesh, router, http, client = start(procs, tokenizer_dir, "--speedup", "1")  # 50 tokens/s
    _prompt, text = expected(hf_tokenizer, 80)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=80,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-request-id": "migrating-request-1"},
    )
    pieces: list[str] = []
    usage, killed = None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        pieces.extend(c.delta.content or "" for c in chunk.choices)
        if killed is None and len("".join(pieces)) >= 10:
            status = json.loads(urllib.request.urlopen(f"http://{http}/status.json", timeout=5).read())
            serving = next(
                e["pool_id"] for e in status["decisions"] if e["request_id"] == "migrating-request-1"
            )
            mesh.pools[serving].pool.kill9()  # the serving pool crashes mid-stream
            killed = serving
    assert killed is not None
    assert "".join(pieces) == text  # the same text as an uninterrupted run: nothing lost or repeated
    assert usage.completion_tokens == 80
    assert router.metric("globalrouter_migrations_total", from_pool=killed) == 1

    def migration_shown():
        status = json.loads(urllib.request.urlopen(f"http://{http}/status.json", timeout=5).read())
        return any(e["request_id"] == "migrating-request-1" for e in status["migrations"])

    wait_until(migration_shown, 5, message="the migration on the status page")


def test_sigterm_lets_an_open_http_stream_finish(procs, tokenizer_dir, hf_tokenizer):
    mesh = Mesh(procs)
    mesh.start_discovery()
    mesh.start_pool("pool-a", "eu", "--vocab-size", str(VOCAB), "--speedup", "1")  # 50 tokens/s
    http = f"127.0.0.1:{free_port()}"
    router = mesh.start_router(
        "--http-listen", http, "--tokenizer", f"{MODEL}={tokenizer_dir}", "--grace", "10"
    )
    mesh.wait_routable(router, mesh.pools)
    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=30)
    _, text = expected(hf_tokenizer, 100)
    pieces: list[str] = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100, stream=True):
        pieces.extend(c.delta.content or "" for c in chunk.choices)
        if len(pieces) == 3:
            router.proc.signal(signal.SIGTERM)  # about 2 s of output still to come
    assert "".join(pieces) == text
    assert router.proc.popen.wait(timeout=20) == 0

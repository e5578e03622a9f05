"""Bad input over HTTP: each case a clear OpenAI-shaped error naming the field, or a bounded wait;
the server stays healthy throughout."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket

import pytest

from tests.openai.conftest import BYTE_MODEL, MODEL

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """One HTTP request with the standard library: (status, headers, decoded JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = raw.decode(errors="replace")
        return resp.status, dict(resp.getheaders()), payload
    finally:
        conn.close()


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": MSG, "max_tokens": 2, **fields}).encode()


CASES = [
    # (name, path, body, status, param)
    ("malformed json", CHAT, b'{"model": ', 400, None),
    ("not an object", CHAT, b"[1, 2]", 400, None),
    ("invalid utf-8", CHAT, b'{"model": "\xff\xfe"}', 400, None),
    ("model wrong type", CHAT, json.dumps({"model": 5, "messages": MSG}).encode(), 400, "model"),
    ("model missing", CHAT, json.dumps({"messages": MSG}).encode(), 400, "model"),
    ("max_tokens as string", CHAT, chat(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens negative", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens huge", CHAT, chat(max_tokens=10**12), 400, "max_tokens"),
    ("max_completion_tokens zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("temperature bool", CHAT, chat(temperature=True), 400, "temperature"),
    ("temperature too high", CHAT, chat(temperature=2.5), 400, "temperature"),
    ("temperature infinite", CHAT, chat(temperature=1e999), 400, "temperature"),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("seed beyond int64", CHAT, chat(seed=2**70), 400, "seed"),
    ("stream not bool", CHAT, chat(stream="yes"), 400, "stream"),
    (
        "stream_options without stream",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages"),
    ("messages not a list", CHAT, chat(messages="hi"), 400, "messages"),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("content wrong type", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("all messages empty", CHAT, chat(messages=[{"role": "user", "content": ""}]), 400, "messages"),
    ("too many stop strings", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("negative stop token id", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids[0]"),
    ("n above one", CHAT, chat(n=3), 400, "n"),
    ("tools", CHAT, chat(tools=[{"type": "function"}]), 400, "tools"),
    ("empty prompt", COMPLETIONS, json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "prompt"),
    ("empty token prompt", COMPLETIONS, json.dumps({"model": MODEL, "prompt": []}).encode(), 400, "prompt"),
    (
        "token id too large",
        COMPLETIONS,
        json.dumps({"model": MODEL, "prompt": [2**33]}).encode(),
        400,
        "prompt",
    ),
    ("two prompts", COMPLETIONS, json.dumps({"model": MODEL, "prompt": ["a", "b"]}).encode(), 400, "prompt"),
    ("echo", COMPLETIONS, json.dumps({"model": MODEL, "prompt": "a", "echo": True}).encode(), 400, "echo"),
    ("nested too deep", CHAT, b"[" * 30_000 + b"]" * 30_000, 400, None),
    # A lone surrogate ("\ud800" in JSON) is not text: 400 naming the field, with either tokenizer.
    (
        "lone surrogate in chat content",
        CHAT,
        chat(messages=[{"role": "user", "content": "hi \ud800"}]),
        400,
        "messages[0].content",
    ),
    (
        "lone surrogate in chat content (byte tokenizer)",
        CHAT,
        chat(model=BYTE_MODEL, messages=[{"role": "user", "content": "\udfff hi"}]),
        400,
        "messages[0].content",
    ),
    (
        "lone surrogate in a content part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
        400,
        "messages[0].content[0].text",
    ),
    ("lone surrogate in a stop string", CHAT, chat(stop=["x\ud800"]), 400, "stop[0]"),
    ("lone surrogate in the model", CHAT, chat(model="m\ud800"), 400, "model"),
    ("lone surrogate in user", CHAT, chat(user="\ud800"), 400, "user"),
    (
        "lone surrogate in a prompt",
        COMPLETIONS,
        json.dumps({"model": MODEL, "prompt": "hi \ud800"}).encode(),
        400,
        "prompt",
    ),
    (
        "lone surrogate in a prompt (byte tokenizer)",
        COMPLETIONS,
        json.dumps({"model": BYTE_MODEL, "prompt": "\ud800"}).encode(),
        400,
        "prompt",
    ),
    (
        "lone surrogate in a prompt list",
        COMPLETIONS,
        json.dumps({"model": MODEL, "prompt": ["\ud800"]}).encode(),
        400,
        "prompt[0]",
    ),
    # The trained tokenizer knows the model's vocabulary (400 ids): a prompt id past it is refused here.
    (
        "token id outside the vocabulary",
        COMPLETIONS,
        json.dumps({"model": MODEL, "prompt": [5, 399, 400]}).encode(),
        400,
        "prompt",
    ),
    ("body over the limit", CHAT, b" " * (65 * 1024), 413, None),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
async def test_bad_input_is_a_clear_error(front, name, path, body, status, param):
    port = front.router.http.port
    got, headers, payload = await asyncio.to_thread(request, port, "POST", path, body)
    assert got == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if param:
        assert param.split("[")[0] in error["message"]
    assert headers["x-request-id"]
    # Still healthy, and still serving real requests.
    assert (await asyncio.to_thread(request, port, "GET", "/health"))[0] == 200
    ok, _, reply = await asyncio.to_thread(request, port, "POST", CHAT, chat())
    assert ok == 200 and reply["usage"]["completion_tokens"] == 2


async def test_unknown_route_and_method_are_json_errors(front):
    port = front.router.http.port
    status, _, payload = await asyncio.to_thread(request, port, "GET", "/v1/nothing")
    assert status == 404 and payload["error"]["code"] == "not_found"
    status, _, payload = await asyncio.to_thread(request, port, "GET", CHAT)
    assert status == 405 and payload["error"]["code"] == "method_not_allowed"


async def test_chunked_body_over_the_limit_is_refused(front):
    port = front.router.http.port

    def chunks():
        for _ in range(100):
            yield b" " * 1024

    def send():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request(
                "POST",
                CHAT,
                body=chunks(),
                encode_chunked=True,
                headers={"transfer-encoding": "chunked", "content-type": "application/json"},
            )
            return conn.getresponse().status
        except (BrokenPipeError, ConnectionResetError):
            return 413  # the server answered and closed before the client finished sending
        finally:
            conn.close()

    assert await asyncio.to_thread(send) == 413


async def test_client_that_stalls_sending_its_body_gets_408(front):
    port = front.router.http.port

    def stall():
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b'content-length: 100\r\n\r\n{"mo'
            )
            return s.recv(4096).decode(errors="replace")

    reply = await asyncio.to_thread(stall)  # bounded by the 2 s body timeout of the fixture
    assert reply.startswith("HTTP/1.1 408"), reply


async def test_streaming_client_that_never_reads_is_ended(front):
    """A client that stops reading cannot hold a pool slot for ever: the write times out (1 s in the
    fixture), the stream is ended and the pool's work is cancelled."""
    fast = await front.add_pool("fast", model="fast", vocab_size=128, speedup=2000.0)
    port = front.router.http.port
    metrics = front.router.http.front.metrics
    body = json.dumps({"model": "fast", "messages": MSG, "max_tokens": 1_000_000, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small window: the server's buffers fill fast
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    try:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = asyncio.get_running_loop().time() + 40
        while metrics.slow_clients._value.get() < 1:
            assert asyncio.get_running_loop().time() < deadline, "the stalled stream was not ended"
            await asyncio.sleep(0.1)
        while fast.tickets:  # the pool's work was cancelled, not left running
            assert asyncio.get_running_loop().time() < deadline, "the pool still runs the request"
            await asyncio.sleep(0.05)
    finally:
        s.close()
    assert (await asyncio.to_thread(request, port, "GET", "/health"))[0] == 200
    ok, _, _reply = await asyncio.to_thread(
        request,
        port,
        "POST",
        COMPLETIONS,
        json.dumps({"model": BYTE_MODEL, "prompt": "x", "max_tokens": 3}).encode(),
    )
    assert ok == 200


async def test_an_unexpected_failure_is_a_json_500_with_the_request_id(front, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(front.router.core, "decide", broken)
    status, headers, payload = await asyncio.to_thread(
        request, front.router.http.port, "POST", CHAT, chat(), {"x-request-id": "req-500"}
    )
    assert status == 500 and payload["error"]["code"] == "internal_error"
    assert headers["x-request-id"] == "req-500"
    assert "boom" not in payload["error"]["message"]  # never an exception's text (it may hold a prompt)
    assert "req-500" in payload["error"]["message"]  # the id to find the logged exception by


@pytest.mark.parametrize("model", [MODEL, BYTE_MODEL], ids=["trained-tokenizer", "byte-tokenizer"])
async def test_a_lone_surrogate_is_a_400_that_never_echoes_the_prompt(front, model):
    port = front.router.http.port
    secret = "the secret prompt"
    for path, body in (
        (CHAT, chat(model=model, messages=[{"role": "user", "content": f"{secret} \ud800"}])),
        (COMPLETIONS, json.dumps({"model": model, "prompt": f"{secret} \ud800"}).encode()),
    ):
        status, _, payload = await asyncio.to_thread(request, port, "POST", path, body)
        assert status == 400, payload
        assert payload["error"]["code"] == "invalid_value"
        assert secret not in payload["error"]["message"]
        assert "surrogate" in payload["error"]["message"]


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/json"],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_body_that_is_not_declared_json_is_refused_with_415(front, path, content_type):
    """A web page can post these cross-site without a CORS preflight: they are never parsed."""
    port = front.router.http.port
    body = json.dumps({"model": MODEL, "prompt": "hi", "messages": MSG, "max_tokens": 2}).encode()

    def send():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            headers = {"content-type": content_type} if content_type is not None else {}
            conn.request("POST", path, body=body, headers=headers)
            reply = conn.getresponse()
            return reply.status, json.loads(reply.read())
        finally:
            conn.close()

    status, payload = await asyncio.to_thread(send)
    assert status == 415, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == "unsupported_media_type"
    assert "application/json" in payload["error"]["message"]
    assert front.router.core.metrics.requests.collect()[0].samples == []  # nothing reached the router


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", "application/json;"]
)
async def test_json_with_parameters_or_in_any_case_is_served(front, content_type):
    port = front.router.http.port
    status, _, payload = await asyncio.to_thread(
        request, port, "POST", CHAT, chat(), {"content-type": content_type}
    )
    assert status == 200, payload


def _http10(port: int, body: bytes) -> bytes:
    """One HTTP/1.0 POST on a raw socket; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


async def test_a_stream_over_http_1_0_is_refused_and_a_whole_reply_is_served(front):
    """HTTP/1.0 has no chunked transfer encoding: a stream is refused naming the field, before any
    pool is asked; a non-streaming reply is served with its length."""
    port = front.router.http.port
    reply = await asyncio.to_thread(_http10, port, chat(stream=True))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), reply[:300]
    assert b"transfer-encoding" not in head.lower()
    error = json.loads(body)["error"]
    assert (error["param"], error["code"]) == ("stream", "invalid_value")
    assert front.router.core.metrics.requests.collect()[0].samples == []  # no pool was asked
    reply = await asyncio.to_thread(_http10, port, chat())
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), reply[:300]
    assert b"transfer-encoding" not in head.lower() and b"content-length" in head.lower()
    assert json.loads(body)["usage"]["completion_tokens"] == 2

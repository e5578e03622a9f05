"""The OpenAI HTTP serving link against a real local HTTP server speaking vLLM's streamed completions."""

from __future__ import annotations

import json

import grpc
import pytest
from aiohttp import web

from globalrouter.openai_link import (
    LinkError,
    OpenAIClient,
    PromptJson,
    SseParser,
    cached_tokens,
    completions_url,
    request_body,
)
from globalrouter.serving import StreamBroken
from globalrouter.v1 import pool_frontend_pb2 as pf
from meshkit.errors import Reason
from tests.support import free_port

REQUEST = pf.PoolFrontendServiceGenerateRequest(request_id="r1", model="m", token_ids=[5, 6, 7], max_tokens=3)


def chunk(ids, finish=None) -> bytes:
    body = {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def serve(handler):
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/base/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def streaming(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    assert body == request_body(REQUEST) and body["prompt"] == [5, 6, 7] and body["temperature"] == 0
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk([11]))
    await resp.write(chunk([12, 13], "length"))
    await resp.write(b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n')
    return resp


async def read_all(stream):
    out = []
    while (msg := await stream.read()) is not None:
        out.append(msg)
    return out


def test_completions_url_follows_the_openai_base_url_convention():
    assert completions_url("http://h:8000") == "http://h:8000/v1/completions"
    assert completions_url("https://gw.example.com/llm/v1/") == "https://gw.example.com/llm/v1/completions"


def test_sse_parser_splits_across_chunks():
    p = SseParser()
    assert p.feed(b'data: {"a"') == []
    assert p.feed(b": 1}\r\n\r\n: comment\ndata: [DONE]\n") == [b'{"a": 1}', b"[DONE]"]


async def test_a_stream_becomes_tokens_then_finish():
    runner, url = await serve(streaming)
    client = OpenAIClient()
    try:
        msgs = await read_all(await client.open(url, REQUEST, StreamBroken))
        assert [list(m.tokens.token_ids) for m in msgs if m.HasField("tokens")] == [[11], [12, 13]]
        assert msgs[-1].finish == pf.PoolFinish(reason=pf.POOL_FINISH_REASON_LENGTH, tokens_generated=3)
        # The same pooled connection serves the next request (keep-alive), here on a base path.
        msgs = await read_all(await client.open(url + "/base/v1", REQUEST, StreamBroken))
        assert msgs[-1].HasField("finish")
    finally:
        await client.close()
        await runner.cleanup()


# The end of a vLLM 0.32 streamed completion started with --enable-prompt-tokens-details, as its
# completion server serializes it: the last token's chunk (exclude_unset), then the usage chunk
# (choices empty, exclude_none) and [DONE]. Without the flag the usage has no prompt_tokens_details.
VLLM_TAIL = (
    b'data: {"id":"cmpl-9f2c","object":"text_completion","created":1764600000,"model":"tiny",'
    b'"choices":[{"index":0,"text":" b","logprobs":null,"finish_reason":"length","stop_reason":null,'
    b'"token_ids":[13]}]}\n\n'
    b'data: {"id":"cmpl-9f2c","object":"text_completion","created":1764600000,"model":"tiny",'
    b'"choices":[],"usage":{"prompt_tokens":1040,"total_tokens":1043,"completion_tokens":3,'
    b'"prompt_tokens_details":{"cached_tokens":1024}}}\n\n'
    b"data: [DONE]\n\n"
)


def vllm_stream(tail: bytes):
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk([11, 12]))
        await resp.write(tail)
        return resp

    return handler


@pytest.mark.parametrize(
    ("tail", "cached"),
    [
        (VLLM_TAIL, 1024),
        (VLLM_TAIL.replace(b',"prompt_tokens_details":{"cached_tokens":1024}', b""), None),
        (VLLM_TAIL.replace(b"1024}", b"0}"), 0),  # a miss, stated: 0 is the pool's word too
    ],
    ids=["cached", "not-stated", "miss"],
)
async def test_the_pools_cached_prompt_tokens_ride_on_the_finish(tail, cached):
    runner, url = await serve(vllm_stream(tail))
    client = OpenAIClient()
    try:
        msgs = await read_all(await client.open(url, REQUEST, StreamBroken))
        assert [list(m.tokens.token_ids) for m in msgs if m.HasField("tokens")] == [[11, 12], [13]]
        finish = msgs[-1].finish
        assert finish.reason == pf.POOL_FINISH_REASON_LENGTH and finish.tokens_generated == 3
        assert (finish.cached_tokens if finish.HasField("cached_tokens") else None) == cached
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_stream_cut_after_its_finish_reason_still_finishes():
    """The usage chunk is a bonus: a pool that closes after the finish reason ended the request."""
    runner, url = await serve(vllm_stream(VLLM_TAIL.split(b"\n\n")[0] + b"\n\n"))
    client = OpenAIClient()
    try:
        msgs = await read_all(await client.open(url, REQUEST, StreamBroken))
        assert msgs[-1].finish == pf.PoolFinish(reason=pf.POOL_FINISH_REASON_LENGTH, tokens_generated=3)
        assert not msgs[-1].finish.HasField("cached_tokens")
    finally:
        await client.close()
        await runner.cleanup()


@pytest.mark.parametrize(
    ("usage", "cached"),
    [
        ({"prompt_tokens_details": {"cached_tokens": 64}}, 64),
        ({"prompt_tokens_details": {"cached_tokens": 0}}, 0),
        ({"prompt_tokens": 9}, None),
        ({"prompt_tokens_details": None}, None),
        (None, None),
        ("usage", None),
        ({"prompt_tokens_details": {"cached_tokens": -1}}, None),
        ({"prompt_tokens_details": {"cached_tokens": 2**32}}, None),
        ({"prompt_tokens_details": {"cached_tokens": "64"}}, None),
        ({"prompt_tokens_details": {"cached_tokens": 64.0}}, None),
        ({"prompt_tokens_details": {"cached_tokens": True}}, None),
        ({"prompt_tokens_details": [64]}, None),
    ],
)
def test_cached_tokens_reads_only_a_token_count(usage, cached):
    assert cached_tokens(usage) == cached


@pytest.mark.parametrize(
    ("status", "code", "reason", "refused"),
    [
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.QUEUE_FULL, True),
        (503, grpc.StatusCode.UNAVAILABLE, Reason.POOL_REFUSING, True),
        (404, grpc.StatusCode.NOT_FOUND, Reason.MODEL_NOT_SERVED, True),
        (400, grpc.StatusCode.INVALID_ARGUMENT, None, False),
        (500, grpc.StatusCode.UNAVAILABLE, None, False),
    ],
)
async def test_an_answer_before_the_stream_is_an_admission_failure(status, code, reason, refused):
    async def handler(request):
        return web.Response(status=status, text="no")

    runner, url = await serve(handler)
    client = OpenAIClient()
    try:
        with pytest.raises(LinkError) as info:
            await client.open(url, REQUEST, StreamBroken)
        err = info.value
        assert (err.code, err.reason, err.refused) == (code, reason, refused)
        assert f"HTTP {status}" in err.message
    finally:
        await client.close()
        await runner.cleanup()


async def test_connection_refused_is_an_unreachable_pool():
    client = OpenAIClient()
    try:
        with pytest.raises(LinkError) as info:
            await client.open(f"http://127.0.0.1:{free_port()}", REQUEST, StreamBroken)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and not info.value.refused
    finally:
        await client.close()


async def test_a_stream_that_ends_without_a_finish_is_broken_after_its_tokens():
    async def dies(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk([11, 12]))
        await resp.write_eof()  # the pool went away mid-stream
        return resp

    runner, url = await serve(dies)
    client = OpenAIClient()
    try:
        stream = await client.open(url, REQUEST, StreamBroken)
        first = await stream.read()
        assert list(first.tokens.token_ids) == [11, 12]
        with pytest.raises(StreamBroken) as info:
            await stream.read()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        await client.close()
        await runner.cleanup()


async def test_an_error_event_or_an_abort_mid_stream_is_broken():
    async def errs(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk([11], "abort"))
        return resp

    runner, url = await serve(errs)
    client = OpenAIClient()
    try:
        stream = await client.open(url, REQUEST, StreamBroken)
        first = await stream.read()  # the tokens that came with the abort are delivered first
        assert list(first.tokens.token_ids) == [11]
        with pytest.raises(StreamBroken, match="abort"):
            await stream.read()
    finally:
        await client.close()
        await runner.cleanup()


def test_sampling_parameters_pass_through_to_the_engine():
    request = pf.PoolFrontendServiceGenerateRequest()
    request.CopyFrom(REQUEST)
    request.sampling.temperature = 0.5
    request.sampling.seed = 7
    request.sampling.stop_token_ids.extend([2, 3])
    body = request_body(request)
    assert (body["temperature"], body["seed"], body["stop_token_ids"]) == (0.5, 7, [2, 3])
    assert "top_p" not in body and "presence_penalty" not in body


def test_a_requests_prompt_is_encoded_once_for_its_tries_and_migrations(monkeypatch):
    prompts = PromptJson()
    encoded: list[int] = []
    real_join = str.join

    class Counting(str):
        def join(self, parts):  # counts the ids each encoding turns into text
            parts = list(parts)
            encoded.append(len(parts))
            return real_join(self, parts)

    monkeypatch.setattr("globalrouter.openai_link._COMMA", Counting(","))
    request = pf.PoolFrontendServiceGenerateRequest(
        request_id="r1", model="m", token_ids=range(1000), max_tokens=3
    )
    for _ in range(3):  # three pools asked
        assert json.loads(prompts.body(request)) == request_body(request)
    migrated = pf.PoolFrontendServiceGenerateRequest()
    migrated.CopyFrom(request)
    migrated.token_ids.extend([7, 8])  # continued elsewhere after two tokens
    assert json.loads(prompts.body(migrated)) == request_body(migrated)
    assert encoded == [1000, 2], "the prompt once, then only the tokens generated since"
    # Another request under the same id (ids come from clients) is encoded afresh, never mixed up.
    other = pf.PoolFrontendServiceGenerateRequest(
        request_id="r1", model="m", token_ids=[9, 9, 9, 9], max_tokens=1
    )
    assert json.loads(prompts.body(other)) == request_body(other)
    shorter = pf.PoolFrontendServiceGenerateRequest(
        request_id="r1", model="m", token_ids=[9, 8], max_tokens=1
    )
    assert json.loads(prompts.body(shorter)) == request_body(shorter)

"""The official openai client against the HTTP front (in-process frontend, real mocker pools)."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from globalrouter.detokenizer import TextStream
from mocker.tokens import continue_sequence
from tests.openai.conftest import BYTE_MODEL, MODEL, VOCAB

pytestmark = pytest.mark.timeout(60)

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello mesh"},
]


def expected_text(tokenizer, prompt: list[int], n: int, seed: int = 0) -> str:
    """What the mocker's deterministic tokens after `prompt` read as."""
    stream = TextStream(tokenizer, prompt[-6:])
    ids = continue_sequence(prompt, n, VOCAB, seed)
    return stream.push(ids).text + stream.finish()


async def test_chat_completion_text_and_usage(front, hf_tokenizer):
    client = front.client()
    reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    prompt = hf_tokenizer.encode(hf_tokenizer.render_chat(MESSAGES), add_special_tokens=False)
    assert reply.choices[0].message.content == expected_text(hf_tokenizer, prompt, 12)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == len(prompt) + 12
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert reply.model == MODEL and reply.object == "chat.completion"


async def test_streamed_chat_equals_the_whole_reply(front):
    front.router.core.table.pools["p2"].directory_draining = True  # both requests go to p1
    client = front.client()
    whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40)
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 40
    # The second identical prompt found its full blocks cached in the pool that served the first
    # (the pool's admission report, in tokens).
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 16 * 16 > 0


async def test_completions_text_and_token_prompt(front, hf_tokenizer):
    client = front.client()
    reply = await client.completions.create(model=MODEL, prompt="hello world", max_tokens=8)
    prompt = hf_tokenizer.encode("hello world", add_special_tokens=True)
    assert reply.choices[0].text == expected_text(hf_tokenizer, prompt, 8)
    assert reply.usage.prompt_tokens == len(prompt)
    by_ids = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    assert by_ids.choices[0].text == reply.choices[0].text
    stream = await client.completions.create(model=MODEL, prompt="hello world", max_tokens=8, stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == reply.choices[0].text


async def test_byte_model_keeps_the_byte_tokenizer(front):
    reply = await front.client().completions.create(model=BYTE_MODEL, prompt="héllo", max_tokens=10)
    assert reply.usage.prompt_tokens == len("héllo".encode())
    text = reply.choices[0].text
    assert len(text) == 10 and text.isascii()  # pool pb emits ids < 128: one character each


async def test_seed_changes_the_output_deterministically(front):
    client = front.client()

    async def run(seed):
        r = await client.completions.create(model=MODEL, prompt="hello", max_tokens=10, seed=seed)
        return r.choices[0].text

    assert await run(7) == await run(7)
    assert await run(7) != await run(8)


async def test_stop_string_ends_the_text_before_it(front, hf_tokenizer):
    client = front.client()
    full = (await client.completions.create(model=MODEL, prompt="hello", max_tokens=30)).choices[0].text
    stop = full[10:13]
    cut = full.index(stop)
    reply = await client.completions.create(model=MODEL, prompt="hello", max_tokens=30, stop=[stop])
    assert reply.choices[0].text == full[:cut]
    assert reply.choices[0].finish_reason == "stop"
    stream = await client.completions.create(
        model=MODEL, prompt="hello", max_tokens=30, stop=stop, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_stop_token_id_is_honoured_by_the_pool(front, hf_tokenizer):
    prompt = hf_tokenizer.encode("hello", add_special_tokens=True)
    ids = continue_sequence(prompt, 30, VOCAB)
    stop_id = ids[5]
    first = ids.index(stop_id)
    reply = await front.client().completions.create(
        model=MODEL, prompt="hello", max_tokens=30, extra_body={"stop_token_ids": [stop_id]}
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == first + 1
    assert reply.choices[0].text == expected_text(hf_tokenizer, prompt, first)


async def test_models_lists_the_served_models(front):
    models = await front.client().models.list()
    assert sorted(m.id for m in models.data) == [BYTE_MODEL, MODEL]


async def test_unknown_model_is_not_found(front):
    with pytest.raises(openai.NotFoundError) as err:
        await front.client().chat.completions.create(model="nope", messages=MESSAGES)
    assert err.value.code == "model_not_found"
    assert err.value.param == "model"


async def test_bad_field_is_bad_request_naming_it(front):
    with pytest.raises(openai.BadRequestError) as err:
        await front.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=3.5)
    assert err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        await front.client().chat.completions.create(model=MODEL, messages=MESSAGES, n=2)
    assert err.value.param == "n"


async def test_every_pool_refusing_is_rate_limited(front):
    for pool in front.pools.values():
        pool.set_faults(pool.faults.__class__(refuse_all=True))
    with pytest.raises(openai.RateLimitError) as err:
        await front.client().chat.completions.create(model=MODEL, messages=MESSAGES)
    assert err.value.code == "ALL_POOLS_REFUSED" or err.value.status_code == 429


async def test_no_eligible_pool_is_service_unavailable(front):
    for pool_id in ("p1", "p2"):
        front.router.core.table.pools[pool_id].directory_draining = True
    with pytest.raises(openai.InternalServerError) as err:
        await front.client().chat.completions.create(model=MODEL, messages=MESSAGES)
    assert err.value.status_code == 503


async def test_request_id_is_echoed_or_made(front):
    client = front.client()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_headers={"x-request-id": "req-abc-1"}
    )
    assert raw.headers["x-request-id"] == "req-abc-1"
    made = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=2
    )
    assert len(made.headers["x-request-id"]) >= 16
    events = front.router.core.events.latest(10, kind="decision")
    assert "req-abc-1" in {e.request_id for e in events}


async def test_error_after_streaming_started_is_the_last_event(front):
    """Both pools fail after 3 tokens: the request moves from one to the other, then no pool can continue. The
    client already has text, so the failure arrives as a final SSE error event, never a silent cut."""
    for pool_id in ("p1", "p2"):
        pool = front.pools[pool_id]
        pool.set_faults(pool.faults.__class__(fail_after_tokens=3))
    stream = await front.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, stream=True
    )
    received: list[str] = []
    with pytest.raises(openai.APIError) as err:
        async for chunk in stream:
            received.extend(c.delta.content or "" for c in chunk.choices)
    assert "no other pool can continue" in err.value.message
    assert "".join(received)  # text arrived before the error
    assert (
        front.router.metrics.migrations.labels("p1")._value.get()
        + front.router.metrics.migrations.labels("p2")._value.get()
        == 2
    )
    # Non-streaming: the same failure is an HTTP error status (no partial body).
    with pytest.raises(openai.InternalServerError) as err2:
        await front.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40)
    assert err2.value.status_code in (502, 503)

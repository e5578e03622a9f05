"""Sampling parameters and request ids on the gRPC API: validated, passed to the pool, honoured by the mocker."""

from __future__ import annotations

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc, sampling_pb2
from meshkit.validation import bad_request_fields
from mocker.tokens import continue_sequence
from tests.openai.conftest import MODEL, VOCAB

pytestmark = pytest.mark.timeout(30)
PROMPT = list(range(10, 60))


def request(**kw) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        model=MODEL, prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=PROMPT)), max_tokens=20, **kw
    )


async def generate(front, req, metadata=()):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front.router.port}") as channel:
        call = router_pb2_grpc.RouterServiceStub(channel).Generate(req, metadata=metadata, timeout=10)
        tokens: list[int] = []
        summary = None
        async for msg in call:
            if msg.WhichOneof("payload") == "tokens":
                tokens.extend(msg.tokens.token_ids)
            else:
                summary = msg.summary
        return tokens, summary, dict(await call.initial_metadata())


async def test_seed_and_stop_token_ids_reach_the_pool(front):
    tokens, summary, _ = await generate(front, request(sampling=sampling_pb2.SamplingParams(seed=42)))
    assert tokens == continue_sequence(PROMPT, 20, VOCAB, seed=42) != continue_sequence(PROMPT, 20, VOCAB)
    stop = tokens[7]
    cut = tokens.index(stop) + 1
    stopped, summary, _ = await generate(
        front, request(sampling=sampling_pb2.SamplingParams(seed=42, stop_token_ids=[stop], temperature=0.7))
    )
    assert stopped == tokens[:cut]  # the stop token is generated and sent, nothing after it
    assert summary.finish_reason == router_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (sampling_pb2.SamplingParams(temperature=2.5), "sampling.temperature"),
        (sampling_pb2.SamplingParams(top_p=0.0), "sampling.top_p"),
        (sampling_pb2.SamplingParams(top_p=float("nan")), "sampling.top_p"),
        (sampling_pb2.SamplingParams(presence_penalty=-3), "sampling.presence_penalty"),
        (sampling_pb2.SamplingParams(stop_token_ids=list(range(65))), "sampling.stop_token_ids"),
    ],
)
async def test_out_of_range_sampling_is_invalid_argument(front, params, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(front, request(sampling=params))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == [field]


async def test_request_id_header_names_the_request(front):
    _, summary, initial = await generate(front, request(), metadata=(("x-request-id", "grpc-req-7"),))
    assert summary.request_id == "grpc-req-7" and initial["x-request-id"] == "grpc-req-7"
    assert front.pools["p1"].stats.requests_admitted + front.pools["p2"].stats.requests_admitted == 1
    _, summary, initial = await generate(front, request())
    assert initial["x-request-id"] == summary.request_id and len(summary.request_id) >= 16


async def test_text_prompt_uses_the_model_tokenizer(front, hf_tokenizer):
    req = router_pb2.GenerateRequest(model=MODEL, prompt=router_pb2.Prompt(text="hello world"), max_tokens=5)
    tokens, _, _ = await generate(front, req)
    prompt = hf_tokenizer.encode("hello world", add_special_tokens=True)
    assert tokens == continue_sequence(prompt, 5, VOCAB)


async def test_a_token_id_outside_the_tokenizers_vocabulary_is_invalid_argument(front):
    """The frontend knows model m's vocabulary (its --tokenizer, VOCAB ids): it refuses an id past it
    itself, naming the field, rather than passing it on for the engine to refuse."""
    bad = router_pb2.GenerateRequest(
        model=MODEL,
        prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=[5, VOCAB - 1, VOCAB])),
        max_tokens=2,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(front, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["prompt.token_ids.ids[2]"]
    assert "vocabulary" in (err.value.details() or "")

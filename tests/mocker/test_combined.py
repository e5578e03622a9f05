"""Combined messages on the serving link: fewer messages, the same admission, tokens and finish."""

from __future__ import annotations

import pytest

from globalrouter.v1 import pool_frontend_pb2 as pf
from mocker.tokens import continue_sequence

pytestmark = pytest.mark.timeout(30)
PROMPT = list(range(500, 532))


async def messages(served, max_tokens: int, combine: bool) -> list[pf.PoolFrontendServiceGenerateResponse]:
    call = served.frontend.Generate(
        pf.PoolFrontendServiceGenerateRequest(
            request_id="r", model="m", token_ids=PROMPT, max_tokens=max_tokens, combine_messages=combine
        )
    )
    return [m async for m in call]


def tokens_of(msgs) -> list[int]:
    out: list[int] = []
    for m in msgs:
        kind = m.WhichOneof("payload")
        if kind == "admission":
            out.extend(m.admission.tokens.token_ids)
        elif kind == "tokens":
            out.extend(m.tokens.token_ids)
    return out


async def test_a_fast_short_request_comes_as_the_admission_with_its_first_tokens_and_tokens_with_the_finish(
    serve_pool,
):
    served = await serve_pool(speedup=10_000.0)
    msgs = await messages(served, 16, combine=True)
    # First tokens due at once: they ride in the admission; the finish rides in the last tokens.
    assert msgs[0].WhichOneof("payload") == "admission" and msgs[0].admission.tokens.token_ids
    assert msgs[0].admission.prompt_blocks == len(PROMPT) // served.pool.config.block_size
    last = msgs[-1].admission.tokens if len(msgs) == 1 else msgs[-1].tokens
    assert last.HasField("finish")
    assert last.finish.reason == pf.POOL_FINISH_REASON_LENGTH and last.finish.tokens_generated == 16
    assert all(m.WhichOneof("payload") != "finish" for m in msgs)
    assert all(not m.tokens.HasField("finish") for m in msgs[:-1])
    assert len(msgs) <= 2  # a 16-token request at this speed: at most two decode batches
    assert tokens_of(msgs) == continue_sequence(PROMPT, 16)


async def test_an_admission_whose_first_token_is_not_due_at_once_goes_out_alone(serve_pool):
    served = await serve_pool(speedup=1.0)  # a token every 20 ms: the admission does not wait for it
    msgs = await messages(served, 2, combine=True)
    assert msgs[0].WhichOneof("payload") == "admission" and not msgs[0].admission.HasField("tokens")
    assert msgs[-1].WhichOneof("payload") == "tokens" and msgs[-1].tokens.finish.tokens_generated == 2
    assert tokens_of(msgs) == continue_sequence(PROMPT, 2)


async def test_a_caller_that_does_not_ask_gets_separate_messages(serve_pool):
    served = await serve_pool(speedup=10_000.0)
    msgs = await messages(served, 16, combine=False)
    kinds = [m.WhichOneof("payload") for m in msgs]
    assert kinds[0] == "admission" and kinds[-1] == "finish" and set(kinds[1:-1]) == {"tokens"}
    assert not msgs[0].admission.HasField("tokens")
    assert not any(m.tokens.HasField("finish") for m in msgs)
    assert msgs[-1].finish.tokens_generated == 16
    assert tokens_of(msgs) == continue_sequence(PROMPT, 16)

"""A request may ask for its priority class (header / metadata x-priority) up to what its policy
allows (max_priority, else its own class); both fronts check it the same way (in-process frontend)."""

from __future__ import annotations

import aiohttp
import grpc
import pytest
from google.rpc import error_details_pb2

from globalrouter.v1 import router_pb2_grpc
from meshkit.errors import detail_of
from meshkit.validation import bad_request_fields
from tests.openai.conftest import MODEL, open_front
from tests.router.fakes import collect, gen_request

pytestmark = pytest.mark.timeout(60)

POLICY = '[identity."unchecked"]\npriority = 2\nmax_priority = 5\n'


async def post(front, priority: str | None) -> tuple[int, dict]:
    headers = {} if priority is None else {"x-priority": priority}
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as client,
        client.post(front.base_url + "/v1/completions", json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.json()


async def generate(front, priority: str | None):
    metadata = () if priority is None else (("x-priority", priority),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front.router.port}") as channel:
        return await collect(
            router_pb2_grpc.RouterServiceStub(channel), gen_request([5, 6, 7], 2), metadata=metadata
        )


@pytest.fixture
async def policed(tokenizer_dir, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    async with open_front(tokenizer_dir, policy=str(policy)) as f:
        yield f


async def test_a_request_may_ask_for_a_class_up_to_its_policys_max_priority(policed):
    flow = policed.router.core.metrics.flow
    for asked, cls in ((None, 2), ("5", 5), ("0", 0), (" 4", 4)):
        status, body = await post(policed, asked)
        assert status == 200, body
        assert flow.series("unchecked", cls).requests >= 1  # counted in the class it asked for
    _, summary = await generate(policed, "3")
    assert summary.tokens_generated == 2
    assert flow.series("unchecked", 3).requests == 1


async def test_a_class_above_the_policys_is_refused_with_a_reason_on_both_fronts(policed):
    status, body = await post(policed, "6")
    assert status == 403 and body["error"]["code"] == "PRIORITY_NOT_ALLOWED", body
    assert "at most 5" in body["error"]["message"]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(policed, "9")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    info = detail_of(e.value, error_details_pb2.ErrorInfo)
    assert info is not None and info.reason == "PRIORITY_NOT_ALLOWED" and info.metadata["max_priority"] == "5"


@pytest.mark.parametrize("bad", ["high", "10", "-1", "2.0", "", "٣"])
async def test_a_malformed_x_priority_is_invalid_argument_naming_the_header(policed, bad):
    status, body = await post(policed, bad)
    assert status == 400 and body["error"]["param"] == "x-priority", body
    if not bad.isascii():
        return  # gRPC clients refuse to send a metadata value that is not ASCII
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(policed, bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(e.value) == ["metadata x-priority"]


async def test_without_a_policy_only_class_0_may_be_asked_for(front):
    assert (await post(front, "0"))[0] == 200
    status, body = await post(front, "1")
    assert status == 403 and body["error"]["code"] == "PRIORITY_NOT_ALLOWED", body

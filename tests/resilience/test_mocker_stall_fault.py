"""The mocker's stall fault, set at run time through SetFaults: a stream hangs after N tokens (open,
silent) while the process and other requests carry on; zero turns it off."""

from __future__ import annotations

import asyncio

import pytest

from globalrouter.v1 import pool_frontend_pb2 as pf
from mocker.config import Faults
from mocker.tokens import continue_sequence
from mocker.v1 import admin_pb2 as adm
from tests.mocker.conftest import serve_pool  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(30)
PROMPT = list(range(32))


async def test_set_faults_stall_after_tokens_hangs_the_stream_then_turns_off(serve_pool):  # noqa: F811
    s = await serve_pool()
    await s.admin.SetFaults(adm.SetFaultsRequest(stall_after_tokens=3))
    assert s.pool.faults == Faults(stall_after_tokens=3)
    call = s.frontend.Generate(
        pf.PoolFrontendServiceGenerateRequest(request_id="hung", model="m", token_ids=PROMPT, max_tokens=10)
    )
    got: list[int] = []
    assert (await call.read()).HasField("admission")
    while len(got) < 3:
        got.extend((await call.read()).tokens.token_ids)
    assert got == continue_sequence(PROMPT, 3)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(call.read(), 1.0)  # open and silent: hung, not dead
    call.cancel()
    await s.admin.SetFaults(adm.SetFaultsRequest(stall_after_tokens=0))
    _, out, finish = await s.generate(PROMPT, 10, request_id="after")
    assert out == continue_sequence(PROMPT, 10) and finish is not None

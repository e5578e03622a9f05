"""Usage that tells the truth: cached prompt tokens from the pool when it reports them, else the
frontend's estimate, and the response says which (in-process frontend, fake OpenAI-HTTP pools)."""

from __future__ import annotations

import json

import aiohttp
import grpc
import pytest
from aiohttp import web

from globaldiscovery.v1 import discovery_pb2
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.blocks import block_hashes
from tests.openai.conftest import MODEL, Front
from tests.router.fakes import collect, gen_request, pool_msg
from tests.support import free_port

pytestmark = pytest.mark.timeout(60)

PROMPT = list(range(3, 3 + 80))  # 5 blocks of 16


def vllm_events(ids: list[int], cached: int | None) -> bytes:
    """A vLLM streamed completion as --enable-prompt-tokens-details makes it (without it, or
    when `cached` is None, the usage chunk has no prompt_tokens_details)."""
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL}
    out = []
    for i, t in enumerate(ids):
        finish = "length" if i == len(ids) - 1 else None
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish, "token_ids": [t]}
        out.append({**head, "choices": [choice]})
    usage: dict = {
        "prompt_tokens": len(PROMPT),
        "total_tokens": len(PROMPT) + len(ids),
        "completion_tokens": len(ids),
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    out.append({**head, "choices": [], "usage": usage})
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in out) + b"data: [DONE]\n\n"


async def http_pool(front: Front, pool_id: str, cached: int | None, dies: bool = False) -> web.AppRunner:
    """A fake OpenAI-HTTP pool listed in the frontend (the mocker pools drain, so it serves); one
    that `dies` sends a token and closes the stream."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream_options"] == {"include_usage": True}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if dies:
            await resp.write(vllm_events([40, 41], None).split(b"\n\n")[0] + b"\n\n")
            return resp
        await resp.write(vllm_events([40 + i for i in range(body["max_tokens"])], cached))
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    table = front.router.core.table
    table.apply_listed(
        pool_msg(
            pool_id,
            f"http://127.0.0.1:{port}",
            model=MODEL,
            frontend_protocol=discovery_pb2.FRONTEND_PROTOCOL_OPENAI_HTTP,
        )
    )
    for pid, pool in table.pools.items():
        pool.directory_draining = pool.directory_draining if pool.openai_http else pid != pool_id
    return runner


async def complete(front: Front, stream: bool) -> tuple[dict, str]:
    """A /v1/completions request of PROMPT: (usage, cached-tokens source)."""
    body: dict = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with (
        aiohttp.ClientSession() as client,
        client.post(front.base_url + "/v1/completions", json=body) as resp,
    ):
        text = await resp.text()
        assert resp.status == 200, text
        if not stream:
            return json.loads(text)["usage"], resp.headers["x-cached-tokens-source"]
    lines = text.splitlines()
    source = next(line.rsplit(" ", 1)[1] for line in lines if line.startswith(": x-cached-tokens-source: "))
    usage = next(
        json.loads(line[6:])["usage"] for line in lines if line.startswith("data: {") and '"usage":{' in line
    )
    return usage, source


async def grpc_summary(front: Front) -> router_pb2.GenerateSummary:
    """The summary of the same request through the gRPC front."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{front.router.port}") as channel:
        _, summary = await collect(router_pb2_grpc.RouterServiceStub(channel), gen_request(PROMPT, 3))
    return summary


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_http_pools_reported_cached_tokens_reach_usage_with_source_pool(front, stream):
    runner = await http_pool(front, "h", cached=48)
    try:
        usage, source = await complete(front, stream)
        assert usage["prompt_tokens_details"] == {"cached_tokens": 48} and source == "pool"
        assert usage["prompt_tokens"] == len(PROMPT) and usage["completion_tokens"] == 3
        # The gRPC front's summary says the same.
        summary = await grpc_summary(front)
        assert summary.cached_tokens == 48
        assert summary.cached_tokens_source == router_pb2.CACHED_TOKENS_SOURCE_POOL
    finally:
        await runner.cleanup()


async def test_a_pool_that_reports_nothing_gets_the_frontends_estimate(front):
    runner = await http_pool(front, "h", cached=None)
    try:
        core = front.router.core
        pool = core.table.pools["h"]
        # The pool's KV events (as its relay would report them) show the prompt's first 2 blocks.
        core.index.apply_snapshot("h/r/1", block_hashes(PROMPT, 16)[:2])
        pool.block_size, pool.kv_sources, pool.kv_at = 16, {"h/r/1"}, core.clock.monotonic()
        usage, source = await complete(front, stream=False)
        assert usage["prompt_tokens_details"] == {"cached_tokens": 32} and source == "estimate"
        summary = await grpc_summary(front)
        assert summary.cached_tokens == 32
        assert summary.cached_tokens_source == router_pb2.CACHED_TOKENS_SOURCE_ESTIMATE
    finally:
        await runner.cleanup()


async def test_a_mesh_pools_admission_is_the_pools_word(front):
    for pid, pool in front.router.core.table.pools.items():
        pool.directory_draining = pid != "p1"
    await complete(front, stream=False)
    usage, source = await complete(front, stream=False)  # the same prompt again: its blocks are cached
    assert usage["prompt_tokens_details"] == {"cached_tokens": len(PROMPT) // 16 * 16} and source == "pool"


async def test_a_migrated_request_keeps_the_first_pools_figure(front):
    """The prompt was prefilled at the first pool; the next one prefilled it plus the tokens so
    far, so its report is not about the prompt: the first pool's figure stays (here it stated
    none before it failed, so the estimate)."""
    dying = await http_pool(front, "h1", cached=None, dies=True)
    other = await http_pool(front, "h2", cached=48)
    try:
        core = front.router.core
        for pid, blocks in (("h1", 2), ("h2", 0)):
            pool = core.table.pools[pid]
            core.index.apply_snapshot(f"{pid}/r/1", block_hashes(PROMPT, 16)[:blocks])
            pool.block_size, pool.kv_sources, pool.kv_at = 16, {f"{pid}/r/1"}, core.clock.monotonic()
        summary = await grpc_summary(front)
        assert list(summary.pools) == ["h1", "h2"] and summary.migrations == 1
        assert summary.cached_tokens == 32
        assert summary.cached_tokens_source == router_pb2.CACHED_TOKENS_SOURCE_ESTIMATE
    finally:
        await dying.cleanup()
        await other.cleanup()


@pytest.mark.parametrize("cached", [48, None], ids=["reported", "unreported"])
async def test_an_http_pools_cached_prefix_reaches_the_metrics_at_its_finish(front, cached):
    runner = await http_pool(front, "h", cached=cached)
    try:
        registry = front.router.core.metrics.registry

        def sample(name: str, labels: dict | None = None) -> float:
            return registry.get_sample_value(name, labels or {}) or 0.0

        ratios = sample("globalrouter_cached_prefix_ratio_count")
        ratio_sum = sample("globalrouter_cached_prefix_ratio_sum")
        await complete(front, stream=True)
        await complete(front, stream=False)
        if cached is None:
            # Unknown is not zero: a pool that states nothing is left out of the cached-prefix figures.
            assert sample("globalrouter_prompt_blocks_total", {"pool": "h"}) == 0
            assert sample("globalrouter_cached_prefix_ratio_count") == ratios
        else:
            # Its usage (48 of 80 prompt tokens) in the mesh's 16-token blocks: 3 of 5, per request.
            assert sample("globalrouter_prompt_blocks_total", {"pool": "h"}) == 10
            assert sample("globalrouter_cached_blocks_total", {"pool": "h"}) == 6
            assert sample("globalrouter_cached_prefix_ratio_count") == ratios + 2
            assert sample("globalrouter_cached_prefix_ratio_sum") - ratio_sum == pytest.approx(1.2)
    finally:
        await runner.cleanup()

"""Replay against an in-process fake RouterService: deterministic prompts, arrival pacing,
bounded concurrency, hit conversion from the mesh's block size, errors counted."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from globalrouter.cli import main
from globalrouter.replay import ReplayConfig, block_tokens, prompt_tokens, replay
from globalrouter.trace import TraceRequest, write_trace
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.blocks import block_hashes
from meshkit.keepalive import SERVER_OPTIONS

MESH_BLOCK = 16


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    """Two pools; a prompt goes to pool-a when its first token is even, else pool-b. Each pool
    caches the block hashes of what it served, and reports cached leading blocks like the mesh."""

    def __init__(self) -> None:
        self.cache: dict[str, set[int]] = {"pool-a": set(), "pool-b": set()}
        self.received: list[tuple[float, str, int, int]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.hold = 0.0

    async def Generate(self, request, context):
        tokens = list(request.prompt.token_ids.ids)
        self.received.append((time.monotonic(), request.request_id, len(tokens), request.max_tokens))
        if request.model != "m":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pool serves {request.model!r}")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            pool = "pool-a" if tokens[0] % 2 == 0 else "pool-b"
            hashes = block_hashes(tokens, MESH_BLOCK)
            cached = 0
            for h in hashes:
                if h not in self.cache[pool]:
                    break
                cached += 1
            self.cache[pool].update(hashes)
            await asyncio.sleep(self.hold)
            yield router_pb2.GenerateResponse(
                tokens=router_pb2.TokenChunk(token_ids=[7] * request.max_tokens, offset=0, pool_id=pool)
            )
            yield router_pb2.GenerateResponse(
                summary=router_pb2.GenerateSummary(
                    finish_reason=router_pb2.FINISH_REASON_LENGTH,
                    pools=[pool],
                    cached_blocks=cached,
                    prompt_blocks=len(hashes),
                    tokens_generated=request.max_tokens,
                    request_id=request.request_id,
                )
            )
        finally:
            self.in_flight -= 1

    async def Route(self, request, context):
        first = request.prompt.token_ids.ids[0]
        ranked = ["pool-a", "pool-b"] if first % 2 == 0 else ["pool-b", "pool-a"]
        return router_pb2.RouteResponse(
            candidates=[
                router_pb2.Candidate(pool_id=p, rank=i + 1, total_cost=float(i), cached_blocks=3 - i)
                for i, p in enumerate(ranked)
            ]
        )


@pytest.fixture
async def fake_router():
    server = grpc.aio.server(options=SERVER_OPTIONS)
    fake = FakeRouter()
    router_pb2_grpc.add_RouterServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield fake, f"127.0.0.1:{port}"
    await server.stop(None)


def test_prompts_are_deterministic_blocks_of_512_cut_to_input_length():
    assert block_tokens(5) == block_tokens(5) and block_tokens(5) != block_tokens(6)
    assert len(block_tokens(5)) == 512 and all(0 <= t < 2**32 for t in block_tokens(5))
    a = prompt_tokens(TraceRequest(0.0, 1000, 1, (5, 6)))
    b = prompt_tokens(TraceRequest(0.0, 1100, 1, (5, 7, 8)))
    assert len(a) == 1000 and len(b) == 1100
    assert a[:512] == b[:512] and a[512:1000] != b[512:1000]
    # equal leading ids give equal leading block hashes at the mesh's block size
    ha, hb = block_hashes(a, MESH_BLOCK), block_hashes(b, MESH_BLOCK)
    assert ha[:32] == hb[:32] and ha[32] != hb[32]


@pytest.mark.timeout(60)
async def test_replay_reports_hits_in_trace_blocks_and_ttft(fake_router):
    fake, target = fake_router
    trace = [
        TraceRequest(0.00, 1024, 3, (1, 2)),
        TraceRequest(0.05, 1536, 2, (1, 2, 3)),  # same first token: same pool, 2 trace blocks hit
        TraceRequest(0.10, 700, 1, (1, 9)),  # 1 block hit
        TraceRequest(0.15, 512, 4, (4,)),
    ]
    result = await replay(
        trace, ReplayConfig(router=target, model="m", speedup=1.0, mesh_block_size=MESH_BLOCK)
    )
    assert result.requests == 4 and result.ok == 4 and result.errors == {}
    assert result.hit_rate == pytest.approx(3 / 8)
    assert result.ideal_hit_rate == pytest.approx(3 / 8)  # unlimited single cache
    assert result.share_of_ideal == pytest.approx(1.0)
    assert result.mesh_hit_rate == pytest.approx((64 + 32) / (64 + 96 + 43 + 32))
    assert sum(result.requests_per_pool.values()) == 4
    assert 0 < result.ttft_p50 <= result.ttft_p99 <= result.latency_p99
    assert [r[3] for r in sorted(fake.received, key=lambda r: r[1])] == [3, 2, 1, 4]


@pytest.mark.timeout(60)
async def test_arrivals_divided_by_speedup_and_concurrency_bounded(fake_router):
    fake, target = fake_router
    fake.hold = 0.3
    trace = [TraceRequest(0.0, 512, 1, (k,)) for k in range(6)] + [TraceRequest(20.0, 512, 1, (99,))]
    t0 = time.monotonic()
    result = await replay(trace, ReplayConfig(router=target, model="m", speedup=20.0, concurrency=2))
    assert result.ok == 7
    assert fake.max_in_flight <= 2
    last = max(r[0] for r in fake.received)
    assert last - t0 >= 1.0  # 20 s of trace at 20x: not before 1 s
    assert result.lag_p99 > 0.2  # the first six queued behind the concurrency limit


@pytest.mark.timeout(60)
async def test_cli_json_and_errors(fake_router, tmp_path, capsys):
    fake, target = fake_router
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceRequest(0.0, 600, 2, (1, 2)), TraceRequest(0.01, 600, 2, (1, 2))])
    argv = ["replay", "--trace", str(path), "--router", target, "--speedup", "10", "--json"]
    assert await asyncio.to_thread(main, [*argv, "--model", "m", "--max-output-tokens", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "requests",
        "hit_rate",
        "ideal_hit_rate",
        "share_of_ideal",
        "ttft_p50",
        "ttft_p99",
        "imbalance",
    ):
        assert key in out
    assert out["ok"] == 2 and all(r[3] == 1 for r in fake.received)
    assert await asyncio.to_thread(main, [*argv, "--model", "nope"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] == 0 and out["errors"] == {"NOT_FOUND": 2}


async def test_outcomes_file_keeps_each_request_in_trace_order_with_the_explained_ranking(
    fake_router, tmp_path
):
    _, target = fake_router
    trace = [TraceRequest(0.01 * i, 600, 4, (i % 3, 10 + i)) for i in range(6)]
    path = tmp_path / "outcomes.jsonl"
    await replay(
        trace, ReplayConfig(router=target, model="m", speedup=10.0, explain=True, outcomes_path=str(path))
    )
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(6))
    for r, req in zip(rows, trace, strict=True):
        first = prompt_tokens(req)[0]
        expected = "pool-a" if first % 2 == 0 else "pool-b"
        assert r["pools"] == [expected]
        assert r["ranking"][0][0] == expected  # what Route said just before
        assert r["ranking"][0][1] == 3

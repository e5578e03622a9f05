"""End to end, real processes: a pool dies mid-stream and the request migrates without loss; the limit holds."""

from __future__ import annotations

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.errors import Reason, reason_of
from meshlaunch import MODEL, Mesh
from mocker.tokens import continue_sequence

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
PROMPT = [(11 * i + 5) % 30_000 for i in range(100)]


def stream(address: str, tokens: list[int], max_tokens: int):
    """Yields the Generate messages (a live stream the test can act in the middle of)."""
    with grpc.insecure_channel(address) as ch:
        yield from router_pb2_grpc.RouterServiceStub(ch).Generate(
            router_pb2.GenerateRequest(
                model=MODEL,
                prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
                max_tokens=max_tokens,
            ),
            timeout=30,
        )


def test_kill_9_mid_stream_migrates_with_every_token_exactly_once(procs):
    mesh = Mesh(procs)
    mesh.start_discovery()
    for name in ("pool-a", "pool-b"):
        mesh.start_pool(name, "eu", "--speedup", "1")  # 50 tokens/s: the stream lasts seconds
    router = mesh.start_router()
    mesh.wait_routable(router, mesh.pools)
    got: list[int] = []
    chunk_pools: list[str] = []
    summary = None
    for msg in stream(router.address, PROMPT, 120):
        if msg.WhichOneof("payload") == "summary":
            summary = msg.summary
            continue
        assert msg.tokens.offset == len(got)
        got.extend(msg.tokens.token_ids)
        chunk_pools.append(msg.tokens.pool_id)
        if len(got) >= 10 and len(set(chunk_pools)) == 1 and mesh.pools[chunk_pools[0]].pool.alive():
            mesh.pools[chunk_pools[0]].pool.kill9()  # the serving pool crashes mid-stream
    first = chunk_pools[0]
    assert got == continue_sequence(PROMPT, 120)  # nothing lost, nothing repeated
    assert summary.migrations == 1 and list(summary.pools) == [
        first,
        next(p for p in mesh.pools if p != first),
    ]
    assert summary.tokens_generated == 120 and summary.finish_reason == router_pb2.FINISH_REASON_LENGTH
    assert router.metric("globalrouter_migrations_total", from_pool=first) == 1


def test_migration_limit_ends_the_request_with_unavailable_and_its_reason(procs):
    mesh = Mesh(procs)
    mesh.start_discovery()
    for name in ("pool-a", "pool-b", "pool-c"):
        mesh.start_pool(name, "eu", "--speedup", "5", "--fail-after-tokens", "6")
    router = mesh.start_router("--migration-limit", "1")
    mesh.wait_routable(router, mesh.pools)
    got: list[int] = []
    with pytest.raises(grpc.RpcError) as err:
        for msg in stream(router.address, PROMPT, 50):
            got.extend(msg.tokens.token_ids)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert reason_of(err.value) == Reason.MIGRATION_LIMIT_REACHED
    assert "migration limit (1)" in err.value.details()
    # At run time each item is a (key, value) tuple; the stub declares a class.
    trailers: dict[str, str] = dict(err.value.trailing_metadata())  # type: ignore[arg-type]
    assert trailers["x-migrations"] == "1" and len(trailers["x-pools"].split(",")) == 2
    assert got == continue_sequence(PROMPT, len(got)) and 6 <= len(got) <= 12
    assert router.metric("globalrouter_migration_aborts_total") == 1

"""End to end, real processes, `globalrouter serve --kv-state summary`: two mocker pools, one of them
with two relay replicas (which share the pool's table), route a repeated prefix back to its holder."""

from __future__ import annotations

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch import MODEL, Mesh, process_group, route, wait_until
from meshlaunch.mesh import relay_argv
from mocker.tokens import continue_sequence

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
PREFIX = [(11 * i + 5) % 30_000 for i in range(512)]  # 32 blocks of 16


def run(address: str, tokens: list[int], max_tokens: int = 8) -> tuple[list[int], router_pb2.GenerateSummary]:
    out: list[int] = []
    summary = None
    request = router_pb2.GenerateRequest(
        model=MODEL,
        prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
        max_tokens=max_tokens,
    )
    with grpc.insecure_channel(address) as ch:
        for msg in router_pb2_grpc.RouterServiceStub(ch).Generate(request, timeout=30):
            if msg.WhichOneof("payload") == "tokens":
                out.extend(msg.tokens.token_ids)
            else:
                summary = msg.summary
    assert summary is not None
    return out, summary


def test_a_summary_frontend_routes_a_repeated_prefix_to_its_holder(tmp_path):
    with process_group(tmp_path) as group:
        m = Mesh(group)
        m.start_discovery()
        m.start_pool("pool-a", "eu", "--workers", "2", "--speedup", "10")
        m.start_pool("pool-b", "eu", "--workers", "2", "--speedup", "10")
        # a second relay replica of pool-a: both stream to the frontend, into one table
        group.start(
            "relay-pool-a-2",
            relay_argv(m.pools["pool-a"].address, m.discovery, "pool-a", "eu", "relay-pool-a-2"),
        )
        router = m.start_router("--kv-state", "summary")
        m.wait_routable(router, m.pools)
        wait_until(
            lambda: router.pools()["pool-a"].telemetry_streams == 2, 20, message="pool-a's two relay streams"
        )

        tokens, summary = run(router.address, [*PREFIX, 1, 2, 3])
        home = summary.pools[0]
        assert tokens == continue_sequence([*PREFIX, 1, 2, 3], 8)
        wait_until(
            lambda: (
                (r := route(router.address, [*PREFIX, 9])).candidates[0].pool_id == home
                and r.candidates[0].cached_blocks == 32
            ),
            20,
            message="the prefix indexed at its pool",
        )
        views = router.pools()
        assert views[home].indexed_blocks >= 32
        for suffix in range(3):
            _tokens, s = run(router.address, [*PREFIX, 100 + suffix, 5])
            assert s.pools[0] == home, f"request with the shared prefix went to {s.pools[0]}, not {home}"
            assert s.cached_blocks == 32
        other = "pool-b" if home == "pool-a" else "pool-a"
        assert route(router.address, [*PREFIX, 9]).candidates[1].cached_blocks == 0
        assert {c.pool_id for c in route(router.address, [*PREFIX, 9]).candidates} == {home, other}

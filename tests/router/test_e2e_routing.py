"""End to end, real processes: prefix affinity, burst spreading, admission, errors, two frontends alike.

One mesh for the module: discovery, three mocker pools of different sizes in two regions (each with
its relay), two global frontends.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch import MODEL, Mesh, generate_cli, process_group, route, wait_until
from mocker.tokens import continue_sequence
from mocker.v1 import admin_pb2, admin_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
PREFIX = [(7 * i + 3) % 30_000 for i in range(512)]  # 32 blocks of 16


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with process_group(tmp_path_factory.mktemp("routing")) as group:
        m = Mesh(group)
        m.start_discovery()
        m.start_pool("pool-a", "eu", "--workers", "1", "--speedup", "10")
        m.start_pool("pool-b", "eu", "--workers", "2", "--speedup", "10")
        m.start_pool("pool-c", "us", "--workers", "4", "--speedup", "10")
        m.start_router()
        m.start_router()
        for router in m.routers:
            m.wait_routable(router, m.pools)
        yield m


def request(tokens, max_tokens=8, model=MODEL):
    return router_pb2.GenerateRequest(
        model=model,
        prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
        max_tokens=max_tokens,
    )


def run(address, tokens, max_tokens=8):
    """(tokens, summary) of one Generate."""
    out: list[int] = []
    summary = None
    with grpc.insecure_channel(address) as ch:
        for msg in router_pb2_grpc.RouterServiceStub(ch).Generate(request(tokens, max_tokens), timeout=30):
            if msg.WhichOneof("payload") == "tokens":
                out.extend(msg.tokens.token_ids)
            else:
                summary = msg.summary
    return out, summary


def set_faults(mesh, pool_ids, **faults):
    for pool_id in pool_ids:
        with grpc.insecure_channel(mesh.pools[pool_id].address) as ch:
            admin_pb2_grpc.MockerAdminServiceStub(ch).SetFaults(
                admin_pb2.SetFaultsRequest(**faults), timeout=5
            )


def test_prefix_affinity_then_a_burst_spreads(mesh):
    router = mesh.routers[0]
    tokens, summary = run(router.address, [*PREFIX, 1, 2, 3], 8)
    home = summary.pools[0]
    assert tokens == continue_sequence([*PREFIX, 1, 2, 3], 8)
    # Once the pool's relay has published the prefix, the router sees it there.
    wait_until(
        lambda: (
            (r := route(router.address, [*PREFIX, 9])).candidates[0].pool_id == home
            and r.candidates[0].cached_blocks == 32
        ),
        15,
        message="the prefix indexed at its pool",
    )
    for suffix in range(4):
        _tokens, s = run(router.address, [*PREFIX, 100 + suffix, 5], 8)
        assert s.pools[0] == home, f"request with the shared prefix went to {s.pools[0]}, not {home}"
        assert s.cached_blocks == 32
    # A burst sharing the prefix: pending work makes the holder costlier, so requests spread.
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: run(router.address, [*PREFIX, 200 + i], 200), range(12)))
    used = [s.pools[0] for _t, s in results]
    assert len(set(used)) > 1, f"the burst all went to {used}"
    assert used.count(home) >= 1
    assert router.metric("globalrouter_decisions_total", pool=home) >= 5


def test_two_frontends_route_alike(mesh):
    a, b = mesh.routers
    prompt = [*PREFIX[:256], 42]

    def same():
        ra, rb = route(a.address, prompt), route(b.address, prompt)
        key = lambda r: [(c.pool_id, c.cached_blocks, c.load_known) for c in r.candidates]  # noqa: E731
        return key(ra) == key(rb) and len(ra.candidates) == 3 and ra.candidates[0].cached_blocks == 16

    wait_until(same, 15, message="both frontends rank alike from the same telemetry")


def test_refusing_pool_hands_over_and_all_refusing_is_resource_exhausted(mesh):
    router = mesh.routers[1]
    prompt = [*PREFIX, 77]
    wait_until(
        lambda: all(
            v.load.requests_running == 0 and v.load.requests_waiting == 0 for v in router.pools().values()
        ),
        15,
        message="the pools idle",
    )
    ranked = [c.pool_id for c in route(router.address, prompt).candidates]
    refusers, acceptor = ranked[:2], ranked[2]
    set_faults(mesh, refusers, refuse_all=True)
    try:
        tokens, summary = run(router.address, prompt, 5)
        assert list(summary.pools) == [acceptor]
        assert summary.refused_by and set(summary.refused_by) <= set(refusers)
        assert tokens == continue_sequence(prompt, 5)
        set_faults(mesh, mesh.pools, refuse_all=True)
        with pytest.raises(grpc.RpcError) as err:
            run(router.address, prompt, 5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert all(p in err.value.details() for p in mesh.pools)
        assert router.metric("globalrouter_refusals_total", pool=refusers[0], code="RESOURCE_EXHAUSTED") >= 1
    finally:
        set_faults(mesh, mesh.pools)


def test_errors_and_the_cli(mesh):
    router = mesh.routers[0]
    with pytest.raises(grpc.RpcError) as err:
        with grpc.insecure_channel(router.address) as ch:
            list(
                router_pb2_grpc.RouterServiceStub(ch).Generate(
                    request([1, 2, 3], 4, model="no-such-model"), timeout=10
                )
            )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    result = generate_cli(router, [*PREFIX[:64], 5], 6)
    assert result["tokens"] == continue_sequence([*PREFIX[:64], 5], 6)
    assert result["finish_reason"] == "length" and result["migrations"] == 0 and len(result["pools"]) == 1
    # The metrics a dashboard needs are exported.
    assert router.metric("globalrouter_telemetry_lag_seconds_count") > 0
    assert router.metric("globalrouter_decision_latency_seconds_count") > 0
    assert router.metric("globalrouter_requests_total", model=MODEL, outcome="OK") >= 1
    assert router.metric("globalrouter_cached_prefix_ratio_count") >= 1

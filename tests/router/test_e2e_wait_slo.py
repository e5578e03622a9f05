"""End to end, real processes: a global frontend started with --wait-slo serves requests, keeps
a prefix on the pool holding it, and exports the price of waiting beyond the SLO on /metrics;
dry runs do not move it."""

from __future__ import annotations

import pytest

from meshlaunch import Mesh, generate_cli, process_group, route, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
PREFIX = [(11 * i + 5) % 30_000 for i in range(256)]  # 16 blocks of 16


def test_a_frontend_under_a_wait_slo_routes_and_exports_its_price(tmp_path):
    with process_group(tmp_path) as group:
        m = Mesh(group)
        m.start_discovery()
        m.start_pool("pool-a", "eu", "--workers", "2", "--speedup", "10")
        m.start_pool("pool-b", "eu", "--workers", "2", "--speedup", "10")
        router = m.start_router("--wait-slo", "2.5", "--wait-slo-quantile", "0.95")
        m.wait_routable(router, m.pools)
        # Dry runs (Route) send nothing, so they leave the initial price (2 seconds of cost per
        # second of wait beyond 2.5 s) as it is.
        for _ in range(3):
            assert route(router.address, [*PREFIX, 1, 2, 3]).candidates
        assert router.metric("globalrouter_wait_slo_price") == pytest.approx(2.0)
        first = generate_cli(router, [*PREFIX, 1, 2, 3], 4)
        assert len(first["tokens"]) == 4
        # The next turn of the same prefix goes where the prefix is, once the frontend knows it
        # (the holder's KV telemetry arrived: a dry run ranks it first with the prefix cached).
        holder = first["pools"][0]
        turn = [*PREFIX, 1, 2, 3, 100]

        def holder_known() -> bool:
            best = route(router.address, turn).candidates[0]
            return best.pool_id == holder and best.cached_blocks > 0

        wait_until(holder_known, timeout=20, message=f"{holder} ranked first with the prefix cached")
        out = generate_cli(router, turn, 4)
        assert len(out["tokens"]) == 4
        assert out["pools"] == [holder] and out["cached_blocks"] > 0, "the prefix came back to its holder"
        # Idle pools: every pick's estimated wait was within 2.5 s, so the price fell from 2.0.
        price = router.metric("globalrouter_wait_slo_price")
        assert 0.25 <= price < 2.0

"""A Route reply built from the ranking's cost vectors (router_api.route_response) is the reply the
per-candidate build gave, on many random fleets, whole or cut to max_candidates."""

from __future__ import annotations

import random

import pytest

from globalrouter.router_api import DIRECTORY_STATES, FILTER_REASONS, route_response
from globalrouter.selection import Decision, Selector
from globalrouter.v1 import router_pb2
from tests.router_core.test_selection_equivalence import NOW, random_config, random_fleet


def reference(decision: Decision, pools: dict, max_candidates: int = 0) -> router_pb2.RouteResponse:
    """The reply as Route built it before (one RankedPool, then one Candidate, per eligible pool)."""
    listed = list(decision.candidates)
    return router_pb2.RouteResponse(
        candidates=[
            router_pb2.Candidate(
                pool_id=c.pool_id,
                rank=i,
                total_cost=c.total_cost,
                prefill_cost=c.prefill_cost,
                load_cost=c.load_cost,
                pending_cost=c.pending_cost,
                cached_blocks=c.cached_blocks,
                prompt_blocks=c.prompt_blocks,
                load_known=c.load_known,
                region=c.region,
                directory_state=DIRECTORY_STATES[
                    pools[c.pool_id].directory_state() if c.pool_id in pools else "unlisted"
                ],
            )
            for i, c in enumerate(listed[:max_candidates] if max_candidates else listed, start=1)
        ],
        filtered=[
            router_pb2.FilteredPool(pool_id=f.pool_id, reason=FILTER_REASONS[f.reason], detail=f.detail)  # type: ignore[arg-type]  # an enum field takes its number
            for f in decision.filtered
        ],
        prompt_blocks=decision.prompt_blocks,
        candidates_total=len(listed),
    )


@pytest.mark.parametrize("seed", range(20))
def test_the_reply_from_the_cost_vectors_is_the_per_candidate_one(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(10):
        pools = random_fleet(rng)
        for p in pools:
            if rng.random() < 0.2:
                p.directory_draining = True
        table = {p.pool_id: p for p in pools}
        selector = Selector(random_config(rng))
        prompt = rng.choice((0, 16, 1600, 16_000))
        cached = {p.pool_id: rng.randint(0, prompt // 16 + 2) for p in pools if rng.random() < 0.6}
        decision = selector.select(pools, rng.choice(("m", "n", "absent")), prompt, 16, cached, NOW)
        for k in (0, 1, 3, 10_000):
            got = route_response(decision, table, k)
            assert got == reference(decision, table, k)
            # Cut or not, the same bytes a client reads.
            assert got.SerializeToString(deterministic=True) == reference(
                decision, table, k
            ).SerializeToString(deterministic=True)
        # A plain list of candidates (a decision not from select) gives the same reply.
        listed = Decision(list(decision.candidates), decision.filtered, decision.prompt_blocks, True)
        assert route_response(listed, table, 2) == reference(decision, table, 2)

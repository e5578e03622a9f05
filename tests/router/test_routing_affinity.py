"""The live decision passes a prompt-derived tie-break key, so idle pools share new prefixes."""

from __future__ import annotations

from collections import Counter

from globalrouter.pool_state import LoadSignal, PoolCapacityHint, PoolState
from globalrouter.routing import affinity_key
from globalrouter.selection import Selector

NOW = 50.0


def idle_pool(pool_id: str) -> PoolState:
    p = PoolState(
        pool_id=pool_id,
        listed=True,
        model="m",
        frontends=("http://127.0.0.1:1",),
        capacity=PoolCapacityHint(prefill_tokens_per_second=10_000),
        block_size=16,
        kv_at=NOW,
    )
    p.record_load(LoadSignal(), NOW)
    return p


def test_affinity_key_depends_only_on_the_first_block():
    a = list(range(40))
    assert affinity_key(a) == affinity_key([*a[:16], 7, 7, 7])
    assert affinity_key(a) != affinity_key([1, *a[1:]])
    assert affinity_key([3, 4]) == affinity_key([3, 4]) != 0
    assert affinity_key([]) == 0


def test_new_prefixes_spread_over_idle_pools_and_repeat_the_same_choice():
    pools = [idle_pool(f"pool-{i}") for i in range(4)]
    selector = Selector()
    firsts = []
    for prompt_id in range(200):
        tokens = [prompt_id * 1000 + t for t in range(64)]
        decision = selector.select(pools, "m", len(tokens), 16, {}, NOW, affinity_key=affinity_key(tokens))
        again = selector.select(pools, "m", len(tokens), 16, {}, NOW, affinity_key=affinity_key(tokens))
        assert decision.candidates[0].pool_id == again.candidates[0].pool_id
        firsts.append(decision.candidates[0].pool_id)
    counts = Counter(firsts)
    # 200 distinct prefixes over 4 idle pools: every pool gets a fair share (expected 50 each).
    assert set(counts) == {p.pool_id for p in pools}
    assert min(counts.values()) >= 25

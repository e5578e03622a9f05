"""The decision's overlap step: the prompt is hashed past its first block only when some pool holds it."""

from __future__ import annotations

from globalrouter.kv_index import KvIndex
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import PoolState
from globalrouter.routing import RoutingCore
from globalrouter.selection import Selector
from meshkit.blocks import adapter_seed, block_hashes
from meshkit.clock import FakeClock
from tests.support import count_routing_hashes

NOW = 10.0


def setup() -> tuple[RoutingCore, list[PoolState], list[int]]:
    tokens = list(range(160))  # 10 blocks of 16
    index = KvIndex()
    hashes = block_hashes(tokens, 16)
    index.apply_snapshot("a/r/1", hashes[:7])
    index.apply_snapshot("b/r/1", hashes[:3])
    pools = []
    for name in ("a", "b"):
        pool = PoolState(pool_id=name, listed=True, model="m", frontends=("http://h:1",), block_size=16)
        pool.kv_at, pool.kv_sources = NOW, {f"{name}/r/1"}
        pools.append(pool)
    core = RoutingCore(PoolTable(), index, Selector(), FakeClock(start=NOW), None)  # type: ignore[arg-type]
    return core, pools, tokens


def test_kv_index_says_whether_any_source_holds_a_block():
    index = KvIndex()
    index.apply_snapshot("s", [5, 6])
    assert index.holds(5) and not index.holds(7)
    index.apply_delta("s", [], [5])
    assert not index.holds(5)


def test_cached_prefixes_are_counted_per_pool():
    core, pools, tokens = setup()
    assert core.overlaps(pools, tokens, NOW) == {"a": 7, "b": 3}


def test_a_prompt_whose_first_block_nobody_holds_has_no_cached_prefix():
    core, pools, tokens = setup()
    assert core.overlaps(pools, [999, *tokens[1:]], NOW) == {}
    assert core.overlaps(pools, tokens[:15], NOW) == {}  # not even one full block


def test_the_rest_of_the_prompt_is_not_hashed_when_the_first_block_is_not_held(monkeypatch):
    core, pools, tokens = setup()
    hashed = count_routing_hashes(monkeypatch)
    core.overlaps(pools, [999, *tokens[1:]], NOW)
    assert hashed == [16]
    hashed.clear()
    core.overlaps(pools, tokens, NOW)
    assert hashed == [16, 160]


def test_an_adapters_prompt_matches_only_the_blocks_cached_under_that_adapter():
    core, pools, tokens = setup()
    sql = block_hashes(tokens, 16, adapter_seed("sql"))
    core.index.apply_snapshot("b/r/1", sql[:5])  # pool b now holds 5 blocks of the prompt under "sql"
    assert core.overlaps(pools, tokens, NOW) == {"a": 7, "b": 0}
    assert core.overlaps(pools, tokens, NOW, adapter_seed("sql")) == {"a": 0, "b": 5}
    assert core.overlaps(pools, tokens, NOW, adapter_seed("chat")) == {}


def test_over_the_summary_the_prefix_search_itself_answers_a_prompt_nobody_holds(monkeypatch):
    """With the KV summary there is no separate "does any pool hold the first block" probe (its
    prefix search makes the same one): the prompt is hashed whole and the answers are the exact
    index's, zero for every pool when nobody holds the first block."""
    from globalrouter.kv_summary import KvSummary

    core, pools, tokens = setup()
    summary = KvSummary()
    hashes = block_hashes(tokens, 16)
    summary.apply_snapshot("a/r/1", hashes[:7])
    summary.apply_snapshot("b/r/1", hashes[:3])
    core.index = summary  # type: ignore[assignment]
    monkeypatch.setattr(KvSummary, "holds", None)  # not asked
    assert dict(core.overlaps(pools, tokens, NOW)) == {"a": 7, "b": 3}
    assert dict(core.overlaps(pools, [999, *tokens[1:]], NOW)) == {"a": 0, "b": 0}
    assert dict(core.overlaps(pools, tokens[:15], NOW)) == {}  # not even one full block

"""`--ranking dynamo`: the frontend's Selector ranks with the simulator's dynamo policy's cost."""

from __future__ import annotations

import random

import pytest

from globalrouter.cli import build_parser
from globalrouter.config import RouterConfig
from globalrouter.policies import DynamoPolicy, FrontendView
from globalrouter.pool_state import LoadSignal, PoolCapacityHint, PoolState
from globalrouter.selection import SelectionConfig, Selector
from globalrouter.serve_cli import router_config
from globalrouter.simulate import run as simulate_run
from globalrouter.trace import TraceRequest
from globalrouter.wait_slo import WaitSlo
from meshkit import settings
from meshkit.tls import SecurityConfig

NOW = 100.0
BLOCK = 16


class _View(FrontendView):
    """The dynamo policy's view with the overlaps given (no index)."""

    __slots__ = ("cached",)
    cached: dict[str, int]

    def overlaps(self, hash_ids, now):
        return self.cached


def _pools(rng: random.Random, n: int) -> list[PoolState]:
    pools = []
    for i in range(n):
        p = PoolState(
            pool_id=f"pool-{i}",
            listed=True,
            model="m",
            frontends=("http://127.0.0.1:1",),
            capacity=PoolCapacityHint(prefill_tokens_per_second=10_000),
            block_size=BLOCK,
            kv_at=NOW,
        )
        # a report up to 2 s old (within the load's freshness): the default ranking drains it
        p.record_load(
            LoadSignal(
                prefill_tokens_in_flight=rng.randrange(0, 40_000),
                decode_tokens_in_flight=rng.randrange(0, 2_000),
            ),
            NOW - rng.uniform(0.0, 2.0),
        )
        if rng.random() < 0.5:
            p.record_sent(rng.randrange(0, 8_000), rng.randrange(0, 200))
        pools.append(p)
    return pools


def _dynamo_cost(
    view: FrontendView, pool: PoolState, prompt: int, cached: dict[str, int], dw: float
) -> float:
    return max(0, prompt - cached.get(pool.pool_id, 0) * BLOCK) + view.queued_work(pool, NOW, dw)


@pytest.mark.parametrize("seed", range(3))
def test_the_dynamo_ranking_picks_a_pool_of_the_dynamo_policys_lowest_cost(seed):
    rng = random.Random(seed)
    config = SelectionConfig.for_ranking("dynamo")
    selector = Selector(config)
    for _ in range(300):
        pools = _pools(rng, 8)
        prompt = rng.randrange(256, 30_000)
        cached = {p.pool_id: rng.randrange(0, prompt // BLOCK + 1) for p in pools if rng.random() < 0.6}
        view = _View(pools, None, config)  # type: ignore[arg-type]
        view.cached = cached
        policy = DynamoPolicy(config.decode_weight, BLOCK, seed)
        choice = policy.choose(view, TraceRequest(0.0, prompt, 64, tuple(range(prompt // BLOCK))), NOW)
        ranked = selector.select(
            pools, "m", prompt, 64, cached, NOW, affinity_key=rng.getrandbits(63)
        ).candidates
        costs = [_dynamo_cost(view, p, prompt, cached, config.decode_weight) for p in pools]
        by_id = {p.pool_id: c for p, c in zip(pools, costs, strict=True)}
        # the same lowest cost (ties may go to another pool of that cost) ...
        assert by_id[ranked[0].pool_id] == pytest.approx(costs[choice.pool])
        # ... and the whole ranking in the order of dynamo's cost
        ordered = [by_id[c.pool_id] for c in ranked]
        assert ordered == pytest.approx(sorted(ordered))


def test_the_default_ranking_is_unchanged_and_unknown_or_sloed_dynamo_rankings_are_refused():
    assert SelectionConfig.for_ranking("default") == SelectionConfig()
    dynamo = SelectionConfig.for_ranking("dynamo", freshness=SelectionConfig().freshness)
    assert (dynamo.prefill_weight, dynamo.drain_reports, dynamo.hotspot_seconds) == (1.0, False, 0.0)
    with pytest.raises(ValueError, match="unknown ranking 'fast'; known: default, dynamo"):
        SelectionConfig.for_ranking("fast")
    with pytest.raises(ValueError, match=r"--ranking dynamo.*--wait-slo"):
        SelectionConfig.for_ranking("dynamo", wait_slo=WaitSlo(1.0))
    with pytest.raises(ValueError, match="--ranking dynamo"):
        RouterConfig(ranking="dynamo", wait_slo=WaitSlo(1.0))
    with pytest.raises(ValueError, match="unknown ranking"):
        RouterConfig(ranking="fast")


def test_serve_and_simulate_take_the_ranking(tmp_path, capsys):
    args = settings.parse_args(build_parser(), ["serve", "--discovery", "127.0.0.1:1", "--ranking", "dynamo"])
    args.security = SecurityConfig()
    assert router_config(args).ranking == "dynamo"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--discovery", "127.0.0.1:1", "--ranking", "fast"])
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}\n')
    sim = build_parser().parse_args(
        ["simulate", "--trace", str(trace), "--ranking", "dynamo", "--wait-slo", "1"]
    )
    assert simulate_run(sim) == 2
    assert "--ranking dynamo" in capsys.readouterr().err
    sim = build_parser().parse_args(["simulate", "--trace", str(trace), "--ranking", "dynamo", "--json"])
    assert simulate_run(sim) == 0

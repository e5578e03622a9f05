"""Routing policies the simulator compares: the project's Selector (default) and baselines.

Every policy sees only what a global frontend sees: the PoolState signals (periodic load
reports plus its own pending bookkeeping) and the KvIndex fed by relay snapshots and deltas.
None of them peeks at the simulated pools' true state.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from globalrouter.kv_index import KvIndex
from globalrouter.pool_state import PoolState
from globalrouter.routed_prefixes import RoutedPrefixes, with_routed
from globalrouter.selection import SelectionConfig, Selector, pool_overlaps
from globalrouter.trace import TraceRequest


@dataclass(slots=True)
class FrontendView:
    """What the simulated global frontend knows: pool signals and the KV index."""

    pools: list[PoolState]
    index: KvIndex
    config: SelectionConfig
    routed: RoutedPrefixes | None = None
    """The prompts the frontend's Selector sent recently (`--routed-prefix-ttl`); None: off."""

    def overlaps(self, hash_ids: Sequence[int], now: float) -> Mapping[str, int]:
        """Pool id -> cached leading blocks, as the frontend's index says (one pass)."""
        return pool_overlaps(self.index, self.pools, hash_ids, now, self.config.freshness)

    def overlaps_routed(self, hash_ids: Sequence[int], now: float) -> Mapping[str, int]:
        """`overlaps` raised by the recently sent prompts, as the live frontend's RoutingCore does."""
        found = pool_overlaps(self.index, self.pools, hash_ids, now, self.config.freshness)
        return with_routed(found, self.routed, hash_ids, now)

    def record_routed(self, pool: int, hash_ids: Sequence[int], now: float) -> None:
        """The request with these block hashes was sent to pool `pool` (its index) at `now`."""
        if self.routed is not None:
            self.routed.record(self.pools[pool].pool_id, hash_ids, now)

    def queued_work(self, pool: PoolState, now: float, decode_weight: float) -> float:
        """Work tokens the frontend believes the pool has queued: last report plus pending."""
        work = pool.pending_prefill_tokens + decode_weight * pool.pending_decode_tokens
        if pool.load is not None:
            work += pool.load.prefill_tokens_in_flight + decode_weight * pool.load.decode_tokens_in_flight
        return work


@dataclass(frozen=True, slots=True)
class Choice:
    """A policy's pick: the pool's index and the prompt tokens it believes are left to prefill."""

    pool: int
    uncached_tokens: int


class Policy(Protocol):
    """Picks a pool for each request."""

    def choose(self, view: FrontendView, request: TraceRequest, now: float) -> Choice: ...


class SelectorPolicy:
    """The project's router: exactly the Selector the global frontend runs.

    `seed` 0 runs it exactly as the frontend does; another seed salts the affinity key, which
    reorders only the tie-breaks between equal costs (as dynamo's seed does), so the spread of
    the figures over seeds shows how much of a difference between policies is tie-break noise.
    """

    def __init__(self, config: SelectionConfig, seed: int = 0) -> None:
        self.selector = Selector(config)
        self.salt = 0 if seed == 0 else xxhash.xxh3_64_intdigest(seed.to_bytes(8, "little", signed=True))

    def choose(self, view: FrontendView, request: TraceRequest, now: float) -> Choice:
        cached = view.overlaps_routed(request.hash_ids, now)
        decision = self.selector.select(
            view.pools,
            view.pools[0].model,
            request.input_length,
            request.output_length,
            cached,
            now,
            affinity_key=(request.hash_ids[0] if request.hash_ids else 0) ^ self.salt,
        )
        best = decision.candidates[0]
        choice = Choice(_index_of(view, best.pool_id), best.uncached_tokens)
        view.record_routed(choice.pool, request.hash_ids, now)  # the simulated pools never refuse
        return choice


class RandomPolicy:
    """Uniformly random pool (seeded)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def choose(self, view: FrontendView, request: TraceRequest, now: float) -> Choice:
        return Choice(self.rng.randrange(len(view.pools)), request.input_length)


class RoundRobinPolicy:
    """Pools in turn."""

    def __init__(self) -> None:
        self.next = 0

    def choose(self, view: FrontendView, request: TraceRequest, now: float) -> Choice:
        i = self.next % len(view.pools)
        self.next += 1
        return Choice(i, request.input_length)


class LeastLoadedPolicy:
    """The pool with the least queued work (last load report plus pending), ignoring the cache."""

    def __init__(self, decode_weight: float) -> None:
        self.decode_weight = decode_weight

    def choose(self, view: FrontendView, request: TraceRequest, now: float) -> Choice:
        i = min(
            range(len(view.pools)), key=lambda k: view.queued_work(view.pools[k], now, self.decode_weight)
        )
        return Choice(i, request.input_length)


class DynamoPolicy:
    """Dynamo's KV-aware cost one level up: prefill tokens left after the pool's overlap plus
    the pool's queued work tokens, equal weights, lowest wins (ties broken at random, seeded,
    which spreads new prefixes better than always taking the first pool)."""

    def __init__(self, decode_weight: float, block_size: int, seed: int) -> None:
        self.decode_weight = decode_weight
        self.block_size = block_size
        self.rng = random.Random(seed)

    def choose(self, view: FrontendView, request: TraceRequest, now: float) -> Choice:
        cached = view.overlaps(request.hash_ids, now)
        costs = []
        for pool in view.pools:
            left = max(0, request.input_length - cached.get(pool.pool_id, 0) * self.block_size)
            costs.append((left + view.queued_work(pool, now, self.decode_weight), left))
        lowest = min(c for c, _ in costs)
        best = self.rng.choice([k for k, (c, _) in enumerate(costs) if c == lowest])
        return Choice(best, costs[best][1])


def _index_of(view: FrontendView, pool_id: str) -> int:
    for k, pool in enumerate(view.pools):
        if pool.pool_id == pool_id:
            return k
    raise KeyError(pool_id)


POLICIES: dict[str, Callable[[SelectionConfig, int, int], Policy]] = {
    "default": lambda config, seed, block_size: SelectorPolicy(config, seed),
    "random": lambda config, seed, block_size: RandomPolicy(seed),
    "round_robin": lambda config, seed, block_size: RoundRobinPolicy(),
    "least_loaded": lambda config, seed, block_size: LeastLoadedPolicy(config.decode_weight),
    "dynamo": lambda config, seed, block_size: DynamoPolicy(config.decode_weight, block_size, seed),
}
"""Policy name -> factory(selection config, seed, block size)."""


def make_policy(name: str, config: SelectionConfig, seed: int = 0, block_size: int = 512) -> Policy:
    """The named policy; KeyError names the known ones."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(config, seed, block_size)

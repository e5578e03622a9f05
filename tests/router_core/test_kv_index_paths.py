"""KvIndex: the one-key-at-a-time paths and the vectorised ones give the same answers as a dict model."""

from __future__ import annotations

import random

import pytest

from globalrouter import kv_index
from globalrouter.kv_index import KvIndex
from tests.router_core.test_kv_index import reference_overlaps

EMPTY_KEY = (1 << 64) - 1


class DictModel:
    """The plainest index: a set per source."""

    def __init__(self) -> None:
        self.sets: dict[str, set[int]] = {}

    def apply_delta(self, source: str, stored: list[int], removed: list[int]) -> None:
        held = self.sets.setdefault(source, set())
        held.difference_update(removed)
        held.update(stored)


# (delta crossover, walk crossover, overlay bound): every delta through the overlay and every
# walk one key at a time (the overlay folded only when a reader needs it, or folded after every
# delta, or every ~100 keys), everything vectorised, and the defaults (which mix both on this
# workload's sizes).
PATHS = {
    "scalar": (10**9, 10**9, 10**9),
    "scalar-fold-each": (10**9, 10**9, 0),
    "scalar-fold-100": (10**9, 10**9, 100),
    "vectorised": (0, 0, 0),
    "default": (kv_index.SMALL, kv_index.WALK_SMALL, kv_index.PENDING),
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("sources", [3, 70])  # one mask word, and two
def test_small_and_vectorised_paths_match_a_dict_model(monkeypatch, path, sources):
    small, walk_small, pending = PATHS[path]
    monkeypatch.setattr(kv_index, "SMALL", small)
    monkeypatch.setattr(kv_index, "WALK_SMALL", walk_small)
    monkeypatch.setattr(kv_index, "PENDING", pending)
    rng = random.Random(sources)
    # Chained prompts share prefixes (so walks end at varied depths); small sequential keys and
    # the empty-slot key are included; churn leaves tombstones and forces rebuilds.
    universe = [rng.getrandbits(64) for _ in range(2000)] + list(range(300)) + [EMPTY_KEY]
    prompts = [rng.sample(universe, rng.choice([1, 5, 30, 129, 300])) for _ in range(8)]
    idx, model = KvIndex(), DictModel()
    for step in range(600):
        source = f"s{rng.randrange(sources)}"
        held = sorted(model.sets.get(source, ()))
        prompt = rng.choice(prompts)
        stored = (
            prompt[: rng.randrange(0, len(prompt) + 1)] if rng.random() < 0.6 else rng.sample(universe, 40)
        )
        removed = rng.sample(held, min(len(held), rng.randrange(0, 50))) + rng.sample(universe, 3)
        idx.apply_delta(source, stored, removed)
        model.apply_delta(source, stored, removed)
        if step % 20 == 0:
            # Readers that see the overlay first (holds, short walks), then those that fold it.
            probe = rng.sample(universe, 50)
            held_any = set().union(*model.sets.values())
            assert [idx.holds(h) for h in probe] == [h in held_any for h in probe]
            for p in sorted(prompts, key=len):
                assert idx.prefix_overlaps(p) == reference_overlaps(model.sets, p)
            assert idx.total_blocks() == len(held_any)
            for s, blocks in model.sets.items():
                assert idx.block_count(s) == len(blocks)
        assert len(idx._pend) <= kv_index.PENDING + 1 + len(stored) + len(removed)


@pytest.mark.parametrize("sources", [3, 70])
def test_snapshots_and_drops_between_pending_deltas_match_a_dict_model(monkeypatch, sources):
    """A snapshot or a drop lands while deltas wait in the overlay: it is folded first, so the
    pending deltas of that source and of the others all count."""
    monkeypatch.setattr(kv_index, "PENDING", 10**9)
    rng = random.Random(100 + sources)
    universe = [rng.getrandbits(64) for _ in range(1500)] + list(range(50)) + [EMPTY_KEY]
    prompts = [rng.sample(universe, rng.choice([3, 30, 200])) for _ in range(6)]
    idx, model = KvIndex(), DictModel()
    for step in range(400):
        source = f"s{rng.randrange(sources)}"
        roll = rng.random()
        if roll < 0.05:
            idx.drop_source(source)
            model.sets.pop(source, None)
        elif roll < 0.1:
            snap = rng.sample(universe, rng.randrange(0, 300))
            idx.apply_snapshot(source, snap)
            model.sets[source] = set(snap)
        else:
            held = sorted(model.sets.get(source, ()))
            stored = rng.sample(universe, rng.randrange(0, 40))
            removed = rng.sample(held, min(len(held), rng.randrange(0, 40)))
            idx.apply_delta(source, stored, removed)
            model.apply_delta(source, stored, removed)
        if step % 25 == 0:
            held_any = set().union(*model.sets.values()) if model.sets else set()
            assert [idx.holds(h) for h in universe[:200]] == [h in held_any for h in universe[:200]]
            for p in sorted(prompts, key=len):
                assert idx.prefix_overlaps(p) == reference_overlaps(model.sets, p)
            assert idx.total_blocks() == len(held_any)
            for s in model.sets:
                assert idx.block_count(s) == len(model.sets[s])
    assert idx.sources() == sorted(model.sets)

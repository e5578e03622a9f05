"""One engine worker's cached blocks, rebuilt as the mesh's own chained block hashes (pure, hot path).

The engine names blocks by its own hashes; the mesh routes by xxh3 hashes chained over 16-token
blocks (meshkit.blocks). A BlockStored event carries the tokens of its blocks and the engine hash
of the parent, so the mesh hash at the end of every engine block is known once its parent's is:
an engine block of k × 16 tokens is k mesh blocks, hashed on from the parent's last mesh hash.

A LoRA adapter's blocks (vLLM names the adapter in the event and in each block's extra keys) are
hashed from the adapter's seed (meshkit.blocks.adapter_seed), so they match only requests naming
that adapter. A block is not routable, and is skipped with its descendants, when its engine hash
covers more than its tokens and its adapter (multimodal inputs, a cache salt, an adapter the event
does not name): a token-only request never hits it. A block whose parent the relay never saw is skipped too: the relay cannot vouch for its
prefix. What a worker holds is counted per mesh hash, so the caller sees only 0↔1 transitions.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from meshkit.blocks import adapter_seed, block_hashes
from poolrelay.engine.events import (
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    EngineHash,
    UnknownEvent,
)

# Engine hash → the mesh hash at the end of that engine block (None: known, not routable). The
# map is a pure function of the block's content, so it outlives eviction (a child stored after
# its parent was evicted still chains); bounded, least recently used entries go first.
CHAIN_CACHE_ENTRIES = 1 << 20


def check_block_sizes(engine_block_size: int, mesh_block_size: int) -> None:
    """Raises ValueError unless the engine block size is a whole multiple of the mesh's."""
    if mesh_block_size <= 0 or engine_block_size <= 0:
        raise ValueError("block sizes must be positive")
    if engine_block_size % mesh_block_size:
        raise ValueError(
            f"the engine block size {engine_block_size} is not a whole multiple of the mesh block size "
            f"{mesh_block_size}: configure the engine with a block size of {mesh_block_size} × k "
            f"(vLLM --block-size, SGLang --page-size)"
        )


@dataclass
class Counts:
    """What a worker's translation did, for status and logs."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unknown_events: int = 0
    skipped_not_routable: int = 0
    skipped_unknown_parent: int = 0
    skipped_bad_size: int = 0


@dataclass
class Transition:
    """Mesh-level changes of one worker's block set from one batch (apply `cleared` first)."""

    cleared: bool = False
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


# A block as the worker holds it: the same engine hash may sit in several media or KV groups.
_Key = tuple[EngineHash, str | None, int | None]


class WorkerBlocks:
    """The mesh blocks one engine worker holds, from its KV events."""

    def __init__(self, mesh_block_size: int, chain_entries: int = CHAIN_CACHE_ENTRIES) -> None:
        self.mesh_block_size = mesh_block_size
        self._held: dict[_Key, tuple[int, ...]] = {}
        self._mesh: Counter[int] = Counter()
        self._chain: OrderedDict[EngineHash, int | None] = OrderedDict()
        self._chain_entries = chain_entries
        self.counts = Counts()

    def __len__(self) -> int:
        return len(self._mesh)

    def mesh_blocks(self) -> set[int]:
        """Every mesh block hash the worker holds."""
        return set(self._mesh)

    def reset(self) -> Transition:
        """Forget everything (a gap that replay could not close, a restart): drops every block."""
        self._held.clear()
        self._mesh.clear()
        self._chain.clear()
        return Transition(cleared=True)

    def _remember(self, engine_hash: EngineHash, tail: int | None) -> None:
        chain = self._chain
        chain[engine_hash] = tail
        chain.move_to_end(engine_hash)
        if len(chain) > self._chain_entries:
            chain.popitem(last=False)

    def _parent_tail(self, parent: EngineHash | None, adapter: str) -> tuple[bool, int | None]:
        """(known, mesh hash to chain from); the root chains from the adapter's seed (0: none)."""
        if parent is None:
            return True, adapter_seed(adapter)
        chain = self._chain
        if parent not in chain:
            return False, None
        chain.move_to_end(parent)
        return True, chain[parent]

    def _store(self, ev: BlockStored, out: Transition) -> None:
        counts = self.counts
        size, mesh = ev.block_size, self.mesh_block_size
        n = len(ev.block_hashes)
        if size % mesh or len(ev.token_ids) != n * size:
            counts.skipped_bad_size += n
            return
        known, tail = self._parent_tail(ev.parent_block_hash, ev.adapter)
        tokens = ev.token_ids
        per_block = size // mesh
        for i, engine_hash in enumerate(ev.block_hashes):
            routable = not ev.unnamed_adapter and not (
                ev.extra_keys and i < len(ev.extra_keys) and ev.extra_keys[i]
            )
            if not known:
                counts.skipped_unknown_parent += 1
                continue
            if tail is None or not routable:
                # Not routable, and neither is anything chained after it.
                counts.skipped_not_routable += 1
                tail = None
                self._remember(engine_hash, None)
                continue
            hashes = tuple(block_hashes(tokens[i * size : (i + 1) * size], mesh, tail))
            assert len(hashes) == per_block
            tail = hashes[-1]
            self._remember(engine_hash, tail)
            key = (engine_hash, ev.medium, ev.group_idx)
            if key in self._held:
                continue  # stored again (a prefix-cache hit is announced too): nothing changes
            self._held[key] = hashes
            counts.stored += 1
            for h in hashes:
                c = self._mesh[h]
                self._mesh[h] = c + 1
                if c == 0:
                    out.stored.append(h)

    def _remove(self, ev: BlockRemoved, out: Transition) -> None:
        for engine_hash in ev.block_hashes:
            hashes = self._held.pop((engine_hash, ev.medium, ev.group_idx), None)
            if hashes is None:
                continue  # a block the relay skipped or never saw stored
            self.counts.removed += 1
            for h in hashes:
                c = self._mesh[h] - 1
                if c:
                    self._mesh[h] = c
                else:
                    del self._mesh[h]
                    out.removed.append(h)

    def apply(self, batch: Batch) -> Transition:
        """Applies one batch in order; returns the mesh-level transitions it made."""
        out = Transition()
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._store(ev, out)
            elif isinstance(ev, BlockRemoved):
                self._remove(ev, out)
            elif isinstance(ev, AllBlocksCleared):
                self.counts.cleared += 1
                self._held.clear()
                self._mesh.clear()
                # Everything before is gone: earlier transitions of this batch no longer matter.
                out = Transition(cleared=True)
            elif isinstance(ev, UnknownEvent):
                self.counts.unknown_events += 1
        # A block stored then removed within the batch appears in both lists: net it out.
        if out.stored and out.removed:
            both = set(out.stored) & set(out.removed)
            if both:
                out.stored = [h for h in out.stored if h not in both or h in self._mesh]
                out.removed = [h for h in out.removed if h not in both or h not in self._mesh]
        return out

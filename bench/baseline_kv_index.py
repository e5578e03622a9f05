"""Baseline for the benches only: the KvIndex before the open-addressing table (a dict of block
hash -> source mask plus a set per source, about 111 bytes per block), kept to measure the table
against in the same run (git show a475381:globalrouter/kv_index.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class DictKvIndex:
    """Pool-level block sets keyed by source (one source = one relay telemetry stream)."""

    __slots__ = ("_bit", "_free_bits", "_holders", "_sets", "_source_of_bit")

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        """Block hash -> bit mask of the sources holding it (never 0: such entries are deleted)."""
        self._sets: dict[str, set[int]] = {}
        """Source -> its block set (needed to replace or drop a source without a full scan)."""
        self._bit: dict[str, int] = {}
        """Source -> its bit (a power of two)."""
        self._source_of_bit: dict[int, str] = {}
        self._free_bits: list[int] = []
        """Bits of dropped sources, reused so masks stay small."""

    # ---- writers -------------------------------------------------------------------------------
    def _bit_for(self, source: str) -> int:
        bit = self._bit.get(source)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else 1 << len(self._bit)
            self._bit[source] = bit
            self._source_of_bit[bit] = source
            self._sets[source] = set()
        return bit

    def _add(self, bit: int, blocks: set[int], hashes: Iterable[int]) -> None:
        holders = self._holders
        for h in hashes:
            if h not in blocks:
                blocks.add(h)
                holders[h] = holders.get(h, 0) | bit

    def _remove(self, bit: int, blocks: set[int], hashes: Iterable[int]) -> None:
        holders = self._holders
        keep = ~bit
        for h in hashes:
            if h in blocks:
                blocks.discard(h)
                mask = holders[h] & keep
                if mask:
                    holders[h] = mask
                else:
                    del holders[h]

    def apply_snapshot(self, source: str, hashes: Iterable[int]) -> None:
        """Replaces the source's whole block set (a stream's snapshot, once its last chunk is in)."""
        bit = self._bit_for(source)
        blocks = self._sets[source]
        new = hashes if isinstance(hashes, (set, frozenset)) else set(hashes)
        self._remove(bit, blocks, [h for h in blocks if h not in new])
        self._add(bit, blocks, new)

    def apply_delta(self, source: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        """Applies one batch of 0<->1 transitions: `removed` first, then `stored`, so a block a
        batch both drops and re-adds ends up held."""
        bit = self._bit_for(source)
        blocks = self._sets[source]
        self._remove(bit, blocks, removed)
        self._add(bit, blocks, stored)

    def drop_source(self, source: str) -> None:
        """Forgets one source (its stream broke); other sources, even of the same pool, stay."""
        bit = self._bit.pop(source, None)
        if bit is None:
            return
        blocks = self._sets.pop(source)
        self._remove(bit, set(blocks), blocks)
        del self._source_of_bit[bit]
        self._free_bits.append(bit)

    # ---- readers -------------------------------------------------------------------------------
    def sources(self) -> list[str]:
        """Sources with state in the index, sorted."""
        return sorted(self._bit)

    def block_count(self, source: str) -> int:
        """Blocks the source holds (0 for an unknown source)."""
        blocks = self._sets.get(source)
        return len(blocks) if blocks is not None else 0

    def holds(self, block_hash: int) -> bool:
        """Whether any source holds this block (a prompt whose first block no source holds has no
        cached prefix anywhere, so the rest of it need not even be hashed)."""
        return block_hash in self._holders

    def total_blocks(self) -> int:
        """Distinct block hashes held by any source."""
        return len(self._holders)

    def prefix_overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Source -> leading blocks of the prompt it holds (sources with 0 omitted).

        One pass over the prompt's blocks, whatever the number of sources.
        """
        holders = self._holders
        if not block_hashes:
            return {}
        alive = holders.get(block_hashes[0], 0)
        if not alive:
            return {}
        out: dict[str, int] = {}
        names = self._source_of_bit
        for i in range(1, len(block_hashes)):
            mask = alive & holders.get(block_hashes[i], 0)
            if mask != alive:
                gone = alive & ~mask
                while gone:
                    low = gone & -gone
                    out[names[low]] = i
                    gone ^= low
                alive = mask
                if not alive:
                    return out
        whole = len(block_hashes)
        while alive:
            low = alive & -alive
            out[names[low]] = whole
            alive ^= low
        return out

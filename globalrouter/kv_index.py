"""Pool-level KV block sets keyed by source, in one open-addressing table over numpy arrays.

One source is one relay telemetry stream (a pool may have several relay replicas, hence several
sources). Each block hash maps to a bit mask of the sources holding it, so the leading-prefix
overlap of every source comes out of one pass over the prompt's block hashes: the running AND
of the masks keeps the sources that held every block so far, and the pass stops once it is 0.
Block hashes are chained (a hash stands for its whole prefix), so the leading run is what a
pool can reuse.

Why this layout: a fleet holds tens of millions of blocks (64 pools x 1,000,000), and a Python
dict of int -> int plus a set per source cost about 111 bytes per block. Here a block is one
8-byte key plus one 8-byte mask word per 64 sources in two flat arrays (linear probing, load
kept between 0.55 and 0.8), so about 20 to 29 bytes per distinct block with up to 64 sources.
A block no source holds any more stays as a tombstone (mask 0) that the next new key on its
probe path reuses, and the table is rebuilt (live keys only) when used slots pass 0.8 of it.
Lookups and batch updates are vectorised; a source's whole set is not kept apart, so replacing
a non-empty source's snapshot or dropping a source clears its bit with one pass over the table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

_EMPTY = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
"""Key of a never-used slot. The one block hash equal to it lives outside the table (_special)."""
_EMPTY_INT = int(_EMPTY)
_GOLDEN = np.uint64(0x9E37_79B9_7F4A_7C15)
_GOLDEN_INT = int(_GOLDEN)
_M64 = (1 << 64) - 1
_SHIFT = np.uint64(32)
MAX_LOAD = 0.8
"""Used slots (live + tombstones) / capacity above which the table is rebuilt."""
REBUILD_LOAD = 0.55
"""Live slots / capacity right after a rebuild (between the two, memory and probe length trade)."""
MIN_CAPACITY = 1024
FIRST_CHUNK = 64
"""Blocks looked up in the first vectorised step of a prefix walk (then doubling): a long prompt
whose cached prefix is short stops after a few small steps instead of looking up every block."""


def _as_keys(hashes: Iterable[int]) -> np.ndarray:
    """Block hashes (64-bit unsigned ints) -> a uint64 array."""
    if isinstance(hashes, np.ndarray):
        return hashes.astype(np.uint64, copy=False)
    if not isinstance(hashes, (list, tuple)):
        hashes = list(hashes)
    return np.array(hashes, dtype=np.uint64)


class KvIndex:
    """Pool-level block sets keyed by source (one source = one relay telemetry stream)."""

    __slots__ = (
        "_cap",
        "_counts",
        "_free_numbers",
        "_keys",
        "_live",
        "_masks",
        "_names",
        "_number",
        "_special",
        "_used",
        "_words",
    )

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        self._words = 1
        """Mask words per slot (64 sources each)."""
        self._cap = 0
        self._keys = np.empty(0, np.uint64)
        self._masks = np.empty((0, 1), np.uint64)
        self._alloc(max(MIN_CAPACITY, capacity))
        self._used = 0
        """Slots whose key is set (live or tombstone)."""
        self._live = 0
        """Slots with a non-zero mask (distinct blocks some source holds), plus _special's."""
        self._special = np.zeros(1, np.uint64)
        """Mask of the one block hash that equals the empty-slot key."""
        self._number: dict[str, int] = {}
        """Source -> its number (bit `n & 63` of mask word `n >> 6`)."""
        self._names: dict[int, str] = {}
        self._counts: dict[str, int] = {}
        """Source -> blocks it holds."""
        self._free_numbers: list[int] = []
        """Numbers of dropped sources, reused so masks stay narrow."""

    def _alloc(self, capacity: int) -> None:
        if capacity >= 1 << 32:
            raise ValueError(f"KvIndex capacity {capacity} exceeds 2^32 slots")
        self._cap = capacity
        self._keys = np.full(capacity, _EMPTY, np.uint64)
        self._masks = np.zeros((capacity, self._words), np.uint64)

    # ---- slots ---------------------------------------------------------------------------------
    def _home(self, keys: np.ndarray) -> np.ndarray:
        """First probe slot of each key: the high bits of a multiplicative hash, scaled to the
        capacity (keys may be small sequential ids, so they are mixed first)."""
        mixed = (keys * _GOLDEN) >> _SHIFT
        return ((mixed * np.uint64(self._cap)) >> _SHIFT).astype(np.int64)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key, -1 where absent (keys equal to _EMPTY are reported absent)."""
        slots = self._home(keys)
        out = np.full(keys.size, -1, np.int64)
        todo = np.arange(keys.size)
        table, last = self._keys, self._cap - 1
        while todo.size:
            s = slots[todo]
            k = table[s]
            hit = k == keys[todo]
            out[todo[hit]] = s[hit]
            go = ~hit & (k != _EMPTY)
            todo = todo[go]
            s = s[go]
            slots[todo] = np.where(s == last, 0, s + 1)
        out[keys == _EMPTY] = -1
        return out

    def _place(self, keys: np.ndarray, rows: np.ndarray, reuse: bool = True) -> None:
        """Puts absent, distinct keys into free slots with masks `rows` (one row for all, or one
        per key). Free: empty, or with `reuse` a tombstone (the key was absent, so any free slot
        on its probe path is one its lookups reach before an empty slot)."""
        per_key = rows.ndim == 2
        slots = self._home(keys)
        todo = np.arange(keys.size)
        table, masks, last = self._keys, self._masks, self._cap - 1
        while todo.size:
            s = slots[todo]
            free = table[s] == _EMPTY
            if reuse:
                free |= ~masks[s].any(axis=1)
            at = np.flatnonzero(free)
            if at.size:
                at = at[self._first_claims(s[at])]
                taken = s[at]
                self._used += int(np.count_nonzero(table[taken] == _EMPTY))
                table[taken] = keys[todo[at]]
                masks[taken] = rows[todo[at]] if per_key else rows
                placed = np.zeros(todo.size, bool)
                placed[at] = True
                todo = todo[~placed]
                s = s[~placed]
            slots[todo] = np.where(s == last, 0, s + 1)

    def _first_claims(self, slots: np.ndarray) -> np.ndarray:
        """Positions in `slots` that win their slot, one per distinct slot. Small batches sort;
        a big one (a snapshot, a rebuild) scatters its positions into a table-sized scratch
        array, where one write per slot survives, so no sort of millions of slots is needed."""
        if slots.size < 65_536:
            return np.unique(slots, return_index=True)[1]
        scratch = np.empty(self._cap, np.int64)
        positions = np.arange(slots.size)
        scratch[slots] = positions
        return np.flatnonzero(scratch[slots] == positions)

    def _reserve(self, extra: int) -> None:
        """Rebuilds the table (live keys only) if `extra` new keys could push it past MAX_LOAD."""
        if self._used + extra <= MAX_LOAD * self._cap:
            return
        live = np.flatnonzero(self._masks.any(axis=1))
        keys, rows = self._keys[live], self._masks[live]
        del live
        self._alloc(max(MIN_CAPACITY, math.ceil((keys.size + extra) / REBUILD_LOAD)))
        self._used = 0
        self._place(keys, rows, reuse=False)

    # ---- sources -------------------------------------------------------------------------------
    def _number_for(self, source: str) -> int:
        n = self._number.get(source)
        if n is None:
            n = self._free_numbers.pop() if self._free_numbers else len(self._number)
            if n >> 6 >= self._words:
                self._widen(n // 64 + 1)
            self._number[source] = n
            self._names[n] = source
            self._counts[source] = 0
        return n

    def _widen(self, words: int) -> None:
        extra = words - self._words
        self._masks = np.hstack([self._masks, np.zeros((self._cap, extra), np.uint64)])
        self._special = np.concatenate([self._special, np.zeros(extra, np.uint64)])
        self._words = words

    def _clear_bit(self, n: int) -> None:
        """Removes source `n` from every block (one pass over the table)."""
        word, bit = n >> 6, np.uint64(1 << (n & 63))
        col = self._masks[:, word]
        had = np.flatnonzero(col & bit)
        if had.size:
            col[had] &= ~bit
            self._live -= int(np.count_nonzero(~self._masks[had].any(axis=1)))
        self._set_special(word, bit, False)
        self._counts[self._names[n]] = 0

    # ---- writers -------------------------------------------------------------------------------
    def _set_special(self, word: int, bit: np.uint64, held: bool) -> int:
        """Sets or clears a source's bit on the one block hash kept outside the table; returns
        1 when that changed the source's set."""
        if bool(self._special[word] & bit) == held:
            return 0
        was_held = bool(self._special.any())
        if held:
            self._special[word] |= bit
        else:
            self._special[word] &= ~bit
        self._live += int(self._special.any()) - int(was_held)
        return 1

    def _add(self, n: int, keys: np.ndarray) -> None:
        if not keys.size:
            return
        word, bit = n >> 6, np.uint64(1 << (n & 63))
        keys = np.unique(keys)
        added = 0
        if keys[-1] == _EMPTY:  # sorted: the special key is last
            keys = keys[:-1]
            added = self._set_special(word, bit, True)
        self._reserve(keys.size)
        slots = self._find(keys)
        found = slots >= 0
        s = slots[found]
        rows = self._masks[s]
        fresh = (rows[:, word] & bit) == 0
        s = s[fresh]
        self._live += int(np.count_nonzero(~rows[fresh].any(axis=1)))
        self._masks[s, word] |= bit
        new = keys[~found]
        if new.size:
            row = np.zeros(self._words, np.uint64)
            row[word] = bit
            self._place(new, row)
            self._live += new.size
        self._counts[self._names[n]] += added + s.size + new.size

    def _remove(self, n: int, keys: np.ndarray) -> None:
        if not keys.size:
            return
        word, bit = n >> 6, np.uint64(1 << (n & 63))
        keys = np.unique(keys)
        removed = 0
        if keys[-1] == _EMPTY:
            keys = keys[:-1]
            removed = self._set_special(word, bit, False)
        slots = self._find(keys)
        s = slots[slots >= 0]
        s = s[(self._masks[s, word] & bit) != 0]
        if s.size:
            self._masks[s, word] &= ~bit
            self._live -= int(np.count_nonzero(~self._masks[s].any(axis=1)))
        self._counts[self._names[n]] -= removed + s.size

    def apply_snapshot(self, source: str, hashes: Iterable[int]) -> None:
        """Replaces the source's whole block set (a stream's snapshot, once its last chunk is in)."""
        n = self._number_for(source)
        if self._counts[source]:
            self._clear_bit(n)
        self._add(n, _as_keys(hashes))

    def apply_delta(self, source: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        """Applies one batch of 0<->1 transitions: `removed` first, then `stored`, so a block a
        batch both drops and re-adds ends up held."""
        n = self._number_for(source)
        self._remove(n, _as_keys(removed))
        self._add(n, _as_keys(stored))

    def drop_source(self, source: str) -> None:
        """Forgets one source (its stream broke); other sources, even of the same pool, stay."""
        n = self._number.get(source)
        if n is None:
            return
        if self._counts[source]:
            self._clear_bit(n)
        del self._number[source], self._names[n], self._counts[source]
        self._free_numbers.append(n)

    # ---- readers -------------------------------------------------------------------------------
    def sources(self) -> list[str]:
        """Sources with state in the index, sorted."""
        return sorted(self._number)

    def block_count(self, source: str) -> int:
        """Blocks the source holds (0 for an unknown source)."""
        return self._counts.get(source, 0)

    def total_blocks(self) -> int:
        """Distinct block hashes held by any source."""
        return self._live

    def memory_bytes(self) -> int:
        """Bytes of the table's arrays (what grows with the number of blocks)."""
        return self._keys.nbytes + self._masks.nbytes

    def _mask_of(self, block_hash: int) -> int:
        """The mask of one block as a Python int (all words), 0 when no source holds it."""
        if block_hash == _EMPTY_INT:
            row = self._special
        else:
            cap, table = self._cap, self._keys
            slot = ((((block_hash * _GOLDEN_INT) & _M64) >> 32) * cap) >> 32
            while True:
                k = int(table[slot])
                if k == block_hash:
                    break
                if k == _EMPTY_INT:
                    return 0
                slot = slot + 1 if slot + 1 < cap else 0
            row = self._masks[slot]
        out = 0
        for w in range(self._words):
            out |= int(row[w]) << (64 * w)
        return out

    def holds(self, block_hash: int) -> bool:
        """Whether any source holds this block (a prompt whose first block no source holds has no
        cached prefix anywhere, so the rest of it need not even be hashed)."""
        return self._mask_of(block_hash) != 0

    def _rows(self, keys: np.ndarray) -> np.ndarray:
        """Masks of the keys (zero rows where absent)."""
        slots = self._find(keys)
        rows = self._masks[slots]  # -1 reads the last slot: zeroed below
        rows[slots < 0] = 0
        special = keys == _EMPTY
        if special.any():
            rows[special] = self._special
        return rows

    def prefix_overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Source -> leading blocks of the prompt it holds (sources with 0 omitted).

        One pass over the prompt's blocks, whatever the number of sources, in vectorised steps
        (64 blocks, then doubling) that stop once no source holds the prefix.
        """
        if not len(block_hashes):
            return {}
        alive = self._mask_of(block_hashes[0])
        if not alive:
            return {}
        keys = _as_keys(block_hashes)
        out: dict[str, int] = {}
        names, words = self._names, self._words
        start, step = 1, FIRST_CHUNK
        total = keys.size
        while start < total:
            end = min(total, start + step)
            rows = self._rows(keys[start:end])
            if words == 1:
                acc = np.bitwise_and.accumulate(rows[:, 0] & np.uint64(alive))
                changed = np.flatnonzero(acc[1:] != acc[:-1]) + 1
                marks = [(0, int(acc[0]))] + [(int(i), int(acc[i])) for i in changed]
            else:
                head = np.array([(alive >> (64 * w)) & _M64 for w in range(words)], np.uint64)
                acc = np.bitwise_and.accumulate(rows & head, axis=0)
                changed = np.flatnonzero((acc[1:] != acc[:-1]).any(axis=1)) + 1
                marks = [
                    (int(i), sum(int(acc[i, w]) << (64 * w) for w in range(words))) for i in [0, *changed]
                ]
            for i, mask in marks:
                gone = alive & ~mask
                while gone:
                    low = gone & -gone
                    out[names[low.bit_length() - 1]] = start + i
                    gone ^= low
                alive = mask
            if not alive:
                return out
            start, step = end, step * 2
        while alive:
            low = alive & -alive
            out[names[low.bit_length() - 1]] = total
            alive ^= low
        return out

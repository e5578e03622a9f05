"""Pool-level KV block sets keyed by source, in one open-addressing table over numpy arrays.

One source is one relay telemetry stream (a pool may have several relay replicas, hence several
sources). Each block hash maps to a bit mask of the sources holding it, so the leading-prefix
overlap of every source comes out of one pass over the prompt's block hashes: the running AND
of the masks keeps the sources that held every block so far, and the pass stops once it is 0.
Block hashes are chained (a hash stands for its whole prefix), so the leading run is what a
pool can reuse.

Why this layout: a fleet holds tens of millions of blocks (64 pools x 1,000,000), and a Python
dict of int -> int plus a set per source cost about 111 bytes per block. Here a block is one
8-byte key plus one 8-byte mask word per 64 sources in two flat arrays (buckets of 8 slots,
load kept between 0.55 and 0.8), so about 20 to 29 bytes per distinct block with up to 64 sources.
A block no source holds any more stays as a tombstone (mask 0) that the next new key folded
from the overlay on its probe path reuses (big batches take empty slots, in sorted passes); when used slots pass 0.8 of it, the table grows into a new one (live keys
only) a bounded step per write, so that no call pays for the whole table (see _room): the new
table's arrays are initialised a slice per write, then the old table's keys move a slice per
write while lookups read the new table, then the old one.
Long prompts and big batches are looked up and updated vectorised; short prompts are walked one
key at a time through memoryviews (a numpy call costs about a microsecond whatever its size;
below the crossover WALK_SMALL, pure-Python reads cost less). The usual small deltas (a few dozen
blocks per KV event) go into an overlay, a dict of block hash -> the source bits set and cleared
since the last fold: a pure-Python probe of the table costs several times a dict update (an
absent key reads a whole bucket), so the table takes the overlay in one vectorised pass once it
holds PENDING keys (or before a reader that needs the table alone); walks and `holds` read the
table then the overlay. Short walks and `holds` first read a bounded dict of recently read blocks'
masks (prompts share prefixes, and a dict read costs a fraction of a table probe), which small
deltas update key by key and whole-source changes empty.
A source's whole set is not kept apart, so replacing a non-empty source's snapshot or dropping
a source clears its bit with one pass over the table, unless the caller first removed the
source's blocks itself (`remove_blocks`, from its own list of them: the telemetry ingestion does,
a slice per step, so a stream's end costs its own blocks, not the whole table).
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Iterable, Sequence, Sized
from itertools import islice
from typing import Any

import numpy as np

try:
    from numpy._core.multiarray import _set_madvise_hugepage  # type: ignore[attr-defined]
except ImportError:  # another numpy: its allocations' page size stays as it is

    def _set_madvise_hugepage(enabled: bool) -> bool:
        return False


_EMPTY = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
"""Key of a never-used slot. The one block hash equal to it lives outside the table (_special)."""
_EMPTY_INT = int(_EMPTY)
_M64 = (1 << 64) - 1
_BYTE_INDEX = np.uint64(0x0001_0203_0405_0607)
"""(w * _BYTE_INDEX) >> 56 is j for w = 1 << 8j: which of a bucket's 8 comparison bytes is set."""
_TOP_BYTE = np.uint64(56)
MAX_LOAD = 0.8
"""Used slots (live + tombstones) / capacity above which the table grows (into a new table,
a bounded step at a time: see _room)."""
HARD_LOAD = 0.92
"""While the next table is being prepared, the current one still takes new keys up to this load
(a bucketed table probes a little longer there); past it the preparation is finished at once."""
PREP_MIN = 1 << 16
"""Slots of the next table initialised (empty key, zero mask) by every write while it is
prepared: 1 MiB with one mask word, a fraction of a millisecond."""
SHED_BYTES = 16 << 20
"""Bytes of a grown-out-of table's arrays whose pages every write returns (MADV_DONTNEED) before
the arrays go: dropping them at once returned every page in one call (4 KiB pages: 19 ms for
256 MiB)."""
MOVE_MIN = 1024
"""Slots of the old table moved into the new one by every write while a growth runs (plus more
in proportion to the keys the write placed, so that it ends before the new table fills)."""
REBUILD_LOAD = 0.55
"""Live slots / capacity right after a rebuild (between the two, memory and probe length trade)."""
MIN_CAPACITY = 1024
BUCKET = 8
"""Slots per bucket (one 64-byte cache line of keys): a key lives in its home bucket or, when
that is full, in the next one with room. Most lookups end in their home bucket; the few that
go on are finished one key at a time (SCALAR_TAIL)."""
SMALL = 256
"""Deltas of at most this many keys go into the overlay (a dict update per key); bigger ones are
applied to the table vectorised at once."""
GROUPS = 1024
"""Bound of the mask -> names cache."""
HOT = 16384
"""Bound of the walks' block -> mask cache (about 150 bytes a key)."""
PENDING = 4096
"""Keys the overlay holds before it is folded into the table (one vectorised pass, a few dozen
numpy calls, so about a microsecond a key less than a pure-Python probe of the table each); also
folded before anything that reads or rewrites whole sources (snapshots, drops, counts, long
prompts). Bounds the overlay's memory (about 200 bytes a key)."""
WALK_SMALL = 128
"""Prompts of at most this many blocks are walked one block at a time (the crossover measured on
the 2-core host with 16 sources: about 128 blocks cost the same both ways)."""
SCALAR_TAIL = 16
"""Keys left after vectorised rounds that are looked up one at a time (also whole small batches)."""
FIRST_CHUNK = 1024
"""Blocks looked up in the first vectorised step of a prefix walk (then doubling): a long prompt
whose cached prefix is short stops after a few small steps instead of looking up every block."""


def _as_keys(hashes: Iterable[int]) -> np.ndarray:
    """Block hashes (64-bit unsigned ints) -> a uint64 array (np.fromiter: np.array took four
    times as long on Python ints above 2^63)."""
    if isinstance(hashes, np.ndarray):
        return hashes.astype(np.uint64, copy=False)
    if isinstance(hashes, Sized):
        return np.fromiter(hashes, np.uint64, len(hashes))
    return np.fromiter(hashes, np.uint64)


def _small_pages(shape: int | tuple[int, int]) -> np.ndarray:
    """np.empty(shape, uint64) without numpy's MADV_HUGEPAGE: a table's pages are written a slice
    per write while it is prepared, and where transparent huge pages are on for advised memory,
    the first write into each 2 MiB page stalled about 5 ms (the kernel compacting memory for it;
    1 MiB slices: a 6 ms step in two); 4 KiB pages cost a steady 0.2 ms per MiB."""
    before = _set_madvise_hugepage(False)
    try:
        return np.empty(shape, np.uint64)
    finally:
        _set_madvise_hugepage(before)


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_MADV_DONTNEED = 4  # Linux


def _shed(array: np.ndarray, start: int, size: int) -> int:
    """Returns the whole pages within bytes [start, start + size) of `array` to the system
    (Linux; elsewhere nothing, and the whole array counts as done); the end of what was done."""
    if _LIBC is None:
        return int(array.nbytes)
    end = min(int(array.nbytes), start + size)
    page = 4096
    base = int(array.ctypes.data)
    low = -(-(base + start) // page) * page
    high = (base + end) // page * page
    if high > low:
        _LIBC.madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), _MADV_DONTNEED)
    return end


def _bits(mask: int) -> list[int]:
    """Numbers of the set bits of a mask."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


_BYTE_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(
    np.int64
)
"""Row v: the 8 bits of byte value v, lowest first."""


def _bit_counts(rows: np.ndarray) -> np.ndarray:
    """How many rows have each bit set: entry j counts bit j of the little-endian words (source
    j). One histogram of (byte position, byte value) then a product with each byte's bits: a
    column sum of the rows' unpacked bits cost ten times as much."""
    words = rows.shape[1]
    nonzero = np.count_nonzero(rows)
    if nonzero * 8 <= rows.size:
        # Sparse (the usual fold: each delta's key changes one source's bit, in one of up to 32
        # words at 2,000 sources): only the non-zero words' bits are counted, 9x less work there.
        r, c = np.nonzero(rows)
        bits = np.unpackbits(
            rows[r, c].astype("<u8").view(np.uint8).reshape(-1, 8), axis=1, bitorder="little"
        )
        k, b = np.nonzero(bits)
        sparse: np.ndarray = np.bincount(c[k] * 64 + b, minlength=64 * words)
        return sparse
    octets = rows.astype("<u8", copy=False).view(np.uint8)
    width = octets.shape[1]
    codes = octets + np.arange(0, 256 * width, 256, dtype=np.int64)
    hist = np.bincount(codes.ravel(), minlength=256 * width).reshape(width, 256)
    out: np.ndarray = (hist @ _BYTE_BITS).ravel()
    return out


def _distinct(keys: np.ndarray) -> np.ndarray:
    """The keys sorted, each once (np.unique hashes, which took a second per million here)."""
    keys = np.sort(keys)
    return keys[np.concatenate(([True], keys[1:] != keys[:-1]))] if keys.size else keys


class _Next:
    """The next table while its arrays are being initialised (phase one of a growth): the
    current table still answers and takes every write. Written in order a slice at a time: a
    fresh array's pages cost their first write (a page fault each), and the keys it would get
    land all over it (one move touched every page of a lazily zeroed mask array: 58 ms)."""

    __slots__ = ("filled", "keys", "masks", "spare")

    def __init__(self, slots: int, words: int, spare: float) -> None:
        self.keys = _small_pages(slots)  # untouched pages cost nothing until written
        self.masks = _small_pages((slots, words))
        self.filled = 0
        self.spare = spare
        """Room (new keys) the current table should still have when this phase ends."""


class _Old:
    """The previous table while its keys move into the current one (phase two of a growth).

    Its layout is frozen (no key is placed in it or emptied), so a probe in it stays valid;
    slots below `cursor` have moved and are ignored. A key lives in at most one of the two
    tables with a non-zero mask: writes move the old keys they touch (removals clear them in
    place), and a key is placed in the current table only when neither table has it."""

    __slots__ = ("cap", "cursor", "keys", "kmv", "live", "masks", "mmv", "nb", "spare", "words")

    def __init__(self, keys: np.ndarray, masks: np.ndarray, nb: int, live: int) -> None:
        self.keys, self.masks, self.nb = keys, masks, nb
        self.cap = nb * BUCKET
        self.words = masks.shape[1]
        self.kmv = keys.data
        self.mmv = masks.reshape(-1).data
        self.cursor = 0
        self.live = live
        """Slots at or past `cursor` with a non-zero mask (what is left to move)."""
        self.spare = 0.0
        """Room (new keys) the current table should still have when the move ends."""


class KvIndex:
    """Pool-level block sets keyed by source (one source = one relay telemetry stream)."""

    __slots__ = (
        "_bit_names",
        "_cap",
        "_counts",
        "_free_numbers",
        "_groups",
        "_hot",
        "_keys",
        "_kmv",
        "_live",
        "_masks",
        "_mmv",
        "_names",
        "_nb",
        "_next",
        "_number",
        "_old",
        "_pend",
        "_sh",
        "_shedding",
        "_special",
        "_used",
        "_words",
    )

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        self._words = 1
        """Mask words per slot (64 sources each)."""
        self._cap = self._nb = 0
        self._keys = np.empty(0, np.uint64)
        self._masks = np.empty((0, 1), np.uint64)
        self._kmv = self._mmv = memoryview(b"")
        self._next: _Next | None = None
        """The next table being prepared (a growth's first phase), or None."""
        self._old: _Old | None = None
        """The previous table whose keys are moving into this one (a growth's second phase), or None."""
        self._shedding: list[list[Any]] = []
        """[array, bytes returned so far] of arrays a growth left behind: their pages go a slice
        per write (SHED_BYTES), then the arrays."""
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
        self._bit_names: dict[int, str] = {}
        """1 << number -> source: the walks name a leaving source from its bit without a bit_length."""
        self._pend: dict[int, int] = {}
        """The overlay: block hash -> (bits set << _sh) | bits cleared by deltas not yet in the table."""
        self._sh = 64
        self._groups: dict[int, tuple[str, ...]] = {}
        """Mask -> its sources' names, for the walks' output (the same sources leave a prompt's
        prefix at the same block walk after walk); cleared when a source comes or goes."""
        self._hot: dict[int, int] = {}
        """Block hash -> its mask (table and overlay), for the blocks short walks read: prompts
        share prefixes, and a dict read costs a fraction of a table probe. A small delta drops
        its keys from it, a whole-source change clears it; emptied when it reaches HOT keys."""
        """64 x mask words: where an overlay value's set bits start."""
        self._counts: dict[str, int] = {}
        """Source -> blocks it holds."""
        self._free_numbers: list[int] = []
        """Numbers of dropped sources, reused so masks stay narrow."""

    def _alloc(self, capacity: int) -> None:
        buckets = -(-capacity // BUCKET) | 1  # odd: key % buckets mixes keys with a common factor of 2
        if buckets >= 1 << 32:
            raise ValueError(f"KvIndex capacity {capacity} exceeds 2^32 buckets")
        self._cap, self._nb = buckets * BUCKET, buckets
        self._keys = np.full(self._cap, _EMPTY, np.uint64)
        self._masks = np.zeros((self._cap, self._words), np.uint64)
        self._views()

    def _views(self) -> None:
        """Memoryviews of the arrays: one element of a memoryview reads and writes as a Python
        int several times faster than numpy scalar indexing (the small-batch paths use them)."""
        self._kmv = self._keys.data
        self._mmv = self._masks.reshape(-1).data

    # ---- slots ---------------------------------------------------------------------------------
    def _home(self, keys: np.ndarray) -> np.ndarray:
        """Home bucket of each key: key % buckets (block hashes are already uniform, sequential
        ids spread one per bucket, and one modulo is the cheapest hash on a Python int, which the
        one-key-at-a-time paths compute: a multiplicative hash took five big-int operations)."""
        return (keys % np.uint64(self._cap // BUCKET)).astype(np.int64)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key in the current table, -1 where absent (see _find_in)."""
        return self._find_in(keys, self._keys, self._nb)

    def _find_old(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key in the old table (a growth's second phase), -1 where absent or moved."""
        old = self._old
        if old is None or not keys.size:
            return np.full(keys.size, -1, np.int64)
        slots = self._find_in(keys, old.keys, old.nb)
        slots[slots < old.cursor] = -1
        return slots

    @staticmethod
    def _find_in(keys: np.ndarray, flat: np.ndarray, nb: int) -> np.ndarray:
        """Slot of each key in the table of key array `flat` (nb buckets), -1 where absent (keys
        equal to _EMPTY are reported absent).

        A key sits in its home bucket or, when that was full, in a later one; a bucket with an
        empty slot ends the search. Each round compares a whole bucket per key at once, so the
        rounds are few even at a load of 0.8 (one slot at a time, the longest probe run of a
        thousand keys took dozens of rounds)."""
        buckets = (keys % np.uint64(nb)).astype(np.int64)
        out = np.full(keys.size, -1, np.int64)
        todo = np.arange(keys.size)
        table, km, cap = flat.reshape(-1, BUCKET), flat.data, flat.size
        while todo.size > SCALAR_TAIL:
            b = buckets[todo]
            rows = np.take(table, b, axis=0)  # np.take: several times faster than table[b]
            # A bucket's 8 comparisons are 8 bytes: read as one uint64 per key, non-zero is a
            # hit and the set byte's index is the slot (numpy reductions over a short axis cost
            # more than the comparisons themselves).
            eq = (rows == keys[todo, None]).view(np.uint64)[:, 0]
            hit = eq != 0
            out[todo[hit]] = b[hit] * BUCKET + ((eq[hit] * _BYTE_INDEX) >> _TOP_BYTE).astype(np.int64)
            go = ~hit & ((rows == _EMPTY).view(np.uint64)[:, 0] == 0)
            todo = todo[go]
            buckets[todo] = (b[go] + 1) % nb
        for i in todo.tolist():  # the few keys whose buckets overflowed, one at a time
            key, s = int(keys[i]), int(buckets[i]) * BUCKET
            k = km[s]
            while k != key:
                if k == _EMPTY_INT:
                    s = -1
                    break
                s += 1
                if s == cap:
                    s = 0
                k = km[s]
            out[i] = s
        out[keys == _EMPTY] = -1
        return out

    def _slot_of(self, key: int, slot: int = -1) -> int:
        """Slot of one key (not the empty-slot key) searched from `slot` on (from its home
        bucket's first slot by default), -1 when absent. Scalar: a few keys cost less this way
        than a vectorised round each. Within a bucket the keyed slots come before the empty
        ones (keys take a bucket's first free slot), so reading slot after slot and stopping at
        the first empty one is the bucket-wise search; one element read costs less than a
        bucket's slice."""
        km = self._kmv
        s = (key % (self._cap >> 3)) << 3 if slot < 0 else slot
        k = km[s]
        while k != key:
            if k == _EMPTY_INT:
                return -1
            s += 1
            if s == self._cap:
                s = 0
            k = km[s]
        return s

    def _place(self, keys: np.ndarray, rows: np.ndarray, reuse: bool = True) -> None:
        """Puts absent, distinct keys into free slots with masks `rows` (one row for all, or one
        per key), each in the first bucket of its chain with a free slot: empty, or with `reuse`
        a tombstone (the key was absent, so its lookups reach that bucket before stopping)."""
        per_key = rows.ndim == 2
        buckets = self._home(keys)
        todo = np.arange(keys.size)
        flat, masks, nb = self._keys, self._masks, self._cap // BUCKET
        table = flat.reshape(-1, BUCKET)
        while todo.size:
            b = buckets[todo]
            free = table[b] == _EMPTY
            if reuse:
                free |= ~masks.reshape(-1, BUCKET, self._words)[b].any(axis=2)
            at, pos = self._claims(b, free)
            slots = b[at] * BUCKET + pos
            self._used += int(np.count_nonzero(flat[slots] == _EMPTY))
            flat[slots] = keys[todo[at]]
            masks[slots] = rows[todo[at]] if per_key else rows
            placed = np.zeros(todo.size, bool)
            placed[at] = True
            full = ~free[~placed].any(axis=1)
            todo, b = todo[~placed], b[~placed]
            buckets[todo[full]] = (b[full] + 1) % nb

    @staticmethod
    def _claims(buckets: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which keys take a slot this round, and where: (positions, slot within the bucket).
        Sorted by bucket, the k-th key of a bucket gets the bucket's k-th free slot, so a
        bucket fills in one round however many keys it receives."""
        n = buckets.size
        order = np.argsort(buckets, kind="stable")
        sb = buckets[order]
        starts = np.flatnonzero(np.concatenate(([True], sb[1:] != sb[:-1])))
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
        ok = np.flatnonzero(rank < free.sum(axis=1))
        nth = np.cumsum(free[ok], axis=1) == (rank[ok] + 1)[:, None]
        return ok, (nth & free[ok]).argmax(axis=1)

    # ---- growth, a bounded step at a time -----------------------------------------------------
    # A growth has two phases, each advanced by every write (add, remove, fold) in proportion to
    # the keys it places, so no single call pays for the whole table (a rebuild in one call took
    # 2.8 s at 8,000,000 blocks): first the next table's key array is initialised (_Next; np.empty
    # pages cost only once written), while the current table takes writes up to HARD_LOAD; then
    # the next table becomes the current one and the old table's live keys move into it slice by
    # slice (_Old), while lookups read the current table then the old one. The rates make each
    # phase end before its table runs out of room (twice as fast as needed); if a write still
    # needs more room, the phase is finished within that write.

    def _room(self, extra: int) -> None:
        """Makes room in the current table for `extra` keys about to be placed (usually by
        starting a growth; at worst by finishing one within this call)."""
        while True:
            old = self._old
            if old is not None:
                if self._used + old.live + extra <= MAX_LOAD * self._cap:
                    return
                self._move(old.cap)  # the new table is short of room: finish the move now
            elif self._next is not None:
                if self._used + extra <= HARD_LOAD * self._cap:
                    return
                self._prepare(len(self._next.keys))
            elif self._used + extra <= MAX_LOAD * self._cap:
                return
            else:
                self._begin_growth(extra, self._words)

    def _begin_growth(self, extra: int, words: int) -> None:
        """Starts a growth into a table sized for the live keys and `extra` more at REBUILD_LOAD,
        with `words` mask words (at least the current width)."""
        slots = max(MIN_CAPACITY, math.ceil((self._live + extra) / REBUILD_LOAD))
        buckets = -(-slots // BUCKET) | 1  # odd: key % buckets mixes keys with a common factor of 2
        if buckets >= 1 << 32:
            raise ValueError(f"KvIndex capacity {slots} exceeds 2^32 buckets")
        spare = max(0.0, HARD_LOAD * self._cap - self._used - extra) / 2
        self._next = _Next(buckets * BUCKET, max(words, self._words), spare)

    def _put(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Places absent, distinct keys with masks `rows` (one per key) in empty slots, a sorted
        pass per bucket hop (a growth's moves and a snapshot's new keys: _place, whose rounds
        read every waiting key's bucket and its masks for tombstones and take two rounds per
        hop, cost about 1 µs a key there, this 0.15). A bucket's keyed slots come before its
        empty ones, so the k-th key aimed at a bucket whose first empty slot is f takes slot
        f + k; those past its end go on to the next bucket."""
        table, flat, masks, nb = self._keys.reshape(-1, BUCKET), self._keys, self._masks, self._nb
        buckets = self._home(keys)
        while keys.size:
            n = keys.size
            order = np.argsort(buckets)  # grouped by bucket; the order within one does not matter
            sb = buckets[order]
            empty = (np.take(table, sb, axis=0) == _EMPTY).view(np.uint64)[:, 0]
            low = empty & (~empty + np.uint64(1))  # the bucket's first empty slot's byte
            first = ((low * _BYTE_INDEX) >> _TOP_BYTE).astype(np.int64)
            first[empty == 0] = BUCKET
            starts = np.flatnonzero(np.concatenate(([True], sb[1:] != sb[:-1])))
            pos = first + np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
            ok = pos < BUCKET
            slots = sb[ok] * BUCKET + pos[ok]
            src = order[ok]
            flat[slots] = keys[src]
            masks[slots] = rows[src]
            self._used += slots.size
            rest = order[~ok]
            keys, rows, buckets = keys[rest], rows[rest], (sb[~ok] + 1) % nb

    def _advance(self, placed: int) -> None:
        """One write's share of a running growth: a minimum, plus for the `placed` keys what is
        left of the phase in proportion to them out of the room left above the phase's `spare`
        (half its room at the start): a steady pace that ends the phase with half its room unused
        (a pace recomputed against the whole room left slowed down as it went: a growth at
        16,000,000 blocks dragged through 4,000,000 inserts, both tables held)."""
        nxt, old = self._next, self._old
        if self._shedding:
            entry = self._shedding[0]
            entry[1] = _shed(entry[0], entry[1], SHED_BYTES)
            if entry[1] >= entry[0].nbytes:
                self._shedding.pop(0)  # its pages are back: dropping it is cheap now
        if nxt is not None:
            left = len(nxt.keys) - nxt.filled
            room = HARD_LOAD * self._cap - self._used - nxt.spare
            share = left if room <= placed else math.ceil(left * placed / room)
            self._prepare(PREP_MIN + share)
        elif old is not None:
            left = old.cap - old.cursor
            room = MAX_LOAD * self._cap - self._used - old.live - old.spare
            share = left if room <= placed else math.ceil(left * placed / room)
            self._move(MOVE_MIN + share)

    def _prepare(self, slots: int) -> None:
        """Initialises up to `slots` more slots of the next table; the last ones make it current."""
        nxt = self._next
        if nxt is None:
            return
        end = min(len(nxt.keys), nxt.filled + slots)
        nxt.keys[nxt.filled : end] = _EMPTY
        nxt.masks[nxt.filled : end] = 0
        nxt.filled = end
        if end < len(nxt.keys):
            return
        # The next table becomes the current one; the current one, the old one (O(1)).
        self._next = None
        special_live = int(self._special.any())
        old = self._old = _Old(self._keys, self._masks, self._nb, self._live - special_live)
        words = nxt.masks.shape[1]
        if words > self._words:
            extra = words - self._words
            self._special = np.concatenate([self._special, np.zeros(extra, np.uint64)])
            if self._pend:  # an overlay value is (set << 64 * words) | cleared
                low, sh = (1 << self._sh) - 1, 64 * words
                self._pend = {k: ((v >> self._sh) << sh) | (v & low) for k, v in self._pend.items()}
            self._words, self._sh = words, 64 * words
        self._keys = nxt.keys
        self._nb = len(nxt.keys) // BUCKET
        self._cap = len(nxt.keys)
        self._masks = nxt.masks
        self._used = 0
        self._views()
        old.spare = max(0.0, MAX_LOAD * self._cap - old.live) / 2

    def _move(self, slots: int) -> None:
        """Moves the live keys of up to `slots` more slots of the old table into the current one."""
        old = self._old
        if old is None:
            return
        start = old.cursor
        end = min(old.cap, start + slots)
        rows = old.masks[start:end]
        live = np.flatnonzero(rows.any(axis=1))
        if live.size:
            moving = rows[live]
            if old.words < self._words:
                moving = np.hstack([moving, np.zeros((live.size, self._words - old.words), np.uint64)])
            # Absent from the current table: a key is placed there only when neither table has
            # it, and a write that moves an old key clears its old mask.
            self._put(old.keys[start:end][live], moving)
            old.live -= live.size
        old.cursor = end
        if end == old.cap:
            self._old = None  # no lookup reads it any more: its pages go a slice per write
            self._shedding += [[old.keys, 0], [old.masks, 0]]

    def _finish_growth(self) -> None:
        """Runs a growth to its end now (whole-table operations, tests and benches)."""
        if self._next is not None:
            self._prepare(len(self._next.keys))
        if self._old is not None:
            self._move(self._old.cap)
        self._shedding.clear()

    def _reserve(self, extra: int) -> None:
        """Room for `extra` new keys now, growing the table within this call if need be (not for
        the serving loop: the writes grow it a step at a time)."""
        self._finish_growth()
        if self._used + extra > MAX_LOAD * self._cap:
            self._begin_growth(extra, self._words)
            self._finish_growth()

    # ---- sources -------------------------------------------------------------------------------
    def _number_for(self, source: str) -> int:
        n = self._number.get(source)
        if n is None:
            n = self._free_numbers.pop() if self._free_numbers else len(self._number)
            if n >> 6 >= self._words:
                # Half as wide again, not one word more: each widening is a growth (a pass over
                # the table, if in steps), and sources arrive in storms.
                self._widen(max(n // 64 + 1, self._words + self._words // 2))
            elif n >= 48 * self._words and self._next is None and self._old is None:
                # Widen ahead, a step at a time, while the numbers in use approach the width.
                self._begin_growth(0, self._words + max(1, self._words // 2))
            self._number[source] = n
            self._names[n] = source
            self._bit_names[1 << n] = source
            self._groups.clear()
            self._counts[source] = 0
        return n

    def _widen(self, words: int) -> None:
        """Makes the current table `words` wide now (a source numbered past its width is here):
        a growth into a wider table whose first phase (initialising its keys, about 1 ms per
        2,000,000 slots) is finished at once; its keys then move a step at a time. Sources
        usually find it wide already (_number_for widens ahead)."""
        self._flush()
        if self._old is not None:
            self._finish_growth()  # a third table is not worth it: sources cross a width rarely
        if self._next is not None and self._next.masks.shape[1] < words:
            self._next = None  # started narrower: start again
        if self._next is None:
            self._begin_growth(0, words)
        self._prepare(1 << 62)

    def _clear_bit(self, n: int) -> None:
        """Removes source `n` from every block (one pass over the table)."""
        word, bit = n >> 6, np.uint64(1 << (n & 63))
        col = self._masks[:, word]
        had = np.flatnonzero(col & bit)
        if had.size:
            col[had] &= ~bit
            self._live -= int(np.count_nonzero(~self._masks[had].any(axis=1)))
        old = self._old
        if old is not None and word < old.words:
            rows = old.masks[old.cursor :]
            had = np.flatnonzero(rows[:, word] & bit)
            if had.size:
                rows[had, word] &= ~bit
                gone = int(np.count_nonzero(~rows[had].any(axis=1)))
                self._live -= gone
                old.live -= gone
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
        keys = _distinct(keys)
        added = 0
        if keys[-1] == _EMPTY:  # sorted: the special key is last
            keys = keys[:-1]
            added = self._set_special(word, bit, True)
        slots = self._find(keys)
        found = slots >= 0
        s = slots[found]
        rows = self._masks[s]
        fresh = (rows[:, word] & bit) == 0
        s = s[fresh]
        self._live += int(np.count_nonzero(~rows[fresh].any(axis=1)))
        self._masks[s, word] |= bit
        new = keys[~found]
        gained = s.size + new.size
        if new.size:
            moved = self._find_old(new)
            at = moved >= 0
            before = None
            if at.any():
                # Keys the old table has move here with their masks (cleared there first, so
                # that a move of the old table's slots in _room does not place them too).
                old = self._old
                assert old is not None
                o = moved[at]
                before = old.masks[o]
                was = int(np.count_nonzero(before.any(axis=1)))
                old.masks[o] = 0
                old.live -= was
                self._live -= was
                if word < old.words:
                    gained -= int(np.count_nonzero(before[:, word] & bit))
            self._room(new.size)  # may change the current table (and its width)
            put = np.zeros((new.size, self._words), np.uint64)
            if before is not None:
                put[at, : before.shape[1]] = before
            put[:, word] |= bit
            # Empty slots only, in one sorted pass (_place's rounds, which also reuse tombstones,
            # were most of a snapshot's cost): the tombstones go at the next growth.
            self._put(new, put)
            self._live += new.size
        self._counts[self._names[n]] += added + gained
        self._advance(new.size)

    def _remove(self, n: int, keys: np.ndarray) -> None:
        if not keys.size:
            return
        word, bit = n >> 6, np.uint64(1 << (n & 63))
        keys = _distinct(keys)
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
        removed += s.size
        old = self._old
        if old is not None and word < old.words:
            # Removals clear old keys in place (nothing to place, the layout stays).
            o = self._find_old(keys[slots < 0])
            o = o[o >= 0]
            o = o[(old.masks[o, word] & bit) != 0]
            if o.size:
                old.masks[o, word] &= ~bit
                gone = int(np.count_nonzero(~old.masks[o].any(axis=1)))
                self._live -= gone
                old.live -= gone
            removed += o.size
        self._counts[self._names[n]] -= removed
        self._advance(0)

    def _flush(self) -> None:
        """Folds the overlay into the table, vectorised: every pending key's new mask is
        (old & ~cleared) | set; counts and live blocks follow from the bits that changed."""
        pend = self._pend
        if not pend:
            return
        self._pend = {}
        words, sh = self._words, self._sh
        special = pend.pop(_EMPTY_INT, None)
        if special is not None:
            for n in _bits(special >> sh):
                self._counts[self._names[n]] += self._set_special(n >> 6, np.uint64(1 << (n & 63)), True)
            for n in _bits(special & ((1 << sh) - 1) & ~(special >> sh)):
                self._counts[self._names[n]] -= self._set_special(n >> 6, np.uint64(1 << (n & 63)), False)
        if not pend:
            return
        size = len(pend)
        keys = np.fromiter(pend, np.uint64, size)
        # One bytes pass: each value is `words` cleared words then `words` set words, little-endian
        # (np.fromiter over int methods took three times as long).
        width = 16 * words
        both = np.frombuffer(b"".join([v.to_bytes(width, "little") for v in pend.values()]), np.uint64)
        both = both.reshape(size, 2 * words)
        clear, put = both[:, :words], both[:, words:]
        slots = self._find(keys)
        found = slots >= 0
        old = np.zeros((size, words), np.uint64)
        old[found] = self._masks[slots[found]]
        prev = self._old
        there = np.zeros(0, np.int64)
        if prev is not None:
            there = self._find_old(keys)  # -1 where the current table has the key
            there[found] = -1
            at = there >= 0
            if at.any():
                old[at, : prev.words] = prev.masks[there[at]]
        new = (old & ~clear) | put
        was, now = old.any(axis=1), new.any(axis=1)
        self._live += int(np.count_nonzero(now & ~was)) - int(np.count_nonzero(was & ~now))
        # Per source: blocks it gained less blocks it lost.
        change = _bit_counts(new & ~old) - _bit_counts(old & ~new)
        for n in np.flatnonzero(change).tolist():
            self._counts[self._names[n]] += int(change[n])
        self._masks[slots[found]] = new[found]
        if prev is not None:
            # Keys the old table has: cleared there; those still held move here below.
            at = there >= 0
            if at.any():
                o = there[at]
                prev.live -= int(np.count_nonzero(prev.masks[o].any(axis=1)))
                prev.masks[o] = 0
        fresh = ~found & now
        placed = 0
        if fresh.any():
            keys, rows = keys[fresh], new[fresh]
            placed = keys.size
            self._room(placed)  # may change the current table (and its width)
            if self._words > words:
                rows = np.hstack([rows, np.zeros((placed, self._words - words), np.uint64)])
            self._place(keys, rows)
        self._advance(placed)

    def apply_snapshot(self, source: str, hashes: Iterable[int]) -> None:
        """Replaces the source's whole block set (a stream's snapshot, once its last chunk is in)."""
        n = self._number_for(source)
        self._hot.clear()
        self._flush()
        if self._counts[source]:
            self._clear_bit(n)
        self._add(n, _as_keys(hashes))

    def apply_delta(self, source: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        """Applies one batch of 0<->1 transitions: `removed` first, then `stored`, so a block a
        batch both drops and re-adds ends up held."""
        n = self._number_for(source)
        if not isinstance(stored, (list, tuple, set)):
            stored = list(stored)
        if not isinstance(removed, (list, tuple, set)):
            removed = list(removed)
        if len(stored) + len(removed) <= SMALL:
            # Into the overlay: a dict update per key, as cheap as the dict-and-set index; the
            # table takes the overlay in one vectorised pass once it holds PENDING keys.
            pend = self._pend
            get = pend.get
            bit = 1 << n
            put = bit << self._sh
            keep_put, keep_bit = ~put, ~bit
            for h in removed:
                pend[h] = (get(h, 0) & keep_put) | bit
            for h in stored:
                pend[h] = (get(h, 0) | put) & keep_bit
            hot = self._hot
            if hot:  # cached masks follow the delta (the same order: removed, then stored)
                cached = hot.get
                for h in removed:
                    mask = cached(h)
                    if mask is not None:
                        hot[h] = mask & keep_bit
                for h in stored:
                    mask = cached(h)
                    if mask is not None:
                        hot[h] = mask | bit
            if len(pend) > PENDING:
                self._flush()
        else:
            self._hot.clear()
            self._flush()
            self._remove(n, _as_keys(removed))
            self._add(n, _as_keys(stored))

    def add_blocks(self, source: str, keys: np.ndarray) -> None:
        """Adds packed block hashes (uint64) to the source's set in one vectorised pass (no
        overlay): one bounded step of a snapshot applied a slice at a time."""
        n = self._number_for(source)
        self._hot.clear()
        self._flush()
        self._add(n, _as_keys(keys))

    def remove_blocks(self, source: str, keys: np.ndarray) -> None:
        """Removes packed block hashes from the source's set (those it does not hold are
        skipped): a leaving source's own blocks, a slice at a time, instead of a pass over the
        whole table."""
        n = self._number.get(source)
        if n is None:
            return
        self._hot.clear()
        self._flush()
        self._remove(n, _as_keys(keys))

    def drop_source(self, source: str) -> None:
        """Forgets one source (its stream broke); other sources, even of the same pool, stay."""
        n = self._number.get(source)
        if n is None:
            return
        self._hot.clear()
        self._flush()
        if self._counts[source]:
            self._clear_bit(n)
        del self._number[source], self._names[n], self._counts[source], self._bit_names[1 << n]
        self._groups.clear()
        self._free_numbers.append(n)

    # ---- readers -------------------------------------------------------------------------------
    def sources(self) -> list[str]:
        """Sources with state in the index, sorted."""
        return sorted(self._number)

    def block_count(self, source: str) -> int:
        """Blocks the source holds (0 for an unknown source)."""
        self._flush()
        return self._counts.get(source, 0)

    def total_blocks(self) -> int:
        """Distinct block hashes held by any source."""
        self._flush()
        return self._live

    def memory_bytes(self) -> int:
        """Bytes of the table's arrays (what grows with the number of blocks), a growing table's
        next or old arrays included."""
        out = self._keys.nbytes + self._masks.nbytes
        if self._next is not None:
            out += self._next.keys.nbytes
        if self._old is not None:
            out += self._old.keys.nbytes + self._old.masks.nbytes
        for array, returned in self._shedding:
            out += array.nbytes - returned
        return out

    def _cached_mask_of(self, block_hash: int) -> int:
        """`_mask_of` through the hot-block cache."""
        hot = self._hot
        mask = hot.get(block_hash)
        if mask is None:
            mask = self._mask_of(block_hash)
            if len(hot) >= HOT:
                hot.clear()
            hot[block_hash] = mask
        return mask

    def _mask_of(self, block_hash: int) -> int:
        """The mask of one block as a Python int (all words), 0 when no source holds it."""
        mask = self._table_mask_of(block_hash)
        pending = self._pend.get(block_hash)
        if pending is None:
            return mask
        sh = self._sh
        return (mask & ~pending) | (pending >> sh)

    def _table_mask_of(self, block_hash: int) -> int:
        """`_mask_of` as the table has it (the overlay not applied)."""
        if block_hash == _EMPTY_INT:
            row: list[int] = self._special.tolist()
        else:
            slot = self._slot_of(block_hash)
            if slot < 0:
                if self._old is None:
                    return 0
                return self._old_mask_of(block_hash)
            words = self._words
            if words == 1:
                return int(self._mmv[slot])
            row = self._mmv[slot * words : (slot + 1) * words].tolist()
        out = 0
        for w, value in enumerate(row):
            out |= value << (64 * w)
        return out

    def _old_mask_of(self, block_hash: int) -> int:
        """The mask of one block in the old table (0 when absent or moved)."""
        old = self._old
        assert old is not None
        km, cap = old.kmv, old.cap
        s = block_hash % old.nb * BUCKET
        k = km[s]
        while k != block_hash:
            if k == _EMPTY_INT:
                return 0
            s += 1
            if s == cap:
                s = 0
            k = km[s]
        if s < old.cursor:
            return 0
        words = old.words
        out = 0
        for w, value in enumerate(old.mmv[s * words : (s + 1) * words].tolist()):
            out |= value << (64 * w)
        return out

    def holds(self, block_hash: int) -> bool:
        """Whether any source holds this block (a prompt whose first block no source holds has no
        cached prefix anywhere, so the rest of it need not even be hashed)."""
        return self._cached_mask_of(block_hash) != 0

    def _rows(self, keys: np.ndarray) -> np.ndarray:
        """Masks of the keys (zero rows where absent)."""
        slots = self._find(keys)
        rows: np.ndarray = self._masks[slots]  # -1 reads the last slot: zeroed below
        absent = slots < 0
        rows[absent] = 0
        old = self._old
        if old is not None and absent.any():
            there = self._find_old(keys[absent])
            at = there >= 0
            if at.any():
                sub = np.zeros((there.size, self._words), np.uint64)
                sub[at, : old.words] = old.masks[there[at]]
                rows[absent] = sub
        special = keys == _EMPTY
        if special.any():
            rows[special] = self._special
        return rows

    def _group(self, mask: int) -> tuple[str, ...]:
        """Names of the mask's sources, lowest number first, through the cache."""
        names = self._bit_names
        group = []
        rest = mask
        while rest:
            low = rest & -rest
            group.append(names[low])
            rest ^= low
        if len(self._groups) >= GROUPS:
            self._groups.clear()
        out = self._groups[mask] = tuple(group)
        return out

    def _walk(self, block_hashes: Sequence[int], alive: int) -> dict[str, int]:
        """The prefix walk one block at a time, for a short prompt: a dict read per block the
        hot-block cache holds (prompts share prefixes), a table probe for the others."""
        hot = self._hot
        cached, fill = hot.get, self._cached_mask_of
        grouped, group_of = self._groups.get, self._group
        km, mm, nb, cap = self._kmv, self._mmv, self._nb, self._cap
        pending, sh = self._pend.get, self._sh
        inline = self._words == 1 and self._old is None  # during a growth, both tables are read
        out: dict[str, int] = {}
        for i, h in enumerate(islice(block_hashes, 1, None), 1):
            held = cached(h)
            if held is None:
                if inline and h != _EMPTY_INT and len(hot) < HOT:
                    # The miss, inlined for one mask word (three method calls per block showed).
                    s = h % nb * BUCKET
                    k = km[s]
                    while k != h:
                        if k == _EMPTY_INT:
                            held = 0
                            break
                        s += 1
                        if s == cap:
                            s = 0
                        k = km[s]
                    else:
                        held = mm[s]
                    p = pending(h)
                    if p is not None:
                        held = (held & ~p) | (p >> sh)
                    hot[h] = held
                else:
                    held = fill(h)
            mask = alive & held
            if mask != alive:
                gone = alive & ~mask
                for name in grouped(gone) or group_of(gone):
                    out[name] = i
                alive = mask
                if not alive:
                    return out
        whole = len(block_hashes)
        for name in grouped(alive) or group_of(alive):
            out[name] = whole
        return out

    def prefix_overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Source -> leading blocks of the prompt it holds (sources with 0 omitted).

        One pass over the prompt's blocks, whatever the number of sources, in vectorised steps
        (1,024 blocks, then doubling) that stop once no source holds the prefix.
        """
        try:
            first = block_hashes[0]
        except IndexError:
            return {}
        alive = self._hot.get(first)
        if alive is None:
            alive = self._cached_mask_of(first)
        if not alive:
            return {}
        if len(block_hashes) <= WALK_SMALL:
            return self._walk(block_hashes, alive)
        return self._walk_vectorised(block_hashes, alive)

    def _walk_vectorised(self, block_hashes: Sequence[int], alive: int) -> dict[str, int]:
        """The prefix walk for a long prompt (its own method: its comprehensions make closure
        cells, which cost every short walk a few tens of nanoseconds when they lived in
        prefix_overlaps)."""
        out: dict[str, int] = {}
        self._flush()  # the vectorised steps read the table alone
        words = self._words
        keys = _as_keys(block_hashes)
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
                if mask != alive:
                    for name in self._group(alive & ~mask):
                        out[name] = start + i
                alive = mask
            if not alive:
                return out
            start, step = end, step * 2
        for name in self._group(alive):
            out[name] = total
        return out

"""Pool-level KV block sets as compact fingerprint tables (about 2.7 bytes a block), searched per pool.

Why: the exact index (kv_index.KvIndex) keeps one mask bit per source per distinct block, so at
1,000 pools x 2 relays a block costs about 400 bytes and 1,000 pools x 1,000,000 blocks cannot be
held. Relay replicas of one pool report the same pool-level set, and what routing needs is, per
pool, "does this pool hold block h" along the prompt's chained block hashes. So here each pool
has its own table whose memory grows with the blocks that pool holds, whatever the number of
sources or pools.

A pool's table is a two-choice bucketed fingerprint filter: `buckets` rows of SLOTS uint16 slots,
all pools' rows in one arena (so one numpy gather reads many pools' rows at once). A block hash is
mixed (splitmix64: the trace ids are sequential), then its 128-bit product with the bucket count
gives its first bucket (high part) and a 15-bit fingerprint (the next bits); its second bucket is
(G(fingerprint) - first) mod buckets, so either bucket and the fingerprint give the other. A slot
holds fingerprint << 1 | (1 if in the second bucket), 0 when empty. An insert takes the emptier
of the two rows, and when both are full evicts an entry to that entry's other row (partial-key
cuckoo), so tables fill to MAX_LOAD; 2 bytes a slot at a load of 0.75 is 2.67 bytes a block, to
which the arena's unused rows add. Lossy one way, rarely: another block with the same fingerprint
and row in one of the two rows reads as held (a false positive, about 2 x SLOTS x load / 2^16 per
probe: 4.6e-5 at 2 slots a row and a load of 0.75). Rows are narrow because that rate grows with
the slots probed, and routing quality with it: at 8 slots (2.0e-4 at a load of 0.85) the
false positives at the prompt's first missing block moved share_of_ideal by up to 0.01 at 32 and
128 pools (BENCHMARKS.md). Two blocks sharing a row and a fingerprint get an entry each (a store
is a 0->1 transition, never a repeat), so removing one leaves the other found.

A table about to pass MAX_LOAD doubles: each entry's first bucket and fingerprint come back
from its slot, and the product with twice the buckets is twice the old one plus one unknown bit,
so the first bucket gains the fingerprint's top bit and the fingerprint loses its lowest bit (the
pool's `lost` bits, masked on every later probe too; a snapshot rebuilds at full precision).
Tables are sized from the snapshot or from the pool's KV capacity (`expect`: load reports carry
kv_blocks_total) so that doubling is the exception (a snapshot never doubles its table); past
MAX_LOST doublings, blocks that find no room are dropped and counted (false negatives) until the
next snapshot. A doubling that deltas start runs a slice at a time (_begin_growth, _grow): the old
rows become a hidden table, new entries go to the new one, each later write to the pool and each
of the telemetry ingest's steps (grow_step) moves a slice of old rows, and reads look at both
until the last slice (an entry not moved yet answers with its full fingerprint).

Bulk placement (a snapshot, a doubling's slice: _bulk) is a few vector passes over the whole
batch, not a round per entry: each entry to the emptier of its rows, one per row a pass (_greedy;
about 5% of a fresh table's find both rows full at a load of 0.75), then those moved in with one
step of look-ahead (one of the four entries in their rows moves to its other row) or a random
eviction, all at once a pass (_shift); the rare rest go to _place's cuckoo rounds. Where an entry
lands never changes an answer: a probe matches its (first bucket, fingerprint) pair in whichever
of its two rows it is. A build's step (a slice of a snapshot into a big table) takes one
leaner pass of that kind (_insert: few of its entries share a row), and the entries it leaves wait
until there are enough of them for _shift's passes to be worth their fixed cost (SHIFT_AT).

Longest cached prefix: chained hashes make membership mostly monotone along a prompt, so every
pool is binary-searched at once (one vectorised probe of all still-searching pools per step,
about log2(blocks) steps). Eviction can leave holes (an LRU that evicts a prompt's first block
first, or an older suffix outliving a newer middle), so the search's answer is an upper bound;
the pools with the longest bounds are then checked block by block, VERIFY_TOP at a time, until
VERIFY_TOP checked pools reach every unchecked pool's bound: the pools that can win on cache
affinity have exact lengths (up to false positives), and an unchecked pool is never credited
more than the VERIFY_TOP-th checked one.

Sources: a pool's set is replaced by the snapshot of any of its sources, and changed by the
deltas of its feeding source (the one whose snapshot came last; when it leaves, another live
source of the pool). Other replicas' deltas are counted and skipped (they carry the same set).
The pool's set is dropped when its last source leaves. Deltas are logged and folded into the
tables vectorised (all pools at once) when the log holds PENDING blocks or before any read.

The live frontend (`globalrouter serve --kv-state summary`) applies a snapshot in bounded steps:
begin_snapshot gives it a table of its own (a hidden table id, never searched), add_blocks fills
it a slice at a time, settle_build places what the slices left waiting a step at a time, and
commit_snapshot makes it the pool's in one swap (until then the pool's old set answers).
remove_blocks is a no-op: a leaving source's blocks are its pool's.
"""

from __future__ import annotations

import bisect
import math
import mmap
import random
import sys
from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import dataclass

import numpy as np

SLOTS = 2
"""Slots per bucket (one 4-byte row): fewer slots probed, fewer false positives (see above)."""
FP_BITS = 15
"""Fingerprint bits in a slot (the 16th says which of the two buckets the entry is in)."""
TARGET_LOAD = 0.75
"""Slots used / slots right after sizing a table (2 bytes / 0.75 = 2.67 bytes a block)."""
MAX_LOAD = 0.8
"""A pool's table doubles before it passes this load (two-choice tables of 2-slot rows fill to
about 0.9 in theory; small ones filled by deltas dropped a block in 48,000 at 0.83, none at 0.8)."""
MIN_BUCKETS = 64
"""The smallest table: 64 rows of 2 slots (256 bytes)."""
MAX_LOST = 6
"""Doublings a table may take before the next snapshot (each costs one fingerprint bit, doubling
the false-positive rate); past it, blocks that find no room are dropped and counted."""
VERIFY_TOP = 8
"""Pools checked block by block after the binary search (see the module docstring)."""
WAVE = 4096
WAVES = 16
"""Batches above WAVE keys are placed in WAVES waves (see _place)."""
GROW_ROWS = 4096
"""Rows of a growing table's old one a write to it moves at least (about 0.5 ms; see _grow)."""
GROW_PACE = 4
"""Old rows moved per block a write places, so that a growth ends long before the new table
fills (it starts at a load of 0.4 and has room for another old table's worth)."""
ZERO_ROWS = 1 << 18
"""Rows (1 MiB) of a growth's new region a write or step zeroes at least (see _fresh)."""
ASIDE = 65536
"""Blocks a pool may set aside while its new region is zeroed (past them, the rest at once)."""
GREEDY_PASSES = 8
"""Passes of _greedy (one entry per row a pass; 1,000,000 blocks into a fresh table took 5)."""
SHIFT_PASSES = 48
"""Passes of _shift over the entries _greedy left (the rest go to _place's cuckoo rounds)."""
BUILD_BATCH = 8192
"""Blocks a build gathers from its steps before placing them (see add_blocks)."""
INSERT_PASSES = 2
"""_insert passes a build's step runs over its slice: the first leaves about 12% of the entries of
a 100,000-block snapshot (most of them lost a cell to another entry of the same pass, their other
row free), which _shift's passes (a few dozen numpy calls each, up to SHIFT_PASSES) placed at
twice the cost of the rest of the build; a second pass, as lean as the first, places most of
them (half as many entries left to _shift; a build about 20% cheaper in CPU: 110 against 138 ns
a block, best of 6 on the loaded 2-core machine)."""
WALK_AT = 128
"""A build's waiting entries at or below this many are placed one at a time (_walk: a cuckoo walk
in Python, a few microseconds an entry) instead of by _shift's passes: those cost a few dozen
numpy calls each whatever their size (0.3-0.6 ms), and the last few hundred homeless entries of a
100,000-block build took eight calls of three passes, a fifth of the build's CPU."""
WALK_KICKS = 64
"""Evictions one entry's walk may take before it is left waiting (for commit's _bulk)."""
CARRY_PASSES = 3
"""_shift passes over a build's waiting entries when they are run (see SHIFT_AT)."""
SHIFT_AT = 2048
"""Entries a build's steps leave homeless (both rows full, or a row taken by another entry of the
same pass) that wait before _shift's passes run over them: a pass is a few dozen numpy calls
whatever its size, so running them every step over a few dozen entries was a third of a stepped
snapshot's CPU."""
ALT_SIZES = 8
"""Bucket counts whose alt-row table (_alt_rows, 256 KiB each) is kept."""
SETTLE_WALK_AT = 32
"""Entries left homeless after _settle's first round at or below which they are placed one at a
time (_settle_walk) instead of in vector rounds."""
KICK_ROUNDS = 500
"""Rounds of cuckoo evictions before entries still homeless are dropped (see _settle)."""
PENDING = 2048
"""Logged delta blocks that trigger a fold (reads fold first anyway). A fold is one turn of the
serving loop, about linear in the blocks folded: at 65,536 it took 62-90 ms (up to 205 ms) with
1,000 pools' deltas of 40 blocks, the steady state's longest turns; 8 ms (up to 17) at 8,192, for
4% more CPU in total (BENCHMARKS.md, "1,000 pools with the fleet settings"). With _settle's
look-ahead and walk, 5-6 ms (p99 8-9) at 8,192 and 3.1-3.4 ms (p99 5) at 4,096 for 10-15% more
CPU in all (still less than 8,192's before them; BENCHMARKS.md, "Loop lag at 1,000 pools"). At
2,048, 2.0 ms (p99 2.4) in bench_fold against 3.3 ms at 4,096, for 17% more CPU in the fold and
5-8% more of the frontend's at 1,000 pools: with the collector on a timer and 2 ms telemetry
slices, 4,096's folds alone left the serving loop's turns of over 10 ms as many as before
(BENCHMARKS.md, "Loop lag at 1,000 pools: the collector on a timer, telemetry in 2 ms slices")."""
FOLD_EVERY = 0.05
"""Seconds after a logged delta within which the telemetry pacer folds it, when reads do not fold
(`KvSummary.reads_fold` off, as the telemetry servicer runs it): how long a delta at most waits for
the decisions to see it, besides the pacer's folds at PENDING."""
PACED_FOLD_AT = 2 * PENDING
"""KvSummary.fold_at when the serving loop's pacer folds (TelemetryServicer): `apply_delta` folds by
itself only past it, in case the pacer has not come to the fold (deltas applied by the index
worker's steps, say)."""
ARENA_SPACE = 1 << 38
"""Bytes of address space the arena maps (Linux: private, anonymous, not reserved; 256 GiB, a
hundred times the 1,000-pool x 1,000,000-block fleet's tables, and a 500th of a process's address
space, so hundreds of instances fit): pages cost memory only once written, and given-up regions give theirs back (MADV_DONTNEED), so the arena
never grows by copying (a copy of every table, seconds at 1,000 pools x 1,000,000 blocks, on
the serving loop) nor compacts: freed regions are reused first-fit."""
_MAP_NORESERVE = 0x4000  # Linux's MAP_NORESERVE (the mmap module does not export it)
_ROW_BYTES = SLOTS * 2

_M32 = np.uint64(0xFFFF_FFFF)
_S32 = np.uint64(32)
_FP_SHIFT = np.uint64(32 - FP_BITS)
_FP_MASK = np.uint64((1 << FP_BITS) - 1)
_ALT_MUL = np.uint64(0x9E37_79B9_7F4A_7C15)
_ONE_FULL = np.uint32(0x10000)
"""A build table's row word at or above it is full (see KvSummary._insert)."""
_ROW_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[SLOTS]
"""A row's SLOTS comparison bytes read as one word (any slot equal <=> the word is not 0)."""


def default_pool_of(source: str) -> str:
    """The pool of a source key: the telemetry ingest names a stream `pool/relay/incarnation#n`
    and the simulator `pool/relay`; the pool id is what precedes the last two (or one) parts."""
    parts = source.rsplit("/", 2)
    if len(parts) < 2 or not parts[0]:
        raise ValueError(f"source {source!r} does not name its pool (expected 'pool/relay[/...]')")
    return parts[0]


def mix(keys: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised: a bijection of uint64 that spreads sequential ids."""
    z = keys.astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58_476D_1CE4_E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D0_49BB_1331_11EB)
    z ^= z >> np.uint64(31)
    return z


def _as_keys(hashes: Iterable[int]) -> np.ndarray:
    if isinstance(hashes, np.ndarray):
        return hashes.astype(np.uint64, copy=False)
    if isinstance(hashes, Sized):
        return np.fromiter(hashes, np.uint64, len(hashes))
    return np.fromiter(hashes, np.uint64)


def _first_match(rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row, the first slot equal to its value, -1 where none."""
    eq = rows == values[:, None]
    pos: np.ndarray = eq.argmax(axis=1).astype(np.int64)
    pos[~eq.any(axis=1)] = -1
    return pos


@dataclass(frozen=True, slots=True)
class SummaryStats:
    """Counters of what the summary skipped or lost (for metrics and tests)."""

    pools: int
    entries: int
    table_bytes: int
    arena_bytes: int
    skipped_deltas: int
    """Delta blocks from a pool's non-feeding sources (the same set, from another replica)."""
    dropped_blocks: int
    """Blocks that found no room (a table past MAX_LOST doublings): false negatives."""
    doublings: int


class KvSummary:
    """Per-pool fingerprint tables behind KvIndex's interface (sources in, source -> prefix out)."""

    __slots__ = (
        "_alt_cache",
        "_aside",
        "_base",
        "_count",
        "_cursor",
        "_doublings",
        "_dropped",
        "_feeder",
        "_floor",
        "_free",
        "_fresh",
        "_garbage",
        "_gather",
        "_hidden",
        "_log_keys",
        "_log_runs",
        "_lost",
        "_map",
        "_nb",
        "_owner",
        "_pool_ids",
        "_pool_names",
        "_pool_of",
        "_pool_sources",
        "_shadow",
        "_skipped",
        "_slots",
        "_source_pool",
        "_spare",
        "_staged",
        "_top",
        "_waiting",
        "_walked",
        "fold_at",
        "reads_fold",
        "settle_rounds",
        "verify_top",
    )

    def __init__(
        self,
        *,
        pool_of: Callable[[str], str] = default_pool_of,
        reserve_blocks: int = 0,
        verify_top: int = VERIFY_TOP,
    ) -> None:
        if verify_top < 1:
            raise ValueError(f"verify_top must be at least 1, got {verify_top}")
        if reserve_blocks < 0:
            raise ValueError(f"reserve_blocks must be >= 0, got {reserve_blocks}")
        self._pool_of = pool_of
        self.verify_top = verify_top
        self._map: mmap.mmap | None = None
        """The arena's mapping (ARENA_SPACE bytes), None where it could not be made (not Linux):
        then the arena is an array grown by copies and compacted, sized from `reserve_blocks`."""
        if sys.platform == "linux":
            try:
                self._map = mmap.mmap(
                    -1, ARENA_SPACE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
                )
            except (OSError, ValueError, OverflowError):
                self._map = None
        if self._map is not None:
            self._slots = np.frombuffer(self._map, np.uint16).reshape(-1, SLOTS)
        else:
            self._slots = np.zeros(
                (max(MIN_BUCKETS, self._buckets_for(reserve_blocks * 101 // 100)), SLOTS), np.uint16
            )
        """The arena: every pool's rows, each pool's contiguous (pages cost on first use). In the
        array fallback, `reserve_blocks` (the fleet's pools x blocks, 1% over for the rounding of
        each table) spares the copies of growing it by a quarter at a time."""
        self._top = 0
        """First arena row no pool has used."""
        self._garbage = 0
        """Arena rows of regions given up (a doubled or dropped table): in the free list (mapped
        arena), or reclaimed by compaction (array fallback)."""
        self._free: dict[int, int] = {}
        """Mapped arena: first row -> rows of each given-up region (adjacent ones merged), reused
        first-fit; one that ends at _top lowers it instead."""
        self._pool_ids: dict[str, int] = {}
        self._pool_names: list[str] = []
        self._pool_sources: list[set[str]] = []
        self._feeder: list[str | None] = []
        self._floor: list[int] = []
        """Per pool: the buckets `expect` asked for (a snapshot's table is never smaller)."""
        self._source_pool: dict[str, int] = {}
        self._base = np.zeros(0, np.int64)
        """Per pool: its first arena row."""
        self._nb = np.zeros(0, np.int64)
        """Per pool: its buckets (0: no table)."""
        self._lost = np.zeros(0, np.int64)
        """Per pool: fingerprint bits lost to doublings since its table was built."""
        self._count = np.zeros(0, np.int64)
        """Per pool: entries in its table (blocks held, up to fingerprint collisions)."""
        self._log_keys: list[int] = []
        self.fold_at = PENDING
        """Logged blocks past which `apply_delta` folds at once (in the call). The telemetry pacer
        raises it to PACED_FOLD_AT and folds at `fold_due` itself, at the start of a loop turn's
        slice: folded inside a message, a fold (3-5 ms at 1,000 pools) came on top of the slice
        that message ended, the steady state's longest turns (BENCHMARKS.md, "what the long turns
        were")."""
        self._log_runs: list[tuple[int, int, int]] = []
        """(pool, removed blocks, stored blocks) per logged delta, in order."""
        self.reads_fold = True
        """Whether the lookups a decision makes (`holds`, `pool_holds`, the prefix searches) fold
        the logged deltas first. Off (the telemetry servicer, whose pacer folds at `fold_due` and
        within FOLD_EVERY of a logged delta), they read the tables as of the last fold: a fold
        took 1-5 ms at 1,000 pools, and with the log rarely empty at fleet rates nearly every
        decision paid one (half of a decision's samples in py-spy at 1,000 pools x 200 events/s;
        BENCHMARKS.md, "The decision's own CPU at 1,000 pools"). The tables change only inside a
        fold, so such a read sees one consistent state, about PENDING logged blocks (at most
        PACED_FOLD_AT) or FOLD_EVERY behind, against relays that send deltas every 0.2-1 s.
        Other reads (counts, stats) and every write still fold first. On (the default: tools,
        tests, the simulator), every read sees every delta logged before it."""
        self._skipped = 0
        self._dropped = 0
        self._doublings = 0
        self._hidden = np.zeros(0, bool)
        """Per table id: a snapshot being built (begin_snapshot), not a pool: never searched."""
        self._staged: dict[str, tuple[int, int]] = {}
        """Source being built -> (its build table's id, its pool's id)."""
        self._spare: list[int] = []
        """Build table ids free for the next begin_snapshot."""
        self._waiting: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        """Build table id -> entries its steps left homeless (both rows full, or a cell another
        entry of the pass took), counted as entries; _shift's passes run over them once SHIFT_AT
        wait (a pass over a few dozen entries is mostly fixed cost), settle_build's steps place
        the last ones, commit_snapshot any left."""
        self._walked: dict[int, int] = {}
        """Build table id -> _shift passes settle_build ran over its waiting entries (bounded: past
        SHIFT_PASSES the commit places the rest, cuckoo rounds if need be)."""
        self._shadow: dict[int, int] = {}
        """Pool id -> the hidden id of its table before a growth in progress (see _begin_growth):
        its rows not yet moved, read with the pool's new table, counted in the pool's _count."""
        self._fresh: dict[int, tuple[int, int]] = {}
        """Pool id -> (first row, rows zeroed so far) of the region its table's growth will move
        into (mapped arena): zeroed a slice at a time first (a fresh region's pages cost a fault
        each on first touch: 10 ms for the 21 MB of a 4,000,000-block table's), blocks
        stored meanwhile set aside (_aside)."""
        self._aside: dict[int, np.ndarray] = {}
        """Pool id -> mixed hashes stored while its new region is zeroed (a table at MAX_LOAD
        places an entry in cuckoo walks: 64 took 3 to 5 ms), read as held, placed in the new
        table when the move starts."""
        self._cursor: dict[int, int] = {}
        """Pool id -> the first row of its old table not yet moved (rows before it are empty)."""
        self._owner = np.zeros(0, np.int32)
        """Scratch of _greedy and _shift, a cell per row of the largest table placed into (kept:
        a fresh array's pages cost a fault each on first touch, most of a small step's time)."""
        self._gather: dict[int, list[np.ndarray]] = {}
        """Build table id -> slices added and not placed yet (see add_blocks)."""
        self._alt_cache: dict[int, np.ndarray] = {}
        """Bucket count -> alt(fingerprint) mod it for every fingerprint (see _alt_rows)."""
        self.settle_rounds = 0
        """Rounds _settle ran (each a few dozen numpy calls over the entries still homeless): what
        a fold's placement costs beyond its first pass (tests and benchmarks read it)."""

    # ---- sizing and the arena --------------------------------------------------------------------
    @staticmethod
    def _buckets_for(blocks: int) -> int:
        return max(MIN_BUCKETS, math.ceil(blocks / (SLOTS * TARGET_LOAD)))

    def _alloc(self, buckets: int) -> int:
        """First row of a fresh zeroed region of `buckets` rows: a given-up region's first fit or
        the arena's end (mapped arena: O(buckets)), else compacts or grows the arena (fallback)."""
        if buckets >= 1 << 32:
            raise ValueError(f"a pool table of {buckets} buckets exceeds 2^32")
        if self._map is not None:
            return self._alloc_mapped(buckets)
        if self._top + buckets > len(self._slots):
            live = self._top - self._garbage
            if self._garbage and live + buckets <= len(self._slots):
                self._compact(len(self._slots))
            else:
                self._compact(max(live + buckets, len(self._slots)) * 5 // 4)
        base = self._top
        self._top += buckets
        self._slots[base : base + buckets] = 0
        return base

    def _compact(self, rows: int) -> None:
        """Copies every live table to the front of a new arena of `rows` rows."""
        new = np.zeros((rows, SLOTS), np.uint16)
        top = 0
        for p in np.flatnonzero(self._nb).tolist():
            b, n = int(self._base[p]), int(self._nb[p])
            new[top : top + n] = self._slots[b : b + n]
            self._base[p] = top
            top += n
        self._slots, self._top, self._garbage = new, top, 0

    def _alloc_mapped(self, buckets: int, zero: bool = True) -> int:
        free = self._free
        base = next((b for b, n in free.items() if n >= buckets), None)  # first fit
        if base is not None:
            rows = free.pop(base)
            if rows > buckets:
                free[base + buckets] = rows - buckets
            self._garbage -= buckets
        else:
            base = self._top
            if base + buckets > len(self._slots):
                raise MemoryError(f"KvSummary arena: {ARENA_SPACE} bytes of address space used up")
            self._top += buckets
        if zero:
            self._slots[base : base + buckets] = 0
        return base

    def _release(self, p: int) -> None:
        self._waiting.pop(p, None)
        self._walked.pop(p, None)
        self._gather.pop(p, None)
        self._aside.pop(p, None)
        fresh = self._fresh.pop(p, None)
        if fresh is not None:
            self._give_back(fresh[0], 2 * int(self._nb[p]))
        old = self._shadow.pop(p, None)
        if old is not None:
            del self._cursor[p]
            self._release(old)
            self._spare.append(old)
        rows = int(self._nb[p])
        if rows and self._map is not None:
            self._give_back(int(self._base[p]), rows)
        elif rows:
            self._garbage += rows
        self._nb[p] = 0
        self._count[p] = 0
        self._lost[p] = 0

    def _give_back(self, base: int, rows: int) -> None:
        """Puts a region in the free list (merged with adjacent ones; lowering _top when it ends
        there) and returns its whole pages' memory (O(region))."""
        assert self._map is not None
        page = mmap.PAGESIZE
        start = -(-base * _ROW_BYTES // page) * page
        end = (base + rows) * _ROW_BYTES // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        free = self._free
        self._garbage += rows
        bases = sorted(free)  # a few thousand regions at most: one per pool and build
        at = bisect.bisect_left(bases, base)
        if at and bases[at - 1] + free[bases[at - 1]] == base:
            base = bases[at - 1]
            rows += free.pop(base)
        after = base + rows
        if after in free:
            rows += free.pop(after)
        if base + rows == self._top:
            self._top = base
            self._garbage -= rows
        else:
            free[base] = rows

    # ---- pools and sources ---------------------------------------------------------------------
    def _pool_for(self, source: str) -> int:
        p = self._source_pool.get(source)
        if p is not None:
            return p
        p = self._pool_named(self._pool_of(source))
        self._source_pool[source] = p
        self._pool_sources[p].add(source)
        return p

    def _pool_named(self, name: str) -> int:
        p = self._pool_ids.get(name)
        if p is None:
            p = self._pool_ids[name] = self._new_table(name)
        return p

    def _new_table(self, name: str) -> int:
        """A new table id (a pool's, or a build's when `name` is empty) with no rows yet."""
        p = len(self._pool_names)
        self._pool_names.append(name)
        self._pool_sources.append(set())
        self._feeder.append(None)
        self._floor.append(MIN_BUCKETS)
        self._base = np.append(self._base, 0)
        self._nb = np.append(self._nb, 0)
        self._lost = np.append(self._lost, 0)
        self._count = np.append(self._count, 0)
        self._hidden = np.append(self._hidden, not name)
        return p

    def expect(self, source: str, blocks: int) -> None:
        """Sizes the source's pool's table for at least `blocks` blocks (the pool's KV capacity),
        so that deltas filling an empty pool need not double it. Keeps what the table holds."""
        if blocks < 0:
            raise ValueError(f"expected blocks must be >= 0, got {blocks}")
        self._fold()
        p = self._pool_for(source)
        want = self._floor[p] = self._buckets_for(blocks)
        while 0 < int(self._nb[p]) < want and int(self._lost[p]) < MAX_LOST:
            self._double(p)
        if self._nb[p] == 0:
            self._base[p] = self._alloc(want)
            self._nb[p] = want

    def expect_pool(self, pool: str, blocks: int) -> None:
        """Sets the pool's table size floor to hold `blocks` (its KV capacity, from its load
        reports): its next table (a snapshot's, or the first deltas') is never smaller. A table it
        has now is left as it is: doubling it now would cost a pass over it on the caller's loop
        and a fingerprint bit, which deltas that overfill it pay anyway, and only then. O(1)."""
        if blocks < 0:
            raise ValueError(f"expected blocks must be >= 0, got {blocks}")
        self._floor[self._pool_named(pool)] = self._buckets_for(blocks)

    # ---- snapshots built a step at a time (the live frontend's telemetry ingest) ---------------
    def begin_snapshot(self, source: str, blocks: int, pool: str | None = None) -> None:
        """Starts building a snapshot of `blocks` blocks under `source` (a key of its own, not yet
        a source of its pool, which is `pool` or else what pool_of names): add_blocks fills a
        table of its own, which commit_snapshot makes the pool's. Until then the pool's current
        table answers."""
        if blocks < 0:
            raise ValueError(f"snapshot blocks must be >= 0, got {blocks}")
        self._drop_build(source)
        p = self._pool_named(self._pool_of(source) if pool is None else pool)
        s = self._spare.pop() if self._spare else self._new_table("")
        want = max(self._buckets_for(blocks), self._floor[p])
        self._base[s] = self._alloc(want)
        self._nb[s] = want
        self._lost[s] = 0
        self._count[s] = 0
        self._staged[source] = (s, p)

    def add_blocks(self, source: str, keys: np.ndarray) -> None:
        """Adds packed block hashes to the snapshot being built under `source` (one bounded step;
        begun with the pool's floor size if begin_snapshot was not called), or, for a source of a
        pool, stores them in the pool's set like a delta."""
        if source in self._source_pool:
            self.apply_delta(source, _as_keys(keys).tolist(), ())
            return
        if source not in self._staged:
            self.begin_snapshot(source, 0)
        s = self._staged[source][0]
        keys = _as_keys(keys)
        if not keys.size:
            return
        # Slices are gathered up to BUILD_BATCH blocks: a step's placement is mostly fixed cost
        # (a hundred numpy calls), and the ingest's steps shrink to 256 blocks on a busy host.
        parts = self._gather.setdefault(s, [])
        parts.append(keys)
        if sum(x.size for x in parts) < BUILD_BATCH:
            return
        self._build(s)

    def _build(self, s: int) -> None:
        """Places the slices gathered for build table s."""
        parts = self._gather.pop(s, None)
        if not parts:
            return
        h = mix(parts[0] if len(parts) == 1 else np.concatenate(parts))
        # A snapshot's blocks are distinct (a relay's set), so no probe for those already placed:
        # two blocks sharing a fingerprint and a row get an entry each, as in apply_snapshot.
        if h.size > 1:  # distinct within the slice (sorted; np.unique cost twice as much)
            h = np.sort(h)
            h = h[np.concatenate(([True], h[1:] != h[:-1]))]
        waiting = self._waiting.get(s)
        if int(self._count[s]) + (waiting[0].size if waiting else 0) + h.size > MAX_LOAD * SLOTS * int(
            self._nb[s]
        ):
            self._settle_waiting(s)
            while (
                int(self._count[s]) + h.size > MAX_LOAD * SLOTS * int(self._nb[s])
                and int(self._lost[s]) < MAX_LOST
            ):
                self._double(s)
        base, nb = int(self._base[s]), int(self._nb[s])
        region = self._slots[base : base + nb]
        if nb < 1 << 31:
            b1, b2, v = self._locate_narrow(s, h)
        else:
            b1, b2, v = self._locate(s, h)
        # INSERT_PASSES passes of _insert (not _bulk's: a step's slice into a big table has few
        # entries sharing a row); those they leave wait, and _shift's passes run over them in bulk.
        a, b, v = self._insert(region, b1, b2, v)
        for _ in range(INSERT_PASSES - 1):
            if not a.size:
                break
            a, b, v = self._insert(region, a, b, v)
        self._count[s] += h.size  # waiting entries count too (the table's load)
        waiting = self._waiting.pop(s, None)
        if waiting is not None:
            a, b, v = (np.concatenate((x, y)) for x, y in zip(waiting, (a, b, v), strict=True))
        if a.size >= SHIFT_AT:
            a, b, v = self._shift(region, a, b, v, CARRY_PASSES)
        if a.size:  # counted as entries (the table's load), placed by a later step or the commit
            self._waiting[s] = (a, b, v)

    def settle_build(self, source: str, budget: int) -> int:
        """Places what the build under `source` has gathered or left waiting, about `budget`
        entry-passes of work (all when budget <= 0), so that commit_snapshot has little left to
        do; returns the work done, 0 when nothing is left (the ingest's steps call it before the
        commit). Unknown sources have nothing left."""
        staged = self._staged.get(source)
        if staged is None:
            return 0
        s = staged[0]
        if s in self._gather:
            parts = self._gather[s]
            done = sum(x.size for x in parts)
            self._build(s)
            return max(1, done)
        walked = self._walked.get(s, 0)
        if s not in self._waiting or walked >= SHIFT_PASSES:
            return 0
        waiting = self._waiting.pop(s)
        base, nb = int(self._base[s]), int(self._nb[s])
        size = waiting[0].size
        if size <= WALK_AT:
            a, b, v = self._walk(self._slots[base : base + nb], *waiting)
            self._walked[s] = SHIFT_PASSES  # what is left (rarely any) is the commit's
            if a.size:
                self._waiting[s] = (a, b, v)
            return max(1, size * WALK_KICKS // 8)
        # A pass costs about as much as SHIFT_AT entries' share of it whatever its size, so a step
        # runs at least one and as many as its budget pays for (the walk of the last few homeless
        # entries of a full table takes a few dozen).
        passes = SHIFT_PASSES - walked if budget <= 0 else max(1, budget // (size + SHIFT_AT))
        passes = min(passes, SHIFT_PASSES - walked)
        a, b, v = self._shift(self._slots[base : base + nb], *waiting, passes, seed=walked + 1)
        self._walked[s] = walked + passes
        if a.size:
            self._waiting[s] = (a, b, v)
        return max(1, passes * (size + SHIFT_AT))

    def _settle_waiting(self, s: int) -> None:
        """Places the entries a build's steps left homeless (before it doubles or is committed)."""
        self._walked.pop(s, None)
        waiting = self._waiting.pop(s, None)
        if waiting is not None:
            self._count[s] -= waiting[0].size
            self._bulk(s, *waiting)

    def remove_blocks(self, source: str, keys: np.ndarray) -> None:
        """Nothing: a source's blocks are its pool's, which keeps them while another source of the
        pool is live and drops them all at once with the last one (drop_source, O(table))."""

    def commit_snapshot(self, source: str) -> None:
        """The snapshot built under `source` replaces its pool's set; `source` becomes a source of
        the pool and its feeder (its deltas change the set from now on)."""
        staged = self._staged.pop(source, None)
        if staged is None:
            raise ValueError(f"no snapshot is being built under {source!r}")
        s, p = staged
        self._build(s)
        self._settle_waiting(s)
        self._fold()  # logged deltas were for the table being replaced
        if self._nb[p]:
            self._release(p)
        self._base[p], self._nb[p] = self._base[s], self._nb[s]
        self._lost[p], self._count[p] = self._lost[s], self._count[s]
        self._nb[s] = self._count[s] = self._lost[s] = 0  # its rows are the pool's now
        self._spare.append(s)
        self._source_pool[source] = p
        self._pool_sources[p].add(source)
        self._feeder[p] = source

    def _drop_build(self, source: str) -> None:
        staged = self._staged.pop(source, None)
        if staged is not None:
            self._release(staged[0])
            self._spare.append(staged[0])

    # ---- hashing -------------------------------------------------------------------------------
    def _locate(self, p: np.ndarray | int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first bucket, second bucket, slot value in the first) of mixed hashes `h` in pools `p`
        (each pool's own bucket count and lost bits; one int for one pool: scalar operands cost
        a third of per-element ones)."""
        nb = np.uint64(self._nb[p]) if isinstance(p, int) else self._nb[p].astype(np.uint64)
        hi, lo = h >> _S32, h & _M32
        x = hi * nb + ((lo * nb) >> _S32)
        b1 = (x >> _S32).astype(np.int64)
        fp = (x >> _FP_SHIFT) & _FP_MASK
        return self._finish(p, b1, fp)

    def _locate_narrow(self, p: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """_locate for one table of fewer than 2^31 rows, in narrow types (int32 buckets, uint16
        fingerprints): the same values at about half the cost (the uint64 temporaries and the two
        copies to int32 were a seventh of a stepped snapshot's CPU)."""
        nb, lost = int(self._nb[p]), int(self._lost[p])
        n = np.uint64(nb)
        x = (h >> _S32) * n + (((h & _M32) * n) >> _S32)
        b1 = (x >> _S32).astype(np.int32)
        fp = ((x >> _FP_SHIFT) & _FP_MASK).astype(np.uint16)
        if lost:
            fp = (fp >> np.uint16(lost)) << np.uint16(lost)
        fp[fp == 0] = np.uint16(1 << lost)
        b2 = self._alt_rows(nb)[fp] - b1
        b2[b2 < 0] += nb
        return b1, b2, fp << np.uint16(1)

    def _finish(
        self, p: np.ndarray | int, b1: np.ndarray, fp: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first bucket, second bucket, first-bucket slot value) from the first bucket and the
        raw fingerprint: the pool's lost bits masked, 0 made the smallest value left."""
        if isinstance(p, int):
            lost, nb = int(self._lost[p]), int(self._nb[p])
            if lost:
                fp = (fp >> np.uint64(lost)) << np.uint64(lost)
            fp[fp == 0] = np.uint64(1 << lost)
            b2 = self._alt_rows(nb)[fp] - b1
            b2[b2 < 0] += nb
        else:
            lost_any = self._lost[p]
            if lost_any.any():
                shift = lost_any.astype(np.uint64)
                fp = (fp >> shift) << shift
                fp = np.where(fp == 0, np.uint64(1) << shift, fp)
            else:  # the usual case, a third of the operations
                fp[fp == 0] = np.uint64(1)
            nbs = self._nb[p]
            b2 = (self._alt(fp) % nbs.astype(np.uint64)).astype(np.int64) - b1
            b2 %= nbs
        return b1, b2, (fp << np.uint64(1)).astype(np.uint16)

    def _alt_rows(self, nb: int) -> np.ndarray:
        """alt(fp) mod nb for every slot fingerprint fp (a row's two buckets add up to it mod nb):
        a gather instead of a 64-bit multiply and modulo per entry. A few sizes are kept (a
        fleet's tables mostly share a few)."""
        rows = self._alt_cache.get(nb)
        if rows is None:
            if len(self._alt_cache) >= ALT_SIZES:
                self._alt_cache.pop(next(iter(self._alt_cache)))
            fp = np.arange(1 << FP_BITS, dtype=np.uint64)
            # int32 where it fits: half the cache lines of a gather, and int32 buckets stay int32
            rows = self._alt_cache[nb] = (self._alt(fp) % np.uint64(nb)).astype(
                np.int32 if nb < 1 << 31 else np.int64
            )
        return rows

    @staticmethod
    def _alt(fp: np.ndarray) -> np.ndarray:
        out: np.ndarray = (fp * _ALT_MUL) >> _S32
        return out

    # ---- table operations ----------------------------------------------------------------------
    def _held(self, p: np.ndarray, h: np.ndarray) -> np.ndarray:
        """Whether pool p[i] holds mixed hash h[i] (up to false positives): in its table, or in
        the rows of its old one not yet moved when it is growing."""
        out = self._in_table(p, h)
        for q, aside in self._aside.items():
            mine = p == q
            if mine.any():
                out[mine] |= np.isin(h[mine], aside)
        if self._shadow:
            grows, old = self._old_of(p)
            if grows.size:
                out[grows] |= self._in_table(old, h[grows])
        return out

    def _old_of(self, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(indexes i of p whose pool is growing, the hidden id of each one's old table)."""
        ids = np.fromiter(self._shadow, np.int64, len(self._shadow))
        olds = np.fromiter(self._shadow.values(), np.int64, len(self._shadow))
        grows = np.flatnonzero(np.isin(p, ids))
        if not grows.size:
            return grows, grows
        order = np.argsort(ids)
        return grows, olds[order][np.searchsorted(ids[order], p[grows])]

    def _in_table(self, p: np.ndarray, h: np.ndarray) -> np.ndarray:
        """Whether table p[i] itself holds mixed hash h[i] (up to false positives)."""
        b1, b2, v = self._locate(p, h)
        base = self._base[p]
        slots = self._slots
        one = (np.take(slots, base + b1, axis=0) == v[:, None]).view(_ROW_WORD)[:, 0]
        two = (np.take(slots, base + b2, axis=0) == (v | np.uint16(1))[:, None]).view(_ROW_WORD)[:, 0]
        out: np.ndarray = (one | two) != 0
        return out

    def _erase(self, p: np.ndarray, h: np.ndarray) -> None:
        """Removes one entry per (p, h) pair where present (distinct pairs): from a growing pool's
        old rows not yet moved where there, else from its table. (A pair whose fingerprint and
        row match another block's entry in the old rows takes that one instead: the two read
        the same before and after the growth, the entry's new form being a function of its old.)"""
        for q in [q for q in self._aside if p.size and (p == q).any()]:
            aside, mine = self._aside[q], np.flatnonzero(p == q)
            there = np.isin(h[mine], aside)
            if there.any():
                # one entry per pair: a block set aside once (the fold's net transitions)
                self._aside[q] = aside[~np.isin(aside, h[mine][there])]
                self._count[q] -= aside.size - self._aside[q].size
                keep = np.ones(p.size, bool)
                keep[mine[there]] = False
                p, h = p[keep], h[keep]
        if self._shadow and p.size:
            grows, old = self._old_of(p)
            if grows.size:
                there = self._in_table(old, h[grows])
                at, old = grows[there], old[there]
                if at.size:
                    self._erase_in(old, h[at])
                    for q, o in set(zip(p[at].tolist(), old.tolist(), strict=True)):
                        self._count[q] += self._count[o]  # the pool counts its old rows' entries
                        self._count[o] = 0
                    keep = np.ones(p.size, bool)
                    keep[at] = False
                    p, h = p[keep], h[keep]
        self._erase_in(p, h)

    def _erase_in(self, p: np.ndarray, h: np.ndarray) -> None:
        """Removes one entry per (p, h) pair from table p where present (distinct pairs)."""
        if not p.size:
            return
        b1, b2, v = self._locate(p, h)
        base = self._base[p]
        g1, g2 = base + b1, base + b2
        slots = self._slots
        while True:
            # Pairs sharing a row and a fingerprint (each stored has its entry) would all find the
            # same slot: one of them a round, the others in the next.
            key = g1 * 65536 + v.astype(np.int64)
            _, once = np.unique(key, return_index=True)
            later = None
            if once.size < key.size:
                later = np.ones(key.size, bool)
                later[once] = False
                rest_p, rest_g1, rest_g2, rest_v = p[later], g1[later], g2[later], v[later]
                p, g1, g2, v = p[once], g1[once], g2[once], v[once]
            at1 = _first_match(slots[g1], v)
            hit1 = at1 >= 0
            slots[g1[hit1], at1[hit1]] = 0
            rest = ~hit1
            at2 = _first_match(slots[g2[rest]], v[rest] | np.uint16(1))
            hit2 = at2 >= 0
            slots[g2[rest][hit2], at2[hit2]] = 0
            gone = np.concatenate((p[hit1], p[rest][hit2]))
            self._count -= np.bincount(gone, minlength=self._count.size)
            if later is None:
                return
            p, g1, g2, v = rest_p, rest_g1, rest_g2, rest_v

    def _place(self, p: np.ndarray, b1: np.ndarray, b2: np.ndarray, v: np.ndarray) -> None:
        """Puts absent entries (pool, first bucket, second bucket, first-bucket slot value) into
        their tables: big batches in waves (keys placed in one round all see the same rows, which
        balances worse than one at a time)."""
        base = self._base[p]
        ga, gb = base + b1, base + b2
        vb = v | np.uint16(1)
        self._count += np.bincount(p, minlength=self._count.size)
        step = max(WAVE, -(-p.size // WAVES))
        for at in range(0, p.size, step):
            cut = slice(at, at + step)
            self._settle(p[cut], ga[cut], v[cut], gb[cut], vb[cut])

    def _bulk(self, p: int, b1: np.ndarray, b2: np.ndarray, v: np.ndarray) -> None:
        """Puts distinct absent entries into pool p's table (any fill) in a bounded number of
        vector passes over the whole batch, no round per entry (see _greedy and _shift); the
        rare rest go the generic way (_place: cuckoo evictions). Where an entry lands does not
        change what the table answers: a probe matches the (first bucket, fingerprint) pair
        wherever of its two rows the entry is."""
        base, nb = int(self._base[p]), int(self._nb[p])
        if not b1.size:
            return
        region = self._slots[base : base + nb]
        index = np.int32 if nb < 1 << 31 else np.int64
        a, b = b1.astype(index), b2.astype(index)
        fresh = int(self._count[p]) == 0
        a, b, v = self._greedy(region, a, b, v, fresh=fresh, passes=GREEDY_PASSES)
        if a.size:
            a, b, v = self._shift(region, a, b, v, SHIFT_PASSES)
        self._count[p] += b1.size - a.size
        if a.size:
            self._place(np.full(a.size, p, np.int64), a.astype(np.int64), b.astype(np.int64), v)

    def _scratch(self, rows: int) -> np.ndarray:
        """The `owner` scratch of at least `rows` cells (stale values: only cells written in a
        pass are read in it)."""
        if self._owner.size < rows:
            self._owner = np.zeros(rows, np.int32)
        return self._owner

    @staticmethod
    def _insert(
        region: np.ndarray, a: np.ndarray, b: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One pass of _greedy for a build table's step, leaner: each entry (rows a and b of
        `region`, first-row slot value v; sorted by (a, v), as a sorted slice of mixed hashes is)
        into the emptier of its two rows. A build table only takes inserts, so its rows fill from
        their first slot: a row's word is 0 (empty), at most 0xFFFF (one entry) or more (full), and
        its free slot is 1 iff it is not 0. Entries aiming at one cell all write it and read it
        back: the one whose value stayed has it (no `owner` scatter, whose cell per row of the
        table made two more cache misses an entry). Two entries could only write the same value
        to the same cell with equal (a, v), and those are adjacent: all but the first of a run
        wait. Returns the entries not placed (rows both full, or a cell another entry took)."""
        words = region.view(np.uint32).reshape(-1)
        ka = np.minimum(words[a], _ONE_FULL)
        kb = np.minimum(words[b], _ONE_FULL)
        second = (kb < ka) | ((kb == ka) & ((v & np.uint16(2)) != 0))
        k = np.where(second, kb, ka)
        room = k < _ONE_FULL
        if a.size > 1:
            room[1:] &= (a[1:] != a[:-1]) | (v[1:] != v[:-1])
        at = np.flatnonzero(room)
        side = second[at]
        cell = np.where(side, b[at], a[at]).astype(np.int64) * SLOTS + (k[at] != 0)
        val = v[at] | side.view(np.uint8)
        flat = region.reshape(-1)
        flat[cell] = val  # a cell written twice holds one of the values (which one is unspecified)
        left = np.ones(a.size, bool)
        left[at[flat[cell] == val]] = False  # the others lost their cell to another entry
        keep = np.flatnonzero(left)
        return a[keep], b[keep], v[keep]

    def _walk(
        self, region: np.ndarray, a: np.ndarray, b: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Places a build table's few homeless entries (rows a and b of `region`, first-row slot
        value v) one at a time: into a free slot of either row (rows fill from their first slot,
        as _insert expects), else evicting a random resident of the row it did not just come from,
        which then goes the same way (a partial-key cuckoo walk of at most WALK_KICKS evictions).
        Returns the entries (an evicted resident in place of its evicter) still homeless."""
        nb = region.shape[0]
        flat = region.reshape(-1)
        alt = self._alt_rows(nb)
        rng = np.random.default_rng(a.size)
        kicks = rng.integers(0, 4, WALK_KICKS * max(1, a.size)).tolist()
        k = 0
        left_a: list[int] = []
        left_b: list[int] = []
        left_v: list[int] = []
        for ea, eb, ev in zip(a.tolist(), b.tolist(), v.tolist(), strict=True):
            came = -1  # the row the entry was just evicted from (never kicked back into)
            for _ in range(WALK_KICKS):
                placed = False
                for row, val in ((ea, ev), (eb, ev | 1)):
                    cell = row * SLOTS
                    if not flat[cell]:
                        flat[cell] = val
                        placed = True
                        break
                    if not flat[cell + 1]:
                        flat[cell + 1] = val
                        placed = True
                        break
                if placed:
                    break
                pick = kicks[k]
                k += 1
                row = eb if came == ea else ea if came == eb else (ea, eb)[pick >> 1]
                cell = row * SLOTS + (pick & 1)
                victim = int(flat[cell])
                flat[cell] = ev if row == ea else ev | 1
                other = int(alt[victim >> 1]) - row
                if other < 0:
                    other += nb
                if victim & 1:  # it was in its second row: `other` is its first
                    ea, eb, ev = other, row, victim & 0xFFFE
                else:
                    ea, eb, ev = row, other, victim
                came = row
            else:
                left_a.append(ea)
                left_b.append(eb)
                left_v.append(ev)
        return (
            np.array(left_a, a.dtype),
            np.array(left_b, b.dtype),
            np.array(left_v, v.dtype),
        )

    def _greedy(
        self, region: np.ndarray, a: np.ndarray, b: np.ndarray, v: np.ndarray, *, fresh: bool, passes: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Puts each entry (rows a and b of `region`, first-row slot value v) into the emptier of
        its two rows (ties by a fingerprint bit, so a fresh table fills both ways), all at once:
        one entry per row a pass (the `owner` scatter picks it), the others again next pass.
        Returns the entries not placed in `passes` passes (those whose rows were both full:
        about 5% of a fresh table's at a load of 0.75)."""
        words = region.view(np.uint32).reshape(-1)  # a row's two slots as one word
        flat = region.reshape(-1)
        owner = self._scratch(words.size)
        homeless: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        first = fresh
        for _ in range(passes):
            if not a.size:
                break
            me = np.arange(a.size, dtype=np.int32)
            bit = (v & np.uint16(2)) != 0
            if first:  # every row empty: no reads, the fingerprint bit chooses
                first = False
                row = np.where(bit, b, a)
                owner[row] = me
                won = owner[row] == me
                at = np.flatnonzero(won)
                words[row[at]] = v[at] | bit[at].view(np.uint8)
                keep = np.flatnonzero(~won)
            else:
                wa, wb = words[a], words[b]
                lo_a, lo_b = (wa & 0xFFFF) != 0, (wb & 0xFFFF) != 0
                fa = lo_a.view(np.uint8) + (wa > 0xFFFF).view(np.uint8)
                fb = lo_b.view(np.uint8) + (wb > 0xFFFF).view(np.uint8)
                second = (fb < fa) | ((fb == fa) & bit)
                row = np.where(second, b, a)
                room = np.where(second, fb, fa) < SLOTS
                full = np.flatnonzero(~room)
                if full.size:
                    homeless.append((a[full], b[full], v[full]))
                owner[row[room]] = me[room]
                won = room & (owner[row] == me)
                at = np.flatnonzero(won)
                slot = np.where(second[at], lo_b[at], lo_a[at])  # the row's free slot
                flat[row[at].astype(np.int64) * SLOTS + slot] = v[at] | second[at].view(np.uint8)
                room[at] = False
                keep = np.flatnonzero(room)
            a, b, v = a[keep], b[keep], v[keep]
        homeless.append((a, b, v))
        if len(homeless) == 1:
            return a, b, v
        return (
            np.concatenate([x for x, _, _ in homeless]),
            np.concatenate([y for _, y, _ in homeless]),
            np.concatenate([z for _, _, z in homeless]),
        )

    def _shift(
        self, region: np.ndarray, a: np.ndarray, b: np.ndarray, v: np.ndarray, passes: int, seed: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Places entries whose two rows were full, all at once a pass, for SHIFT_PASSES passes:
        an entry whose row has room now takes it; else one of the four entries in its rows whose
        other row has room moves there and the entry takes its slot; else it evicts a random one
        of them, which is then placed the same way (a random walk with one step of look-ahead).
        A pass changes each row for one entry at most (`owner`: rows with room are targets,
        full rows sources, so the two never meet). Returns the entries still homeless."""
        nb = region.shape[0]
        words = region.view(np.uint32).reshape(-1)
        flat = region.reshape(-1)
        owner = self._scratch(nb)
        # Seeded per call by the count, as before, plus the passes settle_build already ran over
        # these entries: its calls of a pass or two over the same few entries must not replay the
        # same kicks (a walk that goes round in circles).
        rng = np.random.default_rng((a.size, seed) if seed else a.size)
        wide = a.dtype.type
        cols = np.array([0, 1, 0, 1], np.int64)
        only = np.full(a.size, -1, np.int8)  # a kicked entry's row to kick from: 0 a, 1 b, -1 either
        alt = self._alt_rows(nb)
        for _ in range(passes):
            m = a.size
            if not m:
                break
            me = np.arange(m, dtype=np.int32)
            wa, wb = words[a], words[b]
            lo_a, lo_b = (wa & 0xFFFF) != 0, (wb & 0xFFFF) != 0
            free_a = ~lo_a | (wa <= 0xFFFF)
            free_b = ~lo_b | (wb <= 0xFFFF)
            direct = free_a | free_b
            second = ~free_a & free_b
            # Full both: the four residents and their other rows (the first + second buckets of
            # a fingerprint are alt(fingerprint) mod nb, whichever row it is in).
            src = np.stack((a, a, b, b), axis=1)
            cell = src.astype(np.int64) * SLOTS + cols
            res = flat[cell]
            other = alt[res >> np.uint16(1)] - src
            other[other < 0] += nb
            ow = words[other]
            ok = (((ow & 0xFFFF) == 0) | (ow <= 0xFFFF)) & ~direct[:, None]
            can = ok.any(axis=1)
            pick = ok.argmax(axis=1)
            kick = ~direct & ~can
            # A kick evicts a random resident, not from the row the entry was just evicted from
            # (it would evict its evicter back: a walk that goes round in circles).
            ki = np.flatnonzero(kick)
            pick[ki] = rng.integers(0, 4, ki.size)
            back = only[ki] >= 0
            pick[ki[back]] = only[ki[back]] * 2 + (pick[ki[back]] & 1)
            # Claims: a direct entry its row (with room); a shift its target row (with room) and
            # its source row (full); a kick its source row. An action acts if it owns them all.
            target = np.where(direct, np.where(second, b, a), other[me, pick].astype(wide))
            moves = ~kick
            owner[target[moves]] = me[moves]
            source = src[me, pick]
            via = ~direct
            owner[source[via]] = me[via]
            win = np.where(direct, owner[target] == me, owner[source] == me)
            win &= np.where(can & ~direct, owner[target] == me, True)
            # direct: into the row's free slot
            d = np.flatnonzero(win & direct)
            lo = np.where(second[d], lo_b[d], lo_a[d])
            flat[target[d].astype(np.int64) * SLOTS + lo] = v[d] | second[d].view(np.uint8)
            # shift: the resident to its other row's free slot, the entry into its place
            s = np.flatnonzero(win & can & ~direct)
            rv = res[s, pick[s]]
            tw = words[target[s]]
            flat[target[s].astype(np.int64) * SLOTS + ((tw & 0xFFFF) != 0)] = rv ^ np.uint16(1)
            flat[cell[s, pick[s]]] = v[s] | (source[s] != a[s]).view(np.uint8)
            # kick: the entry into the slot, the resident homeless (its rows: where it was, other)
            k = np.flatnonzero(win & kick)
            kv = res[k, pick[k]]
            flat[cell[k, pick[k]]] = v[k] | (source[k] != a[k]).view(np.uint8)
            was, elsewhere = source[k], other[k, pick[k]].astype(wide)
            in_second = (kv & np.uint16(1)) != 0
            left = np.flatnonzero(~win)
            a = np.concatenate((a[left], np.where(in_second, elsewhere, was)))
            b = np.concatenate((b[left], np.where(in_second, was, elsewhere)))
            v = np.concatenate((v[left], kv & np.uint16(0xFFFE)))
            only = np.concatenate((only[left], in_second.view(np.int8) ^ np.int8(1)))
        return a, b, v

    def _settle(self, p: np.ndarray, ga: np.ndarray, va: np.ndarray, gb: np.ndarray, vb: np.ndarray) -> None:
        """Places entries that may go to arena row ga (as value va) or gb (as vb): each into the
        emptier row; where both are full, it evicts a random entry of one of them (partial-key
        cuckoo), which then goes to its own other row (both of its choices), and so on, for at
        most KICK_ROUNDS rounds (past them the homeless entries are dropped and counted: the
        tables double before MAX_LOAD, where that is not seen)."""
        slots = self._slots
        rng = np.random.default_rng(int(p.size))
        rounds = 0
        while p.size:
            if rounds and p.size <= SETTLE_WALK_AT:
                self._settle_walk(p, ga, va, gb, vb, KICK_ROUNDS - rounds)
                return
            rounds += 1
            self.settle_rounds += 1
            if rounds > KICK_ROUNDS:
                self._dropped += int(p.size)
                self._count -= np.bincount(p, minlength=self._count.size)
                return
            free_a = np.take(slots, ga, axis=0) == 0
            free_b = np.take(slots, gb, axis=0) == 0
            ca, cb = free_a.sum(axis=1), free_b.sum(axis=1)
            # Ties (empty rows) split by a fingerprint bit, so a fresh table fills both ways.
            second = (cb > ca) | ((cb == ca) & ((va & np.uint16(2)) != 0))
            g = np.where(second, gb, ga)
            c = np.where(second, cb, ca)
            free = np.where(second[:, None], free_b, free_a)
            # The k-th entry aimed at a row takes its k-th free slot (sorted by row).
            n = g.size
            order = np.argsort(g, kind="stable")
            sg = g[order]
            head = np.concatenate(([True], sg[1:] != sg[:-1]))
            starts = np.flatnonzero(head)
            rank = np.empty(n, np.int64)
            rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
            ok = np.flatnonzero(rank < c)
            nth = np.cumsum(free[ok], axis=1) == (rank[ok] + 1)[:, None]
            pos = (nth & free[ok]).argmax(axis=1)
            slots[g[ok], pos] = np.where(second[ok], vb[ok], va[ok])
            left = np.ones(n, bool)
            left[ok] = False
            full = np.flatnonzero(c == 0)
            wait = self._look_ahead(p, ga, va, gb, vb, full, left) if full.size else None
            # Both rows full and no resident could move: the first entry aimed at each such row
            # evicts a random slot's entry.
            kick = left & (c == 0) & (rank == 0)
            if wait is not None:
                kick[wait] = False
            kick = np.flatnonzero(kick)
            if kick.size:
                row = np.where(rng.random(kick.size) < 0.5, ga[kick], gb[kick])
                slot = rng.integers(0, SLOTS, kick.size)
                # Two kickers may share a row (one's first row, the other's second): one each.
                _, once = np.unique(row, return_index=True)
                kick, row, slot = kick[once], row[once], slot[once]
                victim = slots[row, slot].copy()
                slots[row, slot] = np.where(row == ga[kick], va[kick], vb[kick])
                left[kick] = False
                vp = p[kick]
                nb = self._nb[vp]
                vbase = self._base[vp]
                fp = (victim >> np.uint16(1)).astype(np.uint64)
                other = vbase + ((self._alt(fp) % nb.astype(np.uint64)).astype(np.int64) - (row - vbase)) % nb
                vv = victim ^ np.uint16(1)
                p = np.concatenate((p[left], vp))
                ga = np.concatenate((ga[left], other))
                gb = np.concatenate((gb[left], other))
                va = np.concatenate((va[left], vv))
                vb = np.concatenate((vb[left], vv))
            else:
                p, ga, gb, va, vb = p[left], ga[left], gb[left], va[left], vb[left]

    def _settle_walk(
        self, p: np.ndarray, ga: np.ndarray, va: np.ndarray, gb: np.ndarray, vb: np.ndarray, steps: int
    ) -> None:
        """_settle's last few entries, one at a time in plain Python: into a free slot of either
        row, else a resident of its rows with room in its other row moves there, else it evicts a
        random resident, which is then placed the same way, for at most `steps` steps an entry
        (then it is dropped and counted). A vector round costs a few dozen numpy calls whatever
        its size, so the long tail of a few walks (the longest of hundreds sets the number of
        rounds) was most of a steady fold's time; a step here is a few microseconds."""
        slots, bases, sizes = self._slots, self._base, self._nb
        rng = random.Random(int(p.size))
        for q, a, x, b, y in zip(p.tolist(), ga.tolist(), va.tolist(), gb.tolist(), vb.tolist(), strict=True):
            base, nb = int(bases[q]), int(sizes[q])
            alt = self._alt_rows(nb)
            for _ in range(max(1, steps)):
                ra0, ra1, rb0, rb1 = int(slots[a, 0]), int(slots[a, 1]), int(slots[b, 0]), int(slots[b, 1])
                if not ra0 or not ra1:
                    slots[a, 0 if not ra0 else 1] = x
                    break
                if not rb0 or not rb1:
                    slots[b, 0 if not rb0 else 1] = y
                    break
                moved = False
                for row, col, res in ((a, 0, ra0), (a, 1, ra1), (b, 0, rb0), (b, 1, rb1)):
                    other = base + (int(alt[res >> 1]) - (row - base)) % nb
                    if not slots[other, 0] or not slots[other, 1]:
                        slots[other, 0 if not slots[other, 0] else 1] = res ^ 1
                        slots[row, col] = x if row == a else y
                        moved = True
                        break
                if moved:
                    break
                row, col = (a if rng.random() < 0.5 else b), rng.randrange(SLOTS)
                victim = int(slots[row, col])
                slots[row, col] = x if row == a else y
                a = b = base + (int(alt[victim >> 1]) - (row - base)) % nb
                x = y = victim ^ 1
            else:
                self._dropped += 1
                self._count[q] -= 1

    def _look_ahead(
        self,
        p: np.ndarray,
        ga: np.ndarray,
        va: np.ndarray,
        gb: np.ndarray,
        vb: np.ndarray,
        full: np.ndarray,
        left: np.ndarray,
    ) -> np.ndarray:
        """One step of look-ahead for _settle's entries `full` (both rows full): where one of the
        four residents of its rows has room in its own other row, the resident moves there and the
        entry takes its slot (clears `left` for it). Without it the walk evicted blindly and only
        one entry a full row a round moved on, so a fold's few hundred such entries took 40-50
        rounds of a few dozen numpy calls each, most of a steady fold's time (at a load of 0.75
        about half of 2-slot rows are full, a quarter of inserts find both full). Returns the
        entries that had such a move but lost their rows to another's this round (they wait for
        the next round rather than evict). Placements of this round wrote only rows with room, so
        the full rows read here are as the round found them; the other rows are read now."""
        slots = self._slots
        src = np.stack((ga[full], ga[full], gb[full], gb[full]), axis=1)
        col = np.array([0, 1, 0, 1], np.int64)
        res = slots[src, col]
        pf = p[full]
        base = self._base[pf][:, None]
        nb = self._nb[pf][:, None]
        fp = (res >> np.uint16(1)).astype(np.uint64)
        other = base + ((self._alt(fp) % nb.astype(np.uint64)).astype(np.int64) - (src - base)) % nb
        room = np.take(slots, other.ravel(), axis=0).reshape(full.size, 4, SLOTS) == 0
        movable = room.any(axis=2)
        can = np.flatnonzero(movable.any(axis=1))
        if not can.size:
            return can
        pick = movable[can].argmax(axis=1)
        target, source = other[can, pick], src[can, pick]
        # One move a row a round, the first entry naming it (targets have room, sources are full:
        # the two never meet). The first entry with a move wins both its rows, so each round
        # moves at least one (dropping every contested row's moves livelocked pairs of entries).
        won = np.zeros(can.size, bool)
        _, first = np.unique(target, return_index=True)
        won[first] = True
        _, first = np.unique(source, return_index=True)
        second = np.zeros(can.size, bool)
        second[first] = True
        won &= second
        w, pick, target, source = can[won], pick[won], target[won], source[won]
        e = full[w]
        slots[target, room[w, pick].argmax(axis=1)] = res[w, pick] ^ np.uint16(1)
        slots[source, col[pick]] = np.where(source == ga[e], va[e], vb[e])
        left[e] = False
        lost: np.ndarray = full[can[~won]]
        return lost

    def _double(self, p: int) -> None:
        """Doubles table p at once (a snapshot being built, `expect`): see _begin_growth."""
        if p in self._shadow:
            self._grow(p, 0)
        if p in self._fresh:
            self._prepare(p, 0)
        else:
            self._begin_growth(p)
        self._grow(p, 0)

    def _start_growth(self, p: int) -> None:
        """Starts pool p's growth: its new region is zeroed a slice at a time first (mapped
        arena; _prepare), then its entries move (_begin_growth)."""
        if self._map is None:
            self._begin_growth(p)
            return
        self._fresh[p] = (self._alloc_mapped(2 * int(self._nb[p]), zero=False), 0)

    def _prepare(self, p: int, rows: int) -> None:
        """Zeroes the next `rows` rows (all when 0) of pool p's new region; the last slice starts
        the move."""
        base, done = self._fresh[p]
        total = 2 * int(self._nb[p])
        end = total if rows <= 0 else min(total, done + rows)
        self._slots[base + done : base + end] = 0
        if end < total:
            self._fresh[p] = (base, end)
            return
        del self._fresh[p]
        self._begin_growth(p, base)
        aside = self._aside.pop(p, None)
        if aside is not None and aside.size:
            self._count[p] -= aside.size  # counted again as they are placed
            self._bulk(p, *self._locate(p, aside))

    def _begin_growth(self, p: int, base: int | None = None) -> None:
        """Starts doubling pool p's table: its rows become a hidden table of their own (the old
        one), the pool gets a new table of twice the buckets, which new entries go to; `_grow`
        moves the old rows' entries a slice at a time (see the module docstring: one fingerprint
        bit becomes a bucket bit), reads look at both until the last slice. O(1) but for the
        new region's pages."""
        old = self._spare.pop() if self._spare else self._new_table("")
        nb = int(self._nb[p])
        self._base[old], self._nb[old], self._lost[old] = self._base[p], nb, self._lost[p]
        self._count[old] = 0  # the pool counts the entries of both tables
        self._base[p] = self._alloc(2 * nb) if base is None else base
        self._nb[p] = 2 * nb
        self._lost[p] += 1
        self._shadow[p] = old
        self._cursor[p] = 0
        self._doublings += 1

    def _grow(self, p: int, rows: int) -> None:
        """Moves the entries of the next `rows` rows (all when 0) of pool p's old table into its
        new one, emptying them; the old table goes with its last row."""
        old, at = self._shadow[p], self._cursor[p]
        nb, base = int(self._nb[old]), int(self._base[old])
        end = nb if rows <= 0 else min(nb, at + rows)
        region = self._slots[base + at : base + end]
        r, cols = np.nonzero(region)
        val = region[r, cols].astype(np.uint64)
        region[:] = 0
        self._cursor[p] = end
        if val.size:
            fp, alt = val >> np.uint64(1), (val & np.uint64(1)).astype(bool)
            bucket = r.astype(np.int64) + at
            first = np.where(alt, self._alt_rows(nb)[fp] - bucket, bucket)
            first[first < 0] += nb
            b1 = 2 * first + (fp >> np.uint64(FP_BITS - 1)).astype(np.int64)
            fp = (fp << np.uint64(1)) & _FP_MASK
            b1, b2, v = self._finish(p, b1, fp)
            self._count[p] -= val.size  # counted again as they are placed
            self._bulk(p, b1, b2, v)
        if end == nb:
            del self._shadow[p], self._cursor[p]
            self._release(old)
            self._spare.append(old)

    def growing(self) -> bool:
        """Whether a table is growing (`grow_step` moves it on)."""
        return bool(self._shadow or self._fresh)

    def grow_step(self, rows: int) -> bool:
        """Moves about `rows` rows (all when 0) of growing tables' old ones into their new ones
        (the telemetry ingest's steps call it between other work); returns whether any is left."""
        left = rows
        if self._fresh:  # a region to zero first: a slice of it is this step
            p = next(iter(self._fresh))
            self._prepare(p, 0 if rows <= 0 else max(ZERO_ROWS, rows * 8))
            return self.growing()
        while self._shadow and (rows <= 0 or left > 0):
            p = next(iter(self._shadow))
            before = self._cursor[p]
            self._grow(p, left if rows > 0 else 0)
            if p in self._cursor:
                left -= self._cursor[p] - before
            else:
                break  # one table's end a step: its region's release is part of the work
        return self.growing()

    def _fill(self, p: int, keys: np.ndarray) -> None:
        """Replaces pool p's table with one holding `keys` (sized for them, full precision)."""
        h = mix(keys)
        if h.size > 1:
            h = np.sort(h)
            h = h[np.concatenate(([True], h[1:] != h[:-1]))]
        want = max(self._buckets_for(int(h.size)), self._floor[p])
        if (
            int(self._nb[p]) == want
            and not int(self._lost[p])
            and p not in self._shadow
            and p not in self._fresh
        ):
            base = int(self._base[p])
            self._slots[base : base + want] = 0
            self._count[p] = 0
        else:
            if self._nb[p]:
                self._release(p)
            self._base[p] = self._alloc(want)
            self._nb[p] = want
        b1, b2, v = self._locate(p, h)
        self._bulk(p, b1, b2, v)

    # ---- writers -------------------------------------------------------------------------------
    def apply_snapshot(self, source: str, hashes: Iterable[int]) -> None:
        """Replaces the source's pool's whole block set; the source becomes the pool's feeder."""
        self._fold()
        p = self._pool_for(source)
        self._feeder[p] = source
        self._fill(p, _as_keys(hashes))

    def apply_delta(self, source: str, stored: Iterable[int], removed: Iterable[int]) -> None:
        """Logs one batch of 0<->1 transitions of the source's pool (`removed` first, then
        `stored`); skipped unless the source feeds its pool. Folded before the next read."""
        p = self._source_pool.get(source)
        if p is None:
            p = self._pool_for(source)
        feeder = self._feeder[p]
        if feeder is None:
            self._feeder[p] = source
        elif feeder != source:
            self._skipped += len(stored) if isinstance(stored, Sized) else 0
            self._skipped += len(removed) if isinstance(removed, Sized) else 0
            return
        keys = self._log_keys
        before = len(keys)
        keys.extend(removed)
        mid = len(keys)
        keys.extend(stored)
        after = len(keys)
        if after > before:
            self._log_runs.append((p, mid - before, after - mid))
            if after > self.fold_at:
                self._fold()

    @property
    def fold_due(self) -> bool:
        """Whether the deltas logged since the last fold reach PENDING blocks (`fold` them)."""
        return len(self._log_keys) >= PENDING

    @property
    def pending(self) -> bool:
        """Whether deltas are logged and not folded yet."""
        return bool(self._log_keys)

    def fold(self) -> None:
        """Applies the logged deltas now (reads and `apply_delta` past `fold_at` do it anyway)."""
        self._fold()

    def drop_source(self, source: str) -> None:
        """Forgets one source (its stream ended). The pool keeps its set while another of its
        sources is live (replicas carry the same set), which then feeds it; else the set goes.
        A snapshot being built under `source` goes too."""
        self._drop_build(source)
        p = self._source_pool.pop(source, None)
        if p is None:
            return
        self._fold()
        members = self._pool_sources[p]
        members.discard(source)
        if self._feeder[p] == source:
            self._feeder[p] = min(members) if members else None
        if not members and self._nb[p]:
            self._release(p)

    def _fold(self) -> None:
        """Applies the logged deltas to the tables, all pools at once: per (pool, block) its net
        transition (one entry per block stored: two blocks sharing a row and a fingerprint keep
        an entry each, so removing one leaves the other found)."""
        if not self._log_keys:
            return
        keys, runs = self._log_keys, self._log_runs
        self._log_keys, self._log_runs = [], []
        n = len(keys)
        h = mix(np.fromiter(keys, np.uint64, n))
        del keys
        run = np.array(runs, np.int64).reshape(-1, 3)
        lengths = run[:, 1:].ravel()
        pools = np.repeat(np.repeat(run[:, 0], 2), lengths)
        store = np.repeat(np.tile(np.array([False, True]), run.shape[0]), lengths)
        # Per (pool, block) its first and last logged transitions (lexsort is stable: within a
        # run of equal pairs the log's order stays). They alternate, so the block was absent
        # before iff the first is a store: stored then (its last) is a new entry, removed then
        # an entry to take; removed and stored again leaves its entry (stored again unless one
        # is found: a relay never sends it, a caller might); stored and removed, nothing.
        order = np.lexsort((h, pools))
        sp, sh = pools[order], h[order]
        last = np.ones(n, bool)
        last[:-1] = (sp[1:] != sp[:-1]) | (sh[1:] != sh[:-1])
        first = np.ones(n, bool)
        first[1:] = last[:-1]
        pick = order[last]
        stored, was_absent = store[pick], store[order[first]]
        pools, h = pools[pick], h[pick]
        back = np.flatnonzero(stored & ~was_absent)
        if back.size:
            has = self._nb[pools[back]] > 0
            found = np.zeros(back.size, bool)
            found[has] = self._held(pools[back][has], h[back][has])
            was_absent[back] = ~found
        keep = stored == was_absent
        pools, h, store = pools[keep], h[keep], stored[keep]
        live = self._nb[pools] > 0
        # A pool with no table yet (deltas before any snapshot) gets one sized for them.
        for q in np.unique(pools[~live]).tolist():
            want = max(self._buckets_for(int(np.count_nonzero(pools == q))), self._floor[q])
            self._base[q] = self._alloc(want)
            self._nb[q] = want
        gone = ~store
        self._erase(pools[gone], h[gone])
        p, h = pools[store], h[store]
        if not p.size:
            return
        # No probe for a new block: a match is another block's entry (a set of fingerprints, which
        # skipped it, lost it when that other block went: a false negative). Double the pools these inserts would take past MAX_LOAD before placing them.
        written = np.bincount(p, minlength=self._count.size)
        need = self._count + written
        over = np.flatnonzero(need > MAX_LOAD * SLOTS * self._nb)
        for q in over.tolist():
            while int(need[q]) > MAX_LOAD * SLOTS * int(self._nb[q]) and int(self._lost[q]) < MAX_LOST:
                if q in self._fresh:  # its new region is being zeroed: these are set aside
                    aside = self._aside.get(q)
                    if (0 if aside is None else aside.size) + int(written[q]) <= ASIDE and int(
                        need[q]
                    ) <= MAX_LOAD * SLOTS * 2 * int(self._nb[q]):
                        break
                    self._prepare(q, 0)  # a burst (or more than the new table takes): at once
                    continue
                if q in self._shadow:  # a second growth before the first ended: rare, at once
                    self._grow(q, 0)
                self._start_growth(q)
        if self._fresh:  # tables at MAX_LOAD whose new region is being zeroed: set aside
            aside = np.isin(p, np.fromiter(self._fresh, np.int64, len(self._fresh)))
            for q in np.unique(p[aside]).tolist():
                mine = h[p == q]
                self._aside[q] = np.concatenate((self._aside.get(q, mine[:0]), mine))
                self._count[q] += mine.size
            p, h = p[~aside], h[~aside]
        b1, b2, v = self._locate(p, h)
        self._place(p, b1, b2, v)
        # Growths move on with the writes to their pools (and the ingest's steps, grow_step).
        for q in [q for q in self._fresh if written[q]]:
            self._prepare(q, ZERO_ROWS + 8 * GROW_PACE * int(written[q]))
        for q in [q for q in self._shadow if written[q] and q in self._cursor]:
            self._grow(q, GROW_ROWS + GROW_PACE * int(written[q]))

    # ---- readers -------------------------------------------------------------------------------
    def sources(self) -> list[str]:
        """Sources with state in the summary, sorted."""
        return sorted(self._source_pool)

    def pools(self) -> list[str]:
        """Pools with a live source, sorted."""
        return sorted(self._pool_names[p] for p in set(self._source_pool.values()))

    def block_count(self, source: str) -> int:
        """Blocks the source's pool holds (its table's entries; 0 for an unknown source)."""
        p = self._source_pool.get(source)
        if p is None:
            return 0
        self._fold()
        return int(self._count[p])

    def pool_block_count(self, pool: str) -> int:
        """Blocks the pool holds (its table's entries; 0 for an unknown pool)."""
        p = self._pool_ids.get(pool)
        if p is None:
            return 0
        self._fold()
        return int(self._count[p])

    def total_blocks(self) -> int:
        """(pool, block) entries over all pools (not distinct blocks, unlike KvIndex: a block two
        pools hold counts twice)."""
        self._fold()
        return int(self._count[~self._hidden].sum())

    def memory_bytes(self) -> int:
        """Bytes of the arena: every pool's table plus rows given up and not yet reused (mapped
        arena; their whole pages are returned), or the whole array (fallback)."""
        if self._map is not None:
            return (self._top - self._garbage) * _ROW_BYTES
        return int(self._slots.nbytes)

    def table_bytes(self) -> int:
        """Bytes of the live pools' tables alone."""
        return int(self._nb.sum()) * SLOTS * 2

    def stats(self) -> SummaryStats:
        self._fold()
        return SummaryStats(
            pools=int(np.count_nonzero(self._nb[~self._hidden])),
            entries=int(self._count[~self._hidden].sum()),
            table_bytes=self.table_bytes(),
            arena_bytes=self.memory_bytes(),
            skipped_deltas=self._skipped,
            dropped_blocks=self._dropped,
            doublings=self._doublings,
        )

    def _active(self) -> np.ndarray:
        out: np.ndarray = np.flatnonzero((self._count > 0) & ~self._hidden)
        return out

    def _fold_for_read(self) -> None:
        if self.reads_fold:
            self._fold()

    def holds(self, block_hash: int) -> bool:
        """Whether any pool holds this block (up to false positives)."""
        self._fold_for_read()
        pools = self._active()
        if not pools.size:
            return False
        h = mix(np.full(pools.size, block_hash, np.uint64))
        return bool(self._held(pools, h).any())

    def pool_holds(self, pool: str, block_hash: int) -> bool:
        """Whether this pool holds this block (up to false positives)."""
        p = self._pool_ids.get(pool)
        if p is None:
            return False
        self._fold_for_read()
        if not self._count[p]:
            return False
        return bool(self._held(np.array([p]), mix(np.array([block_hash], np.uint64)))[0])

    def pool_prefixes(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Pool -> leading blocks of the prompt it holds (pools with 0 omitted)."""
        pools, lengths = self._prefix_lengths(block_hashes)
        names = self._pool_names
        return {names[p]: n for p, n in zip(pools.tolist(), lengths.tolist(), strict=True) if n}

    def prefix_overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Source -> leading blocks of the prompt its pool holds (sources with 0 omitted): what
        KvIndex.prefix_overlaps answers, every source of a pool getting the pool's length."""
        pools, lengths = self._prefix_lengths(block_hashes)
        members = self._pool_sources
        out: dict[str, int] = {}
        for p, n in zip(pools.tolist(), lengths.tolist(), strict=True):
            if n:
                for source in members[p]:
                    out[source] = n
        return out

    def _prefix_lengths(self, block_hashes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(pools, leading blocks held) for the pools holding the prompt's first block."""
        empty = np.zeros(0, np.int64)
        if not len(block_hashes):
            return empty, empty
        self._fold_for_read()
        pools = self._active()
        if not pools.size:
            return empty, empty
        h = mix(_as_keys(block_hashes))
        total = h.size
        pools = pools[self._held(pools, np.full(pools.size, h[0]))]
        if not pools.size or total == 1:
            return pools, np.ones(pools.size, np.int64)
        probe = _Probe(self, pools, h)  # for the pools holding the first block only
        # Binary search, every pool at once: lo blocks are known held (block lo-1 was), hi is
        # the most it can be; each step probes block mid-1 of every pool. Each step at least
        # halves every pool's hi - lo (total - 1 at the start), so bit_length steps end every
        # search. A pool whose search has ended (lo == hi) probes block lo-1 again, which it
        # holds (its probe said so), so it stays put: cheaper than gathering the pools still
        # searching at every step, which all of them are for all but the last step or two.
        lo = np.ones(pools.size, np.int64)
        hi = np.full(pools.size, total, np.int64)
        for _ in range((total - 1).bit_length()):
            mid = (lo + hi + 1) >> 1
            ok = probe.held_all(mid - 1)
            lo = np.where(ok, mid, lo)
            hi = np.where(ok, hi, mid - 1)
        return pools, self._verify(pools, lo, h, probe)

    def _verify(
        self, pools: np.ndarray, bound: np.ndarray, h: np.ndarray, probe: _Probe | None = None
    ) -> np.ndarray:
        """Checks the search's bounds block by block for the pools with the longest, VERIFY_TOP at
        a time, until VERIFY_TOP checked pools reach the longest unchecked bound."""
        if probe is None:
            probe = _Probe(self, pools, h)
        out = bound.copy()
        order = np.argsort(-bound, kind="stable")
        k = self.verify_top
        done = 0
        while done < order.size:
            batch = order[done : done + k]
            done += batch.size
            need = bound[batch] - 1  # blocks 1 .. bound-1 (block 0 is known held)
            firsts = probe.first_misses(batch, need)
            if firsts is not None:
                out[batch] = np.minimum(bound[batch], firsts)
            elif need.sum():
                owner = np.repeat(np.arange(batch.size), need)
                starts = np.cumsum(need) - need
                block = np.arange(int(need.sum())) - np.repeat(starts, need) + 1
                held = probe.held(batch[owner], block)
                miss = ~held
                # each pool's first miss: the smallest block index among its misses
                firsts = np.full(batch.size, np.iinfo(np.int64).max, np.int64)
                np.minimum.at(firsts, owner[miss], block[miss])
                out[batch] = np.minimum(bound[batch], firsts)
            if done >= order.size:
                break
            if np.count_nonzero(out[order[:done]] >= bound[order[done]]) >= k:
                break
        return out

    def pool_lengths(self, block_hashes: Sequence[int]) -> np.ndarray | None:
        """Per table id (`table_of`), the leading blocks of the prompt its pool holds (0 for pools
        not holding the first block, for builds and empty tables), None when no pool holds the
        first block: what selection.pool_overlaps reads for all pools at once, without a dict
        per source."""
        pools, lengths = self._prefix_lengths(block_hashes)
        if not pools.size:
            return None
        out = np.zeros(len(self._pool_names), np.int64)
        out[pools] = lengths
        return out

    def table_of(self, source: str) -> int:
        """The table id of the pool a source names (pool_of), -1 when there is none yet. Ids are
        never reused for another pool, so a mapping stays right until `table_count` grows."""
        try:
            return self._pool_ids.get(self._pool_of(source), -1)
        except ValueError:  # a key naming no pool (default_pool_of) has no table
            return -1

    def table_count(self) -> int:
        """Pools named so far (grows only)."""
        return len(self._pool_ids)


class _Probe:
    """Membership probes of one prompt's blocks in many pools (the longest-prefix search).

    A block's buckets and slot value depend only on its pool's bucket count and lost bits, and
    a fleet's tables mostly share a few sizes (sized from the same KV capacity): so they are
    worked out once per distinct size for every prompt block, and each probe is a gather. With
    many distinct sizes (more work than probing per element), per element as before."""

    __slots__ = ("_b1", "_b2", "_base", "_flat", "_h", "_one", "_pools", "_s", "_v", "_v2")

    def __init__(self, s: KvSummary, pools: np.ndarray, h: np.ndarray) -> None:
        self._s = s
        self._pools = pools
        self._h = h
        self._base = s._base[pools]
        self._flat: np.ndarray | None = None
        growing = [*s._shadow, *s._aside]
        if growing and np.isin(pools, np.array(growing, np.int64)).any():
            self._one = False
            return  # a growing pool's probes read two tables (KvSummary._held)
        key = s._nb[pools] * 64 + s._lost[pools]
        first = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
        self._one = first.size == 1
        if self._one:  # one size (the usual fleet): no grouping needed
            self._flat = np.zeros(pools.size, np.int64)
            reps = pools[:1]
        else:
            groups, where, inverse = np.unique(key, return_index=True, return_inverse=True)
            # a gather of the precomputed values beats probing per element when there are
            # fewer sizes than probes per pool (about log2(blocks) + the verify)
            if groups.size * h.size > 16 * pools.size:
                self._flat = None
                return
            self._flat = inverse.reshape(-1) * h.size
            reps = pools[where]
        parts = [s._locate(int(p), h) for p in reps.tolist()]
        self._b1 = np.concatenate([b1 for b1, _, _ in parts])
        self._b2 = np.concatenate([b2 for _, b2, _ in parts])
        self._v = np.concatenate([v for _, _, v in parts])
        self._v2 = self._v | np.uint16(1)

    def first_misses(self, i: np.ndarray, need: np.ndarray) -> np.ndarray | None:
        """Per pool i[k], the first of prompt blocks 1 .. need[k] it does not hold (int64 max
        when it holds them all); None unless the pools are all of one size (then the blocks'
        buckets are slices shared by the pools: a pool x block grid without per-probe gathers)."""
        if self._flat is None or np.count_nonzero(self._flat[i] != self._flat[i[0]]):
            return None
        upto = int(need.max()) + 1
        out = np.full(i.size, np.iinfo(np.int64).max, np.int64)
        if upto == 1:
            return out
        g = int(self._flat[i[0]])
        slots = self._s._slots
        base = self._base[i][:, None]
        width = upto - 1
        grid = (
            (np.take(slots, base + self._b1[g + 1 : g + upto], axis=0) == self._v[g + 1 : g + upto][:, None])
            .view(_ROW_WORD)
            .reshape(i.size, width)
        )
        two = (
            (np.take(slots, base + self._b2[g + 1 : g + upto], axis=0) == self._v2[g + 1 : g + upto][:, None])
            .view(_ROW_WORD)
            .reshape(i.size, width)
        )
        miss = ((grid | two) == 0) & (np.arange(1, upto) <= need[:, None])
        any_miss = miss.any(axis=1)
        out[any_miss] = miss[any_miss].argmax(axis=1) + 1
        return out

    def held_all(self, block: np.ndarray) -> np.ndarray:
        """Whether pool k (every one of the pools, in order) holds prompt block block[k]: `held`
        without gathering the pools' own columns."""
        if self._flat is None:
            return self._s._held(self._pools, self._h[block])
        return self._in_rows(self._base, block if self._one else self._flat + block)

    def held(self, i: np.ndarray, block: np.ndarray) -> np.ndarray:
        """Whether pool i[k] (an index into the pools) holds prompt block block[k]."""
        if self._flat is None:
            return self._s._held(self._pools[i], self._h[block])
        return self._in_rows(self._base[i], block if self._one else self._flat[i] + block)

    def _in_rows(self, base: np.ndarray, at: np.ndarray) -> np.ndarray:
        # Each probe's two candidate rows (from its pool's first row `base` and the precomputed
        # buckets `at`), compared slot by slot with its value (the second row's with the flag bit).
        slots = self._s._slots
        one = (np.take(slots, base + self._b1[at], axis=0) == self._v[at][:, None]).view(_ROW_WORD)[:, 0]
        two = (np.take(slots, base + self._b2[at], axis=0) == self._v2[at][:, None]).view(_ROW_WORD)[:, 0]
        out: np.ndarray = (one | two) != 0
        return out

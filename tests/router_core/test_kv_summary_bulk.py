"""KvSummary's bulk placement (snapshots, build steps, doublings): vector passes, same answers."""

from __future__ import annotations

import numpy as np
import pytest

from globalrouter import kv_summary
from globalrouter.kv_summary import KvSummary, mix


def _keys(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**63, n, dtype=np.uint64)


def _table_keys(s: KvSummary, p: int) -> np.ndarray:
    """The (first bucket, slot value in the first bucket) of every entry of table p, sorted: what
    the table answers (a probe matches that pair in whichever of its two rows the entry is)."""
    base, nb = int(s._base[p]), int(s._nb[p])
    region = s._slots[base : base + nb]
    rows, cols = np.nonzero(region)
    val = region[rows, cols]
    fp = (val >> np.uint16(1)).astype(np.uint64)
    alt = (s._alt(fp) % np.uint64(nb)).astype(np.int64)
    first = np.where(val & 1, (alt - rows) % nb, rows)
    return np.sort(first * 65536 + (val & np.uint16(0xFFFE)).astype(np.int64))


def _wanted_keys(s: KvSummary, p: int, hashes: np.ndarray) -> np.ndarray:
    """The same pairs computed from the blocks alone (no table)."""
    h = np.unique(mix(hashes))
    b1, _, v = s._locate(p, h)
    return np.sort(b1 * 65536 + v.astype(np.int64))


class _Rounds:
    """Counts entries sent to _settle's cuckoo rounds (one Python-driven round per hop)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entries = 0
        settle = KvSummary._settle

        def counting(s, p, *rest):
            self.entries += int(p.size)
            return settle(s, p, *rest)

        monkeypatch.setattr(KvSummary, "_settle", counting)


def test_a_snapshot_is_placed_without_cuckoo_rounds(monkeypatch):
    """A 300,000-block snapshot, whole or in the ingest's steps: every entry placed by the vector
    passes, none by _settle's rounds (the base code sent about 9% of them there: half of a
    1,000,000-block snapshot's 210 ms)."""
    rounds = _Rounds(monkeypatch)
    hashes = _keys(300_000, 1)
    s = KvSummary()
    s.apply_snapshot("a/r", hashes)
    s.begin_snapshot("b/r/1#1", hashes.size, "b")
    for at in range(0, hashes.size, 8192):
        s.add_blocks("b/r/1#1", hashes[at : at + 8192])
    s.commit_snapshot("b/r/1#1")
    assert rounds.entries == 0
    for pool in ("a", "b"):
        assert s.pool_block_count(pool) == hashes.size
        p = s._pool_ids[pool]
        assert np.array_equal(_table_keys(s, p), _wanted_keys(s, p, hashes))
    assert s.stats().dropped_blocks == 0


@pytest.mark.parametrize("seed", range(6))
def test_placement_keeps_every_entry_and_the_answers(seed):
    """Randomized: snapshots of random sizes into tables of random fill (a build's steps of random
    sizes, a table sized from a floor far above its blocks, one sized for fewer blocks than it
    gets, so that it doubles), then deltas: the table holds exactly one entry per block, each in
    one of its two rows with the right flag (the multiset of (first bucket, fingerprint) pairs is
    the blocks'), every block is held, and every probe's answer is that multiset's."""
    rng = np.random.default_rng(seed)
    s = KvSummary()
    n = int(rng.integers(1, 60_000))
    hashes = _keys(n, seed + 100)
    source = f"p{seed}/r/1#1"
    s.expect_pool(f"p{seed}", int(rng.integers(0, 3 * n)))
    s.begin_snapshot(source, int(rng.integers(0, n + 1)), f"p{seed}")  # maybe too few: doubles
    at = 0
    while at < n:
        step = int(rng.integers(1, 9000))
        s.add_blocks(source, hashes[at : at + step])
        at += step
    s.commit_snapshot(source)
    p = s._pool_ids[f"p{seed}"]
    assert s.pool_block_count(f"p{seed}") == n
    if not int(s._lost[p]):  # a doubled table's pairs lost a bit: checked by held() below
        assert np.array_equal(_table_keys(s, p), _wanted_keys(s, p, hashes))
    assert s._held(np.full(n, p), mix(hashes)).all()
    more = _keys(int(rng.integers(1, 20_000)), seed + 200)
    gone = hashes[: n // 3]
    s.apply_delta(source, more.tolist(), gone.tolist())
    live = np.concatenate((hashes[n // 3 :], more))
    assert s.pool_block_count(f"p{seed}") == live.size
    assert s._held(np.full(live.size, p), mix(live)).all()
    if not int(s._lost[p]):
        assert np.array_equal(_table_keys(s, p), _wanted_keys(s, p, live))
    probes = mix(_keys(50_000, seed + 300))
    b1, _, v = s._locate(p, probes)
    inside = np.isin(b1 * 65536 + v.astype(np.int64), _table_keys(s, p))
    assert np.array_equal(s._held(np.full(probes.size, p), probes), inside)


def test_a_builds_homeless_entries_wait_and_are_placed_by_commit():
    """A build's step leaves the entries its few _shift passes did not place for the next step:
    they count as entries (the table's load), a doubling or the commit places them, and a
    dropped build forgets them."""
    hashes = _keys(200_000, 7)
    s = KvSummary()
    s.begin_snapshot("w/r/1#1", hashes.size, "w")
    for at in range(0, hashes.size, 4096):
        s.add_blocks("w/r/1#1", hashes[at : at + 4096])
    build = s._staged["w/r/1#1"][0]
    assert build in s._waiting  # a table at 0.75 leaves some for later
    s.commit_snapshot("w/r/1#1")
    assert not s._waiting
    p = s._pool_ids["w"]
    assert np.array_equal(_table_keys(s, p), _wanted_keys(s, p, hashes))
    s.begin_snapshot("w/r/1#2", hashes.size, "w")
    for at in range(0, hashes.size, 4096):
        s.add_blocks("w/r/1#2", hashes[at : at + 4096])
    s.drop_source("w/r/1#2")  # the stream ended mid-build
    assert not s._waiting and not s._staged
    assert s.pool_block_count("w") == hashes.size


def test_the_shift_pass_limit_hands_the_rest_to_the_cuckoo_rounds(monkeypatch):
    """With no _shift pass at all, what _greedy left goes to _place and is still placed."""
    monkeypatch.setattr(kv_summary, "SHIFT_PASSES", 0)
    rounds = _Rounds(monkeypatch)
    hashes = _keys(50_000, 9)
    s = KvSummary()
    s.apply_snapshot("c/r", hashes)
    assert rounds.entries > 0
    p = s._pool_ids["c"]
    assert np.array_equal(_table_keys(s, p), _wanted_keys(s, p, hashes))


def test_a_builds_small_steps_are_gathered_before_they_are_placed(monkeypatch):
    """Steps of 256 blocks (the ingest's smallest, on a busy host) are gathered up to
    BUILD_BATCH blocks before a placement: a placement's cost is mostly fixed."""
    calls: list[int] = []
    insert = KvSummary._insert

    def counting(region, a, *rest):
        calls.append(int(a.size))
        return insert(region, a, *rest)

    monkeypatch.setattr(KvSummary, "_insert", staticmethod(counting))
    hashes = _keys(40_000, 11)
    s = KvSummary()
    s.begin_snapshot("g/r/1#1", hashes.size, "g")
    for at in range(0, hashes.size, 256):
        s.add_blocks("g/r/1#1", hashes[at : at + 256])
    s.commit_snapshot("g/r/1#1")
    # (a placement runs INSERT_PASSES passes of _insert, the later ones over what the first left)
    assert 0 < len(calls) <= (hashes.size // kv_summary.BUILD_BATCH + 2) * kv_summary.INSERT_PASSES
    p = s._pool_ids["g"]
    assert np.array_equal(_table_keys(s, p), _wanted_keys(s, p, hashes))


def _build_in_steps(s: KvSummary, source: str, pool: str, hashes: np.ndarray, step: int) -> list[int]:
    """A build as the ingest's steps run it: slices, then settle_build until it says nothing is
    left, then the commit; returns the work settle_build reported for each of its steps."""
    s.begin_snapshot(source, hashes.size, pool)
    for at in range(0, hashes.size, step):
        s.add_blocks(source, hashes[at : at + step])
    work: list[int] = []
    while done := s.settle_build(source, step):
        work.append(done)
        assert len(work) < 1000
    s.commit_snapshot(source)
    return work


def test_a_builds_waiting_entries_are_placed_in_bounded_steps_before_the_commit(monkeypatch):
    """A 1,000,000-block build leaves entries waiting (rows full when its slice came) up to the
    end; settle_build places them a few _shift passes a step (each step's work about its budget),
    so the commit places none itself (the base code's commit ran all of _bulk's passes over them:
    the longest step of a stepped snapshot)."""
    hashes = _keys(1_000_000, 21)
    s = KvSummary()
    s.begin_snapshot("big/r/1#1", hashes.size, "big")
    for at in range(0, hashes.size, 8192):
        s.add_blocks("big/r/1#1", hashes[at : at + 8192])
    build = s._staged["big/r/1#1"][0]
    waiting = s._waiting[build][0].size
    assert 0 < waiting < kv_summary.SHIFT_AT + 8192
    work = []
    while done := s.settle_build("big/r/1#1", 8192):
        work.append(done)
    assert 1 <= len(work) <= kv_summary.SHIFT_PASSES
    assert max(work) <= 2 * 8192 + 2 * kv_summary.SHIFT_AT  # a pass at least, else about the budget
    assert build not in s._waiting
    placed_by_commit: list[int] = []
    bulk = KvSummary._bulk

    def counting(self, p, b1, *rest):
        placed_by_commit.append(int(b1.size))
        return bulk(self, p, b1, *rest)

    monkeypatch.setattr(KvSummary, "_bulk", counting)
    s.commit_snapshot("big/r/1#1")
    assert placed_by_commit == []
    p = s._pool_ids["big"]
    assert s.pool_block_count("big") == hashes.size
    assert np.array_equal(_table_keys(s, p), _wanted_keys(s, p, hashes))


@pytest.mark.parametrize("seed", range(4))
def test_a_stepped_build_holds_what_a_whole_snapshot_does(seed):
    """Randomized steps and budgets: a build through add_blocks and settle_build holds exactly the
    (first bucket, fingerprint) pairs of the same blocks applied whole (what every probe reads)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400_000))
    hashes = _keys(n, seed + 40)
    stepped, whole = KvSummary(), KvSummary()
    _build_in_steps(stepped, "s/r/1#1", "s", hashes, int(rng.integers(64, 20_000)))
    whole.apply_snapshot("s/r", hashes)
    p, q = stepped._pool_ids["s"], whole._pool_ids["s"]
    assert stepped.pool_block_count("s") == whole.pool_block_count("s") == n
    assert int(stepped._nb[p]) == int(whole._nb[q])
    assert np.array_equal(_table_keys(stepped, p), _table_keys(whole, q))
    assert not stepped._waiting and not stepped._walked


def test_blocks_sharing_a_row_and_a_fingerprint_in_one_slice_get_an_entry_each():
    """Two blocks whose (first bucket, fingerprint) pairs are equal write the same value: _insert
    arbitrates a cell by reading back what stayed, so all but the first of such a run wait for
    _shift's passes; none is lost, none takes another's entry."""
    s = KvSummary()
    s.begin_snapshot("c/r/1#1", 0, "c")  # the smallest table: 64 rows, pairs collide often
    build = s._staged["c/r/1#1"][0]
    keys = _keys(200_000, 5)
    b1, b2, v = s._locate(build, mix(keys))
    pair = b1 * 65536 + v.astype(np.int64)
    order = np.argsort(pair, kind="stable")
    same = np.flatnonzero(pair[order][1:] == pair[order][:-1])
    twins: list[int] = []
    rows: set[int] = set()
    for i in same.tolist():  # 12 pairs of twins, no two pairs sharing a row: they all fit
        x, y = int(order[i]), int(order[i + 1])
        if not {int(b1[x]), int(b2[x])} & rows:
            twins += [x, y]
            rows |= {int(b1[x]), int(b2[x])}
        if len(twins) == 24:
            break
    chosen = keys[np.array(twins)]
    assert np.unique(pair[twins]).size == 12
    s.add_blocks("c/r/1#1", chosen)
    s.commit_snapshot("c/r/1#1")
    p = s._pool_ids["c"]
    assert s.pool_block_count("c") == chosen.size
    assert np.array_equal(_table_keys(s, p), _wanted_keys(s, p, chosen))
    s.apply_delta("c/r/1#1", (), chosen[:1].tolist())  # one of a pair goes: the other is held
    assert s.pool_block_count("c") == chosen.size - 1
    assert s._held(np.full(chosen.size - 1, p), mix(chosen[1:])).all()


@pytest.mark.parametrize("lost", [0, 1, 3])
def test_the_builds_narrow_locate_gives_locates_values(lost):
    """A build's step locates its slice in int32 buckets and uint16 fingerprints (_locate_narrow):
    the same first bucket, second bucket and slot value as _locate, lost fingerprint bits too."""
    s = KvSummary()
    s.begin_snapshot("n/r/1#1", 3_000_000, "n")
    build = s._staged["n/r/1#1"][0]
    s._lost[build] = lost
    h = mix(_keys(200_000, 31 + lost))
    h[:3] = [0, 2**64 - 1, 2**63]  # the ends of the product's range
    wide = s._locate(build, h)
    narrow = s._locate_narrow(build, h)
    assert narrow[0].dtype == np.int32 and narrow[2].dtype == np.uint16
    for x, y in zip(wide, narrow, strict=True):
        assert np.array_equal(x, y)


def test_a_builds_steps_leave_few_entries_to_the_shift_passes(monkeypatch):
    """A build's step runs a second lean _insert pass over what its first left (most of it lost a
    cell to another entry of the same pass, its other row free): _shift's passes, a few dozen
    numpy calls each, placed 12% of a 100,000-block snapshot's entries at twice the cost of the
    rest of the build. The build holds every block all the same."""
    blocks = 100_000
    handed: list[int] = []
    shift = KvSummary._shift

    def counting(self, region, a, b, v, passes, seed=0):
        if passes == kv_summary.CARRY_PASSES:  # a step's hand-over (settle_build's own passes not counted)
            handed.append(a.size)
        return shift(self, region, a, b, v, passes, seed)

    monkeypatch.setattr(KvSummary, "_shift", counting)
    s = KvSummary()
    keys = _keys(blocks, 11)
    s.begin_snapshot("p/a#1", blocks, "p")
    t = s._staged["p/a#1"][0]
    s.add_blocks("p/a#1", keys[: kv_summary.BUILD_BATCH])
    first = s._waiting.get(t)
    assert first is None or first[0].size <= kv_summary.BUILD_BATCH // 100  # 1; was 485 of 8,192
    for at in range(kv_summary.BUILD_BATCH, blocks, kv_summary.BUILD_BATCH):
        s.add_blocks("p/a#1", keys[at : at + kv_summary.BUILD_BATCH])
    while s.settle_build("p/a#1", 8192):
        pass
    s.commit_snapshot("p/a#1")
    left = s._waiting.get(t)
    assert sum(handed) + (0 if left is None else left[0].size) <= blocks // 12  # 5,793; was 11,771
    assert s.pool_block_count("p") == blocks
    assert all(s.pool_holds("p", int(k)) for k in keys[::97])


@pytest.mark.parametrize("seed", [3, 4])
def test_a_builds_last_homeless_entries_are_walked_one_at_a_time(monkeypatch, seed):
    """The last few hundred homeless entries of a build took eight _shift calls of three passes
    (0.3-0.6 ms each, whatever their size): at most WALK_AT of them are placed one at a time by a
    cuckoo walk instead, and the table answers as a whole snapshot's would."""
    sizes: list[int] = []
    shift = KvSummary._shift

    def counting(self, region, a, b, v, passes, seed=0):
        sizes.append(a.size)
        return shift(self, region, a, b, v, passes, seed)

    monkeypatch.setattr(KvSummary, "_shift", counting)
    blocks = 100_000
    hashes = _keys(blocks, seed)
    s = KvSummary()
    work = _build_in_steps(s, "p/a#1", "p", hashes, 8192)
    assert work and min(sizes) > getattr(kv_summary, "WALK_AT", 128)  # (the base code: down to 2)
    p = s._pool_ids["p"]
    assert np.array_equal(_table_keys(s, p), _wanted_keys(s, p, hashes))
    assert s.pool_block_count("p") == blocks and s._dropped == 0


def test_a_walk_that_finds_no_room_leaves_the_entry_for_the_commit():
    """A full table: every walk ends after WALK_KICKS evictions with an entry (the last one evicted)
    still homeless, which the commit's bulk placement then takes (here: a doubling)."""
    s = KvSummary()
    s.begin_snapshot("p/a#1", 100, "p")
    t = s._staged["p/a#1"][0]
    base, nb = int(s._base[t]), int(s._nb[t])
    region = s._slots[base : base + nb]
    region[:] = np.arange(1, 2 * nb + 1, dtype=np.uint16).reshape(nb, 2) << np.uint16(1)  # all full
    before = np.sort(region.reshape(-1))
    a, b, v = np.array([0], np.int32), np.array([1], np.int32), np.array([4242 << 1], np.uint16)
    left = s._walk(region, a, b, v)
    assert left[0].size == 1
    after = np.sort(np.append(region.reshape(-1) & np.uint16(0xFFFE), left[2]))
    assert np.array_equal(np.sort(np.append(before, np.uint16(4242 << 1))), after)  # one entry out, one in

"""Pool-level block counting across workers: only 0↔1 transitions, snapshot + numbered deltas."""

from __future__ import annotations

from poolrelay.pool_blocks import PoolBlocks


def test_block_held_by_two_workers_removed_from_one_stays():
    b = PoolBlocks()
    b.apply_event("w1", stored=[1, 2])
    b.apply_event("w2", stored=[2, 3])
    d = b.take_delta()
    assert d is not None and sorted(d.stored) == [1, 2, 3] and d.removed == []
    b.apply_event("w1", removed=[2])
    assert 2 in b
    assert b.take_delta() is None, "no pool-level transition: w2 still holds block 2"
    b.apply_event("w2", removed=[2])
    d = b.take_delta()
    assert d is not None and d.removed == [2] and d.stored == []
    assert 2 not in b


def test_removed_from_both_in_one_batch_publishes_exactly_one_removal():
    b = PoolBlocks()
    b.apply_event("w1", stored=[7])
    b.apply_event("w2", stored=[7])
    b.take_delta()
    b.apply_event("w1", removed=[7])
    b.apply_event("w2", removed=[7])
    b.apply_event("w2", removed=[7])  # a repeated removal changes nothing
    d = b.take_delta()
    assert d is not None and d.removed == [7] and d.stored == []
    assert b.take_delta() is None


def test_store_then_remove_within_a_batch_is_not_published():
    b = PoolBlocks()
    b.apply_event("w1", stored=[5])
    b.apply_event("w1", removed=[5])
    assert b.take_delta() is None
    assert b.sequence == 0


def test_snapshot_and_delta_numbering():
    b = PoolBlocks()
    b.apply_event("w1", stored=[1])
    assert b.take_delta().sequence == 1
    b.apply_event("w1", stored=[2])
    assert b.take_delta().sequence == 2
    seq, blocks = b.snapshot()
    assert seq == 2 and sorted(blocks) == [1, 2]
    b.apply_event("w2", stored=[3])
    assert b.take_delta().sequence == 3, "the first delta after a snapshot is its sequence + 1"


def test_worker_snapshot_replaces_that_workers_set_with_net_transitions():
    b = PoolBlocks()
    b.apply_snapshot("w1", [1, 2, 3])
    b.apply_snapshot("w2", [3, 4])
    b.take_delta()
    b.apply_snapshot("w1", [2, 3, 5])  # 1 gone (pool-level), 3 still held by w2 anyway, 5 new
    d = b.take_delta()
    assert sorted(d.stored) == [5] and sorted(d.removed) == [1]
    assert b.worker_blocks("w1") == {2, 3, 5}


def test_cleared_event_applies_before_stored():
    b = PoolBlocks()
    b.apply_event("w1", stored=[1, 2])
    b.apply_event("w2", stored=[2])
    b.take_delta()
    b.apply_event("w1", stored=[9], cleared=True)
    d = b.take_delta()
    assert sorted(d.stored) == [9] and sorted(d.removed) == [1]
    assert b.worker_blocks("w1") == {9}


def test_resubscribe_drops_workers_without_a_fresh_snapshot():
    b = PoolBlocks()
    b.apply_snapshot("w1", [1, 2])
    b.apply_snapshot("w2", [2, 3])
    b.take_delta()
    b.begin_resync()
    b.apply_snapshot("w1", [1, 2])
    b.end_resync()  # w2 sent nothing: it left the pool
    d = b.take_delta()
    assert d.stored == [] and sorted(d.removed) == [3]
    assert b.workers == ["w1"]

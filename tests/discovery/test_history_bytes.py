"""The watch history is bounded by bytes: large pool records that left are not kept past the
bound (issue 18: 400 pools of ~243 KB raised discovery by 103 MB, kept after they left), and a
resume from before what is kept gets a fresh snapshot."""

from __future__ import annotations

import gc
import tracemalloc

from globaldiscovery.lease_state import Directory
from globaldiscovery.records import EventKind, Removal
from globaldiscovery.watch_fanout import WatcherClosed
from tests.discovery.helpers import reg

BOUND = 2 * 1024 * 1024
POOLS = 60
URL_CHARS = 2_000  # 64 of them: a ~130 KB registration, as a relay with 64 long frontend URLs sends


def big_registration(i: int):
    frontends = tuple(f"http://h{i}-{j}.example:8000/{'x' * URL_CHARS}"[: URL_CHARS + 40] for j in range(64))
    return reg(f"big-{i:03d}", relay="r1", frontends=frontends)


def directory() -> Directory:
    return Directory(15.0, started_at=0.0, wall_offset=1e9, watch_history_bytes=BOUND)


def test_history_of_pools_that_left_holds_no_more_than_its_byte_bound():
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        d = directory()
        for i in range(POOLS):
            registration = big_registration(i)
            d.register_pool(registration, 1.0)
            d.unregister_pool(registration.pool_id, "r1", 1, Removal.UNREGISTERED, 1.0)
            del registration
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert d.history_bytes <= BOUND
    # What the records really hold stays within the bound (and some slack for the directory
    # itself): ~7.8 MB of them were kept before.
    assert retained < BOUND + 512 * 1024, f"{retained / 1e6:.1f} MB retained"


def test_a_resume_from_before_the_kept_history_gets_a_snapshot_and_a_recent_one_resumes():
    d = directory()
    d.register_pool(reg("small", relay="r1"), 1.0)
    oldest = d.revision
    for i in range(POOLS):
        registration = big_registration(i)
        d.register_pool(registration, 1.0)
        d.unregister_pool(registration.pool_id, "r1", 1, Removal.UNREGISTERED, 1.0)
    assert not d.can_resume(oldest)
    stale = d.watch(2.0, start_revision=oldest)
    first = stale._events[0]
    assert first.kind is EventKind.ADDED and first.pool is not None and first.pool.pool_id == "small"
    marker = stale._events[1]
    assert marker.kind is EventKind.SNAPSHOT_DONE and not marker.resumed

    recent = d.revision
    d.register_pool(reg("late", relay="r1"), 3.0)
    resumed = d.watch(3.0, start_revision=recent)
    events = list(resumed._events)
    assert [e.kind for e in events] == [EventKind.SNAPSHOT_DONE, EventKind.ADDED]
    assert events[0].resumed and events[1].pool is not None and events[1].pool.pool_id == "late"


def test_a_replayed_event_does_not_leave_its_encoded_message_in_the_history():
    from globaldiscovery import convert

    d = directory()
    start = d.revision
    d.register_pool(reg("p", relay="r1"), 1.0)
    for event in list(d.watch(2.0, start_revision=start)._events):
        convert.watch_event(event)  # the gRPC layer caches each event's message on it
    assert all(event.encoded is None for event in d._history)


async def test_a_watcher_that_falls_behind_by_bytes_is_closed_and_one_that_reads_is_not():
    """A slow watcher would keep every unread record alive after the history let it go: its
    queue is bounded by bytes too (closed with OVERFLOW, the stream ends RESOURCE_EXHAUSTED)."""
    d = Directory(15.0, started_at=0.0, wall_offset=1e9, watch_queue_bytes=BOUND, watch_history_bytes=BOUND)
    slow = d.watch(1.0)
    reader = d.watch(1.0)
    while reader.pending():  # its snapshot
        await reader.next()
    for i in range(POOLS):
        registration = big_registration(i)
        d.register_pool(registration, 1.0)
        d.unregister_pool(registration.pool_id, "r1", 1, Removal.UNREGISTERED, 1.0)
        while reader.pending():  # this one keeps up
            await reader.next()
    assert slow.closed is WatcherClosed.OVERFLOW and slow not in d.watchers
    assert reader.closed is None and reader in d.watchers

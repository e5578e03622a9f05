"""Lease table and directory logic on explicit monotonic times (FakeClock): no gRPC, no sleeps."""

from __future__ import annotations

import random

import pytest

from globaldiscovery.lease_rules import DrainCompleted, ModelConflict, NotFound, StaleIncarnation
from globaldiscovery.lease_state import Directory
from globaldiscovery.lease_table import LeaseTable
from globaldiscovery.records import EventKind, PoolEvent, Removal
from globaldiscovery.watch_fanout import Watcher, WatcherClosed
from meshkit.clock import FakeClock
from tests.discovery.helpers import reg

LEASE = 15.0
HEARTBEAT = 5.0


def directory(clock: FakeClock, **kw) -> Directory:
    return Directory(LEASE, started_at=clock.monotonic(), wall_offset=clock.wall() - clock.monotonic(), **kw)


def drain(watcher: Watcher) -> list[PoolEvent]:
    events = []
    while watcher.pending():
        events.append(watcher._events.popleft())
    return events


def kinds(events: list[PoolEvent]) -> list[tuple[EventKind, str | None, Removal]]:
    return [(e.kind, e.pool.pool_id if e.pool else None, e.reason) for e in events]


def listed(d: Directory, now: float) -> list[str]:
    return [p.pool_id for p in d.list_pools(now, limit=1000)[0]]


# ----- the lease table -----


def test_lease_table_keeps_deadline_order_and_never_expires_early(fake_clock):
    table: LeaseTable[str, None] = LeaseTable(LEASE)
    t0 = fake_clock.monotonic()
    table.grant("a", 1, None, t0)
    table.grant("b", 1, None, t0 + 1)
    table.grant("a", 1, None, t0 + 2)  # renewal moves "a" behind "b"
    assert table.next_deadline() == t0 + 1 + LEASE
    assert table.expire_due(t0 + 1 + LEASE - 1e-6) == []
    assert [lease.key for lease in table.expire_due(t0 + 1 + LEASE)] == ["b"]
    assert table.expire_due(t0 + 2 + LEASE - 1e-6) == []
    assert [lease.key for lease in table.expire_due(t0 + 2 + LEASE)] == ["a"]
    assert table.next_deadline() is None


def test_lease_table_incarnations(fake_clock):
    table: LeaseTable[str, str] = LeaseTable(LEASE)
    now = fake_clock.monotonic()
    table.grant("a", 5, "v5", now)
    with pytest.raises(StaleIncarnation):
        table.grant("a", 4, "v4", now)
    assert table.get("a").value == "v5"
    table.grant("a", 6, "v6", now)  # a restarted holder takes over
    assert table.get("a").incarnation == 6
    with pytest.raises(StaleIncarnation):
        table.end("a", 5)
    assert table.end("a", 6) is not None
    assert table.end("a", 6) is None  # idempotent


# ----- pools: expiry -----


def test_pool_never_expires_early_and_is_gone_at_its_deadline(fake_clock):
    d = directory(fake_clock)
    t0 = fake_clock.monotonic()
    result = d.register_pool(reg(), t0)
    assert result.lease_expire_wall == d.wall(t0 + LEASE)
    assert listed(d, t0 + LEASE - 1e-6) == ["p1"]
    assert d.next_deadline() == t0 + LEASE
    assert listed(d, t0 + LEASE) == []


def test_renewal_under_jitter_keeps_pool_alive_for_many_leases(fake_clock):
    d = directory(fake_clock)
    w = d.watch(fake_clock.monotonic())
    rng = random.Random(7)
    now = fake_clock.monotonic()
    d.register_pool(reg(), now)
    for _ in range(200):  # 200 heartbeats ≈ 67 leases
        # Renewals come late by up to 60% of the heartbeat: still well inside the lease.
        now += HEARTBEAT * (1 + rng.uniform(-0.3, 0.6))
        d.advance(now)
        assert listed(d, now) == ["p1"]
        d.register_pool(reg(), now)
    # One ADDED and nothing else: renewals that change nothing visible send no events.
    assert [e.kind for e in drain(w)] == [EventKind.SNAPSHOT_DONE, EventKind.ADDED]


def test_renewals_send_no_events_and_expiry_sends_exactly_one_removal(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    w = d.watch(now)
    assert kinds(drain(w)) == [(EventKind.SNAPSHOT_DONE, None, Removal.UNSPECIFIED)]
    d.register_pool(reg(), now)
    for _ in range(10):
        now += HEARTBEAT
        d.register_pool(reg(), now)
    assert kinds(drain(w)) == [(EventKind.ADDED, "p1", Removal.UNSPECIFIED)]
    for _ in range(5):  # expiry applied again and again: still one removal
        now += LEASE
        d.advance(now)
    assert kinds(drain(w)) == [(EventKind.REMOVED, "p1", Removal.LEASE_EXPIRED)]


def test_two_relay_replicas_expire_independently_and_frontends_are_the_union(fake_clock):
    d = directory(fake_clock)
    t0 = fake_clock.monotonic()
    w = d.watch(t0)
    drain(w)
    d.register_pool(reg(relay="r1", frontends=("http://a:1", "http://b:1")), t0)
    d.register_pool(reg(relay="r2", frontends=("http://c:1", "http://a:1")), t0 + 5)
    pool = d.get_pool("p1", t0 + 5)
    assert pool.frontends == ("http://a:1", "http://b:1", "http://c:1")
    assert [lease.relay_id for lease in pool.leases] == ["r1", "r2"]
    # r1 stops renewing: its lease ends on its own, r2's keeps the pool listed.
    pool = d.get_pool("p1", t0 + LEASE)
    assert pool is not None and [lease.relay_id for lease in pool.leases] == ["r2"]
    assert pool.frontends == ("http://a:1", "http://c:1")
    assert d.get_pool("p1", t0 + 5 + LEASE) is None
    assert [e.kind for e in drain(w)] == [
        EventKind.ADDED,
        EventKind.UPDATED,
        EventKind.UPDATED,
        EventKind.REMOVED,
    ]


def test_unregister_is_immediate_and_idempotent(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    w = d.watch(now)
    drain(w)
    d.register_pool(reg(relay="r1"), now)
    d.register_pool(reg(relay="r2"), now)
    assert d.unregister_pool("p1", "r1", 1, Removal.UNREGISTERED, now) is False
    assert listed(d, now) == ["p1"]
    assert d.unregister_pool("p1", "r2", 1, Removal.UNREGISTERED, now) is True
    assert listed(d, now) == []
    assert d.unregister_pool("p1", "r2", 1, Removal.UNREGISTERED, now) is False
    assert kinds(drain(w))[-1] == (EventKind.REMOVED, "p1", Removal.UNREGISTERED)


def test_incarnation_takeover_and_permission_denied(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    d.register_pool(reg(inc=10), now)
    d.register_pool(reg(inc=11, frontends=("http://new:1",)), now + 1)  # restarted relay takes over
    assert d.get_pool("p1", now + 1).leases[0].incarnation == 11
    with pytest.raises(StaleIncarnation):
        d.register_pool(reg(inc=10), now + 2)
    with pytest.raises(StaleIncarnation):
        d.unregister_pool("p1", "r1", 10, Removal.UNREGISTERED, now + 2)
    assert d.get_pool("p1", now + 2).frontends == ("http://new:1",)


def test_model_conflict_ends_callers_own_lease_and_replicas_converge(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    d.register_pool(reg(relay="r1", model="m1"), now)
    d.register_pool(reg(relay="r2", model="m1"), now)
    # r1 moves to m2 first: refused while r2 still names m1, and r1's own m1 lease ends.
    with pytest.raises(ModelConflict):
        d.register_pool(reg(relay="r1", model="m2"), now + 1)
    pool = d.get_pool("p1", now + 1)
    assert [lease.relay_id for lease in pool.leases] == ["r2"] and pool.model == "m1"
    # r2 moves too (no other lease left to conflict with), then r1's next heartbeat joins.
    d.register_pool(reg(relay="r2", model="m2"), now + 2)
    d.register_pool(reg(relay="r1", model="m2"), now + 3)
    pool = d.get_pool("p1", now + 3)
    assert pool.model == "m2" and [lease.relay_id for lease in pool.leases] == ["r1", "r2"]
    with pytest.raises(ModelConflict):
        d.register_pool(reg(relay="r3", model="m2", region="us"), now + 4)


def test_a_lone_relay_may_change_the_model(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    d.register_pool(reg(model="m1"), now)
    assert d.register_pool(reg(model="m2"), now + 1).pool.model == "m2"


# ----- drain -----


def test_operator_drain_marks_pool_then_removes_it_and_refuses_that_incarnation(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    w = d.watch(now)
    drain(w)
    d.register_pool(reg(inc=3), now)
    view = d.drain_pool("p1", 30.0, now + 1)
    assert view.draining and view.drain_deadline_wall == d.wall(now + 31)
    # A second drain keeps the earlier deadline.
    assert d.drain_pool("p1", 100.0, now + 2).drain_deadline_wall == d.wall(now + 31)
    result = d.register_pool(reg(inc=3), now + 5)
    assert result.drain_requested and result.drain_deadline_wall == d.wall(now + 31)
    for t in (10, 15, 20, 25, 30):
        d.register_pool(reg(inc=3), now + t)
    assert d.next_deadline() == now + 31  # the drain ends before the renewed lease
    assert listed(d, now + 31 - 1e-6) == ["p1"]
    d.advance(now + 31)
    assert listed(d, now + 31) == []
    assert kinds(drain(w)) == [
        (EventKind.ADDED, "p1", Removal.UNSPECIFIED),
        (EventKind.UPDATED, "p1", Removal.UNSPECIFIED),
        (EventKind.REMOVED, "p1", Removal.DRAINED),
    ]
    with pytest.raises(DrainCompleted):
        d.register_pool(reg(inc=3), now + 32)
    d.register_pool(reg(inc=4), now + 33)  # a restarted relay may register again
    assert listed(d, now + 33) == ["p1"] and not d.get_pool("p1", now + 33).draining


def test_relay_side_drain_marks_pool_draining(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    d.register_pool(reg(relay="r1"), now)
    d.register_pool(reg(relay="r2", draining=True, drain_deadline_wall=d.wall(now + 60)), now)
    pool = d.get_pool("p1", now)
    assert pool.draining and pool.drain_deadline_wall == d.wall(now + 60)
    assert [lease.draining for lease in pool.leases] == [False, True]


def test_drain_and_remove_of_unknown_pool_are_not_found(fake_clock):
    d = directory(fake_clock)
    with pytest.raises(NotFound):
        d.drain_pool("nope", 5.0, fake_clock.monotonic())
    with pytest.raises(NotFound):
        d.remove_pool("nope", fake_clock.monotonic())


def test_remove_pool_ends_every_lease(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    w = d.watch(now)
    drain(w)
    d.register_pool(reg(relay="r1"), now)
    d.register_pool(reg(relay="r2"), now)
    d.remove_pool("p1", now)
    assert listed(d, now) == [] and d.next_deadline() is None
    assert kinds(drain(w))[-1] == (EventKind.REMOVED, "p1", Removal.REMOVED)


# ----- listing, completeness, watchers -----


def test_listing_is_incomplete_for_one_lease_after_start(fake_clock):
    d = directory(fake_clock)
    t0 = fake_clock.monotonic()
    assert not d.complete(t0) and not d.complete(t0 + LEASE - 0.01) and d.complete(t0 + LEASE)


def test_pages_are_ordered_and_filtered(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    for i in range(25):
        d.register_pool(reg(pool=f"p{i:02d}", model="even" if i % 2 == 0 else "odd"), now)
    page, more = d.list_pools(now, model="even", limit=5)
    assert [p.pool_id for p in page] == ["p00", "p02", "p04", "p06", "p08"] and more
    page, more = d.list_pools(now, model="even", after="p08", limit=5)
    assert [p.pool_id for p in page] == ["p10", "p12", "p14", "p16", "p18"] and more
    page, more = d.list_pools(now, model="even", after="p18", limit=5)
    assert [p.pool_id for p in page] == ["p20", "p22", "p24"] and not more


def test_filtered_watcher_sees_removed_when_pool_stops_matching(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    w = d.watch(now, model="m1")
    drain(w)
    d.register_pool(reg(model="m1"), now)
    d.register_pool(reg(pool="other", model="m2"), now)
    d.register_pool(reg(model="m2"), now + 1)  # the lone relay moves p1 to m2
    assert [e.kind for e in drain(w)] == [EventKind.ADDED, EventKind.REMOVED]
    d.register_pool(reg(model="m1"), now + 2)
    assert [e.kind for e in drain(w)] == [EventKind.ADDED]


def test_watcher_that_falls_behind_is_closed_without_blocking(fake_clock):
    d = directory(fake_clock, watch_queue_limit=3)
    now = fake_clock.monotonic()
    slow = d.watch(now)
    for i in range(10):
        d.register_pool(reg(pool=f"p{i}"), now)
    assert slow.closed is WatcherClosed.OVERFLOW and slow not in d.watchers
    assert len(listed(d, now)) == 10


def test_snapshot_lists_current_pools_then_done(fake_clock):
    d = directory(fake_clock)
    now = fake_clock.monotonic()
    d.register_pool(reg(pool="b"), now)
    d.register_pool(reg(pool="a"), now)
    w = d.watch(now + LEASE / 2)
    events = drain(w)
    assert [e.kind for e in events] == [EventKind.ADDED, EventKind.ADDED, EventKind.SNAPSHOT_DONE]
    assert [e.pool.pool_id for e in events[:2]] == ["a", "b"] and events[2].complete is False

"""One suite, both stores: the lease rules hold alike in memory and through a real etcd.

Each test runs against MemoryStore and EtcdStore (an etcd started on free ports), both timed by a
FakeClock, so drains end when the test moves the clock; etcd's own lease TTL is set far beyond
any test's length, so no lease lapses in real time while a test runs.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from globaldiscovery.lease_rules import DrainCompleted, ModelConflict, NotFound, StaleIncarnation
from globaldiscovery.records import EventKind, PoolEvent, Removal
from globaldiscovery.store import MemoryStore, Store, StoreUnavailable
from meshkit.clock import FakeClock
from tests.discovery.etcd_support import wipe_discovery_keys
from tests.discovery.helpers import reg

pytestmark = pytest.mark.timeout(90)

LEASE = 600.0
HISTORY = 4  # events each store keeps for resumed watches (small, so a test can outrun it)
WAIT = 20.0  # the longest any awaited state may take (etcd under load), never slept for


@pytest.fixture(params=["memory", "etcd"])
async def store(request):
    """A started store of each kind on a FakeClock (`store.clock`), closed at the end."""
    clock = FakeClock()
    s: Store
    if request.param == "memory":
        s = MemoryStore(clock, heartbeat_interval=1.0, lease_duration=LEASE, watch_history_limit=HISTORY)
    else:
        from globaldiscovery.store.etcd import EtcdStore

        endpoint = request.getfixturevalue("etcd")
        await wipe_discovery_keys(endpoint)
        s = EtcdStore(
            clock,
            endpoint=endpoint,
            heartbeat_interval=1.0,
            lease_duration=LEASE,
            watch_history_limit=HISTORY,
        )
    await s.start()
    try:
        yield s
    finally:
        await s.close()


async def listed(store, **filters) -> list[str]:
    pools, _, _ = await store.list_pools(
        model=filters.get("model", ""), region=filters.get("region", ""), after=None, limit=1000
    )
    return [p.pool_id for p in pools]


async def next_event(watcher, kind: EventKind):
    """The next event of `kind` (others are skipped); fails when none comes within WAIT."""
    while True:
        event = await asyncio.wait_for(watcher.next(), WAIT)
        assert event is not None, "the watcher ended"
        if event.kind is kind:
            return event


async def test_registration_renewal_and_the_merge_of_replicas(store):
    first = await store.register_pool(reg("p", relay="r1", frontends=("http://a:1",)))
    again = await store.register_pool(reg("p", relay="r1", frontends=("http://a:1",)))
    assert [lease.relay_id for lease in again.pool.leases] == ["r1"]
    assert again.lease_expire_wall >= first.lease_expire_wall
    both = await store.register_pool(reg("p", relay="r2", frontends=("http://b:1",)))
    assert [lease.relay_id for lease in both.pool.leases] == ["r1", "r2"]
    assert both.pool.frontends == ("http://a:1", "http://b:1")
    assert await listed(store) == ["p"]
    assert await listed(store, model="other") == []


async def test_only_the_holding_or_a_newer_incarnation_renews_or_ends_a_lease(store):
    await store.register_pool(reg("p", inc=5))
    with pytest.raises(StaleIncarnation):
        await store.register_pool(reg("p", inc=4))
    with pytest.raises(StaleIncarnation):
        await store.unregister_pool("p", "r1", 4, Removal.UNREGISTERED)
    taken = await store.register_pool(reg("p", inc=6))  # a restarted relay takes the lease over
    assert [lease.incarnation for lease in taken.pool.leases] == [6]
    assert await store.unregister_pool("p", "r1", 6, Removal.UNREGISTERED) is True
    assert await store.unregister_pool("p", "r1", 6, Removal.UNREGISTERED) is False  # idempotent
    assert await listed(store) == []


async def test_a_model_conflict_ends_the_callers_own_lease(store):
    await store.register_pool(reg("p", relay="r1", model="m"))
    await store.register_pool(reg("p", relay="r2", model="m"))
    with pytest.raises(ModelConflict):
        await store.register_pool(reg("p", relay="r2", model="other"))
    pools, _, _ = await store.list_pools(model="", region="", after=None, limit=10)
    assert [lease.relay_id for lease in pools[0].leases] == ["r1"]
    with pytest.raises(ModelConflict):
        await store.register_pool(reg("p", relay="r3", model="m", region="us"))  # region counts too
    # A lone relay may move its pool to another model.
    await store.register_pool(reg("q", model="m"))
    moved = await store.register_pool(reg("q", model="n"))
    assert moved.pool.model == "n"


async def test_drain_keeps_the_first_deadline_then_removes_and_refuses_that_incarnation(store):
    clock = store.clock
    await store.register_pool(reg("p", inc=3))
    watcher = await store.watch(model="", region="")
    await next_event(watcher, EventKind.SNAPSHOT_DONE)
    view = await store.drain_pool("p", 5.0)
    assert view.draining and view.drain_deadline_wall == pytest.approx(clock.wall() + 5.0)
    again = await store.drain_pool("p", 100.0)
    assert again.drain_deadline_wall == view.drain_deadline_wall  # the earlier deadline is kept
    renewal = await store.register_pool(reg("p", inc=3))
    assert renewal.drain_requested and renewal.drain_deadline_wall == view.drain_deadline_wall
    await clock.advance(5.0)
    removed = await next_event(watcher, EventKind.REMOVED)
    assert removed.pool.pool_id == "p" and removed.reason is Removal.DRAINED

    deadline = time.monotonic() + WAIT
    while True:  # the etcd store records the refusal just after the pool leaves: wait for it
        try:
            await store.register_pool(reg("p", inc=3))
        except DrainCompleted:
            break
        except (StoreUnavailable, NotFound):
            pass  # raced with the drained lease being deleted; a relay retries
        else:
            await store.unregister_pool("p", "r1", 3, Removal.UNREGISTERED)
        assert time.monotonic() < deadline, "the drained incarnation was not refused"
        await asyncio.sleep(0.05)  # poll interval of a wait on state, not a wait for time
    restarted = await store.register_pool(reg("p", inc=4))  # a restarted relay may
    assert not restarted.pool.draining


async def test_operator_actions_on_an_unknown_pool_are_not_found(store):
    with pytest.raises(NotFound):
        await store.drain_pool("nope", 5.0)
    with pytest.raises(NotFound):
        await store.remove_pool("nope")


async def test_remove_ends_every_lease_and_watchers_hear_why(store):
    await store.register_pool(reg("p", relay="r1"))
    await store.register_pool(reg("p", relay="r2"))
    watcher = await store.watch(model="", region="")
    await next_event(watcher, EventKind.SNAPSHOT_DONE)
    removed_view = await store.remove_pool("p")
    assert [lease.relay_id for lease in removed_view.leases] == ["r1", "r2"]
    event = await next_event(watcher, EventKind.REMOVED)
    assert event.reason is Removal.REMOVED
    assert await listed(store) == []


async def test_unregister_reports_its_reason_to_watchers(store):
    await store.register_pool(reg("p"))
    watcher = await store.watch(model="m", region="")
    assert (await next_event(watcher, EventKind.ADDED)).pool.pool_id == "p"
    await store.unregister_pool("p", "r1", 1, Removal.DRAINED)
    assert (await next_event(watcher, EventKind.REMOVED)).reason is Removal.DRAINED


async def test_frontend_leases_follow_the_same_incarnation_rule(store):
    await store.register_frontend("f1", "http://f1:80", "eu", 2)
    with pytest.raises(StaleIncarnation):
        await store.register_frontend("f1", "http://f1:80", "eu", 1)
    with pytest.raises(StaleIncarnation):
        await store.unregister_frontend("f1", 1)
    await store.register_frontend("f0", "http://f0:80", "", 1)
    frontends, _ = await store.list_frontends()
    assert [(f.frontend_id, f.incarnation) for f in frontends] == [("f0", 1), ("f1", 2)]
    assert await store.unregister_frontend("f1", 2) is True
    assert await store.unregister_frontend("f1", 2) is False
    frontends, _ = await store.list_frontends()
    assert [f.frontend_id for f in frontends] == ["f0"]


# ----- a watch resumed from a revision: exactly the changes after it, else a reset snapshot -----


async def opening(watcher) -> tuple[list[PoolEvent], PoolEvent]:
    """The ADDED events up to SNAPSHOT_DONE, and SNAPSHOT_DONE."""
    added: list[PoolEvent] = []
    while True:
        event = await asyncio.wait_for(watcher.next(), WAIT)
        assert event is not None, "the watcher ended"
        if event.kind is EventKind.SNAPSHOT_DONE:
            return added, event
        added.append(event)


def queued(watcher) -> list[tuple[EventKind, str, int]]:
    """The events waiting in `watcher` (each store has applied its change when the call returns)."""
    out = []
    while watcher.pending():
        event = watcher._events.popleft()
        assert event.pool is not None
        out.append((event.kind, event.pool.pool_id, event.revision))
    return out


async def test_a_resume_gets_exactly_the_changes_after_its_revision_in_order(store):
    await store.register_pool(reg("p0"))
    live = await store.watch(model="", region="")
    _, done = await opening(live)
    start = done.revision
    assert start > 0
    await store.register_pool(reg("p1"))
    await store.register_pool(reg("p2"))
    await store.remove_pool("p0")
    changes = queued(live)
    assert [(kind, pool) for kind, pool, _ in changes] == [
        (EventKind.ADDED, "p1"),
        (EventKind.ADDED, "p2"),
        (EventKind.REMOVED, "p0"),
    ]
    revisions = [revision for _, _, revision in changes]
    assert revisions == sorted(set(revisions)) and revisions[0] > start

    resumed = await store.watch(model="", region="", start_revision=start)
    added, marker = await opening(resumed)
    assert added == [] and marker.resumed and marker.revision == start
    assert queued(resumed) == changes  # exactly those, in order, none repeated

    middle = await store.watch(model="", region="", start_revision=revisions[0])
    _, marker = await opening(middle)
    assert marker.resumed
    assert queued(middle) == changes[1:]

    await store.register_pool(reg("p3"))  # a live change after the resume comes once
    (kind, pool, revision), *rest = queued(resumed)
    assert (kind, pool, rest) == (EventKind.ADDED, "p3", []) and revision > revisions[-1]
    for w in (live, resumed, middle):
        store.unwatch(w)


async def test_a_resume_from_an_evicted_or_unknown_revision_gets_a_reset_snapshot(store):
    watcher = await store.watch(model="", region="")
    _, done = await opening(watcher)
    store.unwatch(watcher)
    for i in range(HISTORY + 1):  # the history keeps HISTORY events: the first is gone
        await store.register_pool(reg(f"p{i}"))
    starts = [done.revision, done.revision + 10**12]  # evicted; never seen here
    if not isinstance(store, MemoryStore):
        # etcd still has the evicted changes: the etcd store reads them from there instead.
        again = await store.watch(model="", region="", start_revision=starts.pop(0))
        added, marker = await opening(again)
        assert marker.resumed and added == []
        assert [(kind, pool) for kind, pool, _ in queued(again)] == [
            (EventKind.ADDED, f"p{i}") for i in range(HISTORY + 1)
        ]
        store.unwatch(again)
    for start in starts:
        reset = await store.watch(model="", region="", start_revision=start)
        added, marker = await opening(reset)
        assert not marker.resumed
        assert sorted(e.pool.pool_id for e in added if e.pool) == [f"p{i}" for i in range(HISTORY + 1)]
        assert marker.revision > done.revision
        store.unwatch(reset)


async def test_a_filtered_watch_never_resumes(store):
    watcher = await store.watch(model="", region="")
    _, done = await opening(watcher)
    store.unwatch(watcher)
    await store.register_pool(reg("p1"))
    filtered = await store.watch(model=reg("p1").model, region="", start_revision=done.revision)
    added, marker = await opening(filtered)
    assert not marker.resumed and [e.pool.pool_id for e in added if e.pool] == ["p1"]
    store.unwatch(filtered)

"""After a discovery outage, a re-sync snapshot that misses a pool whose relays still stream telemetry
to this frontend does not unlist it at once (its lease lapsed only because nobody could renew it):
it gets the lease grace, as a LEASE_EXPIRED event would give it. A pool that is really gone leaves
at once, and the alive one too when its grace ends with no registration."""

from __future__ import annotations

import asyncio

import pytest

from globalrouter.pool_directory import DirectoryWatcher, PoolTable
from meshkit.clock import FakeClock
from tests.router.fakes import eventually, pool_msg
from tests.router.test_directory import discovery, snapshot  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(30)
LEASE = 6.0


def listed(table: PoolTable) -> list[str]:
    return [p.pool_id for p in table.listed()]


async def test_a_resync_snapshot_after_an_outage_gives_pools_that_still_stream_the_lease_grace(discovery):  # noqa: F811
    fake, channel = discovery
    table, clock = PoolTable(), FakeClock()
    heard = {"a": clock.monotonic()}  # a's relay streams telemetry here; b's does not
    table.telemetry_heard = heard.get
    outcomes: list[str] = []
    table.on_grace = outcomes.append
    watcher = DirectoryWatcher(table, channel, clock, lease_duration=lambda: LEASE)
    fake.watches.put_nowait(snapshot(pool_msg("a", "http://h:1"), pool_msg("b", "http://h:2")))
    task = asyncio.create_task(watcher.run())
    try:
        await eventually(lambda: table.synced and fake.live)
        table.stream_counts["a"] = 1
        fake.live[-1].put_nowait(None)  # discovery goes away: the watch breaks
        fake.watches.put_nowait(snapshot())  # back, with every lease lapsed meanwhile (a reset snapshot)
        # The second watch is open before its snapshot is applied: wait for the table itself.
        # b is gone; a still streams, so it stays (an `a` dropped too never reaches ["a"]).
        await eventually(
            lambda: watcher.watches_started >= 2 and len(fake.live) >= 2 and listed(table) == ["a"],
            within=10.0,
        )
        assert table.pools["a"].directory_state() == "lease_lapsed"
        end = table.next_grace_end()
        assert end == clock.monotonic() + LEASE
        fake.live[-1].put_nowait(None)  # another break, and a snapshot that still misses a
        fake.watches.put_nowait(snapshot())
        await eventually(lambda: watcher.watches_started >= 3 and len(fake.live) >= 3)
        assert listed(table) == ["a"] and table.next_grace_end() == end, "a grace is never extended"
        heard["a"] = clock.monotonic() + LEASE
        await clock.advance(LEASE - 0.5)
        assert listed(table) == ["a"]
        await clock.advance(1.0)  # the grace ends with no registration: a leaves
        await eventually(lambda: not table.listed())
        assert outcomes == ["kept", "dropped", "expired"]
        # A later snapshot listing it again lists it as ever.
        fake.live[-1].put_nowait(None)
        fake.watches.put_nowait(snapshot(pool_msg("a", "http://h:1")))
        await eventually(lambda: listed(table) == ["a"])
        assert table.pools["a"].directory_state() == "listed"
    finally:
        task.cancel()


async def test_a_pool_that_registers_again_within_the_grace_stays_as_it_was(discovery):  # noqa: F811
    fake, channel = discovery
    table, clock = PoolTable(), FakeClock()
    table.telemetry_heard = {"a": clock.monotonic()}.get
    watcher = DirectoryWatcher(table, channel, clock, lease_duration=lambda: LEASE)
    fake.watches.put_nowait(snapshot(pool_msg("a", "http://h:1")))
    task = asyncio.create_task(watcher.run())
    try:
        await eventually(lambda: table.synced and fake.live)
        table.stream_counts["a"] = 1
        fake.live[-1].put_nowait(None)
        fake.watches.put_nowait(snapshot())
        await eventually(lambda: bool(table.lease_grace))
        await eventually(lambda: len(fake.live) >= 2)
        fake.live[-1].put_nowait(snapshot(pool_msg("a", "http://h:1"))[0])  # its relay registered (ADDED)
        await eventually(lambda: not table.lease_grace)
        assert listed(table) == ["a"] and table.pools["a"].directory_state() == "listed"
        await clock.advance(2 * LEASE)
        assert listed(table) == ["a"]
    finally:
        task.cancel()

"""After a discovery outage, the first snapshot does not unlist a pool whose relays still stream
telemetry to this frontend (its lease lapsed only because nobody could renew it); a pool that is
really gone leaves at once, and the alive one too if the re-sync a lease later still misses it."""

from __future__ import annotations

import asyncio

import pytest

from globalrouter.pool_directory import DirectoryWatcher, PoolTable
from meshkit.clock import FakeClock
from tests.router.fakes import eventually, pool_msg
from tests.router.test_directory import discovery, snapshot  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(30)


async def test_first_snapshot_after_an_outage_keeps_pools_that_still_stream(discovery):  # noqa: F811
    fake, channel = discovery
    table = PoolTable()
    watcher = DirectoryWatcher(table, channel, FakeClock(), resync_after=lambda: 0.3)
    fake.watches.put_nowait(snapshot(pool_msg("a", "http://h:1"), pool_msg("b", "http://h:2")))
    task = asyncio.create_task(watcher.run())
    try:
        await eventually(lambda: table.synced and fake.live)
        table.stream_counts["a"] = 1  # a's relay streams telemetry here; b's does not
        fake.live[-1].put_nowait(None)  # discovery goes away: the watch breaks
        fake.watches.put_nowait(snapshot())  # back, with every lease lapsed meanwhile
        # The second watch is open before its snapshot is applied: wait for the table itself.
        # b is gone; a still streams, so it stays (an `a` dropped too never reaches ["a"]).
        await eventually(
            lambda: (
                watcher.watches_started >= 2
                and len(fake.live) >= 2
                and [p.pool_id for p in table.listed()] == ["a"]
            ),
            within=10.0,
        )
        fake.watches.put_nowait(snapshot(pool_msg("a", "http://h:1")))  # a's relay renewed meanwhile
        await eventually(lambda: watcher.watches_started == 3 and len(fake.live) == 3)
        assert [p.pool_id for p in table.listed()] == ["a"]
        fake.live[-1].put_nowait(None)
        fake.watches.put_nowait(snapshot())
        await eventually(lambda: watcher.watches_started == 4 and len(fake.live) == 4)
        fake.watches.put_nowait(snapshot())  # the re-sync a lease later still misses it: it leaves
        await eventually(lambda: watcher.watches_started == 5 and not table.listed())
    finally:
        task.cancel()

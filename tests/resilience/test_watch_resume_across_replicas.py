"""The frontend's directory watch moves to another discovery replica of one etcd and resumes
there: no snapshot, the changes it missed exactly once, none repeated."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from globalrouter.pool_directory import DirectoryWatcher
from meshkit import discovery_endpoints
from meshkit.clock import SystemClock
from meshlaunch import free_port
from tests.discovery.etcd_support import running_etcd
from tests.discovery.test_watch_cross_replica import register, serve, unregister
from tests.router.fakes import eventually
from tests.router.test_directory import Counting

pytestmark = pytest.mark.timeout(120)


async def test_the_frontend_watch_resumes_on_another_replica_with_the_missed_changes_once(procs):
    with running_etcd() as etcd:
        proc_a, a = serve(procs, etcd)
        b = f"127.0.0.1:{free_port()}"  # B is not up yet: the watch can only go to A
        target, _ = discovery_endpoints.channel_target([a, b])
        channel = grpc.aio.insecure_channel(target, options=discovery_endpoints.channel_options([a, b]))
        table = Counting()
        watcher = DirectoryWatcher(table, channel, SystemClock())
        task = asyncio.create_task(watcher.run())
        try:
            register(a, "p1")
            await eventually(lambda: "p1" in table.pools and watcher.last_revision > 0, within=15)
            seen = watcher.last_revision
            serve(procs, etcd, address=b)
            proc_a.signal(signal.SIGSTOP)  # A hangs: the watch stays open but hears nothing
            register(b, "p2")
            unregister(b, "p1")
            proc_a.kill9()  # now the watch breaks; it re-watches on B from the revision it saw
            await eventually(lambda: "p1" not in table.pools and "p2" in table.pools, within=30)
            # A re-watch may first reach the dead A and fail before any event (one more watch,
            # after a back-off); what must hold is one resume on B and no second snapshot.
            assert watcher.watches_started >= 2 and watcher.resumes == 1, "resumed on B"
            assert table.snapshots == 1, "no snapshot after the first"
            assert table.applied == [("listed", "p1"), ("listed", "p2"), ("removed", "p1")]
            assert watcher.last_revision > seen
        finally:
            task.cancel()
            await channel.close()

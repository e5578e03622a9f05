"""Under the per-pool summary a new stream's first snapshot joins the set its pool already holds
(the replicas of a pool's relay report the same set) instead of building it again: after a mass
redial or a restart every pool's set was built twice, on the serving loop."""

from __future__ import annotations

import numpy as np
import pytest

from globalrouter.kv_summary import KvSummary
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import ADOPT_WITHIN, TelemetryIngest
from meshkit.clock import FakeClock
from poolrelay.v1 import pool_events_pb2
from poolrelay.v1 import telemetry_pb2 as tm
from tests.router.test_telemetry_budgets import chunk, delta, hello

pytestmark = pytest.mark.timeout(30)
SET = range(1, 2001)
Request = tm.PublishPoolTelemetryRequest


class CountingSummary(KvSummary):
    """A KvSummary that counts the blocks put into snapshot builds."""

    def __init__(self) -> None:
        super().__init__()
        self.built = 0

    def add_blocks(self, source: str, keys: np.ndarray) -> None:
        self.built += len(keys)
        super().add_blocks(source, keys)


def make(**kw) -> tuple[TelemetryIngest, PoolTable, CountingSummary]:
    table, summary = PoolTable(), CountingSummary()
    return (
        TelemetryIngest(table, summary, FakeClock(), RouterMetrics(), step_blocks=256, **kw),
        table,
        summary,
    )


def drain(ingest: TelemetryIngest) -> None:
    for _ in range(10_000):
        if not ingest.step():
            return
    raise AssertionError("index work never ended")


def test_the_second_replicas_first_snapshot_joins_the_pools_set():
    ingest, table, summary = make()
    a = ingest.open(hello(relay="a"))
    ingest.receive(a, chunk(SET, last=True))
    drain(ingest)
    assert summary.built == len(SET)
    b = ingest.open(hello(relay="b"))
    ingest.receive(b, chunk(SET, last=True))
    assert not ingest.has_work() and summary.built == len(SET)  # nothing built for b
    assert table.pools["p"].kv_sources == {a.source, b.source} and b.kv_applied
    assert summary.pool_block_count("p") == len(SET) and ingest.snapshot_blocks_held == 0
    assert ingest.snapshots_adopted == 1
    # b's deltas follow its snapshot; a feeds the set while it is live, then b does
    ingest.receive(b, delta(2, stored=[9001]))
    ingest.receive(a, delta(2, stored=[9001]))
    assert summary.pool_holds("p", 9001)
    ingest.close(a)
    drain(ingest)
    assert summary.sources() == [b.source] and summary.pool_block_count("p") == len(SET) + 1
    ingest.receive(b, delta(3, stored=[9002], removed=[1]))
    assert summary.pool_holds("p", 9002) and not summary.pool_holds("p", 1)


def test_a_redial_storm_builds_each_pools_set_once():
    """Both replicas' streams break and their new snapshots arrive before any build step ran."""
    ingest, table, summary = make()
    first = [ingest.open(hello(relay=r)) for r in "ab"]
    for s in first:
        ingest.receive(s, chunk(SET, last=True))
    drain(ingest)
    summary.built = 0
    for s in first:
        ingest.close(s)
    again = [ingest.open(hello(relay=r, incarnation=2)) for r in "ab"]
    for s in again:
        ingest.receive(s, chunk(SET, last=True))
        ingest.receive(s, delta(2, stored=[7000]))  # waits behind the build (or follows the join)
    drain(ingest)
    assert summary.built == len(SET)  # not 2 x
    assert table.pools["p"].kv_sources == {s.source for s in again} and all(s.kv_applied for s in again)
    assert summary.pool_block_count("p") == len(SET) + 1 and summary.pool_holds("p", 7000)
    assert ingest.snapshot_blocks_held == 0 and not ingest.held_by_relay


def test_the_feeders_own_resync_is_built():
    """A stream that already holds the set (so may feed it) and asks for a snapshot after a gap
    must rebuild it: its lost deltas are in no other set."""
    ingest, _table, summary = make()
    a = ingest.open(hello(relay="a"))
    ingest.receive(a, chunk(SET, last=True))
    b = ingest.open(hello(relay="b"))
    ingest.receive(b, chunk(SET, last=True))
    drain(ingest)
    built = summary.built
    assert ingest.receive(a, delta(5, stored=[1])).HasField("snapshot_request")  # a gap
    ingest.receive(a, chunk(range(5000, 5100), last=True, snapshot_id=2, sequence=9))
    drain(ingest)
    assert summary.built == built + 100
    assert summary.pool_block_count("p") == 100 and summary.pool_holds("p", 5000)


def test_the_exact_index_builds_every_streams_set():
    from globalrouter.kv_index import KvIndex

    table, index = PoolTable(), KvIndex()
    ingest = TelemetryIngest(table, index, FakeClock(), RouterMetrics(), step_blocks=256)
    streams = [ingest.open(hello(relay=r)) for r in "ab"]
    for s in streams:
        ingest.receive(s, chunk(SET, last=True))
    drain(ingest)
    assert all(index.block_count(s.source) == len(SET) for s in streams)
    assert ingest.snapshots_adopted == 0


def test_a_silent_streams_set_is_not_joined():
    """The pool's other stream said nothing for longer than ADOPT_WITHIN (it may be stuck): the new
    stream's snapshot is built and the new stream feeds the pool's set."""
    table, summary = PoolTable(), CountingSummary()
    clock = FakeClock()
    ingest = TelemetryIngest(table, summary, clock, RouterMetrics(), step_blocks=256)
    a = ingest.open(hello(relay="a"))
    ingest.receive(a, chunk(SET, last=True))
    drain(ingest)
    clock.set(clock.monotonic() + ADOPT_WITHIN + 1)
    b = ingest.open(hello(relay="b"))
    ingest.receive(b, chunk(range(5001, 5101), last=True))
    drain(ingest)
    assert ingest.snapshots_adopted == 0 and summary.built == len(SET) + 100
    assert summary.pool_block_count("p") == 100
    ingest.receive(b, delta(2, stored=[9500]))
    assert summary.pool_holds("p", 9500)
    # a live stream's set is joined: c's snapshot arrives while b spoke just now
    c = ingest.open(hello(relay="c"))
    ingest.receive(c, chunk(range(5001, 5101), last=True))
    assert ingest.snapshots_adopted == 1


# ---- a second replica's snapshot is counted, not kept, while the first's covers the pool --------
HALF = len(SET) // 2


def test_a_second_replicas_snapshot_is_not_kept_while_the_first_is_queued_for_a_build():
    """After a restart both replicas of every pool send their snapshot at once: the second's
    chunks were converted, held against the budgets and given a table, only to be adopted unbuilt
    once the first's build was swapped in. Now, once another stream of the pool has a whole
    snapshot queued, they are only counted; the stream joins the set when it is swapped in."""
    ingest, table, summary = make()
    a, b = (ingest.open(hello(relay=r)) for r in "ab")
    ingest.receive(b, chunk(SET[:HALF]))  # b's first chunk: nothing covers the pool yet, kept
    assert ingest.snapshot_blocks_held == HALF
    ingest.receive(a, chunk(SET, last=True))  # a's whole snapshot: queued for a build
    assert not summary._staged  # its table is taken at its first step, not here
    assert ingest.snapshot_blocks_held == HALF + len(SET)
    assert ingest.receive(b, chunk(SET[HALF:], index=1, last=True)) is None
    assert ingest.snapshot_blocks_held == len(SET) and not b.snapshot_chunks  # b's first chunk went too
    assert b.awaiting and not b.kv_applied
    assert ingest.receive(b, delta(2, stored=[8000])) is None  # waits with the stream (not held)
    assert ingest.snapshot_blocks_held == len(SET)
    drain(ingest)
    assert summary.built == len(SET) and ingest.snapshots_adopted == 1
    assert table.pools["p"].kv_sources == {a.source, b.source} and b.kv_applied and not b.awaiting
    assert ingest.snapshot_blocks_held == 0 and not ingest.held_by_relay
    assert ingest.receive(b, delta(3, stored=[8001])) is None  # its sequence went on: no gap
    ingest.close(a)
    drain(ingest)
    ingest.receive(b, delta(4, stored=[8002]))
    assert summary.pool_holds("p", 8002) and summary.pool_block_count("p") == len(SET) + 1


def test_a_skipped_snapshot_whose_build_is_gone_is_asked_again():
    """The stream whose build the skipped one waited for ends before its build is swapped in: the
    waiting stream's relay is asked for a fresh snapshot at its next message, which is built."""
    ingest, table, summary = make()
    a, b = (ingest.open(hello(relay=r)) for r in "ab")
    ingest.receive(a, chunk(SET, last=True))
    ingest.receive(b, chunk(SET, last=True))
    assert b.awaiting
    ingest.close(a)  # a's build goes with it
    drain(ingest)
    assert not table.pools["p"].kv_sources
    load = Request(load=tm.LoadReport(load=pool_events_pb2.PoolLoad(kv_blocks_total=4096)))
    answer = ingest.receive(b, load)
    assert answer is not None and answer.HasField("snapshot_request")
    assert table.pools["p"].load is not None  # the message itself was applied too
    assert ingest.receive(b, delta(2, stored=[8000])) is None  # ignored until the snapshot
    ingest.receive(b, chunk(SET, last=True, snapshot_id=2, sequence=7))
    drain(ingest)
    assert table.pools["p"].kv_sources == {b.source} and summary.pool_block_count("p") == len(SET)
    ingest.receive(b, delta(8, stored=[8001]))
    assert summary.pool_holds("p", 8001)


def test_a_skipped_snapshot_joins_a_set_a_resync_replaced():
    """The builder sends a newer snapshot before its first is swapped in (a gap): the waiting
    stream keeps waiting for that build and joins the set it makes."""
    ingest, table, summary = make()
    a, b = (ingest.open(hello(relay=r)) for r in "ab")
    ingest.receive(a, chunk(SET, last=True))
    ingest.receive(b, chunk(SET, last=True))
    assert ingest.receive(a, delta(5)).HasField("snapshot_request")  # a's gap
    ingest.receive(a, chunk(range(5000, 5100), last=True, snapshot_id=2, sequence=9))
    assert ingest.receive(b, delta(2)) is None and b.awaiting
    drain(ingest)
    assert table.pools["p"].kv_sources == {a.source, b.source}
    assert summary.pool_block_count("p") == 100 and summary.built == 100  # the first never built


def test_a_waiting_streams_gap_asks_for_a_snapshot_that_waits_again():
    ingest, table, summary = make()
    a, b = (ingest.open(hello(relay=r)) for r in "ab")
    ingest.receive(a, chunk(SET, last=True))
    ingest.receive(b, chunk(SET, last=True))
    assert ingest.receive(b, delta(5)).HasField("snapshot_request") and not b.awaiting  # a gap
    ingest.receive(b, chunk(SET, last=True, snapshot_id=2, sequence=9))  # a's build still queued
    assert b.awaiting and ingest.snapshot_blocks_held == len(SET)
    drain(ingest)
    assert table.pools["p"].kv_sources == {a.source, b.source} and summary.built == len(SET)
    assert ingest.receive(b, delta(10)) is None

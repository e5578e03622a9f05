"""The telemetry ingest over KvSummary (`--kv-state summary`): snapshots built in a table of their own
and swapped in, relays of one pool sharing its set, tables sized from load reports, no block logs."""

from __future__ import annotations

import numpy as np
import pytest

from globalrouter import serve_cli
from globalrouter.cli import build_parser
from globalrouter.config import RouterConfig
from globalrouter.http_api.status_page import status
from globalrouter.kv_summary import KvSummary
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.server import create_server
from globalrouter.telemetry_ingest import TelemetryIngest
from globalrouter.v1 import router_pb2
from meshkit import settings
from meshkit.blocks import block_hashes
from meshkit.clock import FakeClock
from poolrelay.v1 import pool_events_pb2
from poolrelay.v1 import telemetry_pb2 as tm
from tests.router.fakes import FakeRelay, eventually, pool_msg, start_router
from tests.router.test_telemetry_budgets import chunk, delta, hello

pytestmark = pytest.mark.timeout(30)
PROMPT = list(range(100, 164))  # four blocks of 16
HASHES = block_hashes(PROMPT, 16)


def make(**kw) -> tuple[TelemetryIngest, PoolTable, KvSummary]:
    table, summary = PoolTable(), KvSummary()
    return TelemetryIngest(table, summary, FakeClock(), RouterMetrics(), **kw), table, summary


def load(total: int) -> tm.PublishPoolTelemetryRequest:
    return tm.PublishPoolTelemetryRequest(
        load=tm.LoadReport(load=pool_events_pb2.PoolLoad(kv_blocks_total=total))
    )


def test_a_snapshot_is_built_aside_and_the_old_set_answers_until_the_swap():
    ingest, table, summary = make(step_blocks=100)
    s = ingest.open(hello())
    ingest.receive(s, chunk(range(1, 11), last=True))
    ingest.run(0)
    (old,) = table.pools["p"].kv_sources
    ingest.receive(s, chunk(range(1001, 2001), last=True, sequence=5))
    steps = 0
    while s.building is not None:
        ingest.run(100)
        steps += 1
        if s.building is None:
            break
        # the half-built table is nobody's: the old set alone answers, under the old source
        assert summary.prefix_overlaps([1]) == {old: 1} and summary.prefix_overlaps([1500]) == {}
        assert summary.total_blocks() == 10
    assert steps >= 10
    ingest.run(0)  # the old source leaves
    (new,) = table.pools["p"].kv_sources
    assert new != old and summary.sources() == [new]
    assert summary.prefix_overlaps([1500]) == {new: 1} and summary.prefix_overlaps([1]) == {}
    assert summary.block_count(new) == 1000 and summary.total_blocks() == 1000
    assert s.log is None  # no per-stream block list: the pool's table goes with its last source


def test_relays_of_one_pool_share_its_set_as_the_design_says():
    """A new stream's first snapshot joins the set the pool holds (test_ingest_adopt); a later
    snapshot of any relay replaces the pool's set and its relay feeds it; the other's deltas are
    skipped; when the feeder leaves the other relay feeds the same set; the set goes with the
    pool's last stream."""
    ingest, table, summary = make()
    a = ingest.open(hello(relay="a"))
    ingest.receive(a, chunk(range(1, 101), last=True, sequence=1))
    b = ingest.open(hello(relay="b"))
    ingest.receive(b, chunk(range(1, 51), last=True, sequence=1))  # joins a's set: not built
    assert summary.prefix_overlaps(list(range(1, 101))) == {a.source: 100, b.source: 100}
    ingest.receive(b, chunk(range(1, 51), last=True, sequence=1, snapshot_id=2))  # b's came last
    pool = table.pools["p"]
    assert pool.kv_sources == {a.source, b.source}
    assert summary.prefix_overlaps(list(range(1, 101))) == {a.source: 50, b.source: 50}
    ingest.receive(a, delta(2, stored=[500]))  # a does not feed the pool: skipped
    assert summary.prefix_overlaps([500]) == {} and summary.stats().skipped_deltas == 1
    ingest.receive(b, delta(2, stored=[600]))
    assert summary.prefix_overlaps([600]) == {a.source: 1, b.source: 1}
    ingest.close(b)  # the feeder leaves: the pool keeps its set, a feeds it now
    ingest.run(0)
    assert summary.sources() == [a.source] and summary.block_count(a.source) == 51
    ingest.receive(a, delta(3, stored=[700], removed=[600]))
    assert summary.prefix_overlaps([700]) == {a.source: 1} and summary.prefix_overlaps([600]) == {}
    ingest.close(a)
    ingest.run(0)
    assert summary.sources() == [] and summary.total_blocks() == 0 and summary.table_bytes() == 0
    assert "p" not in table.pools and ingest.snapshot_blocks_held == 0


def test_a_second_relays_stream_before_its_snapshot_changes_nothing():
    ingest, table, summary = make()
    a = ingest.open(hello(relay="a"))
    ingest.receive(a, chunk(range(1, 101), last=True))
    b = ingest.open(hello(relay="b"))
    ingest.receive(b, delta(1, stored=[900]))  # no snapshot yet: ignored
    assert summary.sources() == [a.source] and summary.block_count(a.source) == 100
    ingest.close(b)
    ingest.run(0)
    assert summary.block_count(a.source) == 100 and table.pools["p"].kv_sources == {a.source}


def test_a_superseded_stream_leaves_the_pool_to_its_successor():
    ingest, table, summary = make()
    old = ingest.open(hello(incarnation=1))
    ingest.receive(old, chunk(range(1, 101), last=True))
    new = ingest.open(hello(incarnation=2))  # the old stream's state goes at once
    ingest.run(0)
    assert summary.sources() == [] and not table.pools["p"].kv_sources
    ingest.receive(new, chunk(range(201, 211), last=True))
    assert summary.sources() == [new.source] and summary.prefix_overlaps([1]) == {}


def test_load_reports_size_the_pools_table_before_deltas_fill_it():
    ingest, _table, summary = make()
    s = ingest.open(hello())
    ingest.receive(s, load(50_000))
    ingest.receive(s, chunk(range(1, 11), last=True))
    ingest.receive(s, delta(2, stored=list(range(100, 40_100))))
    assert summary.block_count(s.source) == 40_010
    assert summary.stats().doublings == 0  # without the load report: 12 doublings, 12 bits lost
    assert summary.table_bytes() >= 50_000 * 2
    # an absurd capacity is bounded by the largest snapshot the frontend takes
    ingest.receive(s, load(1 << 60))
    ingest.receive(s, chunk(range(1, 11), last=True, sequence=9))
    assert summary.table_bytes() <= 2 * ingest.max_snapshot_blocks * 2


def test_a_capacity_learnt_after_the_snapshot_sizes_the_next_table_not_the_current_one():
    ingest, _table, summary = make()
    s = ingest.open(hello())
    ingest.receive(s, chunk(range(1, 11), last=True))
    before = summary.table_bytes()
    ingest.receive(s, load(50_000))  # no pass over the table on the serving loop
    assert summary.table_bytes() == before and summary.stats().doublings == 0
    ingest.receive(s, chunk(range(1, 11), last=True, sequence=5))
    assert summary.table_bytes() >= 50_000 * 2 and summary.block_count(s.source) == 10


def test_an_ending_stream_during_its_build_frees_the_build_table():
    ingest, _table, summary = make(step_blocks=100)
    s = ingest.open(hello())
    ingest.receive(s, chunk(range(1, 1001), last=True))
    ingest.run(300)
    ingest.close(s)
    ingest.run(0)
    assert summary.sources() == [] and summary.total_blocks() == 0 and summary.table_bytes() == 0


def test_summary_build_calls_are_checked():
    summary = KvSummary()
    with pytest.raises(ValueError, match="no snapshot is being built"):
        summary.commit_snapshot("p/a/1#1")
    with pytest.raises(ValueError, match="snapshot blocks must be >= 0"):
        summary.begin_snapshot("p/a/1#1", -1)
    with pytest.raises(ValueError, match="expected blocks must be >= 0"):
        summary.expect_pool("p", -1)
    summary.begin_snapshot("p/a/1#1", 10, pool="p/with/slashes")
    summary.add_blocks("p/a/1#1", np.arange(1, 11, dtype=np.uint64))
    summary.commit_snapshot("p/a/1#1")
    assert summary.pools() == ["p/with/slashes"] and summary.pool_block_count("p/with/slashes") == 10


async def test_kv_state_is_a_serve_flag_and_checked():
    args = settings.parse_args(
        build_parser(), ["serve", "--discovery", "127.0.0.1:1"], environ={"GLOBALROUTER_KV_STATE": "summary"}
    )
    args.security = RouterConfig().security  # what cli.main adds after parsing
    assert serve_cli.router_config(args).kv_state == "summary"
    assert RouterConfig().kv_state == "exact"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--discovery", "127.0.0.1:1", "--kv-state", "bloom"])
    with pytest.raises(ValueError, match="kv_state must be one of"):
        create_server(RouterConfig(kv_state="bloom"))
    assert isinstance(create_server(RouterConfig(kv_state="summary")).core.index, KvSummary)


async def test_route_list_pools_and_the_status_page_read_the_summary():
    router, stub, channel = await start_router(kv_state="summary")
    try:
        router.core.table.apply_listed(pool_msg("p1", "http://127.0.0.1:1"))
        relay = FakeRelay(f"127.0.0.1:{router.port}")
        await relay.open("p1")
        await relay.send(kv_snapshot=tm.KvSnapshot(snapshot_id=1, last=True, block_hashes=HASHES))
        await relay.send(load=tm.LoadReport(load=pool_events_pb2.PoolLoad(max_running_requests=4)))
        await eventually(
            lambda: router.core.table.pools["p1"].kv_sources and router.core.table.pools["p1"].load
        )
        reply = await stub.Route(
            router_pb2.RouteRequest(model="m", prompt=router_pb2.Prompt(token_ids={"ids": PROMPT}))
        )
        assert reply.candidates[0].pool_id == "p1" and reply.candidates[0].cached_blocks == 4
        (view,) = (await stub.ListPools(router_pb2.ListPoolsRequest())).pools
        assert view.indexed_blocks == 4 and view.telemetry_streams == 1
        (row,) = [p for region in status(router.core, "f")["regions"] for p in region["pools"]]
        assert row["indexed_blocks"] == 4
        await relay.close()
    finally:
        await channel.close()
        await router.handle.server.stop(0)


def test_the_ingests_steps_move_a_tables_growth_on():
    """Deltas that overfill a pool's table start its growth; the ingest's steps (has_work, run
    with a budget) move it on a slice at a time until it ends, every block held throughout."""
    ingest, _table, summary = make(step_blocks=2048)
    s = ingest.open(hello())
    blocks = list(range(1, 20_001))
    ingest.receive(s, chunk(blocks, last=True))
    while ingest.run(2048):
        pass
    p = summary._pool_ids["p"]
    room = int(0.8 * 2 * int(summary._nb[p])) - len(blocks)
    extra = list(range(30_001, 30_001 + room + 1))
    ingest.receive(s, delta(2, stored=extra))
    assert summary.block_count(s.source) == len(blocks) + len(extra)  # the fold starts the growth
    assert getattr(summary, "_shadow", None) and ingest.has_work()  # (the base code: no growth)
    steps = 0
    while ingest.run(256):
        steps += 1
        assert summary.pool_prefixes(blocks[:4]) == {"p": 4}
    assert steps >= 5 and not summary.growing() and not ingest.has_work()
    assert summary.pool_prefixes(extra[-3:]) == {"p": 3}


def test_reads_without_fold_see_the_last_fold_whole():
    """`reads_fold` off (as the telemetry servicer runs the summary): a decision's lookups read the
    tables as of the last fold, logged deltas unseen and still logged, until a fold; on (the
    default), every lookup sees every delta logged before it."""
    summary = KvSummary()
    summary.fold_at = 1 << 20  # nothing folds inside apply_delta here
    summary.apply_snapshot("p/r0", HASHES[:2])
    summary.apply_delta("p/r0", stored=HASHES[2:], removed=())
    summary.reads_fold = False
    assert summary.pool_prefixes(HASHES) == {"p": 2}
    assert summary.holds(HASHES[0]) and not summary.holds(HASHES[3])
    assert not summary.pool_holds("p", HASHES[3])
    assert summary.fold_due is False and summary._log_keys  # still logged, not lost
    summary.fold()
    assert summary.pool_prefixes(HASHES) == {"p": 4} and summary.pool_holds("p", HASHES[3])
    summary.apply_delta("p/r0", stored=(), removed=HASHES[1:])
    summary.reads_fold = True
    assert summary.pool_prefixes(HASHES) == {"p": 1}  # the default folds first


async def test_the_servicer_leaves_folds_to_its_pacer_which_folds_a_quiet_streams_delta_soon():
    """The frontend with --kv-state summary: decisions do not fold (reads_fold off), and the
    telemetry pacer folds what a quiet stream left logged within about FOLD_EVERY, with no read
    and no further message to trigger it; a Route then finds the delta's blocks."""
    router, stub, channel = await start_router(kv_state="summary")
    summary = router.core.index
    assert isinstance(summary, KvSummary) and summary.reads_fold is False
    try:
        router.core.table.apply_listed(pool_msg("p1", "http://127.0.0.1:1"))
        relay = FakeRelay(f"127.0.0.1:{router.port}")
        await relay.open("p1")
        await relay.send(kv_snapshot=tm.KvSnapshot(snapshot_id=1, last=True, block_hashes=HASHES[:2]))
        await relay.send(load=tm.LoadReport(load=pool_events_pb2.PoolLoad(max_running_requests=4)))
        await eventually(
            lambda: router.core.table.pools["p1"].kv_sources and router.core.table.pools["p1"].load
        )
        await relay.send(kv_delta=tm.KvDelta(sequence=1, stored=HASHES[2:]))
        await eventually(lambda: router.metrics.telemetry_messages._value.get() >= 3)
        await eventually(lambda: not summary._log_keys)  # folded by the tick: nothing read it
        reply = await stub.Route(
            router_pb2.RouteRequest(model="m", prompt=router_pb2.Prompt(token_ids={"ids": PROMPT}))
        )
        assert reply.candidates[0].cached_blocks == 4
        await relay.close()
    finally:
        await channel.close()
        await router.handle.server.stop(0)

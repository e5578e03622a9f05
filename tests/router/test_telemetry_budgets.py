"""Telemetry snapshot memory and block sizes: superseded streams go at once, budgets per relay and in
total, one block size per pool, snapshots applied and streams removed in bounded steps."""

from __future__ import annotations

import asyncio
import random
from typing import cast

import grpc
import numpy as np
import pytest
from structlog.testing import capture_logs

from globalrouter.kv_index import KvIndex
from globalrouter.kv_summary import KvSummary
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import StreamRejected, StreamState, TelemetryIngest
from meshkit.clock import FakeClock
from meshkit.errors import Reason, reason_of
from poolrelay.v1 import telemetry_pb2 as tm
from tests.router.fakes import FakeRelay, eventually, start_router

pytestmark = pytest.mark.timeout(30)


def hello(pool: str = "p", relay: str = "a", incarnation: int = 1, block_size: int = 16) -> tm.TelemetryHello:
    return tm.TelemetryHello(
        pool_id=pool,
        relay_id=relay,
        incarnation=incarnation,
        protocol_version=1,
        block_size=block_size,
        hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
    )


def chunk(hashes, index: int = 0, last: bool = False, snapshot_id: int = 1, sequence: int = 1):
    return tm.PublishPoolTelemetryRequest(
        kv_snapshot=tm.KvSnapshot(
            snapshot_id=snapshot_id, sequence=sequence, chunk_index=index, last=last, block_hashes=hashes
        )
    )


def delta(sequence: int, stored=(), removed=()):
    return tm.PublishPoolTelemetryRequest(
        kv_delta=tm.KvDelta(sequence=sequence, stored=stored, removed=removed)
    )


def make(kv_state: str = "exact", **kw) -> tuple[TelemetryIngest, PoolTable, KvIndex]:
    table = PoolTable()
    # the summary answers the index's calls (the ingest also calls its build ones)
    index = cast(KvIndex, KvSummary()) if kv_state == "summary" else KvIndex()
    return TelemetryIngest(table, index, FakeClock(), RouterMetrics(), **kw), table, index


KV_STATES = pytest.mark.parametrize("kv_state", ["exact", "summary"])


# ---- issue 18 item 6: the snapshot cap is per relay and in total, not per stream ----------------
def test_a_superseded_streams_partial_snapshot_is_dropped_at_once():
    ingest, _table, _index = make(max_snapshot_blocks=10)
    streams = []
    for incarnation in range(1, 11):  # rising incarnations, each with a partial snapshot, then silent
        s = ingest.open(hello(incarnation=incarnation))
        ingest.receive(s, chunk(range(incarnation * 100, incarnation * 100 + 6)))
        streams.append(s)
    assert all(s.snapshot_chunks == [] for s in streams[:-1])
    assert sum(sum(len(c) for c in s.snapshot_chunks) for s in streams) == 6
    assert ingest.snapshot_blocks_held == 6 and ingest.held_by_relay == {("p", "a"): 6}


def test_snapshot_blocks_are_bounded_per_relay_and_in_total():
    ingest, _table, _index = make(
        max_snapshot_blocks=100, max_snapshot_blocks_per_relay=8, max_snapshot_blocks_total=12
    )
    a = ingest.open(hello(relay="a"))
    ingest.receive(a, chunk(range(6)))
    with pytest.raises(StreamRejected) as err:  # a's snapshot grows past its relay's budget
        ingest.receive(a, chunk(range(6, 9), index=1))
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.LIMIT_EXCEEDED)
    assert err.value.metadata == {"limit": "max_snapshot_blocks_per_relay"}
    ingest.close(a)
    assert ingest.snapshot_blocks_held == 0
    b, c = ingest.open(hello(pool="q", relay="b")), ingest.open(hello(pool="r", relay="c"))
    ingest.receive(b, chunk(range(6)))
    with pytest.raises(StreamRejected) as err:  # within its own budget, over the frontend's
        ingest.receive(c, chunk(range(100, 107)))
    assert err.value.metadata == {"limit": "max_snapshot_blocks_total"}
    assert "over this frontend's 12" in err.value.message
    ingest.close(c)
    assert ingest.snapshot_blocks_held == 6
    ingest.receive(b, chunk(range(6, 8), index=1, last=True))  # applied: its blocks are given back
    assert ingest.snapshot_blocks_held == 0 and ingest.held_by_relay == {}


async def test_a_silent_superseded_stream_ends_at_once_with_its_reason():
    router, _stub, channel = await start_router()
    try:
        old = FakeRelay(f"127.0.0.1:{router.port}")
        await old.open("p1", incarnation=1)
        await old.send(kv_snapshot=tm.KvSnapshot(snapshot_id=1, chunk_index=0, block_hashes=range(500)))
        streams = router.telemetry._ingest.streams
        await eventually(
            lambda: (
                ("p1", "relay-1") in streams
                and sum(np.size(c) for c in streams[("p1", "relay-1")].snapshot_chunks) == 500
            )
        )
        new = FakeRelay(f"127.0.0.1:{router.port}")
        await new.open("p1", incarnation=2)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # old says nothing more, yet its call ends
            await old.read(within=5.0)
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert reason_of(err.value) == Reason.TELEMETRY_SUPERSEDED
        assert router.telemetry._ingest.snapshot_blocks_held == 0
        await eventually(lambda: router.core.table.stream_counts.get("p1") == 1)
        await old.close()
        await new.close()
    finally:
        await channel.close()
        await router.handle.server.stop(0)


async def test_a_snapshot_over_the_total_budget_is_refused_with_its_limit():
    router, _stub, channel = await start_router(max_snapshot_blocks_total=1000)
    try:
        a, b = FakeRelay(f"127.0.0.1:{router.port}"), FakeRelay(f"127.0.0.1:{router.port}")
        await a.open("p1")
        await a.send(kv_snapshot=tm.KvSnapshot(snapshot_id=1, chunk_index=0, block_hashes=range(800)))
        await eventually(lambda: router.telemetry._ingest.snapshot_blocks_held == 800)
        await b.open("p2")
        await b.send(kv_snapshot=tm.KvSnapshot(snapshot_id=1, chunk_index=0, block_hashes=range(300)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await b.read()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert reason_of(err.value) == Reason.LIMIT_EXCEEDED
        assert "max_snapshot_blocks_total" not in err.value.details()  # the limit is in ErrorInfo
        await a.close()
        await b.close()
        await eventually(lambda: router.telemetry._ingest.snapshot_blocks_held == 0)
    finally:
        await channel.close()
        await router.handle.server.stop(0)


# ---- issue 18 item 13: one block size per pool, that of its live streams -------------------
def test_a_hello_with_another_block_size_than_the_pools_live_streams_is_refused():
    ingest, table, _index = make()
    a = ingest.open(hello(relay="a", block_size=16))
    ingest.receive(a, chunk(range(10), last=True))
    with pytest.raises(StreamRejected) as err:
        ingest.open(hello(relay="b", block_size=1))
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.reason is Reason.TELEMETRY_BLOCK_SIZE_MISMATCH
    assert err.value.metadata["field"] == "hello.block_size"
    assert table.pools["p"].block_size == 16 and table.stream_counts["p"] == 1
    b = ingest.open(hello(relay="b", block_size=16))
    ingest.close(b)
    assert table.pools["p"].block_size == 16
    # The same relay restarted with another block size replaces its own stream: allowed.
    a2 = ingest.open(hello(relay="a", incarnation=2, block_size=32))
    assert table.pools["p"].block_size == 32
    ingest.close(a2)
    assert "p" not in table.pools  # the last stream ended: the block size is forgotten with the pool


# ---- issue 19 item 3: bounded steps --------------------------------------------------------
@KV_STATES
def test_a_snapshot_is_applied_in_bounded_steps_then_swapped_in_with_the_deltas_behind_it(kv_state):
    ingest, table, index = make(kv_state, step_blocks=100)
    s = ingest.open(hello())
    ingest.receive(s, chunk(range(1, 501), sequence=4))
    ingest.receive(s, chunk(range(501, 1001), index=1, last=True, sequence=4))
    ingest.receive(s, delta(5, stored=[5000], removed=[1]))  # waits behind the snapshot
    pool = table.pools["p"]
    assert not pool.kv_sources and pool.kv_at is None
    steps = 0
    while ingest.run(100):
        steps += 1
        assert not pool.kv_sources  # the old set (none) answers until the swap
    assert steps >= 9
    (source,) = pool.kv_sources
    assert index.block_count(source) == 1000 and pool.kv_at is not None
    assert index.prefix_overlaps([5000]) == {source: 1} and index.prefix_overlaps([1]) == {}
    assert ingest.snapshot_blocks_held == 0
    ingest.receive(s, delta(6, stored=[6000]))  # applied at once now
    assert index.block_count(source) == 1001 and not ingest.has_work()


def test_a_leaving_streams_blocks_are_removed_from_its_own_list_not_a_pass_over_the_table(monkeypatch):
    ingest, table, index = make(step_blocks=100)
    keep = ingest.open(hello(relay="keep"))
    ingest.receive(keep, chunk(range(100_000, 100_300), last=True))
    s = ingest.open(hello(relay="go"))
    ingest.receive(s, chunk(range(1, 1001), last=True))
    ingest.receive(s, delta(2, stored=list(range(2000, 2100))))
    while ingest.run(100):
        pass

    def no_pass(self, n):
        raise AssertionError("a pass over the whole table")

    monkeypatch.setattr(KvIndex, "_clear_bit", no_pass)
    ingest.close(s)
    assert ingest.has_work()
    steps = 0
    while ingest.run(100):
        steps += 1
    assert steps >= 10  # 1,100 blocks, 100 a step
    (kept,) = table.pools["p"].kv_sources
    assert index.sources() == [kept] and index.total_blocks() == 300


@KV_STATES
def test_an_ending_stream_during_its_snapshot_build_leaves_nothing(kv_state):
    ingest, table, index = make(kv_state, step_blocks=100)
    s = ingest.open(hello())
    ingest.receive(s, chunk(range(1, 1001), last=True))
    ingest.run(300)
    ingest.close(s)
    while ingest.run(100):
        pass
    assert index.sources() == [] and index.total_blocks() == 0
    assert ingest.snapshot_blocks_held == 0 and "p" not in table.pools


@KV_STATES
async def test_the_serving_loop_applies_a_snapshot_through_its_worker(kv_state):
    router, _stub, channel = await start_router(snapshot_step_blocks=1000, kv_state=kv_state)
    try:
        relay = FakeRelay(f"127.0.0.1:{router.port}")
        await relay.open("p1")
        await relay.send(kv_snapshot=tm.KvSnapshot(snapshot_id=1, last=True, block_hashes=range(1, 20_001)))
        await eventually(lambda: "p1" in router.core.table.pools and router.core.table.pools["p1"].kv_sources)
        (source,) = router.core.table.pools["p1"].kv_sources
        assert router.core.index.block_count(source) == 20_000
        await relay.close()
        await eventually(lambda: router.core.index.sources() == [])
    finally:
        await channel.close()
        await router.handle.server.stop(0)


@KV_STATES
async def test_stop_does_not_remove_leaving_streams_blocks(kv_state):
    router, _stub, channel = await start_router(kv_state=kv_state)
    try:
        relay = FakeRelay(f"127.0.0.1:{router.port}")
        await relay.open("p1")
        await relay.send(kv_snapshot=tm.KvSnapshot(snapshot_id=1, last=True, block_hashes=range(1, 1001)))
        await eventually(lambda: "p1" in router.core.table.pools and router.core.table.pools["p1"].kv_sources)
        router.telemetry.end_streams()
        await relay.send(heartbeat=tm.TelemetryHeartbeat())
        with pytest.raises(grpc.aio.AioRpcError):
            await relay.read()
        await eventually(lambda: "p1" not in router.core.table.pools)
        await asyncio.sleep(0)
        assert not router.telemetry._ingest.has_work()
        await relay.close()
    finally:
        await channel.close()
        await router.handle.server.stop(0)


def test_a_stream_whose_block_list_outgrew_its_set_is_still_removed_whole(monkeypatch):
    from globalrouter import telemetry_ingest

    monkeypatch.setattr(telemetry_ingest, "LOG_TAIL", 8)
    monkeypatch.setattr(telemetry_ingest, "LOG_FLOOR", 4)
    ingest, table, index = make(step_blocks=100)
    s = ingest.open(hello())
    ingest.receive(s, chunk(range(1, 11), last=True))
    ingest.run(0)
    for i in range(20):  # stores of blocks evicted again: the list grows, the set does not
        ingest.receive(
            s,
            delta(
                2 + i,
                stored=range(1000 + 8 * i, 1008 + 8 * i),
                removed=range(1000 + 8 * (i - 1), 1000 + 8 * i) if i else (),
            ),
        )
    assert s.log is None  # given up: bounded memory, the end is one pass over the table
    assert index.block_count(s.source) == 18
    ingest.close(s)
    ingest.run(0)
    assert index.sources() == [] and index.total_blocks() == 0 and "p" not in table.pools


async def test_every_refused_hello_is_logged_with_its_reason():
    router, _stub, channel = await start_router()
    try:
        a, b = FakeRelay(f"127.0.0.1:{router.port}"), FakeRelay(f"127.0.0.1:{router.port}")
        await a.open("p1", relay_id="relay-a", block_size=16)
        with capture_logs() as logs:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await b.open("p1", relay_id="relay-b", block_size=1)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reason_of(err.value) == Reason.TELEMETRY_BLOCK_SIZE_MISMATCH
        refused = [e for e in logs if e["event"] == "telemetry stream refused"]
        assert refused and refused[0]["reason"] == "TELEMETRY_BLOCK_SIZE_MISMATCH"
        assert refused[0]["pool_id"] == "p1" and refused[0]["relay_id"] == "relay-b"
        await a.close()
        await b.close()
    finally:
        await channel.close()
        await router.handle.server.stop(0)


@KV_STATES
@pytest.mark.parametrize("seed", range(12))
def test_stepped_ingestion_matches_a_plain_set_model(seed, kv_state):
    """Random opens (rising or equal incarnations), snapshots, deltas, closes and partial steps:
    whenever the work is done, every live stream's applied set is what its messages say, and once
    every stream is gone nothing is left in the index or the budgets. (With the summary, whose
    relays of one pool share the pool's set, each relay streams for a pool of its own.)"""
    rnd = random.Random(seed)
    ingest, table, index = make(kv_state, step_blocks=rnd.choice([7, 50, 300]))
    summary = kv_state == "summary"
    live: dict[str, StreamState] = {}
    pending: dict[str, set[int]] = {}  # a snapshot sent but maybe not yet swapped in
    incarnation: dict[str, int] = {}
    seq: dict[str, int] = {}
    for _ in range(300):
        relay = rnd.choice("abc")
        op = rnd.random()
        s = live.get(relay)
        if s is None or op < 0.05:
            incarnation[relay] = incarnation.get(relay, 0) + rnd.choice([0, 1])
            pool = relay if summary else "p"
            live[relay] = ingest.open(hello(pool=pool, relay=relay, incarnation=max(1, incarnation[relay])))
            pending.pop(relay, None)
        elif op < 0.25:
            blocks = set(rnd.sample(range(1, 400), rnd.randint(0, 120)))
            seq[relay] = rnd.randint(1, 1000)
            ordered = sorted(blocks)
            half = len(ordered) // 2
            ingest.receive(s, chunk(ordered[:half], sequence=seq[relay]))
            ingest.receive(s, chunk(ordered[half:], index=1, last=True, sequence=seq[relay]))
            pending[relay] = blocks
        elif op < 0.8 and relay in pending:
            seq[relay] += 1
            stored = set(rnd.sample(range(1, 400), rnd.randint(0, 20)))
            removed = set(rnd.sample(range(1, 400), rnd.randint(0, 20)))
            # 0<->1 transitions, as a relay sends them (the summary keeps an entry per store)
            removed &= pending[relay]
            stored -= pending[relay] - removed
            ingest.receive(s, delta(seq[relay], stored=sorted(stored), removed=sorted(removed)))
            pending[relay] = (pending[relay] - removed) | stored
        elif op < 0.9:
            ingest.close(s)
            del live[relay]
            pending.pop(relay, None)
        ingest.run(rnd.choice([1, 10, 100]))
        if rnd.random() < 0.2:
            ingest.run(0)
            for r, st in live.items():
                if r in pending:
                    assert st.source and index.block_count(st.source) == len(pending[r])
                    for b in pending[r]:
                        assert st.source in index.prefix_overlaps([b])
            assert sorted(src for p in table.pools.values() for src in p.kv_sources) == sorted(
                st.source for st in live.values() if st.source
            )
    for st in list(live.values()):
        ingest.close(st)
    ingest.run(0)
    assert index.sources() == [] and index.total_blocks() == 0
    assert ingest.snapshot_blocks_held == 0 and ingest.held_by_relay == {} and table.pools == {}


@KV_STATES
def test_stopping_drops_queued_index_work_and_leaving_streams_queue_none(kv_state):
    """On stop the index goes with the process: a half-built snapshot, a queued removal and the
    streams that end afterwards leave no work (the worker would otherwise spend the grace on it)."""
    ingest, _table, _index = make(kv_state, step_blocks=100)
    # Pools of their own: a summary pool's second stream would join the first's set, not build one.
    done, half, whole = (ingest.open(hello(pool=r, relay=r)) for r in ("done", "half", "whole"))
    ingest.receive(done, chunk(range(1, 1001), last=True))
    while ingest.run(100):
        pass
    ingest.receive(half, chunk(range(2001, 3001), last=True))
    ingest.run(300)  # part of it in the index
    ingest.receive(whole, chunk(range(4001, 5001), last=True))
    assert ingest.has_work()
    ingest.stop()
    assert not ingest.has_work()
    for s in (done, half, whole):
        ingest.close(s)
        assert not ingest.has_work()


@KV_STATES
def test_snapshots_arriving_after_stop_queue_no_index_work(kv_state):
    ingest, _table, index = make(kv_state, step_blocks=100)
    s = ingest.open(hello())
    ingest.stop()
    ingest.receive(s, chunk(range(1, 1001), last=True))
    assert not ingest.run(100) and not ingest.has_work()
    assert index.total_blocks() == 0


def test_the_default_total_budget_holds_a_restart_of_the_target_fleet():
    """After a restart every relay of the target fleet (1,000 pools x 2 relays x 100,000 blocks,
    issue 19's ready goal) sends its whole snapshot at once: the default budget across streams holds
    them all (at 134,217,728 blocks 180 streams were refused in that storm and their pools came back
    last, up to 100 s later), and the ingest's own default is the frontend's."""
    import inspect

    from globalrouter.config import RouterConfig

    storm = 1_000 * 2 * 100_000
    assert RouterConfig().max_snapshot_blocks_total >= storm
    default = inspect.signature(TelemetryIngest).parameters["max_snapshot_blocks_total"].default
    assert default == RouterConfig().max_snapshot_blocks_total
    # Still a bound: 8 bytes a block, at most a few GiB of packed snapshots.
    assert RouterConfig().max_snapshot_blocks_total * 8 <= 4 * 2**30

"""Streams owing a snapshot read it a few at a time: slots in arrival order, an idle bound that
passes a quiet relay's slot on, and over real gRPC a second stream's snapshot left unread in its
connection until the first's is in."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest

from globalrouter.snapshot_readers import SnapshotReaders
from meshkit.blocks import block_hashes
from poolrelay.v1 import telemetry_pb2
from tests.router.fakes import FakeRelay, eventually, start_router

pytestmark = pytest.mark.timeout(30)


class FakeLater:
    """call_later that runs nothing until the test fires it."""

    class Handle:
        def __init__(self, delay: float, callback: Callable[[], None]) -> None:
            self.delay, self.callback, self.cancelled = delay, callback, False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self) -> None:
        self.handles: list[FakeLater.Handle] = []

    def __call__(self, delay: float, callback: Callable[[], None]) -> FakeLater.Handle:
        handle = FakeLater.Handle(delay, callback)
        self.handles.append(handle)
        return handle

    def live(self) -> list[FakeLater.Handle]:
        return [h for h in self.handles if not h.cancelled]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_slots_go_to_waiting_streams_in_arrival_order():
    readers = SnapshotReaders(slots=2, later=FakeLater())
    a, b, c, d = (readers.turn() for _ in range(4))
    await a.take()
    await b.take()
    waits = [asyncio.create_task(t.take()) for t in (c, d)]
    await settle()
    assert (readers.reading, readers.waiting) == (2, 2)
    assert not c.holding and not d.holding
    a.give_back()
    await settle()
    assert c.holding and not d.holding  # the first to wait, first served
    b.give_back()
    await settle()
    assert d.holding and (readers.reading, readers.waiting) == (2, 0)
    await asyncio.gather(*waits)
    c.give_back()
    d.give_back()
    c.give_back()  # giving back twice frees one slot, not two
    assert readers.reading == 0
    assert readers._free is not None and readers._free._value == 2


async def test_a_quiet_relays_slot_goes_to_the_next_stream_after_the_idle_bound():
    later = FakeLater()
    readers = SnapshotReaders(slots=1, idle=1.5, later=later)
    quiet, next_ = readers.turn(), readers.turn()
    await quiet.take()
    (bound,) = later.live()
    assert bound.delay == 1.5
    waiting = asyncio.create_task(next_.take())
    await settle()
    assert not next_.holding
    bound.callback()  # no snapshot chunk within the bound
    await settle()
    assert next_.holding and not quiet.holding and readers.idled == 1
    # The quiet stream reads the rest of its snapshot without a slot (it does not queue again,
    # holding its partial snapshot), until it owes none.
    await asyncio.wait_for(quiet.take(), 1)
    assert quiet.engaged and not quiet.holding and readers.waiting == 0
    quiet.give_back()
    assert not quiet.engaged and readers.reading == 1  # the other's slot is untouched
    await waiting
    next_.give_back()
    await asyncio.wait_for(quiet.take(), 1)  # its next snapshot takes a slot again
    assert quiet.holding


async def test_a_message_within_the_bound_keeps_the_slot():
    later = FakeLater()
    readers = SnapshotReaders(slots=1, idle=1.0, later=later)
    turn = readers.turn()
    await turn.take()
    turn.got()
    assert later.live() == [] and turn.holding
    await turn.take()  # the next read: still holding, a fresh bound
    assert len(later.live()) == 1 and readers.reading == 1
    await turn.take()  # a read without a chunk (a load report) leaves the running bound as it was
    assert len(later.live()) == 1
    turn.give_back()
    assert later.live() == [] and readers.reading == 0


async def test_a_stream_cancelled_while_waiting_holds_no_slot():
    readers = SnapshotReaders(slots=1, later=FakeLater())
    holder, gone, later_one = readers.turn(), readers.turn(), readers.turn()
    await holder.take()
    waiting = asyncio.create_task(gone.take())
    await settle()
    waiting.cancel()
    await settle()
    assert waiting.cancelled() and not gone.holding and readers.waiting == 0
    holder.give_back()
    await asyncio.wait_for(later_one.take(), 1)  # the slot is free: nobody took it with them
    assert later_one.holding and readers.reading == 1


async def test_no_slots_means_no_bound():
    readers = SnapshotReaders(slots=0, later=FakeLater())
    turns = [readers.turn() for _ in range(50)]
    for t in turns:
        await asyncio.wait_for(t.take(), 1)
    assert not any(t.holding for t in turns) and readers.reading == 0


@pytest.mark.parametrize(("slots", "idle", "what"), [(-1, 1.0, "slots"), (1, 0.0, "idle")])
def test_bad_settings_are_refused_naming_what_is_wrong(slots, idle, what):
    with pytest.raises(ValueError, match=what):
        SnapshotReaders(slots=slots, idle=idle)


PROMPT = list(range(64))  # four blocks of 16
HASHES = block_hashes(PROMPT, 16)


@contextlib.asynccontextmanager
async def two_relays(readers: SnapshotReaders):
    """An in-process frontend whose telemetry uses `readers`, and two relays' streams to it."""
    router, _stub, channel = await start_router()
    router.telemetry.snapshot_readers = readers
    first, second = FakeRelay(f"127.0.0.1:{router.port}"), FakeRelay(f"127.0.0.1:{router.port}")
    try:
        yield router, first, second
    finally:
        await first.close()
        await second.close()
        await channel.close()
        await router.handle.server.stop(0)


async def test_a_second_streams_snapshot_waits_in_its_connection_until_the_first_is_in():
    readers = SnapshotReaders(slots=1, idle=60.0)
    async with two_relays(readers) as (router, first, second):
        await first.open("p1")
        await first.send(
            kv_snapshot=telemetry_pb2.KvSnapshot(snapshot_id=1, chunk_index=0, block_hashes=HASHES[:2])
        )
        await eventually(lambda: readers.reading == 1)
        await second.open("p2")
        await second.send(kv_snapshot=telemetry_pb2.KvSnapshot(snapshot_id=1, last=True, block_hashes=HASHES))
        await eventually(lambda: readers.waiting == 1)
        await settle()
        assert not router.core.table.pools["p2"].kv_sources  # sent, and not read yet
        (waiting,) = [s for (pool, _), s in router.ingest.streams.items() if pool == "p2"]
        assert waiting.next_chunk == 0  # its chunk is still in the connection, not half-applied
        sample = router.metrics.registry.get_sample_value
        assert sample("globalrouter_telemetry_snapshot_readers", {"state": "reading"}) == 1
        assert sample("globalrouter_telemetry_snapshot_readers", {"state": "waiting"}) == 1
        assert sample("globalrouter_telemetry_snapshot_slots_idled_total") == 0
        await first.send(
            kv_snapshot=telemetry_pb2.KvSnapshot(
                snapshot_id=1, chunk_index=1, last=True, block_hashes=HASHES[2:]
            )
        )
        await eventually(lambda: bool(router.core.table.pools["p2"].kv_sources))
        await eventually(lambda: bool(router.core.table.pools["p1"].kv_sources))
        # Both owe nothing now: their later messages are read without a slot.
        await eventually(lambda: (readers.reading, readers.waiting) == (0, 0))
        await first.send(kv_delta=telemetry_pb2.KvDelta(sequence=1))
        await second.send(kv_delta=telemetry_pb2.KvDelta(sequence=1))
        await settle()
        assert (readers.reading, readers.waiting) == (0, 0)


def chunk(snapshot_id: int, index: int, hashes, last: bool = False) -> telemetry_pb2.KvSnapshot:
    return telemetry_pb2.KvSnapshot(
        snapshot_id=snapshot_id, chunk_index=index, block_hashes=hashes, last=last
    )


async def test_a_snapshot_the_relay_begins_by_itself_is_read_with_a_slot_too():
    # A relay whose delta queue overflowed sends a fresh snapshot unasked: the stream owes none
    # by its sequence, and is partway through one.
    readers = SnapshotReaders(slots=1, idle=60.0)
    async with two_relays(readers) as (router, first, second):
        await first.open("p1")
        await first.send(kv_snapshot=chunk(1, 0, HASHES[:1], last=True))
        await eventually(lambda: bool(router.core.table.pools["p1"].kv_sources))
        await eventually(lambda: readers.reading == 0)
        await first.send(kv_snapshot=chunk(2, 0, HASHES[:2]))  # unasked, not its last chunk
        await eventually(lambda: readers.reading == 1)
        await second.open("p2")
        await second.send(kv_snapshot=chunk(1, 0, HASHES, last=True))
        await eventually(lambda: readers.waiting == 1)
        await first.send(kv_snapshot=chunk(2, 1, HASHES[2:], last=True))
        await eventually(lambda: bool(router.core.table.pools["p2"].kv_sources))
        await eventually(lambda: (readers.reading, readers.waiting) == (0, 0))


async def test_reports_do_not_keep_a_slot_whose_snapshot_stalled():
    later = FakeLater()
    readers = SnapshotReaders(slots=1, idle=1.0, later=later)
    async with two_relays(readers) as (router, first, second):
        await first.open("p1")
        await first.send(kv_snapshot=chunk(1, 0, HASHES[:2]))
        # One bound armed at the slot's grant (ended by the chunk), one after it for the next read.
        await eventually(lambda: len(later.handles) == 2 and len(later.live()) == 1)
        (bound,) = later.live()
        await second.open("p2")
        await second.send(kv_snapshot=chunk(1, 0, HASHES, last=True))
        await eventually(lambda: readers.waiting == 1)
        for _ in range(3):  # reports, no chunk: the same bound keeps running
            await first.send(load=telemetry_pb2.LoadReport())
        await eventually(lambda: router.core.table.pools["p1"].load_at is not None)
        assert later.live() == [bound]
        bound.callback()  # a second without a chunk
        await eventually(lambda: bool(router.core.table.pools["p2"].kv_sources))
        assert readers.idled == 1
        # The first stream reads the rest of its snapshot without waiting for a slot.
        await first.send(kv_snapshot=chunk(1, 1, HASHES[2:], last=True))
        await eventually(lambda: bool(router.core.table.pools["p1"].kv_sources))
        await eventually(lambda: (readers.reading, readers.waiting) == (0, 0))


async def test_a_slot_holder_replaced_by_a_newer_stream_frees_its_slot():
    readers = SnapshotReaders(slots=1, idle=60.0)
    async with two_relays(readers) as (router, old, new):
        await old.open("p1", incarnation=1)
        await old.send(kv_snapshot=chunk(1, 0, HASHES[:2]))
        await eventually(lambda: readers.reading == 1)
        await new.open("p1", incarnation=2)  # supersedes the holder
        await new.send(kv_snapshot=chunk(1, 0, HASHES, last=True))
        await eventually(lambda: bool(router.core.table.pools["p1"].kv_sources))
        await eventually(lambda: (readers.reading, readers.waiting) == (0, 0))

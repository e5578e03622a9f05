"""The mocker's three gRPC services through a real in-process aio server."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from globalrouter.v1 import pool_frontend_pb2 as pf
from meshkit.errors import Reason, reason_of
from meshkit.timeconv import duration, wall_seconds
from meshkit.validation import bad_request_fields
from mocker.config import Faults
from mocker.tokens import continue_sequence
from mocker.v1 import admin_pb2 as adm
from poolrelay.v1 import pool_events_pb2 as pe

pytestmark = pytest.mark.timeout(30)


def request(**fields) -> pf.PoolFrontendServiceGenerateRequest:
    base: dict[str, Any] = dict(request_id="r1", model="m", token_ids=list(range(40)), max_tokens=5)
    base.update(fields)
    return pf.PoolFrontendServiceGenerateRequest(**base)


async def first_error(call) -> grpc.aio.AioRpcError:
    """The error a call (unary or streaming) ends with; fails the test when it succeeds."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    return e.value


async def read_tokens(call) -> tuple[list[int], grpc.aio.AioRpcError | None]:
    """Reads a Generate call (already started with read()) to its end: (tokens, error or None)."""
    tokens: list[int] = []
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            tokens.extend(msg.tokens.token_ids)
    except grpc.aio.AioRpcError as exc:
        return tokens, exc
    return tokens, None


async def read_all(call) -> list[pf.PoolFrontendServiceGenerateResponse]:
    """The rest of a Generate call already read from with read()."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def test_generate_streams_admission_tokens_finish_and_reuses_the_cache(serve_pool):
    s = await serve_pool(block_size=16)
    prompt = list(range(100))
    admission, tokens, finish = await s.generate(prompt, 30)
    assert (admission.prompt_blocks, admission.cached_blocks) == (6, 0)
    assert tokens == continue_sequence(prompt, 30)
    assert finish.reason == pf.POOL_FINISH_REASON_LENGTH and finish.tokens_generated == 30
    again, _, _ = await s.generate(prompt, 1)
    assert (again.worker_id, again.cached_blocks) == (admission.worker_id, 6)
    # A migrated request (prompt + first k) continues exactly as the uninterrupted one.
    # Finished output blocks stay cached too: the continuation finds all 7 of its full blocks.
    resumed, tail, _ = await s.generate(prompt + tokens[:12], 18)
    assert tail == tokens[12:]
    assert (resumed.worker_id, resumed.cached_blocks, resumed.prompt_blocks) == (admission.worker_id, 7, 7)
    stats = await s.admin.GetPoolStats(adm.GetPoolStatsRequest())
    assert (stats.requests_admitted, stats.requests_finished, stats.tokens_generated) == (3, 3, 49)
    assert (stats.prompt_blocks, stats.cached_blocks) == (6 + 6 + 7, 0 + 6 + 7)


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"request_id": ""}, ["request_id"]),
        ({"request_id": "x" * 129}, ["request_id"]),
        ({"request_id": "a\nb"}, ["request_id"]),
        ({"model": ""}, ["model"]),
        ({"token_ids": []}, ["token_ids"]),
        ({"token_ids": [1] * 1_048_577}, ["token_ids"]),
        ({"max_tokens": 0}, ["max_tokens"]),
        ({"max_tokens": 1_048_577}, ["max_tokens"]),
        (
            {"request_id": "", "model": "", "token_ids": [], "max_tokens": 0},
            ["request_id", "model", "token_ids", "max_tokens"],
        ),
    ],
)
async def test_malformed_requests_name_every_bad_field(serve_pool, fields, bad):
    s = await serve_pool()
    err = await first_error(s.frontend.Generate(request(**fields)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err) == bad
    for name in bad:
        assert name in err.details()


async def test_unknown_model_and_not_ready_model(serve_pool):
    s = await serve_pool()
    err = await first_error(s.frontend.Generate(request(model="other")))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "other" in err.details()
    assert reason_of(err) == Reason.MODEL_NOT_SERVED
    err = await first_error(s.frontend.Generate(request(model="cold")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not ready" in err.details()
    assert reason_of(err) == Reason.MODEL_NOT_READY
    await s.admin.SetModelReady(adm.SetModelReadyRequest(model="cold", ready=True))
    _, tokens, _ = await s.generate(list(range(40)), 5, model="cold")
    assert len(tokens) == 5
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await s.admin.SetModelReady(adm.SetModelReadyRequest(model="other", ready=True))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_queue_full_is_resource_exhausted_and_refuse_all_too(serve_pool):
    # One slot, no queue, slow decode: one long request fills the pool.
    s = await serve_pool(workers=1, max_running_per_worker=1, max_queue=0, speedup=1.0)
    long_call = s.frontend.Generate(request(max_tokens=10_000))
    first = await long_call.read()
    assert first.HasField("admission")
    err = await first_error(s.frontend.Generate(request(request_id="r2")))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.details()
    assert reason_of(err) == Reason.QUEUE_FULL
    long_call.cancel()

    await s.admin.SetFaults(adm.SetFaultsRequest(refuse_all=True))
    err = await first_error(s.frontend.Generate(request(request_id="r3")))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "refuses all" in err.details()
    assert reason_of(err) == Reason.POOL_REFUSING
    stats = await s.admin.GetPoolStats(adm.GetPoolStatsRequest())
    assert stats.requests_refused == 2


async def test_a_request_waiting_for_a_slot_is_told_so_when_it_asks(serve_pool):
    s = await serve_pool(
        workers=1, max_running_per_worker=1, max_queue=2, speedup=1.0, queue_report_interval=0.2
    )
    long_call = s.frontend.Generate(request(max_tokens=10_000))
    assert (await long_call.read()).HasField("admission")
    asks = s.frontend.Generate(request(request_id="r2", queue_updates=True, combine_messages=True))
    first = [await asks.read() for _ in range(3)]
    assert [m.WhichOneof("payload") for m in first] == ["admission", "queued", "queued"]
    assert first[1].queued.position == 1
    quiet = s.frontend.Generate(request(request_id="r3"))  # did not ask: no PoolQueued
    assert (await quiet.read()).HasField("admission")
    long_call.cancel()
    rest = await read_all(asks)
    kinds = [m.WhichOneof("payload") for m in rest]
    assert "tokens" in kinds and set(kinds) <= {"queued", "tokens"}, kinds
    assert "queued" not in kinds[kinds.index("tokens") :], "no PoolQueued once it runs"
    assert [t for m in rest for t in m.tokens.token_ids] == continue_sequence(list(range(40)), 5)
    quiet_rest = await read_all(quiet)
    assert {m.WhichOneof("payload") for m in quiet_rest} == {"tokens", "finish"}


async def test_cancelled_caller_frees_its_slot(serve_pool):
    s = await serve_pool(workers=1, max_running_per_worker=1, max_queue=0, speedup=1.0)
    call = s.frontend.Generate(request(max_tokens=10_000))
    await call.read()
    call.cancel()

    async def closed() -> None:  # the pool notifies its changes when it closes a ticket
        while s.pool.tickets:
            await s.pool.changes.wait_newer(s.pool.changes.version, 1.0)

    await asyncio.wait_for(closed(), 10)  # a cancel crossing real gRPC: seconds on a loaded machine
    _, tokens, _ = await s.generate(list(range(8)), 1)
    assert len(tokens) == 1


async def test_fail_after_tokens_sends_exactly_that_many_then_the_process_exits(serve_pool):
    s = await serve_pool(faults=Faults(fail_after_tokens=10))
    call = s.frontend.Generate(request(max_tokens=50))
    got: list[int] = []
    with pytest.raises(grpc.aio.AioRpcError):
        async for msg in call:
            got.extend(msg.tokens.token_ids)
    assert got == continue_sequence(list(range(40)), 10)
    assert s.exits == [1]


async def test_added_latency_delays_admission(serve_pool):
    s = await serve_pool()
    await s.admin.SetFaults(adm.SetFaultsRequest(added_latency=duration(0.3)))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await s.generate(list(range(8)), 1)
    assert loop.time() - t0 >= 0.3
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await s.admin.SetFaults(adm.SetFaultsRequest(added_latency=duration(-1)))
    assert bad_request_fields(e.value) == ["added_latency"]


async def test_kv_stream_snapshot_then_events_replays_to_worker_blocks(serve_pool):
    s = await serve_pool(worker_capacity_blocks=8, block_size=4, workers=2)
    await s.generate(list(range(16)), 1)  # state before subscribing lands in the snapshot
    stream = s.events.WatchKvEvents(pe.WatchKvEventsRequest())
    held: dict[str, set[int]] = {}
    last: dict[str, int] = {}
    for _ in range(2):
        msg = await stream.read()
        assert msg.HasField("snapshot")
        held[msg.snapshot.worker_id] = set(msg.snapshot.block_hashes)
        last[msg.snapshot.worker_id] = msg.snapshot.event_id
    assert sorted(held) == ["worker-0", "worker-1"]
    assert len(held["worker-0"]) == 4
    # Enough distinct prompts, two at a time, to spread over both workers and force evictions.
    for i in range(6):
        await asyncio.gather(
            s.generate([1000 * i + t for t in range(20)], 2, request_id=f"a{i}"),
            s.generate([50_000 + 1000 * i + t for t in range(12)], 2, request_id=f"b{i}"),
        )
    want = {w.worker_id: w.event_id for w in s.pool.workers}
    removed = 0
    while last != want:
        ev = (await stream.read()).event
        assert ev.event_id == last[ev.worker_id] + 1, "events must be gap-free per worker"
        last[ev.worker_id] = ev.event_id
        held[ev.worker_id] |= set(ev.stored)
        held[ev.worker_id] -= set(ev.removed)
        removed += len(ev.removed)
    assert removed > 0
    blocks = await s.admin.GetWorkerBlocks(adm.GetWorkerBlocksRequest())
    assert {w.worker_id: set(w.block_hashes) for w in blocks.workers} == held
    assert all(len(w.block_hashes) == 8 for w in blocks.workers)
    assert [list(w.block_hashes) for w in blocks.workers] == [w.cache.blocks() for w in s.pool.workers]
    stream.cancel()


async def test_slow_kv_subscriber_is_ended_and_resubscribes_to_a_fresh_snapshot(serve_pool):
    s = await serve_pool(kv_subscriber_queue=3, workers=1)
    stream = s.events.WatchKvEvents(pe.WatchKvEventsRequest())
    assert (await stream.read()).HasField("snapshot")
    worker = s.pool.workers[0]
    for i in range(10):  # a burst faster than the subscriber can take (all in one loop step)
        worker.store([i])
    events = []
    with pytest.raises(grpc.aio.AioRpcError) as e:
        while True:
            events.append((await stream.read()).event.event_id)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "re-subscribe" in e.value.details()
    assert events == list(range(1, len(events) + 1))  # what was delivered has no gap
    fresh = s.events.WatchKvEvents(pe.WatchKvEventsRequest())
    snap = (await fresh.read()).snapshot
    assert snap.event_id == 10 and list(snap.block_hashes) == list(range(10))
    fresh.cancel()


async def test_status_stream_is_complete_and_follows_changes(serve_pool):
    s = await serve_pool(workers=3, speedup=2.0, prefill_tokens_per_second=1000.0, block_size=8)
    stream = s.events.WatchPoolStatus(pe.WatchPoolStatusRequest(interval=duration(60)))
    first = await stream.read()
    assert [(m.model, m.state) for m in first.models] == [
        ("cold", pe.MODEL_STATE_NOT_READY),
        ("m", pe.MODEL_STATE_READY),
    ]
    assert [w.worker_id for w in first.workers] == ["worker-0", "worker-1", "worker-2"]
    assert (first.block_size, first.pool_id, first.sequence) == (8, "p", 1)
    assert first.prefill_tokens_per_second == 6000
    assert first.load.kv_blocks_total == 3 * 4096 and first.load.max_running_requests == 12
    assert first.load.max_waiting_requests == 64
    assert first.drain.state == pe.DRAIN_STATE_ACTIVE
    await s.admin.SetModelReady(adm.SetModelReadyRequest(model="cold", ready=True))
    # Pushed on the change, long before the 60 s interval (10 s allows a loaded machine; a 5 s
    # interval with a 2 s wait would fail whenever the push took longer).
    nxt = await asyncio.wait_for(stream.read(), 10.0)
    assert nxt.sequence == 2 and all(m.state == pe.MODEL_STATE_READY for m in nxt.models)
    stream.cancel()

    for bad in (duration(0.001), duration(-1)):
        err = await first_error(s.events.WatchPoolStatus(pe.WatchPoolStatusRequest(interval=bad)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_request_fields(err) == ["interval"]


async def test_status_repeats_every_interval(serve_pool):
    s = await serve_pool()
    stream = s.events.WatchPoolStatus(pe.WatchPoolStatusRequest(interval=duration(0.05)))
    seqs = [(await asyncio.wait_for(stream.read(), 5.0)).sequence for _ in range(4)]
    assert seqs == [1, 2, 3, 4]
    stream.cancel()


async def test_drain_finishes_accepted_refuses_new_hands_back_at_deadline(serve_pool):
    # decode 50 tok/s x 100 = 5,000 tok/s: 200 tokens take 0.04 s, 10^6 tokens 200 s.
    s = await serve_pool()
    status = s.events.WatchPoolStatus(pe.WatchPoolStatusRequest(interval=duration(0.05)))
    long_call = s.frontend.Generate(request(request_id="long", max_tokens=1_000_000))
    short_call = s.frontend.Generate(request(request_id="short", token_ids=list(range(9)), max_tokens=200))
    assert (await long_call.read()).HasField("admission")
    assert (await short_call.read()).HasField("admission")

    err = await first_error(s.events.StartDrain(pe.StartDrainRequest()))
    assert bad_request_fields(err) == ["timeout"]
    reply = await s.events.StartDrain(pe.StartDrainRequest(timeout=duration(2.0), reason="test"))
    assert reply.drain.state == pe.DRAIN_STATE_DRAINING
    again = await s.events.StartDrain(pe.StartDrainRequest(timeout=duration(60), reason="test"))
    assert wall_seconds(again.drain.deadline) == wall_seconds(reply.drain.deadline)

    err = await first_error(s.frontend.Generate(request(request_id="late")))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
    assert reason_of(err) == Reason.POOL_DRAINING

    short_tokens, short_error = await read_tokens(short_call)
    assert short_error is None and short_tokens == continue_sequence(list(range(9)), 200)

    got, error = await read_tokens(long_call)
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "drain deadline: handed back"
    assert reason_of(error) == Reason.DRAIN_HANDED_BACK
    assert got == continue_sequence(list(range(40)), len(got))  # the caller can continue from here

    states: list[int] = []
    while not states or states[-1] != pe.DRAIN_STATE_DRAINED:
        states.append((await asyncio.wait_for(status.read(), 5.0)).drain.state)
    assert pe.DRAIN_STATE_DRAINING in states
    status.cancel()
    stats = await s.admin.GetPoolStats(adm.GetPoolStatsRequest())
    assert (stats.requests_finished, stats.requests_handed_back, stats.requests_refused) == (1, 1, 1)


async def test_generate_is_measured_as_received_not_with_byte_size(serve_pool, monkeypatch):
    """The mocker registers PoolFrontendService with SizedDeserializers (meshkit.limits.add_sized_servicer):
    a Generate is not measured again with ByteSize() after decoding. Fails on the code that used the
    generated registration (the size-cap interceptor's ByteSize() raised: UNKNOWN)."""

    def raising(self):
        raise AssertionError("ByteSize() called on a received Generate")

    s = await serve_pool(block_size=16)
    monkeypatch.setattr(pf.PoolFrontendServiceGenerateRequest, "ByteSize", raising)
    prompt = list(range(16_384))
    admission, tokens, finish = await s.generate(prompt, 3)
    assert tokens == continue_sequence(prompt, 3) and finish.reason == pf.POOL_FINISH_REASON_LENGTH
    assert admission.prompt_blocks == 1024


async def test_a_generate_over_its_8_mib_cap_is_still_refused(serve_pool):
    s = await serve_pool(block_size=16)
    err = await first_error(s.frontend.Generate(request(request_id="x" * (9 << 20))))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # the server's receive limit is the cap
    assert (await s.generate(list(range(20)), 2))[1] == continue_sequence(list(range(20)), 2)  # still serving

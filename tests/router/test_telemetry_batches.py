"""TelemetryBatch at the frontend: its ack accepts batches, a batch leaves the same state as its
messages one by one, bad batches are refused naming the field, relays of either kind interoperate."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from globalrouter import serve_cli
from globalrouter.cli import build_parser
from globalrouter.config import RouterConfig
from globalrouter.kv_summary import KvSummary
from globalrouter.selection import pool_overlaps
from meshkit import settings
from meshkit.blocks import block_hashes
from meshkit.clock import SystemClock
from meshkit.timeconv import seconds
from meshkit.validation import bad_request_fields
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.telemetry_publisher import TelemetryConfig, TelemetryHub
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import telemetry_pb2 as tm
from tests.router.fakes import FakeRelay, eventually, start_router

pytestmark = pytest.mark.timeout(30)
Req = tm.PublishPoolTelemetryRequest
PROMPT = list(range(64))  # four blocks of 16
HASHES = block_hashes(PROMPT, 16)


@pytest.fixture(params=["exact", "summary"])
async def router(request):
    r, _stub, channel = await start_router(kv_state=request.param)
    yield r
    await channel.close()
    await r.handle.server.stop(0)


def overlaps(router, pool_id: str) -> int:
    """The pool's cached prefix of PROMPT once what the messages logged is folded (a decision's
    read of the summary sees it within FOLD_EVERY: test_telemetry_summary)."""
    if isinstance(router.core.index, KvSummary):
        router.core.index.fold()
    pool = router.core.table.pools[pool_id]
    now = router.clock.monotonic()
    hashes = block_hashes(PROMPT, pool.block_size)
    return pool_overlaps(router.core.index, [pool], hashes, now, router.config.freshness)[pool_id]


def state(router, pool_id: str) -> tuple:
    """What the selection sees of a pool (times aside)."""
    p = router.core.table.pools[pool_id]
    return (
        p.load,
        p.models_ready,
        p.adapters,
        p.telemetry_draining,
        overlaps(router, pool_id),
        len(p.kv_sources),
    )


SCRIPT = [
    Req(load=tm.LoadReport(load=pe.PoolLoad(requests_running=3, max_running_requests=8))),
    Req(
        readiness=tm.ReadinessReport(
            models=[pe.ModelStatus(model="m", state=pe.MODEL_STATE_READY, adapters=["lora-a"])]
        )
    ),
    Req(kv_delta=tm.KvDelta(sequence=6, stored=HASHES[2:4])),
    Req(kv_delta=tm.KvDelta(sequence=7, removed=[HASHES[3]])),
    Req(drain=tm.DrainReport(drain=pe.DrainStatus(state=pe.DRAIN_STATE_DRAINING))),
    Req(heartbeat=tm.TelemetryHeartbeat()),
    Req(load=tm.LoadReport(load=pe.PoolLoad(requests_running=5, max_running_requests=8))),
]


async def _open(router, pool_id: str) -> FakeRelay:
    relay = FakeRelay(f"127.0.0.1:{router.port}")
    ack = await relay.open(pool_id)
    assert ack.hello_ack.accepts_batches
    await relay.send(kv_snapshot=tm.KvSnapshot(snapshot_id=1, sequence=5, last=True, block_hashes=HASHES[:2]))
    await eventually(lambda: router.core.table.pools[pool_id].kv_sources)
    return relay


async def test_a_batch_leaves_the_same_state_as_its_messages_one_by_one(router):
    one, batched = await _open(router, "p1"), await _open(router, "p2")
    messages0 = router.metrics.telemetry_messages._value.get()
    for msg in SCRIPT:
        await one.send(**{msg.WhichOneof("payload"): getattr(msg, msg.WhichOneof("payload"))})
    await batched.send_batch(*SCRIPT)

    def done(pool_id: str) -> bool:
        p = router.core.table.pools[pool_id]
        return p.telemetry_draining and p.load is not None and p.load.requests_running == 5

    await eventually(lambda: done("p1") and done("p2"))
    assert state(router, "p1") == state(router, "p2")
    assert overlaps(router, "p2") == 3 and router.core.table.pools["p2"].adapters == {
        "m": frozenset({"lora-a"})
    }
    # Each message of the batch counts in the ingest metrics, and the batch once.
    assert router.metrics.telemetry_messages._value.get() - messages0 == 2 * len(SCRIPT)
    assert router.metrics.telemetry_batches._value.get() == 1
    await one.close()
    await batched.close()


async def test_a_gap_inside_a_batch_asks_for_one_snapshot_and_the_rest_waits_for_it(router):
    relay = await _open(router, "p1")
    await relay.send_batch(
        Req(kv_delta=tm.KvDelta(sequence=6, stored=HASHES[2:3])),
        Req(kv_delta=tm.KvDelta(sequence=8, stored=HASHES[3:4])),  # 7 is missing
        Req(kv_delta=tm.KvDelta(sequence=9, removed=HASHES[:1])),  # ignored until a snapshot
        Req(heartbeat=tm.TelemetryHeartbeat()),
    )
    answer = await relay.read()
    assert answer.snapshot_request.reason == "gap: expected 7, got 8"
    assert overlaps(router, "p1") == 3  # the delta before the gap was applied, none after it
    await relay.send(kv_snapshot=tm.KvSnapshot(snapshot_id=2, sequence=20, last=True, block_hashes=HASHES))
    await relay.send_batch(
        Req(kv_delta=tm.KvDelta(sequence=21, removed=HASHES[3:])), Req(heartbeat=tm.TelemetryHeartbeat())
    )
    await eventually(lambda: overlaps(router, "p1") == 3)
    assert router.metrics.telemetry_snapshot_requests._value.get() == 1
    await relay.close()


_HELLO = Req(hello=tm.TelemetryHello(pool_id="p1", relay_id="relay-1", incarnation=1))
_BEAT = Req(heartbeat=tm.TelemetryHeartbeat())
_LOAD = Req(load=tm.LoadReport(load=pe.PoolLoad(requests_running=3)))


@pytest.mark.parametrize(
    ("inner", "field"),
    [
        ([], "batch.messages"),
        ([_BEAT] * 257, "batch.messages"),
        ([_LOAD, _HELLO], "batch.messages[1]"),
        ([Req(kv_snapshot=tm.KvSnapshot(snapshot_id=2, last=True))], "batch.messages[0]"),
        ([_LOAD, Req(batch=tm.TelemetryBatch(messages=[_BEAT]))], "batch.messages[1]"),
        ([Req()], "batch.messages[0]"),
    ],
    ids=["empty", "257-messages", "hello", "snapshot-chunk", "nested-batch", "no-payload"],
)
async def test_a_bad_batch_is_refused_naming_the_field_and_nothing_of_it_applied(router, inner, field):
    relay = await _open(router, "p1")
    await relay.send_batch(*inner)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await relay.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == [field]
    await eventually(lambda: "p1" not in router.core.table.pools)  # its stream ended; the load never landed
    await relay.close()


async def test_a_frontend_that_does_not_accept_batches_refuses_them():
    router, _stub, channel = await start_router()
    router.telemetry.accepts_batches = False  # a frontend told not to take them (acks say so)
    try:
        relay = FakeRelay(f"127.0.0.1:{router.port}")
        ack = await relay.open("p1")
        assert not ack.hello_ack.accepts_batches
        await relay.send_batch(_BEAT, _BEAT)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await relay.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_fields(err.value) == ["batch"]
        await relay.close()
    finally:
        await channel.close()
        await router.handle.server.stop(0)


async def test_the_relay_batches_to_a_real_frontend_and_its_state_arrives(router):
    """New relay, new frontend: the hub's batches land as its messages would."""
    blocks = PoolBlocks()
    blocks.apply_event("w", stored=HASHES[:2], removed=())
    config = TelemetryConfig(pool_id="p1", relay_id="relay-1", incarnation=1, region="x", report_interval=30)
    hub = TelemetryHub(config, blocks, SystemClock())
    hub.set_frontends(static=[f"http://127.0.0.1:{router.port}"])
    pub = hub.publishers[f"http://127.0.0.1:{router.port}"]
    try:
        await eventually(lambda: "p1" in router.core.table.pools and overlaps(router, "p1") == 2)
        await eventually(lambda: pub.batching)
        # Several queued at once (deltas and a drain report between two writes): one batch.
        batches0 = router.metrics.telemetry_batches._value.get()
        blocks.apply_event("w", stored=HASHES[2:3], removed=())
        hub.flush()
        blocks.apply_event("w", stored=HASHES[3:4], removed=())
        hub.flush()
        hub.set_drain(pe.DrainStatus(state=pe.DRAIN_STATE_DRAINING))
        await eventually(
            lambda: overlaps(router, "p1") == 4 and router.core.table.pools["p1"].telemetry_draining
        )
        assert router.metrics.telemetry_batches._value.get() == batches0 + 1
        assert pub.batches_sent >= 1
    finally:
        await hub.close()
        await asyncio.sleep(0)


# -- the write interval the frontend asks for (--telemetry-batch-interval) ----------------------


async def test_the_ack_asks_for_the_write_interval_only_with_the_flag():
    router, _stub, channel = await start_router(telemetry_batch_interval=0.5)
    try:
        relay = FakeRelay(f"127.0.0.1:{router.port}")
        ack = (await relay.open("p1")).hello_ack
        assert ack.accepts_batches and ack.HasField("batch_interval")
        assert seconds(ack.batch_interval) == 0.5
        await relay.close()
        # Asked only along with batches: a relay that may not batch could not honour it.
        router.telemetry.accepts_batches = False
        relay = FakeRelay(f"127.0.0.1:{router.port}")
        ack = (await relay.open("p2")).hello_ack
        assert not ack.accepts_batches and not ack.HasField("batch_interval")
        await relay.close()
    finally:
        await channel.close()
        await router.handle.server.stop(0)


async def test_without_the_flag_the_ack_asks_for_no_interval(router):
    relay = FakeRelay(f"127.0.0.1:{router.port}")
    ack = (await relay.open("p1")).hello_ack
    assert ack.accepts_batches and not ack.HasField("batch_interval")
    await relay.close()


def _serve_args(*flags: str):
    args = settings.parse_args(build_parser(), ["serve", "--discovery", "127.0.0.1:1", *flags], environ={})
    args.security = RouterConfig().security  # what cli.main adds after parsing
    return args


@pytest.mark.parametrize("value", ["-0.1", "5.01", "inf", "nan", "soon"])
def test_the_batch_interval_flag_is_checked(value, capsys):
    with pytest.raises(SystemExit):
        _serve_args("--telemetry-batch-interval", value)
    assert "argument --telemetry-batch-interval:" in capsys.readouterr().err  # not merely unknown


def test_the_batch_interval_flag_reaches_the_config_and_is_bounded_there_too():
    assert serve_cli.router_config(_serve_args()).telemetry_batch_interval == 0.0
    assert (
        serve_cli.router_config(_serve_args("--telemetry-batch-interval", "1")).telemetry_batch_interval
        == 1.0
    )
    assert (
        serve_cli.router_config(_serve_args("--telemetry-batch-interval", "5")).telemetry_batch_interval
        == 5.0
    )
    for bad in (-1.0, 5.5, float("nan")):
        with pytest.raises(ValueError, match="telemetry_batch_interval"):
            RouterConfig(telemetry_batch_interval=bad)

"""End to end: a real `poolrelay serve --engine vllm` process in front of a fake engine (HTTP + ZMQ in
process) shows each worker's poll and KV event counters on its status endpoint and in `poolrelay status`."""

from __future__ import annotations

import asyncio
import json
import subprocess

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from meshlaunch import command, free_port, wait_healthy
from meshlaunch.vllm_wire import encode, removed, stored
from poolrelay.v1 import status_pb2, status_pb2_grpc
from tests.relay.fakes import FakeDiscovery, FakeEngine, FakeEngineEvents, start_server, wait_for

pytestmark = pytest.mark.e2e

ENGINE = 32
TOKENS = list(range(700, 700 + 4 * ENGINE))


def block(i: int, parent: bytes | None) -> bytes:
    """A batch storing engine block i of TOKENS (named b"i"), chained to `parent`."""
    return encode(stored([b"%d" % i], parent, TOKENS[i * ENGINE : (i + 1) * ENGINE], ENGINE))


def start_engine_relay(procs, discovery: str, url: str, events: FakeEngineEvents) -> str:
    status = f"127.0.0.1:{free_port()}"
    p = procs.start(
        "relay",
        [
            command("poolrelay"),
            "serve",
            "--engine",
            "vllm",
            "--engine-block-size",
            str(ENGINE),
            "--engine-worker",
            f"url={url},events={events.events},replay={events.replay},id=rank0",
            "--discovery",
            discovery,
            "--routing-pool",
            "pool-e",
            "--routing-pool-region",
            "eu-west",
            "--status-listen",
            status,
        ],
    )
    wait_healthy(status, proc=p)
    return status


async def get_status(stub) -> status_pb2.GetRelayStatusResponse:
    return await stub.GetRelayStatus(status_pb2.GetRelayStatusRequest(), timeout=5)


async def worker_once(stub, predicate, message: str, within: float = 20.0) -> status_pb2.EngineWorkerStatus:
    """The only engine worker's status once `predicate` holds for it; fails naming the last one seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        (w,) = (await get_status(stub)).engine_workers
        if predicate(w):
            return w
        if loop.time() > deadline:
            raise AssertionError(f"{message} not shown within {within} s; last status: {w}")
        await asyncio.sleep(0.05)


@pytest.mark.timeout(90)
async def test_the_status_shows_each_engine_workers_feed_and_poll_counters(procs):
    discovery = FakeDiscovery()
    server, discovery_addr = await start_server((dpb_grpc.add_DiscoveryServiceServicer_to_server, discovery))
    engine, events = FakeEngine(), FakeEngineEvents()
    url = await engine.start()
    events.start()
    try:
        status = await asyncio.to_thread(start_engine_relay, procs, discovery_addr, url, events)
        # The relay subscribes and asks for what the engine buffers (nothing yet) before anything is sent.
        await events.subscribed()
        await wait_for(lambda: events.asked == [0], within=20, message="the relay's catch-up replay")
        async with grpc.aio.insecure_channel(status) as ch:
            stub = status_pb2_grpc.RelayStatusServiceStub(ch)

            await worker_once(stub, lambda w: w.replays_closed == 1, "the catch-up replay closed")
            await events.publish(0, block(0, None))
            await events.publish(1, block(1, b"0"))
            await events.publish(2, encode(removed([b"1"])), live=False)  # the relay misses it
            await events.publish(
                3, encode(stored([b"1"], b"0", TOKENS[ENGINE : 2 * ENGINE], ENGINE), removed([b"0"]))
            )
            # The relay asks for 2 and takes 2 and 3 from the replay before anything else is sent.
            await worker_once(stub, lambda w: w.last_sequence == 3, "the gap closed")
            assert events.asked == [0, 2]
            await events.send_raw([b"", b"two frames"])
            await events.publish(4, b"\xc1 not msgpack")
            await events.publish(5, block(0, None))
            w = await worker_once(
                stub,
                lambda w: w.healthy and w.last_sequence == 5 and w.malformed_dropped == 2,
                "batch 5 taken",
            )
            assert (w.worker_id, w.url, w.healthy, w.consecutive_failures, w.last_error) == (
                "rank0",
                url,
                True,
                0,
                "",
            )
            assert (w.kv_event_batches, w.kv_events_applied, w.gaps) == (6, 6, 1)
            assert (w.replays_asked, w.replays_closed, w.replayed_batches, w.duplicates_skipped) == (
                2,
                2,
                2,
                0,
            )
            assert (w.resets, w.last_reset_reason) == (1, "batch 4 could not be decoded")
            assert w.blocks == 2  # only what batch 5 stored after the reset is vouched for
            reply = await get_status(stub)
            assert reply.pool_blocks == 2

            # The operator's view: `poolrelay status --json` carries the same fields.
            out = await asyncio.to_thread(
                subprocess.run,
                [command("poolrelay"), "status", "--relay", status, "--json"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            (worker,) = json.loads(out.stdout)["engine_workers"]
            assert worker["worker_id"] == "rank0" and worker["last_sequence"] == "5"
            assert worker["gaps"] == "1" and worker["malformed_dropped"] == "2" and worker["resets"] == "1"
            text = await asyncio.to_thread(
                subprocess.run,
                [command("poolrelay"), "status", "--relay", status],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            assert f"engine rank0 {url}: healthy" in text.stdout
            assert "gaps=1 replays=2 closed=2 resets=1 malformed=2 last_seq=5" in text.stdout

            # The engine stops answering /health: failed polls, the last error, then the worker down.
            engine.up = False
            w = await worker_once(stub, lambda w: not w.healthy, "the worker down")
            assert w.consecutive_failures >= 3 and "503" in w.last_error
            assert w.resets == 2 and w.last_reset_reason.startswith("worker down: ") and w.blocks == 0
            assert not w.HasField("last_sequence"), "a reset forgets the sequence"
    finally:
        await events.close()
        await engine.runner.cleanup()
        await server.stop(0)

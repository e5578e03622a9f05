"""Load generators of the scale harness, one process each: simulated pools with their relay replicas,
counting sink frontends, and a real relay hub fed at a fixed rate.

`pools`: many simulated pools per process. Each pool holds a constant number of KV blocks: shared
prefix nodes (32 blocks = 512 trace tokens each, chained as in the traces, so pools share them) and
blocks of its own; it churns them at `--rate` block events per second. Each of its relay replicas
registers with discovery over KeepAlivePools (the relay's own client) and speaks the relay's
telemetry protocol to the frontend: hello, a chunked snapshot, numbered deltas, the periodic load,
readiness, drain and heartbeat reports, a fresh snapshot when asked, and a redial with the relay's
back-off when the stream breaks. Messages are encoded once per pool and written as bytes; to a
frontend whose hello ack accepts batches, what is queued at a write goes as one TelemetryBatch, as
the relay sends it (`--no-batch`: one message per write, as relays before batches).

`leases`: the discovery leases of a `pools` process's relays (same pools, relays and incarnation),
renewed by a process of their own so that a starved `pools` process does not let them lapse
(`pools --leases-apart STATS` then keeps none itself and waits on that process's counters).

`sinks`: N minimal TelemetryService servers that only count. `relay`: poolrelay's own TelemetryHub
and PoolBlocks fed with worker events, streaming to the given frontends.

SIGUSR1 makes a `pools` process end every relay's stream at once (each redials at once and sends a
fresh snapshot): the harness's mass redial. Every process writes its counters to a JSON file once a second (replaced atomically) and stops on
SIGTERM or after `--seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from globalrouter.replay import block_tokens
from globalrouter.trace import TRACE_BLOCK_SIZE, load_trace
from meshkit.blocks import block_hashes
from meshkit.channels import aio_channel
from meshkit.clock import SystemClock
from meshkit.logs import configure_logging
from meshkit.timeconv import duration, seconds, timestamp
from poolrelay.lease_stream import KeepAliveClient
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.retry import TELEMETRY_RECONNECT, reconnect_forever
from poolrelay.telemetry_publisher import (
    _REFUSALS,
    BATCH_BYTES,
    MAX_BATCH,
    MAX_BATCH_INTERVAL,
    PROTOCOL_VERSION,
    TelemetryConfig,
    TelemetryHub,
    batch_wire,
    varint,
)
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import telemetry_pb2 as tm
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc

MODEL = "demo-model"
BLOCK_SIZE = 16
NODE_BLOCKS = TRACE_BLOCK_SIZE // BLOCK_SIZE
"""KV blocks per trace block id (512 tokens / 16)."""
CHUNK = 16_384
"""Block hashes per snapshot chunk, as the relay's default."""
REFUSED = frozenset(code.name for code in _REFUSALS)
"""Status codes (by name) with which a frontend refuses a stream: the relay backs off, as after a failed dial."""
QUEUE_LIMIT = 1024
"""Deltas a stream queues before it drops them and sends a fresh snapshot, as the relay's default."""
PUBLISH = "/poolrelay.v1.TelemetryService/PublishPoolTelemetry"
Req = tm.PublishPoolTelemetryRequest


# ---- shared prefixes ------------------------------------------------------------------------
def prefix_nodes(trace: Path, requests: int) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """The trace's first `requests` prompts as a prefix tree of 512-token nodes.

    Returns (hashes: nodes x NODE_BLOCKS chained block hashes, uses: how many prompts pass through
    each node, tokens: each request's full-node tokens). A node is a distinct (prefix, block id):
    equal prefixes of two requests are one node, so its block hashes are shared exactly as the
    trace shares them.
    """
    ids: dict[tuple[int, int], int] = {}
    rows: list[list[int]] = []
    paths: list[list[int]] = []
    tokens: list[list[int]] = []
    for req in load_trace(trace, limit=requests):
        full = req.input_length // TRACE_BLOCK_SIZE
        parent_node, parent_hash = -1, 0
        path: list[int] = []
        toks: list[int] = []
        for hid in req.hash_ids[:full]:
            block = list(block_tokens(hid))
            toks.extend(block)
            key = (parent_node, hid)
            node = ids.get(key)
            if node is None:
                node = ids[key] = len(rows)
                rows.append(block_hashes(block, BLOCK_SIZE, parent=parent_hash))
            path.append(node)
            parent_node, parent_hash = node, rows[node][-1]
        paths.append(path)
        tokens.append(toks)
    uses = np.zeros(len(rows), dtype=np.float64)
    for path in paths:
        uses[path] += 1
    return np.array(rows, dtype=np.uint64).reshape(-1, NODE_BLOCKS), uses, tokens


# ---- wire encoding --------------------------------------------------------------------------
def _packed(field: int, values: np.ndarray) -> bytes:
    """A packed `repeated fixed64` field (empty when there are no values, as protobuf writes it)."""
    if len(values) == 0:
        return b""
    raw = values.astype("<u8", copy=False).tobytes()
    return varint(field << 3 | 2) + varint(len(raw)) + raw


def _wrap(field: int, inner: bytes) -> bytes:
    """A PublishPoolTelemetryRequest whose oneof `field` holds the message `inner`."""
    return varint(field << 3 | 2) + varint(len(inner)) + inner


def delta_message(sequence: int, stored: np.ndarray, removed: np.ndarray) -> bytes:
    """A serialized PublishPoolTelemetryRequest(kv_delta=...)."""
    inner = tm.KvDelta(sequence=sequence).SerializeToString() + _packed(2, stored) + _packed(3, removed)
    return _wrap(3, inner)


def snapshot_chunk(snapshot_id: int, sequence: int, index: int, last: bool, hashes: np.ndarray) -> bytes:
    """A serialized PublishPoolTelemetryRequest(kv_snapshot=...) carrying `hashes`."""
    head = tm.KvSnapshot(snapshot_id=snapshot_id, sequence=sequence, chunk_index=index, last=last)
    return _wrap(2, head.SerializeToString() + _packed(5, hashes))


def _splitmix(x: np.ndarray) -> np.ndarray:
    """64-bit hashes of distinct integers (distinct in, distinct out), for blocks of one pool's own."""
    # Array arithmetic wraps silently (only scalar arithmetic warns), so no np.errstate: entering
    # one was 11% of a simulator's CPU (it runs for every pool's delta, 5,000 a second at 1,000 pools).
    z = np.asarray(x).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


# ---- a simulated pool ------------------------------------------------------------------------
class SimPool:
    """One pool's block set, constant in size: `shared` prefix nodes plus a ring of its own blocks."""

    def __init__(
        self, index: int, nodes: np.ndarray, uses: np.ndarray, shared_nodes: int, own_blocks: int, seed: int
    ) -> None:
        self.index = index
        self.pool_id = f"scale-{index:04d}"
        self.nodes = nodes
        rng = np.random.default_rng(seed * 1_000_003 + index)
        # A shuffle weighted by how many prompts use a node (Efraimidis-Spirakis keys): popular
        # prefixes (system prompts, the start of long conversations) are held by most pools.
        keys = -np.log(rng.random(len(nodes))) / np.maximum(uses, 1e-9) if len(nodes) else np.zeros(0)
        self.order = np.argsort(keys)
        shared_nodes = min(shared_nodes, len(nodes) // 2)  # rotation needs nodes it does not hold
        self.held: deque[int] = deque(int(n) for n in self.order[:shared_nodes])
        self.held_set = set(self.held)
        self.next_node = shared_nodes
        self.own_counter = own_blocks
        self.ring = _splitmix(np.arange(own_blocks, dtype=np.uint64) + np.uint64(index << 40))
        self.ring_pos = 0
        self.sequence = 0
        self.shared_credit = 0.0
        self.own_credit = 0.0
        self.load = pe.PoolLoad(
            requests_running=index % 7,
            max_running_requests=64,
            max_waiting_requests=256,
            kv_blocks_total=2 * self.size,
            kv_blocks_used=self.size,
            prefill_tokens_in_flight=(index % 13) * 512,
        )

    @property
    def size(self) -> int:
        return len(self.held) * NODE_BLOCKS + len(self.ring)

    def blocks(self) -> np.ndarray:
        """The whole block set now."""
        shared = self.nodes[list(self.held)].ravel() if self.held else np.zeros(0, dtype=np.uint64)
        return np.concatenate([shared, self.ring])

    def churn(self, events: float, shared_share: float) -> tuple[np.ndarray, np.ndarray] | None:
        """About `events` block events (stores + evictions, half each); None when nothing changed."""
        self.shared_credit += events * shared_share
        self.own_credit += events * (1 - shared_share)
        stored: list[np.ndarray] = []
        removed: list[np.ndarray] = []
        while self.shared_credit >= 2 * NODE_BLOCKS and self.held:
            self.shared_credit -= 2 * NODE_BLOCKS
            for _ in range(len(self.order)):
                node = int(self.order[self.next_node % len(self.order)])
                self.next_node += 1
                if node not in self.held_set:
                    break
            old = self.held.popleft()
            self.held_set.discard(old)
            self.held.append(node)
            self.held_set.add(node)
            stored.append(self.nodes[node])
            removed.append(self.nodes[old])
        own = min(int(self.own_credit // 2), len(self.ring))
        if own:
            self.own_credit -= 2 * own
            new = _splitmix(
                np.arange(self.own_counter, self.own_counter + own, dtype=np.uint64)
                + np.uint64(self.index << 40)
            )
            self.own_counter += own
            idx = (np.arange(own) + self.ring_pos) % len(self.ring)
            removed.append(self.ring[idx].copy())
            stored.append(new)
            self.ring[idx] = new
            self.ring_pos = (self.ring_pos + own) % len(self.ring)
        if not stored:
            return None
        self.sequence += 1
        return np.concatenate(stored), np.concatenate(removed)


def distinct_blocks(
    nodes: np.ndarray, uses: np.ndarray, pools: int, blocks: int, shared_share: float, seed: int = 1
) -> int:
    """Distinct block hashes across `pools` simulated pools at their start (a shared block counts once)."""
    shared_nodes = int(blocks * shared_share) // NODE_BLOCKS
    own = blocks - shared_nodes * NODE_BLOCKS
    held: set[int] = set()
    for i in range(pools):
        held.update(SimPool(i, nodes, uses, shared_nodes, own, seed).held)
    shared = min(shared_nodes, len(nodes) // 2)
    return len(held) * NODE_BLOCKS + pools * (blocks - shared * NODE_BLOCKS)


@dataclass
class PoolStats:
    """Counters of one `pools` process (cumulative)."""

    pools: int = 0
    relays: int = 0
    blocks_per_pool: int = 0
    registered: int = 0
    register_errors: int = 0
    connects: int = 0
    hello_acks: int = 0
    streaming: int = 0
    snapshots: int = 0
    snapshot_blocks: int = 0
    snapshot_requests: int = 0
    deltas: int = 0
    delta_events: int = 0
    """Block events of the deltas queued for live streams (what the pools produced)."""
    written_events: int = 0
    """Of those, the ones written into their streams (a starved simulator writes fewer)."""
    reports: int = 0
    writes: int = 0
    """gRPC messages written after the hello (a batch counts once, snapshot chunks each)."""
    batches: int = 0
    """Of those, TelemetryBatch messages."""
    dropped: int = 0
    stream_errors: int = 0
    cuts: int = 0
    """SIGUSR1s taken: each ended every relay's stream at once (a network blip; they redial at once)."""
    breaks: dict[str, int] = field(default_factory=dict)
    """Streams that ended after their snapshot went out, by the status code the call ended with."""
    last_error: str = ""


class SimRelay:
    """One relay replica of a simulated pool: its discovery lease and its telemetry stream."""

    def __init__(
        self,
        pool: SimPool,
        replica: int,
        frontend: str,
        incarnation: int,
        stats: PoolStats,
        batch: bool = True,
    ) -> None:
        self.pool = pool
        self.batch = batch
        """Batch what is queued when the frontend accepts batches (False: never, as older relays)."""
        self.batching = False
        self.batch_interval = 0.0
        """Seconds between writes the frontend's ack asked for (as the relay's publisher honours it)."""
        self.last_write: float | None = None
        self.relay_id = f"relay-{replica}"
        self.incarnation = incarnation
        self.stats = stats
        self.channel = aio_channel(frontend)
        self.call_factory: grpc.aio.StreamStreamMultiCallable = self.channel.stream_stream(
            PUBLISH, request_serializer=None, response_deserializer=tm.PublishPoolTelemetryResponse.FromString
        )
        self.queue: deque[tuple[int, bytes, int]] = deque()
        """(sequence, serialized delta, its block events) not yet written."""
        self.latest: dict[str, bytes] = {}
        self.resync = True
        self.live = False
        self.cut_due = False
        self.wake = asyncio.Event()

    def hello(self, report_interval: float) -> bytes:
        return Req(
            hello=tm.TelemetryHello(
                pool_id=self.pool.pool_id,
                relay_id=self.relay_id,
                incarnation=self.incarnation,
                protocol_version=PROTOCOL_VERSION,
                block_size=BLOCK_SIZE,
                hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
                report_interval=duration(report_interval),
                model=MODEL,
                region=f"r{self.pool.index % 4}",
            )
        ).SerializeToString()

    def enqueue(self, sequence: int, msg: bytes, events: int = 0) -> None:
        if self.resync or not self.live:
            return  # a snapshot is due and will include it
        if len(self.queue) >= QUEUE_LIMIT:
            self.stats.dropped += len(self.queue) + 1
            self.queue.clear()
            self.resync = True
        else:
            self.queue.append((sequence, msg, events))
        self.wake.set()

    def cut(self) -> None:
        """Ends the current stream (if any) at its next turn; the relay redials at once, as after a
        stream that broke once it had worked."""
        if self.live:
            self.cut_due = True
            self.wake.set()

    def offer(self, kind: str, msg: bytes) -> None:
        if self.live:
            self.latest[kind] = msg
            self.wake.set()

    async def run(self, report_interval: float, delay: float = 0.0) -> None:
        hello = self.hello(report_interval)
        await asyncio.sleep(delay)

        async def session() -> None:
            await self._session(hello)

        await reconnect_forever(session, TELEMETRY_RECONNECT, self._failed)

    def _failed(self, state) -> None:
        self.stats.stream_errors += 1
        exc = state.outcome.exception() if state.outcome else None
        self.stats.last_error = f"{self.pool.pool_id}/{self.relay_id}: {exc!r}"[:300]

    async def _read(self, call) -> None:
        async for resp in call:
            kind = resp.WhichOneof("payload")
            if kind == "hello_ack":
                self.stats.hello_acks += 1
                self.batching = self.batch and resp.hello_ack.accepts_batches
                interval = seconds(resp.hello_ack.batch_interval) if self.batching else 0.0
                self.batch_interval = min(max(interval, 0.0), MAX_BATCH_INTERVAL)
                self.wake.set()
            elif kind == "snapshot_request":
                self.stats.snapshot_requests += 1
                self.resync = True
                self.wake.set()

    async def _snapshot(self, call) -> None:
        self.resync = False
        self.queue.clear()
        sequence = self.pool.sequence
        hashes = self.pool.blocks()
        chunks = max(1, -(-len(hashes) // CHUNK))
        snapshot_id = self.stats.snapshots + 1
        for i in range(chunks):
            await call.write(
                snapshot_chunk(snapshot_id, sequence, i, i == chunks - 1, hashes[i * CHUNK : (i + 1) * CHUNK])
            )
        self.stats.writes += chunks
        self.stats.snapshots += 1
        self.stats.snapshot_blocks += len(hashes)
        while self.queue and self.queue[0][0] <= sequence:
            self.queue.popleft()

    def _write_delay(self) -> float:
        """Seconds the next write waits for the frontend's write interval (as Publisher._write_delay)."""
        if not self.batching or self.batch_interval <= 0 or self.last_write is None:
            return 0.0
        wait = self.last_write + self.batch_interval - time.monotonic()
        if wait <= 0 or len(self.latest) + len(self.queue) >= MAX_BATCH:
            return 0.0
        size = sum(len(p) for p in self.latest.values()) + sum(len(m) for _, m, _ in self.queue)
        return 0.0 if size >= BATCH_BYTES else wait

    async def _write_batch(self, call) -> None:
        """The latest reports, then queued deltas, in one TelemetryBatch (as the relay's publisher)."""
        parts = list(self.latest.values())
        self.stats.reports += len(parts)
        self.latest.clear()
        size = sum(len(p) for p in parts)
        events = 0
        while self.queue and len(parts) < MAX_BATCH:
            msg = self.queue[0][1]
            if parts and size + len(msg) > BATCH_BYTES:
                break
            parts.append(msg)
            size += len(msg)
            events += self.queue.popleft()[2]
        await call.write(parts[0] if len(parts) == 1 else batch_wire(parts))
        self.stats.writes += 1
        self.stats.written_events += events
        if len(parts) > 1:
            self.stats.batches += 1

    async def _session(self, hello: bytes) -> None:
        self.stats.connects += 1
        call = self.call_factory()
        reader = asyncio.ensure_future(self._read(call))
        productive = False
        self.live = True
        self.resync = True
        self.batching = False
        self.batch_interval = 0.0
        self.last_write = None
        try:
            await call.write(hello)
            while True:
                if self.cut_due:
                    self.cut_due = False
                    self.stats.breaks["CUT"] = self.stats.breaks.get("CUT", 0) + 1
                    break
                if self.resync:
                    await self._snapshot(call)
                    if not productive:
                        productive = True
                        self.stats.streaming += 1
                    continue
                if (self.latest or self.queue) and (wait := self._write_delay()) > 0:
                    if reader.done():
                        break
                    self.wake.clear()
                    waiter = asyncio.ensure_future(self.wake.wait())
                    timer = asyncio.ensure_future(asyncio.sleep(wait))
                    await asyncio.wait([waiter, timer, reader], return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    timer.cancel()
                    continue
                if self.latest or self.queue:
                    self.last_write = time.monotonic()
                if self.batching and len(self.latest) + len(self.queue) > 1:
                    await self._write_batch(call)
                    continue
                if self.latest:
                    kind = next(iter(self.latest))
                    await call.write(self.latest.pop(kind))
                    self.stats.reports += 1
                    self.stats.writes += 1
                    continue
                if self.queue:
                    _, msg, events = self.queue.popleft()
                    await call.write(msg)
                    self.stats.writes += 1
                    self.stats.written_events += events
                    continue
                if reader.done():
                    break
                self.wake.clear()
                waiter = asyncio.ensure_future(self.wake.wait())
                await asyncio.wait([waiter, reader], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            if reader.done() and (failure := reader.exception()) is not None:
                raise failure
        except Exception as exc:
            self.stats.last_error = f"{self.pool.pool_id}/{self.relay_id}: {exc!r}"[:300]
            if not productive:
                raise
            # A failed write says only INTERNAL: the status the call really ended with says why.
            code = "unknown"
            with contextlib.suppress(Exception):
                code = (await asyncio.wait_for(call.code(), 1.0)).name
            self.stats.breaks[code] = self.stats.breaks.get(code, 0) + 1
            if code in REFUSED:
                # Refused (e.g. RESOURCE_EXHAUSTED over the frontend's snapshot budget), not a broken
                # link: the relay's publisher backs off before it redials, and so does this relay.
                raise
        finally:
            self.live = False
            self.queue.clear()
            self.latest.clear()
            if productive:
                self.stats.streaming -= 1
            reader.cancel()
            if reader.done() and not reader.cancelled():
                reader.exception()  # retrieved: the session's own error says what happened
            call.cancel()


@dataclass(frozen=True)
class LeaseSpec:
    """What one relay replica registers with discovery: its pool, its relay id and its incarnation."""

    index: int
    relay_id: str
    incarnation: int
    blocks: int

    @property
    def pool_id(self) -> str:
        return f"scale-{self.index:04d}"


def lease_specs(first: int, count: int, relays: int, incarnation: int, blocks: int) -> list[LeaseSpec]:
    """The leases of pools first .. first + count - 1, `relays` replicas each (as the pools process names them)."""
    return [
        LeaseSpec(i, f"relay-{r}", incarnation, blocks)
        for i in range(first, first + count)
        for r in range(relays)
    ]


async def keep_registered(
    leases: list[LeaseSpec], discovery: str, stats: PoolStats, stop: asyncio.Event
) -> None:
    """Registers and renews every relay's lease over KeepAlivePools (one stream per relay, as relays do),
    at the heartbeat discovery dictates; a failed call is retried a second later."""
    channel = aio_channel(discovery)
    stub = dpb_grpc.DiscoveryServiceStub(channel)

    async def one(lease: LeaseSpec) -> None:
        client = KeepAliveClient(stub, unary_timeout=10.0)
        req = dpb.RegisterPoolRequest(
            pool_id=lease.pool_id,
            model=MODEL,
            region=f"r{lease.index % 4}",
            frontends=[f"http://127.0.0.1:{10_000 + lease.index}"],
            relay_id=lease.relay_id,
            incarnation=lease.incarnation,
            capacity=dpb.PoolCapacity(
                max_running_requests=64, kv_cache_blocks=2 * lease.blocks, prefill_tokens_per_second=20_000
            ),
            frontend_protocol=dpb.FRONTEND_PROTOCOL_MESH_GRPC,
        )
        first = True
        while not stop.is_set():
            try:
                reply = await client.register(req, within=10.0)
                if first:
                    stats.registered += 1
                    first = False
                wait = reply.heartbeat_interval.ToTimedelta().total_seconds() or 1.0
            except Exception as exc:
                stats.register_errors += 1
                stats.last_error = f"register {lease.pool_id}/{lease.relay_id}: {exc!r}"[:300]
                wait = 1.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
        await client.close()

    # Spread the first registrations over a second, as relays that start apart would.
    async def staggered(lease: LeaseSpec) -> None:
        await asyncio.sleep(random.random())
        await one(lease)

    try:
        await asyncio.gather(*(staggered(lease) for lease in leases))
    finally:
        await channel.close()


async def run_leases(args) -> None:
    """The `leases` process: the discovery leases of a `pools` process's relays, kept apart from it.

    A `pools` process streams hundreds of relays' snapshots on one loop at a low priority; on a
    shared machine it can be starved for longer than a lease lasts (15 s), and leases lapsing
    make the frontend drop the pools mid-storm, which a real relay (one process per pool, its
    lease beside one stream) would not see. This process runs at the priority it is started with."""
    stats = PoolStats()
    leases = lease_specs(args.first, args.count, args.relays, args.incarnation, args.blocks)
    stats.relays = len(leases)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    keeper = asyncio.ensure_future(keep_registered(leases, args.discovery, stats, stop))
    writer = asyncio.ensure_future(write_stats(args.stats, stats, stop))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), args.seconds)
    stop.set()
    await keeper
    await writer


def registered_apart(path: str) -> int:
    """Leases a `leases` process reports registered in its stats file (0 before it wrote one)."""
    try:
        return int(json.loads(Path(path).read_text()).get("registered", 0))
    except (OSError, ValueError):
        return 0


async def run_pools(args) -> None:
    """The `pools` process: pools args.first .. args.first + args.count - 1."""
    data = np.load(args.nodes)
    nodes = data["hashes"]
    uses = data["uses"]
    shared_nodes = int(args.blocks * args.shared_share) // NODE_BLOCKS
    own = args.blocks - shared_nodes * NODE_BLOCKS
    stats = PoolStats()
    pools = [
        SimPool(i, nodes, uses, shared_nodes, own, args.seed)
        for i in range(args.first, args.first + args.count)
    ]
    stats.pools = len(pools)
    stats.blocks_per_pool = pools[0].size if pools else 0
    incarnation = args.incarnation or int(time.time() * 1000)
    relays = [
        SimRelay(p, r, args.frontend, incarnation, stats, batch=not args.no_batch)
        for p in pools
        for r in range(args.relays)
    ]
    stats.relays = len(relays)
    by_pool: dict[int, list[SimRelay]] = {}
    for r in relays:
        by_pool.setdefault(r.pool.index, []).append(r)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def cut_all() -> None:
        stats.cuts += 1
        for r in relays:
            r.cut()

    loop.add_signal_handler(signal.SIGUSR1, cut_all)
    started = time.monotonic()
    tasks: list[asyncio.Future] = []
    if not args.leases_apart:
        specs = lease_specs(args.first, args.count, args.relays, incarnation, stats.blocks_per_pool)
        tasks.append(asyncio.ensure_future(keep_registered(specs, args.discovery, stats, stop)))

    def registered() -> int:
        return registered_apart(args.leases_apart) if args.leases_apart else stats.registered

    if args.register_first:  # streams open once every lease is there, as after a fleet's start
        while registered() < len(relays) and not stop.is_set():  # noqa: ASYNC110 (counters, polled)
            await asyncio.sleep(0.1)
    # With --ramp, pools dial one after the other over that many seconds (a fleet brought up in turn).
    tasks += [
        asyncio.ensure_future(
            r.run(args.report_interval, args.ramp * (r.pool.index - args.first) / len(pools))
        )
        for r in relays
    ]

    async def traffic() -> None:
        tick = args.tick
        offset = random.random() * tick
        await asyncio.sleep(offset)
        n = 0
        t0 = time.monotonic()
        while not stop.is_set():
            n += 1
            if args.traffic_seconds and time.monotonic() - started > args.traffic_seconds:
                return
            for pool in pools:
                change = pool.churn(args.rate * tick, args.shared_share)
                if change is None:
                    continue
                msg = delta_message(pool.sequence, *change)
                events = len(change[0]) + len(change[1])
                for relay in by_pool[pool.index]:
                    if relay.live and not relay.resync:
                        stats.deltas += 1
                        stats.delta_events += events
                    relay.enqueue(pool.sequence, msg, events)
            await asyncio.sleep(max(0.0, t0 + n * tick - time.monotonic()))

    async def reports() -> None:
        ready = Req(
            readiness=tm.ReadinessReport(models=[pe.ModelStatus(model=MODEL, state=pe.MODEL_STATE_READY)])
        ).SerializeToString()
        drain = Req(
            drain=tm.DrainReport(drain=pe.DrainStatus(state=pe.DRAIN_STATE_ACTIVE))
        ).SerializeToString()
        while not stop.is_set():
            now = time.time()
            beat = Req(heartbeat=tm.TelemetryHeartbeat(send_time=timestamp(now))).SerializeToString()
            for pool in pools:
                load = Req(
                    load=tm.LoadReport(load=pool.load, observe_time=timestamp(now))
                ).SerializeToString()
                for relay in by_pool[pool.index]:
                    relay.offer("load", load)
                    relay.offer("readiness", ready)
                    relay.offer("drain", drain)
                    relay.offer("heartbeat", beat)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.report_interval)

    tasks += [asyncio.ensure_future(traffic()), asyncio.ensure_future(reports())]
    writer = asyncio.ensure_future(write_stats(args.stats, stats, stop))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), args.seconds)
    stop.set()
    await writer
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for r in relays:
        await r.channel.close(grace=None)


# ---- counting sinks --------------------------------------------------------------------------
class CountingSink(tm_grpc.TelemetryServiceServicer):
    """A frontend's TelemetryService that only acknowledges the hello and counts."""

    def __init__(self) -> None:
        self.messages = 0
        self.delta_events = 0
        self.snapshots = 0
        self.sequence = -1

    async def PublishPoolTelemetry(self, request_iterator, context):
        yield tm.PublishPoolTelemetryResponse(hello_ack=tm.TelemetryHelloAck(frontend_id="sink"))
        async for req in request_iterator:
            self.messages += 1
            kind = req.WhichOneof("payload")
            if kind == "kv_delta":
                self.delta_events += len(req.kv_delta.stored) + len(req.kv_delta.removed)
                self.sequence = req.kv_delta.sequence
            elif kind == "kv_snapshot" and req.kv_snapshot.last:
                self.snapshots += 1
                self.sequence = req.kv_snapshot.sequence


async def run_sinks(args) -> None:
    servers, sinks, ports = [], [], []
    for _ in range(args.count):
        sink = CountingSink()
        server = grpc.aio.server()
        tm_grpc.add_TelemetryServiceServicer_to_server(sink, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        servers.append(server)
        sinks.append(sink)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    deadline = time.monotonic() + args.seconds
    while not stop.is_set() and time.monotonic() < deadline:
        _write_json(
            args.stats,
            {
                "ports": ports,
                "messages": sum(s.messages for s in sinks),
                "delta_events": [s.delta_events for s in sinks],
                "snapshots": [s.snapshots for s in sinks],
                "sequence": [s.sequence for s in sinks],
                "time": time.time(),
            },
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    for server in servers:
        await server.stop(0)


# ---- a real relay hub -----------------------------------------------------------------------
def worker_events(n: int, blocks_per_event: int, seed: int = 1) -> list[tuple[str, list[int], list[int]]]:
    """n worker events, each storing `blocks_per_event` new blocks and evicting as many old ones."""
    rng = random.Random(seed)
    held: dict[str, deque[int]] = {f"w{i}": deque() for i in range(4)}
    out = []
    next_block = 1
    for _ in range(n):
        w = f"w{rng.randrange(4)}"
        stored = [(next_block + k) * 0x9E3779B97F4A7C15 % (1 << 64) for k in range(blocks_per_event)]
        next_block += blocks_per_event
        removed = [held[w].popleft() for _ in range(blocks_per_event)] if len(held[w]) >= 4096 else []
        held[w].extend(stored)
        out.append((w, stored, removed))
    return out


async def run_relay(args) -> None:
    """poolrelay's TelemetryHub to `--frontends`: pre-filled with `--blocks`, fed `--rate` block
    events/s (0: as fast as it goes, `--events` of them) for `--seconds`."""
    blocks = PoolBlocks()
    blocks.apply_snapshot(
        "w0", [int(x) for x in _splitmix(np.arange(args.blocks, dtype=np.uint64) + np.uint64(1 << 50))]
    )
    blocks.take_delta()
    config = TelemetryConfig(
        pool_id="scale-relay", relay_id="relay-0", incarnation=1, region="r0", report_interval=1.0
    )
    hub = TelemetryHub(config, blocks, SystemClock())
    hub.set_frontends(static=[u for u in args.frontends.split(",") if u])
    periodic = asyncio.ensure_future(hub.run_periodic())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    per_event = 8  # 4 stored + 4 evicted block events per worker event
    # Enough distinct events for the whole run: a paced run never replays one.
    wanted = args.events if not args.rate else max(args.events, int(args.rate / per_event * args.seconds) + 1)
    events = worker_events(wanted, per_event // 2)
    fed = 0
    state = {"phase": "connecting", "fed_events": 0, "rate": 0.0}

    def snapshot_stats() -> dict:
        pubs = list(hub.publishers.values())
        return {
            **state,
            "fed_events": fed * per_event,
            "sent": sum(p.messages_sent for p in pubs),
            "dropped": sum(p.messages_dropped for p in pubs),
            "queued": sum(p.queue_depth for p in pubs),
            "snapshots": sum(p.snapshots_sent for p in pubs),
            "time": time.time(),
            "pid": os.getpid(),
        }

    async def write_relay_stats() -> None:
        while not stop.is_set():
            _write_json(args.stats, snapshot_stats())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    writer = asyncio.ensure_future(write_relay_stats())
    deadline = time.monotonic() + args.seconds
    while sum(p.snapshots_sent for p in hub.publishers.values()) < len(hub.publishers):
        if time.monotonic() > deadline or stop.is_set():
            break
        await asyncio.sleep(0.05)
    state["phase"] = "feeding"
    t0 = time.monotonic()
    i = 0
    while not stop.is_set() and time.monotonic() < deadline:
        w, stored, removed = events[i % len(events)]
        i += 1
        blocks.apply_event(w, stored, removed)
        hub.blocks_changed()
        fed = i
        if args.rate:
            if i % 10 == 0:
                await asyncio.sleep(max(0.0, t0 + i * per_event / args.rate - time.monotonic()))
        else:
            if i % 64 == 0:
                await asyncio.sleep(0)
            if i >= len(events):
                break
    hub.flush()
    if not args.rate:  # as fast as it goes: until every stream's queue is written out
        while any(p.queue_depth for p in hub.publishers.values()) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        state["rate"] = fed * per_event / (time.monotonic() - t0)
    state["phase"] = "done"
    _write_json(args.stats, snapshot_stats())
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, deadline - time.monotonic()))
    stop.set()
    periodic.cancel()
    await writer
    await hub.close()


def parse_cpus(text: str) -> frozenset[int]:
    """'0,2' -> {0, 2} ('' -> none given); ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"--cpus takes comma-separated CPU numbers, got {part!r}")
        cpus.add(int(part))
    return frozenset(cpus)


def set_autogroup_nice(pid: int | str, nice: int) -> str | None:
    """Sets the nice of the autogroup of process `pid`'s session ("self": this one's); what /proc
    then says of it, or None without autogroup scheduling. OSError when not allowed."""
    autogroup = Path(f"/proc/{pid}/autogroup")
    if not autogroup.exists():
        return None
    autogroup.write_text(str(nice))
    return autogroup.read_text().strip()


def lower_priority(nice: int, cpus: frozenset[int]) -> dict[str, object]:
    """Lowers this process's CPU priority (`nice` added, 0..19) and pins it to `cpus` (empty: any), in
    the main thread before any other starts (Linux applies both per thread; threads inherit them), so
    that a load generator beside the measured frontend takes only the CPU the frontend leaves.
    Returns what was applied ({} when nothing was asked); ValueError naming a bad value."""
    if not 0 <= nice <= 19:
        raise ValueError(f"--nice must be 0..19, got {nice}")
    done: dict[str, object] = {}
    if nice:
        done["nice"] = os.nice(nice)
        # With autogroup scheduling (Linux's default for desktops and many VMs) the CPU is shared
        # fairly between sessions first and nice only weighs threads inside one: meshlaunch starts
        # every process in a session of its own, so the process's own nice changed nothing (measured:
        # 4 simulators at nice 19 still took 4/5 of the machine and preempted the frontend 115,000
        # times in 4 minutes). The session's autogroup gets the same nice.
        try:
            if (group := set_autogroup_nice("self", os.nice(0))) is not None:
                done["autogroup"] = group
        except OSError as exc:  # not allowed here: said in the stats, not hidden
            done["autogroup"] = f"not set: {exc}"
    if cpus:
        allowed = os.sched_getaffinity(0)
        if not cpus <= allowed:
            raise ValueError(
                f"--cpus {sorted(cpus)} not all available to this process (it may use {sorted(allowed)})"
            )
        os.sched_setaffinity(0, cpus)
        done["cpus"] = sorted(cpus)
    return done


def placement() -> dict[str, object]:
    """This process's niceness and the CPUs it may run on, as its stats file reports them."""
    autogroup = Path("/proc/self/autogroup")
    group = autogroup.read_text().strip() if autogroup.exists() else "none"
    return {"nice": os.nice(0), "autogroup": group, "cpus": sorted(os.sched_getaffinity(0))}


async def write_stats(path: str, stats: PoolStats, stop: asyncio.Event) -> None:
    """Writes the counters (with where the process runs) once a second, and once more at stop."""
    while True:
        _write_json(path, {**asdict(stats), **placement(), "time": time.time(), "pid": os.getpid()})
        if stop.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(obj))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pools", help="simulated pools and their relay replicas")
    p.add_argument("--frontend", required=True, help="the frontend's telemetry URL")
    p.add_argument("--discovery", required=True, help="discovery HOST:PORT")
    p.add_argument("--nodes", required=True, help=".npz of shared prefix nodes (bench_scale writes it)")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--relays", type=int, default=2)
    p.add_argument("--blocks", type=int, required=True, help="KV blocks per pool")
    p.add_argument(
        "--shared-share", type=float, default=0.5, help="share of blocks (and of churn) from shared prefixes"
    )
    p.add_argument("--rate", type=float, default=50.0, help="block events per second per pool")
    p.add_argument("--tick", type=float, default=0.2, help="seconds between a pool's deltas")
    p.add_argument("--report-interval", type=float, default=1.0)
    p.add_argument(
        "--traffic-seconds", type=float, default=0.0, help="stop the churn after this long (0: never)"
    )
    p.add_argument(
        "--register-first", action="store_true", help="open telemetry streams once every lease is there"
    )
    p.add_argument(
        "--ramp", type=float, default=0.0, help="seconds over which the pools' first dials are spread"
    )
    p.add_argument(
        "--no-batch", action="store_true", help="one message per write even to a frontend that takes batches"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--seconds", type=float, default=1800.0, help="exit after this long at the latest")
    p.add_argument("--stats", required=True)
    p.add_argument(
        "--leases-apart",
        default="",
        metavar="STATS",
        help="a `leases` process keeps the leases and writes STATS (default: this process keeps them)",
    )
    g = sub.add_parser("leases", help="the discovery leases of a `pools` process's relays, kept apart")
    g.add_argument("--discovery", required=True, help="discovery HOST:PORT")
    g.add_argument("--first", type=int, default=0)
    g.add_argument("--count", type=int, required=True)
    g.add_argument("--relays", type=int, default=2)
    g.add_argument("--blocks", type=int, required=True, help="KV blocks per pool (the capacity registered)")
    g.add_argument("--seconds", type=float, default=1800.0, help="exit after this long at the latest")
    g.add_argument("--stats", required=True)
    for sp in (p, g):
        sp.add_argument(
            "--incarnation", type=int, default=0, help="the relays' incarnation (0: this process's start, ms)"
        )
    s = sub.add_parser("sinks", help="counting TelemetryService servers")
    s.add_argument("--count", type=int, required=True)
    s.add_argument("--seconds", type=float, default=600.0)
    s.add_argument("--stats", required=True)
    r = sub.add_parser("relay", help="poolrelay's TelemetryHub fed at a rate")
    r.add_argument("--frontends", required=True, help="comma-separated telemetry URLs")
    r.add_argument("--blocks", type=int, default=10_000)
    r.add_argument("--rate", type=float, default=2000.0, help="block events/s (0: as fast as it goes)")
    r.add_argument("--events", type=int, default=20_000, help="worker events prepared (8 block events each)")
    r.add_argument("--seconds", type=float, default=60.0)
    r.add_argument("--stats", required=True)
    for sp in (p, s, r, g):
        sp.add_argument(
            "--nice",
            type=int,
            default=0,
            help="lower this process's CPU priority by N (0..19) before it starts",
        )
        sp.add_argument("--cpus", default="", help="comma-separated CPU numbers to run on (default: any)")
    args = parser.parse_args(argv)
    # Checked before logging is configured: a refused command line changes nothing in this process.
    if args.cmd == "leases":
        for name, least in (("count", 1), ("relays", 1), ("blocks", 1), ("incarnation", 0)):
            if getattr(args, name) < least:
                parser.error(f"--{name} must be at least {least}, got {getattr(args, name)}")
        args.incarnation = args.incarnation or int(time.time() * 1000)
    try:
        lower_priority(args.nice, parse_cpus(args.cpus))
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging("scale-sim", "warning")
    run = {"pools": run_pools, "sinks": run_sinks, "relay": run_relay, "leases": run_leases}[args.cmd]
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

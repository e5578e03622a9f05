"""The relay's view of an engine pool: KV events per worker, load from /metrics, readiness from /health.

It offers the relay what PoolSource offers for a mocker pool: a complete pool status (models,
workers, load, drain) on every poll, and the pool-level block set kept current from every worker's
events. Engines have no drain API: a drain passed on from discovery is the relay's own (reported
as the pool's, so frontends stop choosing it; it ends when the engines are idle or the deadline).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import zmq.asyncio

from meshkit.blocks import DEFAULT_BLOCK_SIZE
from meshkit.clock import Clock, SystemClock
from meshkit.logs import get_logger
from meshkit.timeconv import timestamp
from poolrelay.engine.config import EngineConfig, EngineWorker
from poolrelay.engine.feed import WorkerFeed, ZmqWorkerTransport, cancel_all, clip
from poolrelay.engine.metrics import (
    MAX_ADAPTERS_PER_MODEL,
    MAX_METRICS_BYTES,
    NAMES,
    EngineLoad,
    parse_load,
    parse_model_list,
)
from poolrelay.engine.translate import Transition, WorkerBlocks, check_block_sizes
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.v1 import pool_events_pb2 as pe

log = get_logger(module="poolrelay.engine.source")


@dataclass
class WorkerState:
    """What the relay knows of one engine worker."""

    worker: EngineWorker
    feed: WorkerFeed
    transport: ZmqWorkerTransport
    healthy: bool = False
    failures: int = 0
    """Failed /health polls in a row."""
    read_failures: int = 0
    """Polls in a row whose /health answered but whose /metrics or /v1/models read failed."""
    models: list[str] = field(default_factory=list)
    adapters: dict[str, list[str]] = field(default_factory=dict)
    """Base model -> the LoRA adapters the worker lists on it (its /v1/models `parent`)."""
    load: EngineLoad | None = None
    last_error: str = ""
    """The last failed poll's error (cut to MAX_REASON_CHARS); empty once a poll succeeds."""


class EngineSource:
    """Keeps an engine pool's status and block set current."""

    def __init__(
        self,
        config: EngineConfig,
        blocks: PoolBlocks,
        *,
        on_status: Callable[[pe.WatchPoolStatusResponse], None],
        on_reachable: Callable[[bool], None],
        on_blocks: Callable[[], None],
        clock: Clock | None = None,
        mesh_block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        check_block_sizes(config.block_size, mesh_block_size)
        self.config = config
        self.blocks = blocks
        self.mesh_block_size = mesh_block_size
        self.clock = clock or SystemClock()
        self._on_status = on_status
        self._on_reachable = on_reachable
        self._on_blocks = on_blocks
        self._ctx = zmq.asyncio.Context()
        self.workers: dict[str, WorkerState] = {}
        for w in config.workers:
            transport = ZmqWorkerTransport(self._ctx, w, config.replay_timeout)
            feed = WorkerFeed(w, WorkerBlocks(mesh_block_size), self._apply, transport.replay)
            self.workers[w.worker_id] = WorkerState(w, feed, transport)
        self.reachable = False
        self.sequence = 0
        self.drain_deadline: float | None = None
        self.drained = False
        self.names = NAMES[config.kind]

    # --- blocks -------------------------------------------------------------------------------

    def _apply(self, worker_id: str, t: Transition) -> None:
        if t.cleared or t.stored or t.removed:
            self.blocks.apply_event(worker_id, t.stored, t.removed, t.cleared)
            self._on_blocks()

    # --- HTTP ---------------------------------------------------------------------------------

    async def _get(self, session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
        async with session.get(url) as resp:
            body = await resp.content.read(MAX_METRICS_BYTES + 1)
            if len(body) > MAX_METRICS_BYTES:
                raise ValueError(f"{url} answered more than {MAX_METRICS_BYTES} bytes")
            return resp.status, body

    async def _poll_worker(self, session: aiohttp.ClientSession, st: WorkerState) -> None:
        base = st.worker.url.rstrip("/")
        try:
            status, _ = await self._get(session, f"{base}/health")
            if status != 200:
                raise ConnectionError(f"/health answered {status}")
        except (aiohttp.ClientError, OSError, TimeoutError, ConnectionError) as exc:
            st.failures += 1
            st.last_error = clip(repr(exc))
            if st.failures >= self.config.down_after and st.healthy:
                st.healthy = False
                st.load = None
                log.warning("engine worker down", worker=st.worker.worker_id, error=st.last_error)
            if st.failures == self.config.down_after:
                # It may be restarting with an empty cache: its blocks can no longer be vouched for.
                st.feed.reset(f"worker down: {st.last_error}")
            return
        try:
            status, body = await self._get(session, f"{base}/metrics")
            if status != 200:
                raise ConnectionError(f"/metrics answered {status}")
            load = parse_load(body.decode("utf-8", "replace"), self.names)
            status, body = await self._get(session, f"{base}/v1/models")
            if status != 200:
                raise ConnectionError(f"/v1/models answered {status}")
            listed = parse_model_list(json.loads(body))
            models = listed.models
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, ConnectionError) as exc:
            # Alive (it answered /health) but its load or models could not be read: a busy vLLM
            # renders every histogram on /metrics and can take seconds to. Taking a serving pool
            # out of the mesh for that would move its traffic exactly when it is loaded, so the
            # worker stays up with its last models; its last load counts for `down_after` polls,
            # then the pool's load is unknown (status() leaves it out) until a read succeeds.
            st.failures = 0
            st.read_failures += 1
            st.last_error = clip(f"reading load or models: {exc!r}")
            if st.read_failures == self.config.down_after:
                log.warning("engine worker load unreadable", worker=st.worker.worker_id, error=st.last_error)
            return
        if (
            st.load is not None
            and load.process_start
            and st.load.process_start
            and (load.process_start != st.load.process_start)
        ):
            st.feed.reset("the engine process restarted (process_start_time_seconds changed)")
        if not st.healthy:
            log.info("engine worker up", worker=st.worker.worker_id, models=models)
        st.healthy, st.failures, st.load, st.models, st.last_error = True, 0, load, models, ""
        st.adapters = listed.adapters
        st.read_failures = 0

    def load_known(self) -> bool:
        """Whether every up worker's load is current: read, and not stale past `down_after` failed reads."""
        return all(
            st.load is not None and st.read_failures < self.config.down_after
            for st in self.workers.values()
            if st.healthy
        )

    def status(self) -> pe.WatchPoolStatusResponse:
        """The pool's status as the relay reports it."""
        self.sequence += 1
        states = list(self.workers.values())
        ready = {m for st in states if st.healthy for m in st.models}
        known = {m for st in states for m in st.models}
        # An adapter is reported while some up worker serves it (vLLM loads adapters per server).
        adapters: dict[str, set[str]] = {}
        for st in states:
            if st.healthy:
                for m, names in st.adapters.items():
                    adapters.setdefault(m, set()).update(names)
        load = pe.PoolLoad()
        seen_urls: set[str] = set()
        workers = []
        for st in sorted(states, key=lambda s: s.worker.worker_id):
            lo = st.load or EngineLoad()
            workers.append(
                pe.WorkerStatus(
                    worker_id=st.worker.worker_id,
                    kv_blocks_total=lo.kv_blocks_total,
                    kv_blocks_used=lo.kv_blocks_used,
                    requests_running=lo.running,
                )
            )
            # Workers behind one HTTP server (data-parallel ranks) share its metrics: count once.
            if st.load is not None and st.worker.url not in seen_urls:
                seen_urls.add(st.worker.url)
                load.requests_running += lo.running
                load.requests_waiting += lo.waiting
                load.kv_blocks_used += lo.kv_blocks_used
                load.kv_blocks_total += lo.kv_blocks_total
        load_known = self.load_known()
        drain = pe.DrainStatus(state=pe.DRAIN_STATE_ACTIVE)
        if self.drain_deadline is not None:
            idle = load_known and load.requests_running == 0 and load.requests_waiting == 0
            if idle or self.clock.wall() >= self.drain_deadline:
                self.drained = True
            drain = pe.DrainStatus(
                state=pe.DRAIN_STATE_DRAINED if self.drained else pe.DRAIN_STATE_DRAINING,
                deadline=timestamp(self.drain_deadline),
            )
        reply = pe.WatchPoolStatusResponse(
            models=[
                pe.ModelStatus(
                    model=m,
                    state=pe.MODEL_STATE_READY if m in ready else pe.MODEL_STATE_NOT_READY,
                    adapters=sorted(adapters.get(m, ()))[:MAX_ADAPTERS_PER_MODEL],
                )
                for m in sorted(known)
            ],
            workers=workers,
            drain=drain,
            block_size=self.mesh_block_size,
            sequence=self.sequence,
        )
        if load_known:  # an unknown load is left out, not sent as a partial sum that looks idle
            reply.load.CopyFrom(load)
        return reply

    async def _poll_loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.http_timeout)
        # One keep-alive connection pool for every poll of every worker.
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await asyncio.gather(*(self._poll_worker(session, st) for st in self.workers.values()))
                reachable = any(st.healthy for st in self.workers.values())
                if reachable != self.reachable:
                    self.reachable = reachable
                    log.info("engine pool reachable" if reachable else "engine pool unreachable")
                    self._on_reachable(reachable)
                if reachable:
                    self._on_status(self.status())
                await asyncio.sleep(self.config.poll_interval)

    async def run(self) -> None:
        """Reads every worker's events and polls their HTTP endpoints until cancelled."""
        tasks = [
            asyncio.create_task(st.transport.run(st.feed), name=f"kv events {st.worker.worker_id}")
            for st in self.workers.values()
        ]
        tasks.append(asyncio.create_task(self._poll_loop(), name="engine polls"))
        try:
            await asyncio.gather(*tasks)
        finally:
            await cancel_all(tasks)
            self._ctx.destroy(linger=0)

    async def start_drain(self, timeout_s: float, reason: str) -> pe.StartDrainResponse:
        """A drain passed on from discovery: the relay reports the pool draining until idle or the deadline."""
        if self.drain_deadline is None:
            self.drain_deadline = self.clock.wall() + timeout_s
            log.info("engine pool drains", reason=reason, timeout_s=timeout_s)
        st = self.status()
        return pe.StartDrainResponse(drain=st.drain)

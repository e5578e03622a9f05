"""Reads the pool-local event API (WatchPoolStatus + WatchKvEvents) and reconnects when it breaks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from tenacity import RetryCallState

from meshkit.channels import aio_channel
from meshkit.logs import get_logger
from meshkit.timeconv import duration
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.retry import POOL_RECONNECT, reconnect_forever
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import pool_events_pb2_grpc as pe_grpc

log = get_logger(module="poolrelay.pool_source")

# Seconds between the pool's status messages the relay asks for.
STATUS_INTERVAL_S = 0.5
# After a re-subscribe, a worker that sent no fresh snapshot within this quiet time has left.
RESYNC_QUIET_S = 0.5


class KvGap(Exception):
    """A worker's events skipped a number: re-subscribe for fresh snapshots."""


class PoolSource:
    """Keeps the pool's latest status and the pool-level block set current."""

    def __init__(
        self,
        pool: str,
        blocks: PoolBlocks,
        *,
        on_status: Callable[[pe.WatchPoolStatusResponse], None],
        on_reachable: Callable[[bool], None],
        on_blocks: Callable[[], None],
    ) -> None:
        self.pool = pool
        self.blocks = blocks
        self._on_status = on_status
        self._on_reachable = on_reachable
        self._on_blocks = on_blocks
        self._channel = aio_channel(pool)
        self._stub = pe_grpc.PoolEventsServiceStub(self._channel)
        self.reachable = False

    def _set_reachable(self, value: bool) -> None:
        if value != self.reachable:
            self.reachable = value
            log.info("pool reachable" if value else "pool unreachable", pool=self.pool)
            self._on_reachable(value)

    def _status_broken(self, state: RetryCallState) -> None:
        # A redial that failed means the stream stays broken: the relay cannot see its pool.
        self._set_reachable(False)
        log.warning(
            "pool status stream down",
            pool=self.pool,
            error=repr(state.outcome.exception() if state.outcome else None),
        )

    async def _status_session(self) -> None:
        call = self._stub.WatchPoolStatus(pe.WatchPoolStatusRequest(interval=duration(STATUS_INTERVAL_S)))
        got = False
        try:
            while True:
                # The pool sends at least every interval: silence for several means a dead stream.
                msg = await asyncio.wait_for(call.read(), timeout=max(3 * STATUS_INTERVAL_S, 2.0))
                # Anything but a response is grpc.aio.EOF (typeshed types read() as object).
                if not isinstance(msg, pe.WatchPoolStatusResponse):
                    break
                got = True
                self._set_reachable(True)
                self._on_status(msg)
        except (grpc.RpcError, TimeoutError):
            if not got:
                raise
        finally:
            call.cancel()
        if not got:
            raise ConnectionError("pool status stream ended before its first message")

    async def _kv_session(self) -> None:
        call = self._stub.WatchKvEvents(pe.WatchKvEventsRequest())
        blocks = self.blocks
        blocks.begin_resync()
        resyncing = True
        last_id: dict[str, int] = {}
        got = False
        # While re-syncing, a read is waited for with a timeout; it must not be cancelled (that
        # would cancel the whole call), so it stays pending and is awaited after the timeout.
        pending: asyncio.Future | None = None
        try:
            while True:
                if resyncing:
                    pending = pending or asyncio.ensure_future(call.read())
                    done, _ = await asyncio.wait({pending}, timeout=RESYNC_QUIET_S)
                    if not done:
                        blocks.end_resync()
                        resyncing = False
                        self._on_blocks()
                        continue
                    msg, pending = pending.result(), None
                elif pending is not None:
                    msg, pending = await pending, None
                else:
                    msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                got = True
                if msg.HasField("snapshot"):
                    snap = msg.snapshot
                    blocks.apply_snapshot(snap.worker_id, snap.block_hashes)
                    last_id[snap.worker_id] = snap.event_id
                else:
                    ev = msg.event
                    expected = last_id.get(ev.worker_id, ev.event_id - 1) + 1
                    if ev.event_id != expected:
                        raise KvGap(f"worker {ev.worker_id}: expected event {expected}, got {ev.event_id}")
                    last_id[ev.worker_id] = ev.event_id
                    if resyncing:
                        blocks.end_resync()
                        resyncing = False
                    blocks.apply_event(ev.worker_id, ev.stored, ev.removed, ev.cleared)
                self._on_blocks()
        except KvGap as exc:
            log.warning("kv event gap; re-subscribing", pool=self.pool, error=str(exc))
            return
        except grpc.RpcError:
            if not got:
                raise
        finally:
            if pending is not None:
                pending.cancel()
            call.cancel()
        if not got:
            raise ConnectionError("pool kv stream ended before its first message")

    async def run(self) -> None:
        """Reads both streams until cancelled, reconnecting each with bounded back-off."""
        try:
            await asyncio.gather(
                reconnect_forever(self._status_session, POOL_RECONNECT, self._status_broken),
                reconnect_forever(self._kv_session, POOL_RECONNECT),
            )
        finally:
            await self._channel.close()

    async def start_drain(self, timeout_s: float, reason: str) -> pe.StartDrainResponse:
        """Passes a drain on to the pool (idempotent at the pool)."""
        return await self._stub.StartDrain(
            pe.StartDrainRequest(timeout=duration(max(timeout_s, 0.001)), reason=reason), timeout=5.0
        )

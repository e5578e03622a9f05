"""The pool-local event API (poolrelay.v1.PoolEventsService): status, KV events, drain."""

from __future__ import annotations

import asyncio

import grpc

from meshkit.errors import Reason, abort_with_reason
from meshkit.logs import get_logger
from meshkit.timeconv import seconds, timestamp
from meshkit.validation import Violations
from mocker.feeds import SubscriberTooSlow
from mocker.pool import DrainState, Pool
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import pool_events_pb2_grpc as pe_grpc

DEFAULT_STATUS_INTERVAL_S = 1.0
MIN_STATUS_INTERVAL_S = 0.010
# Bursts of changes (every token batch changes the load) are coalesced into one status per window.
STATUS_COALESCE_S = 0.020

_DRAIN_STATES = {
    DrainState.ACTIVE: pe.DRAIN_STATE_ACTIVE,
    DrainState.DRAINING: pe.DRAIN_STATE_DRAINING,
    DrainState.DRAINED: pe.DRAIN_STATE_DRAINED,
}

log = get_logger(module="mocker.events")


def drain_status(pool: Pool) -> pe.DrainStatus:
    status = pe.DrainStatus(state=_DRAIN_STATES[pool.drain.state])
    if pool.drain.deadline_wall is not None:
        status.deadline.CopyFrom(timestamp(pool.drain.deadline_wall))
    return status


def pool_status(pool: Pool, sequence: int) -> pe.WatchPoolStatusResponse:
    """One complete status message of the pool."""
    load = pool.load()
    return pe.WatchPoolStatusResponse(
        models=[
            pe.ModelStatus(
                model=m,
                state=pe.MODEL_STATE_READY if ready else pe.MODEL_STATE_NOT_READY,
                adapters=pool.adapters.get(m, ()),
            )
            for m, ready in sorted(pool.models.items())
        ],
        workers=[
            pe.WorkerStatus(
                worker_id=w.worker_id,
                kv_blocks_total=w.cache.capacity,
                kv_blocks_used=len(w.cache),
                requests_running=w.running,
                max_running_requests=w.max_running,
            )
            for w in sorted(pool.workers, key=lambda w: w.worker_id)
        ],
        load=pe.PoolLoad(
            requests_waiting=load.requests_waiting,
            requests_running=load.requests_running,
            prefill_tokens_in_flight=load.prefill_tokens_in_flight,
            kv_blocks_used=load.kv_blocks_used,
            kv_blocks_total=load.kv_blocks_total,
            max_running_requests=load.max_running_requests,
            max_waiting_requests=load.max_waiting_requests,
            decode_tokens_in_flight=load.decode_tokens_in_flight,
        ),
        drain=drain_status(pool),
        block_size=pool.config.block_size,
        pool_id=pool.config.pool_id,
        sequence=sequence,
        prefill_tokens_per_second=round(pool.config.pool_prefill_tokens_per_second),
    )


class PoolEvents(pe_grpc.PoolEventsServiceServicer):
    """What a PoolRelay reads from the simulated pool."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def WatchPoolStatus(  # type: ignore[override]  # writes with context.write instead of yielding
        self, request: pe.WatchPoolStatusRequest, context: grpc.aio.ServicerContext
    ) -> None:
        v = Violations()
        interval = DEFAULT_STATUS_INTERVAL_S
        if request.HasField("interval"):
            requested = seconds(request.interval)
            if requested != 0 and requested < MIN_STATUS_INTERVAL_S:
                v.add("interval", f"must be 0 (1 s) or at least {MIN_STATUS_INTERVAL_S * 1000:g} ms")
            elif requested > 0:
                interval = requested
        await v.abort_if_any(context)
        loop = asyncio.get_running_loop()
        changes = self.pool.changes
        sequence = 0
        while True:
            version = changes.version
            sequence += 1
            await context.write(pool_status(self.pool, sequence))
            sent_at = loop.time()
            if await changes.wait_newer(version, interval):
                # Something changed: wait out the coalescing window so a burst becomes one message.
                await asyncio.sleep(max(0.0, sent_at + STATUS_COALESCE_S - loop.time()))

    async def WatchKvEvents(  # type: ignore[override]  # writes with context.write instead of yielding
        self, request: pe.WatchKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Snapshot and subscription are taken in one synchronous step: no event can fall between.
        sub = self.pool.kv_hub.subscribe()
        snapshots = [(w.worker_id, *w.snapshot()) for w in self.pool.workers]
        try:
            for worker_id, event_id, blocks in snapshots:
                await context.write(
                    pe.WatchKvEventsResponse(
                        snapshot=pe.WorkerKvSnapshot(
                            worker_id=worker_id, event_id=event_id, block_hashes=blocks
                        )
                    )
                )
            async for ev in sub.events():
                await context.write(
                    pe.WatchKvEventsResponse(
                        event=pe.WorkerKvEvent(
                            worker_id=ev.worker_id,
                            event_id=ev.event_id,
                            stored=ev.stored,
                            removed=ev.removed,
                            cleared=ev.cleared,
                        )
                    )
                )
        except SubscriberTooSlow as exc:
            log.warning("kv subscriber fell behind; ending its stream", error=str(exc))
            await abort_with_reason(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                Reason.SLOW_CONSUMER,
                f"{exc}; re-subscribe for a fresh snapshot",
            )
        finally:
            self.pool.kv_hub.unsubscribe(sub)

    async def StartDrain(
        self, request: pe.StartDrainRequest, context: grpc.aio.ServicerContext
    ) -> pe.StartDrainResponse:
        v = Violations()
        if not request.HasField("timeout"):
            v.add("timeout", "is required")
        elif seconds(request.timeout) <= 0:
            v.add("timeout", f"must be > 0 (got {seconds(request.timeout):g} s)")
        await v.abort_if_any(context)
        if self.pool.drain.state is DrainState.ACTIVE:
            log.info("drain started", timeout_s=seconds(request.timeout), reason=request.reason)
        self.pool.start_drain(seconds(request.timeout))
        return pe.StartDrainResponse(drain=drain_status(self.pool))

"""Mapping between the directory's plain values and globaldiscovery.v1 messages.

Stored times go out through timeconv.clamped_timestamp, which never raises: requests are checked
on the way in (request_checks), and this is the second line, so that one record that slipped past
(an older server's, a store written by hand) can never make a listing that includes it fail.
"""

from __future__ import annotations

from globaldiscovery.records import (
    Capacity,
    EventKind,
    FrontendView,
    PoolEvent,
    PoolRegistration,
    PoolView,
    Removal,
)
from globaldiscovery.v1 import discovery_pb2 as pb
from meshkit import timeconv

_EVENT_TYPES = {
    EventKind.ADDED: pb.WATCH_EVENT_TYPE_ADDED,
    EventKind.UPDATED: pb.WATCH_EVENT_TYPE_UPDATED,
    EventKind.REMOVED: pb.WATCH_EVENT_TYPE_REMOVED,
    EventKind.SNAPSHOT_DONE: pb.WATCH_EVENT_TYPE_SNAPSHOT_DONE,
}


def registration(req: pb.RegisterPoolRequest) -> PoolRegistration:
    """A validated RegisterPoolRequest as the directory takes it."""
    capacity = None
    if req.HasField("capacity") and (
        req.capacity.max_running_requests
        or req.capacity.kv_cache_blocks
        or req.capacity.prefill_tokens_per_second
    ):
        capacity = Capacity(
            max_running_requests=req.capacity.max_running_requests,
            kv_cache_blocks=req.capacity.kv_cache_blocks,
            prefill_tokens_per_second=req.capacity.prefill_tokens_per_second,
        )
    deadline = None
    if req.draining and req.HasField("drain_deadline"):
        deadline = timeconv.wall_seconds(req.drain_deadline)
    return PoolRegistration(
        pool_id=req.pool_id,
        model=req.model,
        region=req.region,
        frontends=tuple(req.frontends),
        relay_id=req.relay_id,
        incarnation=req.incarnation,
        capacity=capacity,
        capabilities=tuple(req.capabilities),
        draining=req.draining,
        drain_deadline_wall=deadline,
        frontend_protocol=req.frontend_protocol,
    )


def removal(reason: int) -> Removal:
    """A RemovalReason number as the directory's Removal (unknown numbers: UNREGISTERED)."""
    try:
        value = Removal(reason)
    except ValueError:
        return Removal.UNREGISTERED
    return Removal.UNREGISTERED if value is Removal.UNSPECIFIED else value


def pool(view: PoolView) -> pb.Pool:
    """A directory PoolView as a Pool message."""
    msg = pb.Pool(
        pool_id=view.pool_id,
        model=view.model,
        region=view.region,
        frontends=view.frontends,
        draining=view.draining,
        capabilities=view.capabilities,
        create_time=timeconv.clamped_timestamp(view.create_wall),
        revision=view.revision,
        frontend_protocol=view.frontend_protocol,  # type: ignore[arg-type]
        leases=[
            pb.PoolLease(
                relay_id=lease.relay_id,
                incarnation=lease.incarnation,
                frontends=lease.frontends,
                expire_time=timeconv.clamped_timestamp(lease.expire_wall),
                draining=lease.draining,
            )
            for lease in view.leases
        ],
    )
    if view.drain_deadline_wall is not None:
        msg.drain_deadline.CopyFrom(timeconv.clamped_timestamp(view.drain_deadline_wall))
    if view.capacity is not None:
        msg.capacity.CopyFrom(
            pb.PoolCapacity(
                max_running_requests=view.capacity.max_running_requests,
                kv_cache_blocks=view.capacity.kv_cache_blocks,
                prefill_tokens_per_second=view.capacity.prefill_tokens_per_second,
            )
        )
    return msg


def frontend(view: FrontendView) -> pb.Frontend:
    """A directory FrontendView as a Frontend message."""
    return pb.Frontend(
        frontend_id=view.frontend_id,
        url=view.url,
        region=view.region,
        incarnation=view.incarnation,
        expire_time=timeconv.clamped_timestamp(view.expire_wall),
    )


def watch_event(event: PoolEvent) -> pb.WatchPoolsResponse:
    """A directory event as a WatchPoolsResponse, encoded once and shared by every watcher."""
    if event.encoded is None:
        msg = pb.WatchPoolsResponse(
            type=_EVENT_TYPES[event.kind],
            complete=event.complete,
            revision=event.revision,
            resumed=event.resumed,
        )
        if event.pool is not None:
            msg.pool.CopyFrom(pool(event.pool))
        if event.kind is EventKind.REMOVED:
            msg.removal_reason = event.reason.value  # type: ignore[assignment]  # a proto enum field takes its number
        event.encoded = msg
    return event.encoded  # type: ignore[return-value]

"""RelayStatusService: what the relay registers, why not, each telemetry stream's and engine worker's state."""

from __future__ import annotations

import grpc

from meshkit.timeconv import timestamp
from poolrelay.engine.source import EngineSource, WorkerState
from poolrelay.relay import Relay
from poolrelay.v1 import status_pb2, status_pb2_grpc


def relay_status(relay: Relay) -> status_pb2.GetRelayStatusResponse:
    """The relay's status as the contract shapes it."""
    reason, detail = relay.unregistered
    reply = status_pb2.GetRelayStatusResponse(
        healthy=True,  # the process answers; an unregistered pool does not make the relay unhealthy
        pool_id=relay.config.pool_id,
        relay_id=relay.config.relay_id,
        incarnation=relay.config.incarnation,
        registered_model=relay.registered_model,
        routing_pool_unregistered_reason=int(reason),  # type: ignore[arg-type]  # a proto enum field takes its number
        routing_pool_unregistered_detail=detail,
        pool_blocks=len(relay.blocks),
        draining=relay.draining,
    )
    if relay.lease_expire_wall is not None and relay.registered_model:
        reply.lease_expire_time.CopyFrom(timestamp(relay.lease_expire_wall))
    for url in sorted(relay.hub.publishers):
        p = relay.hub.publishers[url]
        reply.telemetry_streams.add(
            frontend_url=url,
            state=p.state,
            last_error=p.last_error,
            messages_sent=p.messages_sent,
            queue_depth=p.queue_depth,
            connects=p.connects,
            snapshots_sent=p.snapshots_sent,
            messages_dropped=p.messages_dropped,
        )
    if isinstance(relay.source, EngineSource):
        for worker_id in sorted(relay.source.workers):
            reply.engine_workers.append(engine_worker_status(relay.source.workers[worker_id]))
    return reply


def engine_worker_status(st: WorkerState) -> status_pb2.EngineWorkerStatus:
    """One engine worker's polls and KV event feed, as the contract shapes them."""
    c = st.feed.counts
    reply = status_pb2.EngineWorkerStatus(
        worker_id=st.worker.worker_id,
        url=st.worker.url,
        healthy=st.healthy,
        last_error=st.last_error,
        consecutive_failures=st.failures,
        kv_event_batches=c.batches,
        kv_events_applied=c.events,
        gaps=c.gaps,
        replays_asked=c.replays,
        replays_closed=c.replays_closed,
        replayed_batches=c.replayed_batches,
        resets=c.resets,
        last_reset_reason=c.last_reset_reason,
        malformed_dropped=c.malformed,
        duplicates_skipped=c.duplicates,
        blocks=len(st.feed.blocks),
    )
    if st.feed.last is not None:
        reply.last_sequence = st.feed.last
    return reply


class RelayStatusServicer(status_pb2_grpc.RelayStatusServiceServicer):
    """Serves GetRelayStatus from the running relay."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    async def GetRelayStatus(
        self, request: status_pb2.GetRelayStatusRequest, context: grpc.aio.ServicerContext
    ) -> status_pb2.GetRelayStatusResponse:
        return relay_status(self.relay)


def register(relay: Relay):
    """A `create_server` register callback adding the status service."""

    def _register(server: grpc.aio.Server) -> list[str]:
        status_pb2_grpc.add_RelayStatusServiceServicer_to_server(RelayStatusServicer(relay), server)
        return [status_pb2.DESCRIPTOR.services_by_name["RelayStatusService"].full_name]

    return _register

"""This frontend's lease in discovery: RegisterFrontend at the server-dictated interval, Unregister on stop."""

from __future__ import annotations

import grpc

from globaldiscovery.v1 import discovery_pb2, discovery_pb2_grpc
from meshkit.clock import Clock
from meshkit.logs import get_logger
from meshkit.timeconv import seconds

log = get_logger(module="globalrouter.frontend_lease")

FIRST_RETRY_S = 1.0
"""A failed registration is retried after this long, the wait doubling up to the heartbeat interval."""
DEFAULT_HEARTBEAT_S = 5.0
"""The heartbeat assumed until discovery has dictated one."""
CALL_TIMEOUT_S = 3.0


def next_delay(heartbeat: float, failures: int) -> float:
    """Seconds until the next RegisterFrontend: the heartbeat after a success, else 1 s doubling, capped."""
    if failures == 0:
        return heartbeat
    return min(FIRST_RETRY_S * 2 ** (failures - 1), heartbeat)


class FrontendRegistration:
    """Renews this frontend's lease so relays find it; ends it on a graceful stop."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        clock: Clock,
        *,
        frontend_id: str,
        url: str,
        region: str,
        incarnation: int,
    ) -> None:
        self._stub = discovery_pb2_grpc.DiscoveryServiceStub(channel)
        self._clock = clock
        self._request = discovery_pb2.RegisterFrontendRequest(
            frontend_id=frontend_id, url=url, region=region, incarnation=incarnation
        )
        self.heartbeat = DEFAULT_HEARTBEAT_S
        self.lease_duration = 3 * DEFAULT_HEARTBEAT_S
        """The lease duration discovery dictated (how long a fresh replica's listing may be incomplete)."""
        self.failures = 0
        self.registrations = 0

    async def register_once(self) -> bool:
        """One RegisterFrontend; adopts the heartbeat the server dictates. True on success."""
        try:
            reply = await self._stub.RegisterFrontend(self._request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self.failures += 1
            log.warning("frontend registration failed", code=exc.code().name, detail=exc.details())
            return False
        if self.failures or not self.registrations:
            log.info("frontend registered", frontend_id=self._request.frontend_id, url=self._request.url)
        self.failures = 0
        self.registrations += 1
        hb, lease = seconds(reply.heartbeat_interval), seconds(reply.lease_duration)
        if hb > 0:
            self.heartbeat = hb
        if lease > 0:
            self.lease_duration = lease
        return True

    async def run(self) -> None:
        """Registers and renews until cancelled."""
        while True:
            await self.register_once()
            await self._clock.sleep(next_delay(self.heartbeat, self.failures))

    async def unregister(self) -> None:
        """Ends the lease at once (a graceful stop), so relays stop streaming here."""
        try:
            await self._stub.UnregisterFrontend(
                discovery_pb2.UnregisterFrontendRequest(
                    frontend_id=self._request.frontend_id, incarnation=self._request.incarnation
                ),
                timeout=CALL_TIMEOUT_S,
            )
            log.info("frontend unregistered", frontend_id=self._request.frontend_id)
        except grpc.aio.AioRpcError as exc:
            log.warning("frontend unregistration failed", code=exc.code().name)

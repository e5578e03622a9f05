"""The etcd budget store: one record key per (tenant, limit), changed only by compare-and-swap transactions.

Every frontend of a fleet points at the same etcd. The record holds the reservations of the
buckets still in the horizon (`bucket:count,...`, see globalrouter.budgets). A step reads it,
applies `budgets.apply_step` (forget buckets that left the horizon, take returns off, add what
fits under the limit) and writes it back only if nobody changed the key in between (its
mod_revision), retrying on a race. Each write puts the key under an etcd lease that ends a little
after the written bucket leaves the horizon, so an idle tenant's record disappears by itself; a
dead frontend's unused chunk stops counting when its bucket leaves the horizon (the next step
forgets it), whether or not the lease has ended.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import aetcd
import aetcd.exceptions

from globalrouter.budgets import StoreError, apply_step, decode_record, encode_record
from meshkit import discovery_endpoints
from meshkit.clock import Clock
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.budget_etcd")

PREFIX = b"/globalrouter/v1/budget/"
MAX_RACES = 32
"""Compare-and-swap attempts one reservation makes before it counts as the store not answering."""
_ETCD_ERRORS = (aetcd.exceptions.ClientError, OSError, TimeoutError)


class EtcdBudgetStore:
    """Budget counters in etcd, shared by every frontend that uses the same endpoints."""

    def __init__(self, endpoints: str, clock: Clock, *, timeout: float = 5.0) -> None:
        parsed = discovery_endpoints.parse_endpoints(endpoints)
        host, _, port = discovery_endpoints.channel_target(parsed)[0].rpartition(":")
        self._client = aetcd.Client(
            host=host,
            port=int(port),
            timeout=timeout,
            options=dict(discovery_endpoints.channel_options(parsed)),
        )
        self.clock = clock
        self._leases: dict[
            int, int
        ] = {}  # expiry second -> etcd lease id (shared by the records written for it)
        self._connected = False

    async def _connect(self) -> None:
        if not self._connected:
            await self._client.connect()
            self._connected = True

    async def _lease(self, expires_wall: float) -> int:
        """A lease that lasts until `expires_wall` (rounded up to the second), shared by every record of that second."""
        second = math.ceil(expires_wall)
        lease_id = self._leases.get(second)
        if lease_id is None:
            ttl = max(2, second - math.floor(self.clock.wall()))
            lease_id = (await self._client.lease(ttl)).id
            now = self.clock.wall()
            self._leases = {s: i for s, i in self._leases.items() if s > now}
            self._leases[second] = lease_id
        return lease_id

    async def reserve(
        self,
        key: str,
        bucket: int,
        first: int,
        ask: int,
        limit: int,
        returns: Mapping[int, int],
        expires_wall: float,
    ) -> tuple[int, dict[int, int]]:
        length = max(1.0, expires_wall - self.clock.wall())
        k = PREFIX + key.encode()
        try:
            await self._connect()
            t = self._client.transactions
            for _ in range(MAX_RACES):
                current = await self._client.get(k)
                try:
                    counts = decode_record(current.value) if current is not None else {}
                except ValueError as exc:
                    raise StoreError(f"budget record {key!r} in etcd is corrupt: {exc}") from exc
                granted, after = apply_step(counts, bucket, first, ask, limit, returns)
                if after == counts:
                    return granted, after  # nothing to write (nothing granted, nothing to return)
                # The record outlives its newest bucket's horizon a little: a late give-back
                # still finds it, and an idle tenant's record goes by itself.
                lease_id = await self._lease(expires_wall + min(length, 60.0))
                revision = current.mod_revision if current is not None else 0
                ok, _ = await self._client.transaction(
                    compare=[t.mod(k) == revision],
                    success=[t.put(k, encode_record(after), lease=lease_id)],
                    failure=[],
                )
                if ok:
                    return granted, after
        except _ETCD_ERRORS as exc:
            raise StoreError(f"etcd did not answer: {exc}") from exc
        raise StoreError(f"budget record {key!r} changed {MAX_RACES} times while reserving")

    async def record(self, key: str) -> dict[int, int]:
        """The record (reservations per bucket; empty when absent), for tests and status."""
        await self._connect()
        current = await self._client.get(PREFIX + key.encode())
        return decode_record(current.value) if current is not None else {}

    async def close(self) -> None:
        if self._connected:
            await self._client.close()
            self._connected = False

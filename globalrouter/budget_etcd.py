"""The etcd budget store: one counter key per (tenant, limit, window), changed only by compare-and-swap transactions.

Every frontend of a fleet points at the same etcd. A reservation reads the counter, adds what
fits under the limit and writes it back only if nobody changed the key in between (its
mod_revision), retrying on a race. The key is put under an etcd lease that outlives its window
(window end + one window length), so counters of past windows disappear by themselves and a
frontend that died holds its unused chunk only until then.
"""

from __future__ import annotations

import math

import aetcd
import aetcd.exceptions

from globalrouter.budgets import StoreError
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
        self._leases: dict[int, int] = {}  # expiry second -> etcd lease id (one per window end)
        self._connected = False

    async def _connect(self) -> None:
        if not self._connected:
            await self._client.connect()
            self._connected = True

    async def _lease(self, expires_wall: float) -> int:
        """A lease that lasts until `expires_wall`, shared by every key of that window end."""
        second = math.ceil(expires_wall)
        lease_id = self._leases.get(second)
        if lease_id is None:
            ttl = max(2, second - math.floor(self.clock.wall()))
            lease_id = (await self._client.lease(ttl)).id
            now = self.clock.wall()
            self._leases = {s: i for s, i in self._leases.items() if s > now}
            self._leases[second] = lease_id
        return lease_id

    async def reserve(self, key: str, ask: int, limit: int, expires_wall: float) -> tuple[int, int]:
        length = expires_wall - math.floor(self.clock.wall())
        try:
            await self._connect()
            # The counter outlives its window by a window's length: a late give-back still finds it.
            lease_id = await self._lease(expires_wall + max(1.0, length))
            k = PREFIX + key.encode()
            t = self._client.transactions
            for _ in range(MAX_RACES):
                current = await self._client.get(k)
                counter = int(current.value) if current is not None else 0
                granted = max(0, min(ask, limit - counter))
                if granted == 0:
                    return 0, counter
                ok, _ = await self._client.transaction(
                    compare=[t.mod(k) == (current.mod_revision if current is not None else 0)],
                    success=[t.put(k, str(counter + granted).encode(), lease=lease_id)],
                    failure=[],
                )
                if ok:
                    return granted, counter + granted
        except _ETCD_ERRORS as exc:
            raise StoreError(f"etcd did not answer: {exc}") from exc
        raise StoreError(f"budget counter {key!r} changed {MAX_RACES} times while reserving")

    async def give_back(self, key: str, amount: int) -> None:
        k = PREFIX + key.encode()
        try:
            await self._connect()
            t = self._client.transactions
            for _ in range(MAX_RACES):
                current = await self._client.get(k)
                if current is None:
                    return  # its window ended and the lease took it
                counter = int(current.value)
                ok, _ = await self._client.transaction(
                    compare=[t.mod(k) == current.mod_revision],
                    success=[t.put(k, str(max(0, counter - amount)).encode(), lease=current.lease)],
                    failure=[],
                )
                if ok:
                    return
        except _ETCD_ERRORS as exc:
            raise StoreError(f"etcd did not answer: {exc}") from exc

    async def counter(self, key: str) -> int:
        """The counter's value (0 when absent), for tests and status."""
        await self._connect()
        current = await self._client.get(PREFIX + key.encode())
        return int(current.value) if current is not None else 0

    async def close(self) -> None:
        if self._connected:
            await self._client.close()
            self._connected = False

"""When a global frontend may take traffic: its directory synced and the listed pools' KV state arrived, or a bounded wait passed."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from globalrouter.pool_directory import PoolTable
from meshkit.clock import Clock
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.readiness")

# How often the condition is looked at until it holds (then never again): one pass over the
# listed pools, a few microseconds per pool.
POLL_INTERVAL_S = 0.1
# Pools named in the log when the wait times out (the count is always given).
NAMED_POOLS = 10


class Readiness:
    """Ready (once, then for the process's life) when the directory is synced, i.e. the first
    WatchPools snapshot is applied, and every pool it lists has a KV snapshot from at least one
    relay stream, or `timeout` seconds after the start, whichever comes first; the directory is
    waited for in any case (routing without it would refuse every model). Without discovery, ready
    at once. A pool listed later does not make a ready frontend unready."""

    def __init__(
        self,
        table: PoolTable,
        clock: Clock,
        *,
        directory: bool,
        timeout: float,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if not timeout >= 0:
            raise ValueError(f"ready timeout must be >= 0 seconds (got {timeout})")
        self._table = table
        self._clock = clock
        self.timeout = timeout
        self.started_at = clock.monotonic()
        self.ready_after: float | None
        """Seconds from the start to readiness (None until ready)."""
        self.pools_without_kv = 0
        """Listed pools without KV state at the last check (0 before the directory synced and
        once ready): for the probe, which must not walk the table from its own thread."""
        self._gauge = Gauge(
            "globalrouter_ready",
            "1 once the frontend is ready to route (directory synced, listed pools' KV state arrived "
            "or --ready-timeout passed), 0 before",
            registry=registry,
        )
        # Without discovery (tests, benches) ready at once; said quietly (no log at construction).
        self.ready = not directory
        self.ready_after = None if directory else 0.0
        self._gauge.set(0 if directory else 1)

    def pools_waiting(self) -> list[str]:
        """Listed pools with no KV snapshot from any relay stream yet, sorted."""
        return sorted(p.pool_id for p in self._table.listed() if not p.kv_sources)

    def check(self) -> bool:
        """Whether the frontend is ready; latches and logs the transition the first time."""
        if self.ready:
            return True
        waited = self._clock.monotonic() - self.started_at
        if not self._table.synced:
            return False
        waiting = self.pools_waiting()
        self.pools_without_kv = len(waiting)
        if not waiting:
            self._become_ready(
                waited,
                "directory synced; every listed pool's KV state arrived",
                pools=len(self._table.listed()),
            )
            return True
        if waited >= self.timeout:
            self._become_ready(
                waited,
                "directory synced; ready timeout passed before some listed pools' KV state arrived",
                pools=len(self._table.listed()),
                pools_without_kv=len(waiting),
                named=waiting[:NAMED_POOLS],
            )
            return True
        return False

    def _become_ready(self, waited: float, why: str, **detail: Any) -> None:
        self.ready = True
        self.pools_without_kv = 0
        self.ready_after = waited
        self._gauge.set(1)
        log.info("ready to route", why=why, waited_s=round(waited, 3), timeout_s=self.timeout, **detail)

    async def wait(self) -> None:
        """Returns once ready (polls the condition on the clock)."""
        while not self.check():
            await self._clock.sleep(POLL_INTERVAL_S)

    def status(self) -> dict[str, Any]:
        """What /readyz says: ready or not, and how much is still waited for. Counts only: probes
        need no credentials, so pool ids are left to the log (and to ListPools, for clients)."""
        if self.check():
            return {"status": "ready", "ready_after_s": round(self.ready_after or 0.0, 3)}
        return {
            "status": "not ready",
            "directory_synced": self._table.synced,
            "pools_without_kv": len(self.pools_waiting()) if self._table.synced else 0,
            "waited_s": round(self._clock.monotonic() - self.started_at, 3),
            "ready_timeout_s": self.timeout,
        }

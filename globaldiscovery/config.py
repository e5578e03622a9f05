"""Configuration of a discovery server: one frozen dataclass, built by cli.py and checked at start."""

from __future__ import annotations

from dataclasses import dataclass, field

from globaldiscovery.lease_state import DEFAULT_HISTORY_BYTES, DEFAULT_QUEUE_BYTES
from globaldiscovery.store.etcd_link import DEFAULT_ISOLATION_TIMEOUT
from meshkit.tls import SecurityConfig

MAX_LEASE_SECONDS = 86_400.0


@dataclass(frozen=True)
class DiscoveryConfig:
    """Everything a discovery server needs to start."""

    listen: str = "127.0.0.1:50051"
    """HOST:PORT to listen on (port 0 picks a free one)."""

    heartbeat_interval: float = 5.0
    """Seconds between renewals, dictated to every relay and frontend in each reply."""

    lease_duration: float = 15.0
    """Seconds a lease lives without renewal; greater than heartbeat_interval, at most one day."""

    watch_queue_limit: int = 10_000
    """Events a WatchPools stream may fall behind before it is ended with RESOURCE_EXHAUSTED."""

    watch_queue_bytes: int = DEFAULT_QUEUE_BYTES
    """Bytes of pool records a WatchPools stream may fall behind before it is ended likewise."""

    watch_history_bytes: int = DEFAULT_HISTORY_BYTES
    """Bytes of pool records the watch history (what a resumed watch replays) may hold; a resume
    from before the oldest kept change gets a fresh snapshot."""

    store: str = "memory"
    """Where the directory lives: "memory" (this process only) or "etcd" (shared by replicas)."""

    etcd_endpoints: str = ""
    """HOST:PORT of etcd, with store "etcd"; several, comma-separated, for an etcd cluster's members."""

    etcd_isolation_timeout: float = DEFAULT_ISOLATION_TIMEOUT
    """Seconds a replica of the etcd store may go without etcd before it stops serving (NOT_SERVING,
    watches ended and every call refused with UNAVAILABLE, so callers move to another replica);
    it serves again by itself once its mirror re-synced."""

    stop_grace: float = 5.0
    """Seconds in-flight calls get to finish on SIGTERM."""

    max_watchers: int = 1024
    """WatchPools streams open at once (each holds a queue); one more is refused with RESOURCE_EXHAUSTED."""

    security: SecurityConfig = field(default_factory=SecurityConfig)
    """TLS, identities and API keys (the shared security flags)."""

    def problems(self) -> list[str]:
        """What is wrong with this configuration, one sentence per problem naming the flag."""
        found = []
        if not self.heartbeat_interval > 0:
            found.append(f"--heartbeat-interval must be > 0 (got {self.heartbeat_interval:g})")
        if not self.lease_duration > self.heartbeat_interval:
            found.append(
                f"--lease-duration ({self.lease_duration:g} s) must be greater than "
                f"--heartbeat-interval ({self.heartbeat_interval:g} s)"
            )
        if self.lease_duration > MAX_LEASE_SECONDS:
            found.append(f"--lease-duration must be at most one day (got {self.lease_duration:g} s)")
        if self.store == "etcd" and not self.etcd_endpoints:
            found.append("--store etcd needs --etcd-endpoints HOST:PORT")
        if not self.etcd_isolation_timeout > 0:
            found.append(f"--etcd-isolation-timeout must be > 0 (got {self.etcd_isolation_timeout:g})")
        if self.max_watchers < 1:
            found.append(f"--max-watchers must be >= 1 (got {self.max_watchers})")
        if self.watch_queue_limit < 1:
            found.append(f"--watch-queue-limit must be >= 1 (got {self.watch_queue_limit})")
        if self.watch_queue_bytes < 1:
            found.append(f"--watch-queue-bytes must be >= 1 (got {self.watch_queue_bytes})")
        if self.watch_history_bytes < 1:
            found.append(f"--watch-history-bytes must be >= 1 (got {self.watch_history_bytes})")
        return found

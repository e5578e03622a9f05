"""Configuration of one global frontend (`globalrouter serve`), parsed once in server.add_parser."""

from __future__ import annotations

from dataclasses import dataclass, field

from globalrouter.http_api.config import HttpConfig
from globalrouter.pool_state import FreshnessLimits
from globalrouter.stall import StallPolicy
from globalrouter.wait_slo import WaitSlo
from meshkit.tls import SecurityConfig


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything a global frontend needs to run; built from flags or directly by tests."""

    listen: str = "127.0.0.1:0"
    """HOST:PORT the gRPC server binds (RouterService + TelemetryService); port 0 picks a free one."""
    discovery: str = ""
    """HOST:PORT (or URL) of the discovery service; empty runs without discovery (tests only)."""
    advertise: str = ""
    """URL relays dial for telemetry; empty derives http://<listen host>:<bound port>."""
    frontend_id: str = ""
    """This frontend's id in discovery; empty derives `globalrouter-<port>`."""
    region: str = ""
    """This frontend's region, as registered with discovery (may be empty)."""
    incarnation: int = 0
    """This process's incarnation (0: the start time in nanoseconds)."""
    migration_limit: int = 3
    """Mid-stream migrations allowed per request; one more failure ends it with UNAVAILABLE, reason MIGRATION_LIMIT_REACHED."""
    admission_tries: int = 4
    """Pools asked at most per admission round before the request fails (refusals, unreachable)."""
    link_backoff_initial: float = 1.0
    """Seconds a pool's serving link is avoided after its first failure (doubles per failure)."""
    link_backoff_max: float = 15.0
    """Upper bound of the serving-link failure back-off, in seconds."""
    metrics_listen: str = ""
    """HOST:PORT of the Prometheus endpoint; empty: off."""
    grace: float = 5.0
    """Seconds in-flight calls may run after SIGTERM before the server stops."""
    stall: StallPolicy = field(default_factory=StallPolicy)
    """How long an admitted pool may stay silent before it counts as hung for the request."""
    freshness: FreshnessLimits = field(default_factory=FreshnessLimits)
    """How old each kind of pool signal may be before it counts as unknown."""
    wait_slo: WaitSlo | None = None
    """When set, the ranking runs under this wait SLO instead of fixed weights
    (`SelectionConfig.wait_slo`)."""
    max_streams_per_client: int = 64
    """Concurrent Generate streams one client identity may hold (enforced with TLS or API keys)."""
    max_generate_streams: int = 10_000
    """Concurrent Generate streams of all clients together."""
    max_prompt_tokens: int = 1_048_576
    """Longest prompt accepted, in tokens."""
    max_output_tokens: int = 1_048_576
    """Largest max_tokens accepted."""
    max_telemetry_streams: int = 1024
    """Telemetry streams open at once (one per relay replica); one more is RESOURCE_EXHAUSTED."""
    max_snapshot_blocks: int = 4_194_304
    """Block hashes one telemetry snapshot may carry across its chunks (bounds a stream's memory)."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """TLS, identities and API keys (the shared security flags)."""
    tokenizers: tuple[tuple[str, str], ...] = ()
    """(model, directory) pairs: a Hugging Face tokenizer.json + tokenizer_config.json per model,
    for text prompts of both APIs; other models use one token per UTF-8 byte."""
    tokenizer_threads: int = 2
    """Threads that encode text prompts (and render chat templates), off the event loop."""
    tokenizer_queue: int = 64
    """Prompts that may wait for an encoding thread; one more is refused (RESOURCE_EXHAUSTED / 429)."""
    http: HttpConfig = field(default_factory=HttpConfig)
    """The OpenAI-compatible HTTP front (off unless http.listen is set)."""

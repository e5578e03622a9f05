"""Configuration of one global frontend (`globalrouter serve`), parsed once in serve_cli.py; its defaults are the flags' defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from globalrouter.dispatch import DispatchConfig
from globalrouter.http_api.config import HttpConfig
from globalrouter.pool_state import FreshnessLimits
from globalrouter.selection import SelectionConfig
from globalrouter.snapshot_readers import SNAPSHOT_READERS
from globalrouter.stall import StallPolicy
from globalrouter.wait_slo import WaitSlo
from meshkit.tls import SecurityConfig
from meshkit.tracing import TracingConfig


@dataclass(frozen=True, slots=True)
class OpenAILinkConfig:
    """The global frontend's HTTP client to OpenAI-compatible pools (vLLM, SGLang): one pooled session."""

    connect_timeout: float = 5.0
    """Seconds to open a TCP (and TLS) connection to a pool's frontend before it counts as unreachable."""
    read_timeout: float = 300.0
    """Seconds an admitted stream may go without a byte before it counts as broken (the request migrates)."""
    max_connections: int = 1024
    """Connections open at once to all OpenAI pools together (keep-alive pooled); more wait for one."""


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """The health probe served off the serving loop (`globalrouter.health_probe`); off unless a
    listen address is set."""

    listen: str = ""
    """HOST:PORT of gRPC health (grpc.health.v1: "" readiness, "liveness" liveness), plaintext; empty: off."""
    http_listen: str = ""
    """HOST:PORT of HTTP GET /livez and /readyz, plaintext; empty: off."""
    live_within: float = 10.0
    """Seconds since the serving loop's last tick after which the probe says not live (restart me)."""
    ready_within: float = 1.0
    """Seconds since the serving loop's last tick after which the probe says not ready, even when ready."""

    def __post_init__(self) -> None:
        if not 0 < self.ready_within <= self.live_within:
            raise ValueError(
                "probe: ready_within (--probe-ready-within) must be > 0 and at most live_within "
                f"(--probe-live-within); got {self.ready_within} and {self.live_within} seconds"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.listen or self.http_listen)


@dataclass(frozen=True, slots=True)
class GcConfig:
    """Python's cyclic garbage collector in the frontend (globalrouter.gc_pauses): a collection
    holds the serving loop for as long as it walks its generation."""

    freeze: bool = True
    """gc.freeze() at the start, once the frontend is ready, and after every full collection: what
    is alive then (at a fleet, the pools' state and 2,000 telemetry streams' calls) is left out of
    later collections. Without it, full collections over that state took 100-500 ms at 1,000
    pools, each a pause of every call (BENCHMARKS.md, "Loop lag at 1,000 pools"). Cycles among
    frozen objects that become garbage wait for the next planned full collection (full_every)."""
    full_every: float = 600.0
    """Seconds between planned full collections over everything, frozen objects included (one
    pause of a full collection's length, which frees cycles among frozen objects that became
    garbage: a closed stream's); 0: never (such cycles are then never freed)."""
    young_every: float = 0.05
    """Seconds between the young collections the serving loop runs itself (gc.collect(0) from a
    timer), then, with `freeze`, a freeze of what survived: what is young is then at most this old.
    The interpreter's own trigger counts allocations net of every deallocation, old objects' too,
    so while each stream's new pending read replaces an older one its count hardly moves and the
    young generation grew to 37,000 objects at 1,000 pools: young collections of up to 17-21 ms,
    and generation-1 ones of 18-23 ms over every stream's read. Timed, young collections stay under
    about 1.5 ms (p99) and, frozen after each, there are no older ones left to walk (BENCHMARKS.md,
    "Loop lag at 1,000 pools: the collector on a timer, telemetry in 2 ms slices"). 0: none (the
    thresholds alone decide)."""
    threshold: int = 0
    """Allocations between young-generation collections (gc.set_threshold's first value); 0 keeps
    Python's (700)."""
    threshold1: int = 100
    """Young collections between generation-1 collections (gc.set_threshold's second value); 0
    keeps Python's (10). A generation-1 collection walks what survived the young ones since the
    last: at a fleet, mostly every open stream's pending gRPC read (about 15 objects each, alive
    until its relay's next write), so its length grows with the streams (6-7 ms CPU at 1,000
    streams, 23-28 ms at 2,000 in a loaded run) and hardly with this value, which sets how often
    it comes: at 100 a tenth as often as Python's 10 (BENCHMARKS.md, "Loop lag at 1,000 pools").
    With `young_every` and the freeze, what survives a young collection is frozen at once, so
    generation 1 stays nearly empty whatever this value."""

    def __post_init__(self) -> None:
        if not (self.full_every >= 0 and math.isfinite(self.full_every)):
            raise ValueError(f"gc full_every (--gc-full-every) must be >= 0 seconds; got {self.full_every!r}")
        if not (self.young_every >= 0 and math.isfinite(self.young_every)):
            raise ValueError(
                f"gc young_every (--gc-young-every) must be >= 0 seconds; got {self.young_every!r}"
            )
        if self.threshold < 0:
            raise ValueError(f"gc threshold (--gc-threshold) must be >= 0; got {self.threshold!r}")
        if self.threshold1 < 0:
            raise ValueError(f"gc threshold1 (--gc-threshold1) must be >= 0; got {self.threshold1!r}")


MAX_TELEMETRY_BATCH_INTERVAL = 5.0
"""RouterConfig.telemetry_batch_interval's bound: deltas held longer would age the KV view past use."""

KV_STATES = ("exact", "summary")
"""RouterConfig.kv_state's choices."""


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
    ready_timeout: float = 30.0
    """Seconds after the start at most that health waits for the listed pools' KV state before it
    says SERVING anyway (the synced directory is waited for in any case); `globalrouter.readiness`."""
    stall: StallPolicy = field(default_factory=StallPolicy)
    """How long an admitted pool may stay silent before it counts as hung for the request."""
    freshness: FreshnessLimits = field(default_factory=FreshnessLimits)
    """How old each kind of pool signal may be before it counts as unknown."""
    routed_prefix_ttl: float = 0.0
    """Seconds a prompt this frontend sent to a pool counts as cached there before the pool's KV
    events say so (globalrouter.routed_prefixes); 0: off."""
    ranking: str = "default"
    """The ranking's weights by name (`globalrouter.selection.RANKINGS`): `default`, or `dynamo`
    (Dynamo's KV router cost one level up, the baseline the simulator's `dynamo` policy runs)."""
    wait_slo: WaitSlo | None = None
    """When set, the ranking runs under this wait SLO instead of fixed weights
    (`SelectionConfig.wait_slo`)."""
    dispatch: DispatchConfig | None = None
    """Late binding (`globalrouter.dispatch`): requests wait in this frontend's dispatch queue
    until a pool can start them; None (the default) commits each request at arrival."""
    max_streams_per_client: int = 64
    """Concurrent Generate streams one client identity may hold (enforced with TLS or API keys)."""
    max_generate_streams: int = 10_000
    """Concurrent Generate streams of all clients together."""
    max_prompt_tokens: int = 1_048_576
    """Longest prompt accepted, in tokens."""
    max_output_tokens: int = 1_048_576
    """Largest max_tokens accepted."""
    max_telemetry_streams: int = 4096
    """Telemetry streams open at once (one per relay replica); one more is RESOURCE_EXHAUSTED.
    Sized for a fleet of 1,000 pools x 2 relays, with room for reconnects."""
    snapshot_readers: int = SNAPSHOT_READERS
    """Telemetry streams that may read a snapshot at the same time; the others read nothing until a
    slot frees (their data waits in their connections), and a slot whose relay sends no snapshot
    chunk for a second goes to the next stream. Keeps the loop's turns short in a restart or a mass redial,
    so that main-port calls are answered meanwhile. 0: no bound."""
    telemetry_batch_interval: float = 0.0
    """Seconds between a relay's writes on one telemetry stream that this frontend asks for in its
    hello ack (TelemetryHelloAck.batch_interval): what is queued meanwhile arrives as one batch, so
    the frontend pays one gRPC message per stream per interval; no delta waits longer than it. 0
    (the default): relays write as soon as something is queued. At most 5."""
    max_snapshot_blocks: int = 4_194_304
    """Block hashes one telemetry snapshot may carry across its chunks (bounds a stream's memory)."""
    max_snapshot_blocks_per_relay: int = 8_388_608
    """Snapshot blocks not yet applied (partial snapshots, snapshots being applied, deltas queued
    behind them) one relay identity may hold across its streams: 64 MiB packed."""
    max_snapshot_blocks_total: int = 268_435_456
    """The same across every telemetry stream of this frontend: 2 GiB packed, sized for a restart
    of the target fleet (1,000 pools x 2 relays x 100,000 blocks: 200,000,000 blocks arrive at
    once; at 1 GiB, 180 streams were refused in that storm and their pools' KV came back last, up
    to 100 s later, behind the loop's backlog). A snapshot storm past it refuses the streams over
    it (RESOURCE_EXHAUSTED, LIMIT_EXCEEDED, ErrorInfo metadata limit=max_snapshot_blocks_total);
    they back off and redial."""
    snapshot_step_blocks: int = 8192
    """Most blocks of snapshot application or stream removal done per step of the serving loop,
    which yields in between; fewer when a step takes over 2 ms (a big table: cache misses)."""
    kv_state: str = "exact"
    """How the frontend holds the pools' KV blocks: "exact" (KvIndex, one mask bit per relay stream
    per block: exact, fastest for small fleets) or "summary" (KvSummary, one fingerprint table per
    pool, about 2.4 bytes per (pool, block) whatever the relays: for fleets of hundreds of pools;
    rarely lossy, see BENCHMARKS.md "KV summary at fleet scale")."""
    gc: GcConfig = field(default_factory=GcConfig)
    """Python's garbage collector: frozen after the start and when ready, its young threshold."""
    loop_stall_sample: float = 0.0
    """Seconds: when > 0, a thread samples the serving loop's stack whenever its heartbeat is late
    by more than this and logs the counts every 10 s (globalrouter.loop_stalls: where the long
    turns go); 0 (the default): off."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    """OpenTelemetry export (--otlp-endpoint; empty: off)."""
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
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    """Liveness and readiness answered off the serving loop (off unless probe.listen or
    probe.http_listen is set); the main port's health is unchanged."""
    openai_link: OpenAILinkConfig = field(default_factory=OpenAILinkConfig)
    """Links to pools that speak OpenAI HTTP (timeouts, connection limit)."""
    aliases: str = ""
    """A TOML file of model aliases and traffic splits (globalrouter.aliases), re-read on SIGHUP;
    empty: no aliases."""
    policy: str = ""
    """A tenant policy file (TOML, `globalrouter.policy`): per identity, priority class, weight,
    budgets, allowed regions and models; re-read on SIGHUP. Empty: everyone may do everything."""
    budget_etcd: str = ""
    """etcd HOST:PORT[,HOST:PORT...] where the fleet's frontends keep the policy's budget counters,
    so budgets hold across them; empty: counted in this process only."""

    def __post_init__(self) -> None:
        if not (0 <= self.routed_prefix_ttl <= 3600 and math.isfinite(self.routed_prefix_ttl)):
            raise ValueError(
                f"routed_prefix_ttl (--routed-prefix-ttl) must be between 0 and 3600 seconds; got {self.routed_prefix_ttl!r}"
            )
        # raises if the ranking does not exist or does not go with the SLO
        SelectionConfig.for_ranking(self.ranking, wait_slo=self.wait_slo)
        if not (0 <= self.loop_stall_sample <= 10 and math.isfinite(self.loop_stall_sample)):
            raise ValueError(
                f"loop_stall_sample (--loop-stall-sample) must be between 0 and 10 seconds; got {self.loop_stall_sample!r}"
            )
        if not 0 <= self.telemetry_batch_interval <= MAX_TELEMETRY_BATCH_INTERVAL:
            raise ValueError(
                "telemetry_batch_interval (--telemetry-batch-interval) must be between 0 and "
                f"{MAX_TELEMETRY_BATCH_INTERVAL:g} seconds; got {self.telemetry_batch_interval!r}"
            )

"""Configuration of a simulated pool: sizes, timing, limits and injected faults (frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass

from meshkit.blocks import DEFAULT_BLOCK_SIZE
from mocker.tokens import VOCAB_SIZE


@dataclass(frozen=True)
class Faults:
    """Fault injection, settable at start (flags) and at run time (MockerAdminService.SetFaults)."""

    fail_after_tokens: int = 0
    """When > 0, the process exits abruptly once any one stream has sent this many tokens."""
    added_latency: float = 0.0
    """Seconds added before each request's admission decision (and so before its first message)."""
    refuse_all: bool = False
    """When true, every new request is refused with RESOURCE_EXHAUSTED."""
    stall_after_tokens: int = 0
    """When > 0, a stream that has sent this many tokens hangs: it stays open and sends nothing more
    (a wedged engine; the process keeps running)."""


@dataclass(frozen=True)
class PoolConfig:
    """What the simulated pool is: its models, workers, timing model and admission limits."""

    pool_id: str
    """The pool's id as it reports it in its status; with TLS, only relays whose certificate names
    this pool may read its events or drain it."""
    models: tuple[str, ...]
    """The models in the pool's topology (all served by every worker)."""
    workers: int = 2
    """Number of simulated workers."""
    worker_capacity_blocks: int = 4096
    """KV blocks each worker's LRU cache holds."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV block (block hashes are chained over blocks of this size)."""
    speedup: float = 1.0
    """Every simulated duration (prefill, decode) is divided by this."""
    max_queue: int = 64
    """Requests the pool admits beyond those it runs (waiting for a worker slot)."""
    max_running_per_worker: int = 4
    """Requests one worker runs at once."""
    prefill_tokens_per_second: float = 20_000.0
    """Uncached prompt tokens one worker prefills per second, before speedup."""
    decode_tokens_per_second: float = 50.0
    """Output tokens one request decodes per second, before speedup."""
    drain_timeout: float = 30.0
    """Seconds accepted work may run after SIGTERM before it is handed back."""
    not_ready: tuple[str, ...] = ()
    """Models that start NOT_READY (SetModelReady makes them Ready)."""
    vocab_size: int = VOCAB_SIZE
    """Output token ids are below this (set it to the vocabulary of the tokenizer that decodes them)."""
    queue_report_interval: float = 1.0
    """Seconds between PoolQueued messages to a request waiting for a slot (real seconds, not
    divided by speedup: they tell the caller the pool is busy, not hung)."""
    kv_subscriber_queue: int = 10_000
    """KV events buffered per WatchKvEvents subscriber before it is ended as too slow."""
    adapters: tuple[str, ...] = ()
    """LoRA adapters served on the first model (a request may name one; its KV blocks are hashed
    from meshkit.blocks.adapter_seed, apart from the base model's)."""

    @property
    def pool_prefill_tokens_per_second(self) -> float:
        """Prompt tokens per second the whole pool prefills, after speedup."""
        return self.workers * self.prefill_tokens_per_second * self.speedup

    @property
    def max_running(self) -> int:
        """Requests the whole pool runs at once."""
        return self.workers * self.max_running_per_worker

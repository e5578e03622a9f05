"""Engine pool configuration: the engine kind and its workers, parsed from `--engine-worker` values."""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshkit.validation import url_problem

ENGINES = ("vllm", "sglang")
_ENDPOINT = re.compile(r"^(tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+|\*):\d{1,5}|ipc://\S+)$")
_KEYS = {"url", "events", "events-bind", "replay", "id", "topic"}


@dataclass(frozen=True)
class EngineWorker:
    """One engine instance (or data-parallel rank) of the pool."""

    worker_id: str
    url: str
    """Its OpenAI HTTP base URL (/health, /metrics, /v1/models are read there)."""
    events: str
    """Its KV event ZMQ endpoint."""
    bind: bool = False
    """True: the relay binds `events` and the engine connects to it (a non-wildcard vLLM endpoint)."""
    replay: str | None = None
    """Its replay (ROUTER) endpoint, to ask for missed batches; None: gaps are never replayed."""
    topic: str = ""
    """The topic its publisher sends on ("" = vLLM's default)."""


@dataclass(frozen=True)
class EngineConfig:
    """What the relay reads from an engine pool."""

    kind: str
    """vllm or sglang."""
    workers: tuple[EngineWorker, ...]
    block_size: int
    """The engine's KV block size in tokens: a whole multiple of the mesh block size."""
    poll_interval: float = 1.0
    """Seconds between /metrics and /health polls of each worker."""
    http_timeout: float = 3.0
    """Seconds one poll may take."""
    down_after: int = 3
    """Consecutive failed health polls after which a worker is down and its blocks are dropped."""
    replay_timeout: float = 5.0
    """Seconds to wait for a replay reply before giving up on closing a gap."""


def endpoint_problem(value: str) -> str | None:
    """Why `value` is not a ZMQ endpoint the relay can use (tcp://HOST:PORT, ipc://PATH)."""
    if not _ENDPOINT.match(value):
        return f"must be a ZMQ endpoint like tcp://127.0.0.1:5557 or ipc:///path (got {value!r})"
    if value.startswith("tcp://") and not 0 < int(value.rpartition(":")[2]) <= 65535:
        return f"has a port outside 1..65535 ({value!r})"
    return None


def parse_worker(value: str, index: int) -> EngineWorker:
    """One `--engine-worker` value: comma-separated key=value pairs; raises ValueError naming the problem.

    Keys: url (required), events or events-bind (one required), replay, id (default w<index>), topic.
    """
    fields: dict[str, str] = {}
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"{part!r} is not key=value (keys: {', '.join(sorted(_KEYS))})")
        if key not in _KEYS:
            raise ValueError(f"unknown key {key!r} (keys: {', '.join(sorted(_KEYS))})")
        if key in fields:
            raise ValueError(f"{key} is given twice")
        fields[key] = val.strip()
    if "url" not in fields:
        raise ValueError("url=http://HOST:PORT is required")
    problem = url_problem(fields["url"])
    if problem:
        raise ValueError(f"url {problem}")
    if ("events" in fields) == ("events-bind" in fields):
        raise ValueError(
            "exactly one of events= (the engine binds) or events-bind= (the relay binds) is required"
        )
    bind = "events-bind" in fields
    events = fields["events-bind" if bind else "events"]
    for name, endpoint in (("events", events), ("replay", fields.get("replay"))):
        if endpoint is None:
            continue
        problem = endpoint_problem(endpoint)
        if problem:
            raise ValueError(f"{name} {problem}")
        if "*" in endpoint and not (bind and name == "events"):
            raise ValueError(f"{name} names a wildcard host: give the engine's address to connect to")
    worker_id = fields.get("id", f"w{index}")
    if not worker_id or len(worker_id) > 128 or any(ch.isspace() for ch in worker_id):
        raise ValueError("id must be 1 to 128 characters without white space")
    return EngineWorker(
        worker_id=worker_id,
        url=fields["url"],
        events=events,
        bind=bind,
        replay=fields.get("replay"),
        topic=fields.get("topic", ""),
    )


def parse_workers(values: list[str]) -> tuple[EngineWorker, ...]:
    """Every `--engine-worker`; ids must be unique. Raises ValueError naming the bad one."""
    workers = []
    for i, value in enumerate(values):
        try:
            workers.append(parse_worker(value, i))
        except ValueError as exc:
            raise ValueError(f"--engine-worker {value!r}: {exc}") from None
    ids = [w.worker_id for w in workers]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"--engine-worker ids must be unique (repeated: {', '.join(dup)})")
    return tuple(workers)

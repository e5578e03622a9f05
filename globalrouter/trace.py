"""Loading request traces in the Mooncake JSONL format (timestamp ms, lengths, prefix block ids)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_SIZE = 512
"""Tokens per block of a trace's `hash_ids` (the format's fixed block size)."""


class TraceError(ValueError):
    """A trace line is not a valid request; the message names the line and the field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    arrival: float
    """Seconds from the start of the trace (the line's `timestamp` is in milliseconds)."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Output tokens."""
    hash_ids: tuple[int, ...]
    """Prefix block ids, one per 512 prompt tokens (the last block may be partial); equal ids
    at equal positions mean a reusable prefix."""


def _int_field(obj: dict, name: str, where: str, minimum: int) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{where}: field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_line(line: str, where: str) -> TraceRequest:
    """One JSON object -> TraceRequest, with an error naming the bad field."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    ts = obj.get("timestamp")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
        raise TraceError(f"{where}: field 'timestamp' must be a number of ms >= 0, got {ts!r}")
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers >= 0")
    return TraceRequest(
        arrival=ts / 1000.0,
        input_length=_int_field(obj, "input_length", where, 1),
        output_length=_int_field(obj, "output_length", where, 0),
        hash_ids=tuple(hash_ids),
    )


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Reads a JSONL trace (blank lines skipped), sorted by arrival (stable), at most `limit`."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            out.append(parse_line(line, f"{path}:{number}"))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival)
    return out


@dataclass(frozen=True, slots=True)
class SyntheticTraceSpec:
    """A synthetic workload of the same format, to check a policy away from the shipped trace.

    Requests belong to sessions; a session starts from one of `prefix_groups` shared prefixes
    (Zipf-popular: system prompts, documents) and each of its turns extends the previous turn's
    blocks (a multi-turn conversation), so prefixes are shared both across and within sessions.
    """

    requests: int = 4000
    """Requests in the trace."""
    rate: float = 4.0
    """Mean arrivals per second (Poisson)."""
    prefix_groups: int = 200
    """Distinct shared prefixes."""
    zipf_s: float = 1.1
    """Zipf exponent of the prefix popularity (larger: a few prefixes dominate)."""
    prefix_blocks: tuple[int, int] = (4, 40)
    """Range of a shared prefix's length in blocks."""
    turn_blocks: tuple[int, int] = (1, 12)
    """Range of the blocks each turn adds."""
    continue_probability: float = 0.6
    """Chance that a request continues an open session rather than starting a new one."""
    open_sessions: int = 64
    """Sessions that can be continued at once (the oldest is closed when a new one opens)."""
    max_blocks: int = 200
    """A session ends once its prompt reaches this many blocks."""
    output_mean: float = 150.0
    """Mean output length (exponential)."""
    seed: int = 0


def synthetic_trace(spec: SyntheticTraceSpec) -> list[TraceRequest]:
    """Generates a trace from `spec` (deterministic for a seed)."""
    import random

    rng = random.Random(spec.seed)
    weights = [1.0 / (k + 1) ** spec.zipf_s for k in range(spec.prefix_groups)]
    next_id = 0
    prefixes: list[list[int]] = []
    for _ in range(spec.prefix_groups):
        n = rng.randint(*spec.prefix_blocks)
        prefixes.append(list(range(next_id, next_id + n)))
        next_id += n
    sessions: list[list[int]] = []
    out: list[TraceRequest] = []
    t = 0.0
    for _ in range(spec.requests):
        t += rng.expovariate(spec.rate)
        if sessions and rng.random() < spec.continue_probability:
            k = rng.randrange(len(sessions))
            blocks = sessions[k]
        else:
            group = rng.choices(range(spec.prefix_groups), weights)[0]
            blocks = list(prefixes[group])
            sessions.append(blocks)
            if len(sessions) > spec.open_sessions:
                sessions.pop(0)
            k = len(sessions) - 1
        added = rng.randint(*spec.turn_blocks)
        blocks.extend(range(next_id, next_id + added))
        next_id += added
        if len(blocks) >= spec.max_blocks:
            sessions.pop(k)
        input_length = len(blocks) * TRACE_BLOCK_SIZE - rng.randrange(TRACE_BLOCK_SIZE)
        output_length = max(1, round(rng.expovariate(1.0 / spec.output_mean)))
        out.append(TraceRequest(round(t, 3), input_length, output_length, tuple(blocks)))
    return out


def write_trace(path: str | Path, trace: list[TraceRequest]) -> None:
    """Writes a trace as JSONL (timestamps in integer milliseconds)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            obj = {
                "timestamp": round(r.arrival * 1000),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(obj) + "\n")

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

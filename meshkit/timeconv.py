"""Conversions between seconds and protobuf Duration/Timestamp, and monotonic ↔ wall time."""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2

# The ranges google/protobuf/timestamp.proto and duration.proto allow; the protobuf runtime
# refuses to build or print anything outside them, so values must be checked before they are kept.
MIN_TIMESTAMP_SECONDS = -62_135_596_800  # 0001-01-01T00:00:00Z
MAX_TIMESTAMP_SECONDS = 253_402_300_799  # 9999-12-31T23:59:59Z
MAX_DURATION_SECONDS = 315_576_000_000  # about 10,000 years, either sign
MAX_NANOS = 999_999_999
_LOWEST = float(MIN_TIMESTAMP_SECONDS)
_HIGHEST = MAX_TIMESTAMP_SECONDS + MAX_NANOS / 1e9


def duration(seconds: float) -> duration_pb2.Duration:
    """A Duration of `seconds` (fractions kept to the nanosecond)."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def seconds(d: duration_pb2.Duration) -> float:
    """A Duration as float seconds."""
    return d.seconds + d.nanos / 1e9


def timestamp(wall_seconds: float) -> timestamp_pb2.Timestamp:
    """A Timestamp at `wall_seconds` since the epoch."""
    t = timestamp_pb2.Timestamp()
    t.FromNanoseconds(round(wall_seconds * 1e9))
    return t


def clamped_timestamp(wall_seconds: float) -> timestamp_pb2.Timestamp:
    """timestamp(), pinned into the range a Timestamp can hold (NaN as the epoch): never raises.

    For values already stored: one out-of-range record must not make a listing that includes it
    fail (the record keeps its place; its time reads as the nearest representable one).
    """
    t = timestamp_pb2.Timestamp()
    if _LOWEST < wall_seconds < _HIGHEST:  # the common case first (renewal replies use it)
        t.FromNanoseconds(round(wall_seconds * 1e9))
    elif wall_seconds >= _HIGHEST:
        t.seconds, t.nanos = MAX_TIMESTAMP_SECONDS, MAX_NANOS
    elif wall_seconds <= _LOWEST:
        t.seconds = MIN_TIMESTAMP_SECONDS
    # else NaN (it fails every comparison): the epoch, which t already is
    return t


def wall_seconds(t: timestamp_pb2.Timestamp) -> float:
    """A Timestamp as float seconds since the epoch."""
    return t.seconds + t.nanos / 1e9


def timestamp_problem(t: timestamp_pb2.Timestamp) -> str | None:
    """Why `t` is not a valid Timestamp (years 0001 to 9999, nanos in [0, 1e9)); None when it is."""
    if not MIN_TIMESTAMP_SECONDS <= t.seconds <= MAX_TIMESTAMP_SECONDS:
        return (
            f"seconds must be between {MIN_TIMESTAMP_SECONDS} and {MAX_TIMESTAMP_SECONDS} "
            f"(0001-01-01 to 9999-12-31, got {t.seconds})"
        )
    if not 0 <= t.nanos <= MAX_NANOS:
        return f"nanos must be between 0 and {MAX_NANOS} (got {t.nanos})"
    return None


def duration_problem(d: duration_pb2.Duration) -> str | None:
    """Why `d` is not a valid Duration (±10,000 years, nanos of the seconds' sign); None when it is."""
    if not -MAX_DURATION_SECONDS <= d.seconds <= MAX_DURATION_SECONDS:
        return f"seconds must be between {-MAX_DURATION_SECONDS} and {MAX_DURATION_SECONDS} (got {d.seconds})"
    if not -MAX_NANOS <= d.nanos <= MAX_NANOS:
        return f"nanos must be between {-MAX_NANOS} and {MAX_NANOS} (got {d.nanos})"
    if (d.seconds > 0 and d.nanos < 0) or (d.seconds < 0 and d.nanos > 0):
        return f"seconds and nanos must have the same sign (got {d.seconds} and {d.nanos})"
    return None

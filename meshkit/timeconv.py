"""Conversions between seconds and protobuf Duration/Timestamp, and monotonic ↔ wall time."""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2


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


def wall_seconds(t: timestamp_pb2.Timestamp) -> float:
    """A Timestamp as float seconds since the epoch."""
    return t.seconds + t.nanos / 1e9

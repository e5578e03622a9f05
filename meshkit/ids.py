"""Incarnations and request ids."""

from __future__ import annotations

import time
import uuid


def new_incarnation() -> int:
    """A number that grows with every process start (nanoseconds since the epoch)."""
    return time.time_ns()


def new_request_id() -> str:
    """A random request id."""
    return uuid.uuid4().hex


def request_id_from(candidate: str | None) -> str:
    """The caller's request id (an x-request-id header) when it is usable — printable ASCII, at most
    128 characters, no surrounding space — else a new one; the id then names the request everywhere."""
    if candidate and len(candidate) <= 128 and candidate.isascii() and candidate.isprintable():
        if candidate == candidate.strip():
            return candidate
    return new_request_id()

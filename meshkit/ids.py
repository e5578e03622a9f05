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

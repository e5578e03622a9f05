"""Which admission failures are the pool's own 'no': decided on the ErrorInfo reason, never the text."""

from __future__ import annotations

import grpc
import pytest

from globalrouter.serving import is_refusal
from meshkit.errors import Reason

S = grpc.StatusCode


@pytest.mark.parametrize(
    "code, reason, refused",
    [
        (S.UNAVAILABLE, Reason.POOL_DRAINING, True),
        (S.RESOURCE_EXHAUSTED, Reason.QUEUE_FULL, True),
        (S.RESOURCE_EXHAUSTED, Reason.POOL_REFUSING, True),
        (S.NOT_FOUND, Reason.MODEL_NOT_SERVED, True),
        (S.FAILED_PRECONDITION, Reason.MODEL_NOT_READY, True),
        # A pool that sets no reason is taken at its word for the overload / stale-view codes...
        (S.RESOURCE_EXHAUSTED, None, True),
        (S.NOT_FOUND, None, True),
        (S.FAILED_PRECONDITION, None, True),
        # ...but UNAVAILABLE without POOL_DRAINING is a link failure, whatever its message says.
        (S.UNAVAILABLE, None, False),
        (S.DEADLINE_EXCEEDED, None, False),
        (S.INTERNAL, None, False),
        # A reason that is not a refusal does not make one out of a refusal-looking code.
        (S.RESOURCE_EXHAUSTED, Reason.SLOW_CONSUMER, False),
        (S.UNAVAILABLE, Reason.DRAIN_HANDED_BACK, False),
    ],
)
def test_is_refusal(code, reason, refused):
    assert is_refusal(code, reason) is refused

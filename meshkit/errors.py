"""Refusals with a machine-readable reason: google.rpc.Status carrying a google.rpc.ErrorInfo.

Callers decide on `ErrorInfo.reason` (a stable UPPER_SNAKE_CASE constant from `Reason`), never on
the message text, which is for people and may change.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "globalrouter.mesh"
"""ErrorInfo.domain of every reason this mesh sets (AIP-193: the service that owns the reasons)."""


_M = TypeVar("_M", bound=Message)


class Reason(StrEnum):
    """Every ErrorInfo reason the mesh sets. Values are stable: clients compare against them."""

    # Admission at a pool frontend (the pool's own 'no'; the next candidate may say yes).
    POOL_DRAINING = "POOL_DRAINING"
    QUEUE_FULL = "QUEUE_FULL"
    MODEL_NOT_READY = "MODEL_NOT_READY"
    MODEL_NOT_SERVED = "MODEL_NOT_SERVED"
    POOL_REFUSING = "POOL_REFUSING"
    # Mid-stream: a draining pool handed the request back at its deadline (not a link failure).
    DRAIN_HANDED_BACK = "DRAIN_HANDED_BACK"
    # Discovery lease rules.
    STALE_INCARNATION = "STALE_INCARNATION"
    MODEL_CONFLICT = "MODEL_CONFLICT"
    DRAIN_COMPLETED = "DRAIN_COMPLETED"
    POOL_NOT_FOUND = "POOL_NOT_FOUND"
    FRONTEND_NOT_FOUND = "FRONTEND_NOT_FOUND"
    # Global frontend.
    NO_POOL_FOR_MODEL = "NO_POOL_FOR_MODEL"
    NO_ELIGIBLE_POOL = "NO_ELIGIBLE_POOL"
    ALL_POOLS_REFUSED = "ALL_POOLS_REFUSED"
    POOLS_UNREACHABLE = "POOLS_UNREACHABLE"
    MIGRATION_LIMIT_REACHED = "MIGRATION_LIMIT_REACHED"
    NO_POOL_TO_CONTINUE = "NO_POOL_TO_CONTINUE"
    POOL_STALLED = "POOL_STALLED"
    # Telemetry streams.
    TELEMETRY_STALE_INCARNATION = "TELEMETRY_STALE_INCARNATION"
    TELEMETRY_PROTOCOL = "TELEMETRY_PROTOCOL"
    # A hello's block size differs from the one the pool's other live streams use.
    TELEMETRY_BLOCK_SIZE_MISMATCH = "TELEMETRY_BLOCK_SIZE_MISMATCH"
    # Limits and access.
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    SLOW_CONSUMER = "SLOW_CONSUMER"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    NOT_AUTHORIZED = "NOT_AUTHORIZED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    # Tenant policy (globalrouter --policy): a model the caller may not use (PERMISSION_DENIED), a
    # budget spent for its window (RESOURCE_EXHAUSTED, with QuotaFailure and RetryInfo).
    MODEL_NOT_ALLOWED = "MODEL_NOT_ALLOWED"
    # A request asked (header x-priority) for a priority class above what its policy allows
    # (PERMISSION_DENIED; the policy's max_priority, else its own priority).
    PRIORITY_NOT_ALLOWED = "PRIORITY_NOT_ALLOWED"
    BUDGET_EXCEEDED = "BUDGET_EXCEEDED"
    # A newer telemetry stream of the same relay replica took over (ABORTED: the older one ends).
    TELEMETRY_SUPERSEDED = "TELEMETRY_SUPERSEDED"
    # A shared store (discovery's etcd) did not answer in time; the call may be retried.
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    # A request field is wrong: INVALID_ARGUMENT, with a BadRequest naming each field beside it.
    INVALID_FIELDS = "INVALID_FIELDS"


def error_info(reason: Reason, metadata: Mapping[str, str] | None = None) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo for `reason` in the mesh's domain."""
    return error_details_pb2.ErrorInfo(reason=str(reason), domain=ERROR_DOMAIN, metadata=dict(metadata or {}))


def rpc_status_for(
    code: grpc.StatusCode, reason: Reason, message: str, metadata: Mapping[str, str] | None = None
) -> status_pb2.Status:
    """A google.rpc.Status with `code`, `message` and one ErrorInfo detail."""
    detail = any_pb2.Any()
    detail.Pack(error_info(reason, metadata))
    return status_pb2.Status(code=code.value[0], message=message, details=[detail])


def grpc_status_for(
    code: grpc.StatusCode, reason: Reason, message: str, metadata: Mapping[str, str] | None = None
) -> grpc.Status:
    """rpc_status_for() as the grpc.Status a call aborts with (details travel in trailers)."""
    return rpc_status.to_status(rpc_status_for(code, reason, message, metadata))


async def abort_with_reason(
    context: grpc.aio.ServicerContext[Any, Any],
    code: grpc.StatusCode,
    reason: Reason,
    message: str,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Ends the call with `code`, `message` and an ErrorInfo naming `reason` (raises, like abort)."""
    await context.abort_with_status(grpc_status_for(code, reason, message, metadata))


def reason_of_status(status: status_pb2.Status | None) -> str | None:
    """The ErrorInfo reason in a google.rpc.Status (None when it carries none)."""
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):  # False for a detail of another type
            return info.reason
    return None


def reason_of(error: grpc.RpcError) -> str | None:
    """The ErrorInfo reason a failed call carries (None when it carries none). Works for aio errors."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:
        return None
    return reason_of_status(status)


def detail_of(error: grpc.RpcError, kind: type[_M]) -> _M | None:
    """The first google.rpc detail of type `kind` (QuotaFailure, RetryInfo, ...) a failed call
    carries, None when it carries none. For clients and tests; works for aio errors."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:
        return None
    if status is None:
        return None
    for detail in status.details:
        message = kind()
        if detail.Unpack(message):  # False for a detail of another type
            return message
    return None

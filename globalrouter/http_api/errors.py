"""Errors in OpenAI's JSON shape, with the HTTP status each client library maps to its exception."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

# gRPC code of a GenerateError -> (HTTP status, OpenAI error type). The SDKs pick the exception
# class from the status alone: 400 BadRequestError, 404 NotFoundError, 429 RateLimitError, 5xx
# InternalServerError.
_BY_CODE: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.ABORTED: (502, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


class ApiError(Exception):
    """Ends an HTTP request with `status` and OpenAI's {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.headers = tuple(headers)
        """Sent with the error (a budget refusal's x-ratelimit-* and Retry-After)."""
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_grpc(
    code: grpc.StatusCode,
    message: str,
    reason: str | None,
    *,
    headers: Sequence[tuple[str, str]] = (),
    type: str = "",
) -> ApiError:
    """The HTTP error for a routing outcome (code and ErrorInfo reason as the gRPC API gives them;
    a tenant refusal's headers and OpenAI error type, e.g. "tokens" for a token budget)."""
    status, kind = _BY_CODE.get(code, (500, "server_error"))
    if code == grpc.StatusCode.NOT_FOUND:
        return ApiError(status, message, type=kind, param="model", code="model_not_found")
    return ApiError(
        status, message, type=type or kind, code=str(reason) if reason else code.name.lower(), headers=headers
    )

"""Field validation shared by every service, and INVALID_ARGUMENT errors carrying google.rpc.BadRequest.

Validators collect violations instead of raising on the first, so one reply names every field
that is wrong.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
from google.protobuf import any_pb2, duration_pb2, timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from meshkit import timeconv
from meshkit.errors import Reason, error_info

MAX_ID_LENGTH = 128
MAX_FRONTENDS = 64

MAX_LISTED_VIOLATIONS = 16
"""Violations named in one error (message and BadRequest); the count of the others is said."""
MAX_FIELD_CHARS = 256
MAX_DESCRIPTION_CHARS = 256


@dataclass
class Violations:
    """The field violations found in one request."""

    items: list[tuple[str, str]] = field(default_factory=list)

    def add(self, field_path: str, description: str) -> None:
        """Records that `field_path` is wrong, and why."""
        self.items.append((field_path, description))

    def __bool__(self) -> bool:
        return bool(self.items)

    def _listed(self) -> list[tuple[str, str]]:
        """The violations an error names: at most MAX_LISTED_VIOLATIONS, each cut to a bounded
        length. A request with many bad fields (64 frontend URLs, each echoed in its description)
        would otherwise make a status past gRPC's 16 KiB metadata limit, and the caller would see
        RESOURCE_EXHAUSTED instead of which fields are wrong."""
        return [
            (
                f[:MAX_FIELD_CHARS],
                d if len(d) <= MAX_DESCRIPTION_CHARS else d[: MAX_DESCRIPTION_CHARS - 3] + "...",
            )
            for f, d in self.items[:MAX_LISTED_VIOLATIONS]
        ]

    def message(self) -> str:
        """One human sentence naming the fields at fault (the first MAX_LISTED_VIOLATIONS)."""
        text = "invalid request: " + "; ".join(f"{f}: {d}" for f, d in self._listed())
        more = len(self.items) - MAX_LISTED_VIOLATIONS
        return text + (f" (and {more} more)" if more > 0 else "")

    def to_rpc_status(self) -> status_pb2.Status:
        """The INVALID_ARGUMENT google.rpc.Status: a BadRequest listing each violation, and an ErrorInfo
        (reason INVALID_FIELDS, metadata `fields`) so callers can branch on a reason like any other refusal."""
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in self._listed()
            ]
        )
        detail = any_pb2.Any()
        detail.Pack(bad)
        fields = ",".join(dict.fromkeys(f for f, _d in self.items))
        info = any_pb2.Any()
        info.Pack(error_info(Reason.INVALID_FIELDS, {"fields": fields[:1024]}))
        return status_pb2.Status(
            code=code_pb2.INVALID_ARGUMENT, message=self.message(), details=[detail, info]
        )

    def to_status(self) -> grpc.Status:
        """to_rpc_status() as the grpc.Status a call aborts with."""
        return rpc_status.to_status(self.to_rpc_status())

    async def abort_if_any(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Aborts the RPC with INVALID_ARGUMENT + BadRequest when anything was recorded."""
        if self.items:
            await context.abort_with_status(self.to_status())

    def raise_if_any(self, context: grpc.ServicerContext) -> None:
        """Same as abort_if_any, for synchronous servicers."""
        if self.items:
            context.abort_with_status(self.to_status())


def bad_request_fields(error: grpc.RpcError) -> list[str]:
    """The field names in an error's BadRequest detail (empty when it has none). For clients and tests."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is None:
        return []
    names: list[str] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            names.extend(v.field for v in bad.field_violations)
    return names


def _has_control(value: str) -> bool:
    return any(unicodedata.category(ch) in ("Cc", "Cf") for ch in value)


def check_identifier(v: Violations, field_path: str, value: str, *, required: bool = True) -> None:
    """An id, name or region: non-empty, ≤ 128 characters, no surrounding white space, no control characters."""
    if not value:
        if required:
            v.add(field_path, "must not be empty")
        return
    if len(value) > MAX_ID_LENGTH:
        v.add(field_path, f"must be at most {MAX_ID_LENGTH} characters (got {len(value)})")
    if value != value.strip():
        v.add(field_path, "must not start or end with white space")
    if _has_control(value):
        v.add(field_path, "must not contain control characters")


def host_port_problem(value: str) -> str | None:
    """Why `value` is not a listen address HOST:PORT with a numeric port in 0..65535; None when it is."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return f"must be HOST:PORT with a port in 0..65535 (got {value!r})"
    return None


def url_problem(url: str, *, allow_path: bool = True) -> str | None:
    """Why `url` is not an http:// or https:// frontend URL; None when it is.

    A URL names a host; its port may be left out (80 for http, 443 for https, as deployments
    write them) but never be 0 (nothing can be dialled there), and it may carry a base path (an OpenAI base URL such as http://h:8000/v1)
    unless `allow_path` is False. Credentials, a query and a fragment are refused: they do not
    belong in a frontend's address (credentials would leak into the directory).
    """
    if not url:
        return "must not be empty"
    if url != url.strip() or _has_control(url) or any(ch.isspace() for ch in url):
        return "must not contain white space or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"must be an http:// or https:// URL (got {url!r})"
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        return "must not contain credentials"
    if not parts.hostname:
        return "must name a host"
    if parts.port == 0:  # a dialer cannot reach port 0: relays would dial it and back off forever
        return f"must not use port 0 (got {url!r})"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "must not have a query or fragment"
    if parts.path not in ("", "/") and not allow_path:
        return "must not have a path (only OpenAI HTTP frontends take a base path)"
    return None


def check_url(v: Violations, field_path: str, url: str, *, allow_path: bool = True) -> None:
    """Records a violation when `url` is not an http(s) frontend URL (see url_problem)."""
    problem = url_problem(url, allow_path=allow_path)
    if problem:
        v.add(field_path, problem)


def check_frontends(
    v: Violations, field_path: str, urls: list[str], *, required: bool = True, allow_path: bool = True
) -> None:
    """A list of 1..64 frontend URLs, each checked, no duplicates."""
    if not urls:
        if required:
            v.add(field_path, "must list at least one frontend URL")
        return
    if len(urls) > MAX_FRONTENDS:
        v.add(field_path, f"must list at most {MAX_FRONTENDS} frontends (got {len(urls)})")
        return
    seen: set[str] = set()
    for i, url in enumerate(urls):
        check_url(v, f"{field_path}[{i}]", url, allow_path=allow_path)
        if url in seen:
            v.add(f"{field_path}[{i}]", f"duplicates {url!r}")
        seen.add(url)


def check_timestamp(v: Violations, field_path: str, value: timestamp_pb2.Timestamp) -> None:
    """Records a violation when a Timestamp lies outside the range the protobuf runtime accepts."""
    problem = timeconv.timestamp_problem(value)
    if problem:
        v.add(field_path, problem)


def check_duration(v: Violations, field_path: str, value: duration_pb2.Duration) -> None:
    """Records a violation when a Duration lies outside the range the protobuf runtime accepts."""
    problem = timeconv.duration_problem(value)
    if problem:
        v.add(field_path, problem)

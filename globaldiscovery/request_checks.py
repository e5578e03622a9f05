"""Checks of every field of every DiscoveryService request; each returns the Violations found.

(meshkit.validation holds the field rules shared by every service; this module applies them to
this service's requests.)
"""

from __future__ import annotations

from globaldiscovery.v1 import discovery_pb2 as pb
from meshkit import pagination, timeconv
from meshkit.validation import (
    Violations,
    check_duration,
    check_frontends,
    check_identifier,
    check_timestamp,
    check_url,
)

MAX_CAPABILITIES = 64
MAX_DRAIN_SECONDS = 86_400.0


def _check_incarnation(v: Violations, field_path: str, incarnation: int) -> None:
    if incarnation <= 0:
        v.add(field_path, "must be > 0 (e.g. the process start time in nanoseconds)")


def register_pool(req: pb.RegisterPoolRequest) -> Violations:
    """pool_id, model, region, frontends, relay_id, incarnation, capabilities, drain_deadline."""
    v = Violations()
    check_identifier(v, "pool_id", req.pool_id)
    check_identifier(v, "model", req.model)
    check_identifier(v, "region", req.region)
    if req.frontend_protocol not in pb.FrontendProtocol.values():
        v.add("frontend_protocol", f"must be a FrontendProtocol value (got {req.frontend_protocol})")
    # A base path is an OpenAI HTTP notion; a gRPC target has none.
    openai = req.frontend_protocol == pb.FRONTEND_PROTOCOL_OPENAI_HTTP
    # Optional (PR #18077): a pool with no frontends is listed but not routable.
    check_frontends(v, "frontends", list(req.frontends), allow_path=openai, required=False)
    check_identifier(v, "relay_id", req.relay_id)
    _check_incarnation(v, "incarnation", req.incarnation)
    if len(req.capabilities) > MAX_CAPABILITIES:
        v.add("capabilities", f"must list at most {MAX_CAPABILITIES} entries (got {len(req.capabilities)})")
    else:
        for i, cap in enumerate(req.capabilities):
            check_identifier(v, f"capabilities[{i}]", cap)
    if req.HasField("drain_deadline"):
        check_timestamp(v, "drain_deadline", req.drain_deadline)
    return v


def unregister_pool(req: pb.UnregisterPoolRequest) -> Violations:
    """pool_id, relay_id, incarnation."""
    v = Violations()
    check_identifier(v, "pool_id", req.pool_id)
    check_identifier(v, "relay_id", req.relay_id)
    _check_incarnation(v, "incarnation", req.incarnation)
    return v


def filters(req: pb.ListPoolsRequest | pb.WatchPoolsRequest) -> Violations:
    """The optional model and region filters (ids when set)."""
    v = Violations()
    check_identifier(v, "model", req.model, required=False)
    check_identifier(v, "region", req.region, required=False)
    if isinstance(req, pb.WatchPoolsRequest) and req.start_revision < 0:
        v.add(
            "start_revision",
            f"must be 0 (a snapshot) or a revision from an earlier watch, got {req.start_revision}",
        )
    return v


def list_pools(req: pb.ListPoolsRequest) -> tuple[Violations, pagination.PageRequest]:
    """Filters, page_size and page_token; also returns the page asked for."""
    v = filters(req)
    page = pagination.page_request(v, req.page_size, req.page_token, ("pools", req.model, req.region))
    return v, page


def list_frontends(req: pb.ListFrontendsRequest) -> tuple[Violations, pagination.PageRequest]:
    """page_size and page_token; also returns the page asked for."""
    v = Violations()
    page = pagination.page_request(v, req.page_size, req.page_token, ("frontends",))
    return v, page


def drain_pool(req: pb.DrainPoolRequest) -> Violations:
    """pool_id and timeout (> 0, at most one day)."""
    v = Violations()
    check_identifier(v, "pool_id", req.pool_id)
    if not req.HasField("timeout"):
        v.add("timeout", "is required (how long accepted work may run)")
    elif timeconv.duration_problem(req.timeout) is not None:
        check_duration(v, "timeout", req.timeout)
    else:
        timeout = timeconv.seconds(req.timeout)
        if not 0 < timeout <= MAX_DRAIN_SECONDS:
            v.add("timeout", f"must be > 0 and at most one day (got {timeout:g} s)")
    return v


def remove_pool(req: pb.RemovePoolRequest) -> Violations:
    """pool_id."""
    v = Violations()
    check_identifier(v, "pool_id", req.pool_id)
    return v


def register_frontend(req: pb.RegisterFrontendRequest) -> Violations:
    """frontend_id, url, region (optional), incarnation."""
    v = Violations()
    check_identifier(v, "frontend_id", req.frontend_id)
    check_url(v, "url", req.url, allow_path=False)
    check_identifier(v, "region", req.region, required=False)
    _check_incarnation(v, "incarnation", req.incarnation)
    return v


def unregister_frontend(req: pb.UnregisterFrontendRequest) -> Violations:
    """frontend_id, incarnation."""
    v = Violations()
    check_identifier(v, "frontend_id", req.frontend_id)
    _check_incarnation(v, "incarnation", req.incarnation)
    return v

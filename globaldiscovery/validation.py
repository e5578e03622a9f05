"""Validation of every field of every DiscoveryService request; each returns the Violations found."""

from __future__ import annotations

from globaldiscovery.v1 import discovery_pb2 as pb
from meshkit import pagination, timeconv
from meshkit.validation import Violations, check_frontends, check_identifier, check_url

MAX_CAPABILITIES = 64
MAX_DRAIN_SECONDS = 86_400.0


def _check_incarnation(v: Violations, field_path: str, incarnation: int) -> None:
    if incarnation <= 0:
        v.add(field_path, "must be > 0 (e.g. the process start time in nanoseconds)")


def _check_page_size(v: Violations, size: int) -> None:
    if size < 0:
        v.add("page_size", f"must not be negative (got {size})")


def register_pool(req: pb.RegisterPoolRequest) -> Violations:
    """pool_id, model, region, frontends, relay_id, incarnation, capabilities."""
    v = Violations()
    check_identifier(v, "pool_id", req.pool_id)
    check_identifier(v, "model", req.model)
    check_identifier(v, "region", req.region)
    check_frontends(v, "frontends", list(req.frontends))
    check_identifier(v, "relay_id", req.relay_id)
    _check_incarnation(v, "incarnation", req.incarnation)
    if len(req.capabilities) > MAX_CAPABILITIES:
        v.add("capabilities", f"must list at most {MAX_CAPABILITIES} entries (got {len(req.capabilities)})")
    else:
        for i, cap in enumerate(req.capabilities):
            check_identifier(v, f"capabilities[{i}]", cap)
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
    return v


def list_pools(req: pb.ListPoolsRequest) -> tuple[Violations, str | None]:
    """Filters, page_size and page_token; also returns the pool id to resume after."""
    v = filters(req)
    _check_page_size(v, req.page_size)
    after = _page_after(v, req.page_token, ("pools", req.model, req.region))
    return v, after


def list_frontends(req: pb.ListFrontendsRequest) -> tuple[Violations, str | None]:
    """page_size and page_token; also returns the frontend id to resume after."""
    v = Violations()
    _check_page_size(v, req.page_size)
    after = _page_after(v, req.page_token, ("frontends",))
    return v, after


def _page_after(v: Violations, token: str, filters: tuple[str, ...]) -> str | None:
    try:
        return pagination.decode_page_token(token, filters)
    except pagination.PageTokenError as exc:
        v.add("page_token", str(exc))
        return None


def drain_pool(req: pb.DrainPoolRequest) -> Violations:
    """pool_id and timeout (> 0, at most one day)."""
    v = Violations()
    check_identifier(v, "pool_id", req.pool_id)
    if not req.HasField("timeout"):
        v.add("timeout", "is required (how long accepted work may run)")
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
    check_url(v, "url", req.url)
    check_identifier(v, "region", req.region, required=False)
    _check_incarnation(v, "incarnation", req.incarnation)
    return v


def unregister_frontend(req: pb.UnregisterFrontendRequest) -> Violations:
    """frontend_id, incarnation."""
    v = Violations()
    check_identifier(v, "frontend_id", req.frontend_id)
    _check_incarnation(v, "incarnation", req.incarnation)
    return v

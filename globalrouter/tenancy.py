"""The tenant gate every request passes before routing: model access, budgets, residency, per-tenant metrics.

One object per frontend, shared by both fronts: `admit` looks the caller's policy up, refuses a
model the policy does not allow (PERMISSION_DENIED, MODEL_NOT_ALLOWED), reserves the request's
budget (RESOURCE_EXHAUSTED, BUDGET_EXCEEDED, with a google.rpc.QuotaFailure and RetryInfo beside
the ErrorInfo; 429 with OpenAI's x-ratelimit-* headers and Retry-After over HTTP) and hands back
an Admission carrying the allowed regions for the selection's residency filter, the priority
class and weight, and the ticket `finish` settles with the tokens the request used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from globalrouter.budgets import UNLIMITED, BudgetExceeded, Kind, Quota, StoreError, TenantBudgets, Ticket
from globalrouter.metrics import RouterMetrics
from globalrouter.migration import GenerateError
from globalrouter.policy import OTHER_LABEL, PolicyFile, TenantPolicy, policy_key
from globalrouter.selection import Decision, FilterReason
from meshkit.errors import Reason, error_info
from meshkit.identity import Identity
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.tenancy")


class TenantRefusal(GenerateError):
    """A GenerateError with more than an ErrorInfo: further google.rpc details (QuotaFailure,
    RetryInfo) and the HTTP headers OpenAI clients read (x-ratelimit-*, Retry-After)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: Reason,
        message: str,
        *,
        details: Sequence[Message] = (),
        headers: Sequence[tuple[str, str]] = (),
        http_type: str = "",
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(code, reason, message, metadata)
        self.details = tuple(details)
        self.headers = tuple(headers)
        self.http_type = http_type
        """OpenAI's error type for the HTTP body ("tokens", "requests"), "" for the default."""


def grpc_status(error: GenerateError) -> grpc.Status:
    """The status a call ends with for `error`: code, message, ErrorInfo, and a TenantRefusal's details."""
    packed = []
    if error.reason is not None:
        info = any_pb2.Any()
        info.Pack(error_info(error.reason, error.metadata))
        packed.append(info)
    for detail in getattr(error, "details", ()):
        extra = any_pb2.Any()
        extra.Pack(detail)
        packed.append(extra)
    return rpc_status.to_status(
        status_pb2.Status(code=error.code.value[0], message=error.message, details=packed)
    )


def reset_text(seconds: float) -> str:
    """A duration as OpenAI's x-ratelimit-reset-* headers write it: 250ms, 7s, 1m30s, 2h0m0s."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def ratelimit_headers(quotas: Sequence[Quota]) -> list[tuple[str, str]]:
    """x-ratelimit-{limit,remaining,reset}-{tokens,requests}: the per-minute limits (OpenAI's
    headers are per minute), tokens per day when that is the only token limit."""
    by_kind = {q.kind: q for q in quotas}
    out = []
    tokens = by_kind.get(Kind.TOKENS_PER_MINUTE) or by_kind.get(Kind.TOKENS_PER_DAY)
    for name, quota in (("tokens", tokens), ("requests", by_kind.get(Kind.REQUESTS_PER_MINUTE))):
        if quota is not None:
            out += [
                (f"x-ratelimit-limit-{name}", str(quota.limit)),
                (f"x-ratelimit-remaining-{name}", str(quota.remaining)),
                (f"x-ratelimit-reset-{name}", reset_text(quota.reset_seconds)),
            ]
    return out


@dataclass(slots=True)
class Admission:
    """A request the gate let in: what routing and dispatch need, and its budget ticket."""

    tenant: str
    """The policy key ("client/alice", "unchecked")."""
    label: str
    """The metrics label (the key when the policy names it, else "other")."""
    policy: TenantPolicy
    ticket: Ticket
    gate: TenantGate | None = None
    finished: bool = False

    @property
    def regions(self) -> frozenset[str] | None:
        return self.policy.regions

    @property
    def priority(self) -> int:
        return self.policy.priority

    @property
    def weight(self) -> float:
        return self.policy.weight

    def headers(self) -> list[tuple[str, str]]:
        """The x-ratelimit-* headers after this admission ([] without a budget)."""
        return ratelimit_headers(self.ticket.quotas)

    def finish(self, used_tokens: int) -> None:
        """The request ended having used `used_tokens` (prompt + generated): the unused
        reservation goes back, the tokens are counted. Idempotent."""
        if self.finished:
            return
        self.finished = True
        self.ticket.settle(used_tokens)
        if self.gate is not None:
            metrics = self.gate.metrics
            metrics.labelled(metrics.tenant_tokens, self.label).inc(max(0, used_tokens))

    def no_pool(self, decision: Decision) -> None:
        """The decision left no candidate: counts a residency refusal when the region filter
        removed a pool of the model (nothing else for other causes)."""
        if self.gate is not None and any(
            f.reason is FilterReason.REGION_NOT_ALLOWED for f in decision.filtered
        ):
            metrics = self.gate.metrics
            metrics.labelled(
                metrics.tenant_filter_refusals, self.label, FilterReason.REGION_NOT_ALLOWED.name
            ).inc()


class TenantGate:
    """Policy lookups, model access and budgets for one frontend (both fronts share it)."""

    def __init__(self, policy: PolicyFile, budgets: TenantBudgets, metrics: RouterMetrics) -> None:
        self.policy = policy
        self.budgets = budgets
        self.metrics = metrics

    def reload(self) -> bool:
        """SIGHUP: re-reads the policy file (the one in force stays when the new one is refused)."""
        ok = self.policy.reload()
        if ok:
            self.budgets.update_settings(self.policy.current.budget)
        return ok

    def for_identity(self, identity: Identity) -> TenantPolicy:
        """The caller's policy (priority class and weight for the dispatch queue)."""
        return self.policy.current.for_identity(identity)

    async def admit(self, identity: Identity, model: str, prompt_tokens: int, max_tokens: int) -> Admission:
        """Lets the request in or raises TenantRefusal (counted)."""
        current = self.policy.current
        key = policy_key(identity)
        policy = current.entries.get(key)
        if policy is None:
            policy, tenant, label = current.default, key, OTHER_LABEL
        else:
            tenant = label = key
        metrics = self.metrics
        if not policy.allows_model(model):
            metrics.labelled(metrics.tenant_filter_refusals, label, Reason.MODEL_NOT_ALLOWED.value).inc()
            raise TenantRefusal(
                grpc.StatusCode.PERMISSION_DENIED,
                Reason.MODEL_NOT_ALLOWED,
                f"{identity} may not use model {model!r} (its policy allows: {', '.join(sorted(policy.models or ())) or 'none'})",
                metadata={"model": model},
            )
        if not policy.limited:
            return Admission(tenant, label, policy, UNLIMITED, self)
        try:
            ticket = await self.budgets.admit(tenant, policy, prompt_tokens + max_tokens)
        except BudgetExceeded as exc:
            metrics.labelled(metrics.tenant_budget_refusals, label, exc.exceeded.kind.value).inc()
            metrics.flow.series(label, policy.priority).budget_refused(exc.exceeded.kind.value)
            raise budget_refusal(exc, prompt_tokens + max_tokens) from None
        except StoreError as exc:
            log.warning("budget store unavailable; request refused", tenant=tenant, error=str(exc))
            raise TenantRefusal(
                grpc.StatusCode.UNAVAILABLE,
                Reason.STORE_UNAVAILABLE,
                f"the budget store did not answer; retry: {exc}",
                http_type="service_unavailable_error",
            ) from None
        return Admission(tenant, label, policy, ticket, self)

    async def close(self) -> None:
        """Gives unused reservations back to the shared counters."""
        await self.budgets.close()


_UNIT = {Kind.TOKENS_PER_MINUTE: "tokens per min (TPM)", Kind.TOKENS_PER_DAY: "tokens per day (TPD)"}


def budget_refusal(exc: BudgetExceeded, requested: int) -> TenantRefusal:
    """RESOURCE_EXHAUSTED BUDGET_EXCEEDED with QuotaFailure and RetryInfo; 429 headers and body over HTTP."""
    over = exc.exceeded
    unit = _UNIT.get(over.kind, "requests per min (RPM)")
    asked = requested if over.kind.tokens else 1
    retry = max(1, math.ceil(over.reset_seconds))
    if over.too_large:
        message = (
            f"Request too large for {exc.tenant} on {unit}: Limit {over.limit}, Requested {asked}. "
            "Send a shorter prompt or a lower max_tokens."
        )
    else:
        message = (
            f"Rate limit reached for {exc.tenant} on {unit}: Limit {over.limit}, Remaining {over.remaining}, "
            f"Requested {asked}. Please try again in {reset_text(over.reset_seconds)}."
        )
    quota = error_details_pb2.QuotaFailure(
        violations=[
            error_details_pb2.QuotaFailure.Violation(
                subject=f"tenant:{exc.tenant}",
                description=f"{over.kind.value} limit {over.limit}: {over.remaining} left, {asked} requested",
            )
        ]
    )
    retry_info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=retry))
    return TenantRefusal(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        Reason.BUDGET_EXCEEDED,
        message,
        details=(quota, retry_info),
        headers=(*ratelimit_headers(exc.quotas), ("retry-after", str(retry))),
        http_type="tokens" if over.kind.tokens else "requests",
        metadata={
            "limit": over.kind.value,
            "retry_after_seconds": str(retry),
            "too_large": str(over.too_large).lower(),
        },
    )

"""The one request path both fronts (gRPC Generate, OpenAI HTTP) call: pass the tenant gate
(model access, budget, residency), decide, refuse with a reason, run (admit, stream, migrate
under the configured stall policy), count the outcome, settle the budget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING

import grpc

from globalrouter.aliases import Resolved, Target
from globalrouter.config import RouterConfig
from globalrouter.dispatch_live import LateBinder
from globalrouter.metrics import Flow
from globalrouter.migration import GenerateError, GenerateRun, Output, RunRecord, decision_attributes
from globalrouter.policy import OTHER_LABEL
from globalrouter.routing import RoutingCore, describe_filtered
from globalrouter.selection import Decision
from globalrouter.serving import ServingLinks
from globalrouter.stall import StallPolicy
from globalrouter.tenancy import Admission, TenantGate
from globalrouter.v1 import sampling_pb2
from meshkit import tracing
from meshkit.authz import UNCHECKED
from meshkit.errors import Reason
from meshkit.identity import Identity

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

NOT_SERVED_LABEL = "(not served)"
"""The metric's model label of a model no pool serves: clients must not grow the label set."""


class RequestPath:
    """Routes and runs generation requests for every front of one global frontend, with one
    configuration (migration limit, admission tries, stall policy) and one set of metrics."""

    def __init__(
        self,
        core: RoutingCore,
        links: ServingLinks,
        *,
        migration_limit: int,
        admission_tries: int,
        stall: StallPolicy,
        gate: TenantGate | None = None,
        binder: LateBinder | None = None,
    ) -> None:
        self.core = core
        self.links = links
        self.migration_limit = migration_limit
        self.admission_tries = admission_tries
        self.stall = stall
        self.gate = gate
        """The tenant policy (--policy): model access, budgets, residency; None lets everyone in."""
        self.binder = binder
        """Late binding (--dispatch late): requests wait for a pool in its queue; None decides at once."""

    @classmethod
    def of(
        cls,
        core: RoutingCore,
        links: ServingLinks,
        config: RouterConfig,
        *,
        gate: TenantGate | None = None,
        binder: LateBinder | None = None,
    ) -> RequestPath:
        return cls(
            core,
            links,
            migration_limit=config.migration_limit,
            admission_tries=config.admission_tries,
            stall=config.stall,
            gate=gate,
            binder=binder,
        )

    def resolve(self, name: str, request_id: str) -> Resolved:
        """The model (and LoRA adapter) a request's model name stands for: an alias (its split
        picked by the request id), a model, model:adapter or an adapter's name (globalrouter.aliases).
        Called before the prompt is tokenized (an alias's model has its own tokenizer); raises
        ResolveError for an adapter name served on several models."""
        return self.core.resolve(name, request_id)

    async def start(
        self,
        *,
        request_id: str,
        model: str,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: sampling_pb2.SamplingParams | None = None,
        adapter: str = "",
        identity: Identity = UNCHECKED,
        trace_context: Context | None = None,
    ) -> PathRun:
        """Lets `identity` use `model` (the resolved model: the policy names models, not aliases)
        under its budget (tenancy.TenantRefusal: PERMISSION_DENIED MODEL_NOT_ALLOWED,
        RESOURCE_EXHAUSTED BUDGET_EXCEEDED, counted in the tenant metrics), then decides where the
        request goes (with its `adapter`, "" for none) within the identity's allowed regions;
        raises GenerateError (NOT_FOUND NO_POOL_FOR_MODEL, UNAVAILABLE NO_ELIGIBLE_POOL), counted,
        when no pool can take it. Nothing is sent to a pool until the returned run's outputs() is
        iterated. `trace_context`: the caller's (a front extracts it); with tracing on, the
        request's span continues it (or starts a trace)."""
        span = None
        if tracing.enabled():
            span = tracing.start_span(
                "globalrouter.request",
                trace_context,
                {
                    "request.id": request_id,
                    "request.model": model,
                    "request.adapter": adapter or None,
                    "request.prompt_tokens": len(prompt),
                    "request.max_tokens": max_tokens,
                },
                server=True,
            )
        admission = None
        try:
            if self.gate is not None:
                # Prompt + max_tokens reserved now; the run's end gives back what was not generated.
                admission = await self.gate.admit(identity, model, len(prompt), max_tokens)
                flow = self.core.metrics.flow.series(admission.label, admission.priority)
                flow.admitted(admission.ticket.quotas if admission.label == admission.tenant else ())
            else:
                flow = self.core.metrics.flow.series(OTHER_LABEL, 0)
                flow.admitted()
            decision = None
            if self.binder is not None:
                # late binding: the request waits here until a pool can start it (or is shed)
                decision = await self.binder.decide(
                    model,
                    prompt,
                    max_tokens,
                    regions=admission.regions if admission is not None else None,
                    adapter=adapter,
                    priority=admission.priority if admission is not None else 0,
                    tenant=admission.tenant if admission is not None else "",
                    weight=admission.weight if admission is not None else 1.0,
                    flow=flow,
                )
            return self._start(
                request_id, model, prompt, max_tokens, sampling, adapter, admission, span, decision, flow
            )
        except BaseException as exc:
            if admission is not None:
                admission.finish(0)  # nothing was sent to a pool
            if span is not None:
                if isinstance(exc, GenerateError):  # a tenant refusal too
                    outcome = exc.code.name
                else:
                    outcome = "CANCELLED" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__
                tracing.end_span(span, exc, **{"request.outcome": outcome})
            raise

    def _start(
        self,
        request_id: str,
        model: str,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: sampling_pb2.SamplingParams | None,
        adapter: str,
        admission: Admission | None,
        span: Span | None,
        decision: Decision | None = None,
        flow: Flow | None = None,
    ) -> PathRun:
        core = self.core
        regions = admission.regions if admission is not None else None
        if decision is None:
            decide_span = tracing.start_span("globalrouter.decide", span) if span is not None else None
            decision = core.decide(model, prompt, max_tokens, adapter=adapter, regions=regions)
            if decide_span is not None:
                made = decision
                tracing.end_span_with(decide_span, lambda: decision_attributes(made))
        error = _no_candidate_error(str(Target(model, adapter)), decision)
        if error is not None:
            metrics = core.metrics
            label = model if decision.model_served else NOT_SERVED_LABEL
            metrics.labelled(metrics.requests, label, error.code.name).inc()
            if admission is not None:
                admission.no_pool(decision)
            raise error
        run = GenerateRun(
            core,
            self.links,
            request_id=request_id,
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            migration_limit=self.migration_limit,
            admission_tries=self.admission_tries,
            sampling=sampling,
            stall=self.stall,
            adapter=adapter,
        )
        run.trace = span
        return PathRun(core, run, decision, model, admission, len(prompt), flow)


class PathRun:
    """One routed request: its outputs as plain values, its record, its outcome counted once.

    Used as `async with run as outputs: async for out in outputs: ...`, or, when the output is
    pulled from several places (the HTTP front's start, then its text stream), through `outputs`
    and end(): either way the run's stream is closed and the request counted exactly once. (A
    context rather than a wrapping generator: no extra layer on every output of the hot path.)"""

    __slots__ = ("_admission", "_core", "_ended", "_flow", "_model", "_prompt_tokens", "_run", "outputs")

    def __init__(
        self,
        core: RoutingCore,
        run: GenerateRun,
        decision: Decision,
        model: str,
        admission: Admission | None = None,
        prompt_tokens: int = 0,
        flow: Flow | None = None,
    ) -> None:
        self._core = core
        self._flow = flow
        self._run = run
        self._model = model
        self._admission = admission
        self._prompt_tokens = prompt_tokens
        self._ended = False
        self.outputs: AsyncGenerator[Output, None] = run.stream(decision)  # type: ignore[assignment]
        """The run's outputs (the last carries the finish); raises GenerateError on failure."""

    @property
    def record(self) -> RunRecord:
        """What happened so far: pools, migrations, refusals, cached blocks, tokens."""
        return self._run.record

    def ratelimit_headers(self) -> list[tuple[str, str]]:
        """OpenAI's x-ratelimit-* headers after this request's admission ([] without a budget)."""
        return self._admission.headers() if self._admission is not None else []

    async def __aenter__(self) -> AsyncGenerator[Output, None]:
        return self.outputs

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.end(exc)

    async def end(self, error: BaseException | None) -> None:
        """Closes the run's stream (its pool call is let go) and counts the request in
        globalrouter_requests by its outcome: OK, the gRPC code name of a GenerateError, or
        CANCELLED. Only the first call counts."""
        if self._ended:
            return
        self._ended = True
        try:
            await self.outputs.aclose()
        finally:
            outcome = "OK"
            if isinstance(error, GenerateError):
                outcome = error.code.name
            elif isinstance(error, asyncio.CancelledError):
                outcome = "CANCELLED"
            elif isinstance(error, GeneratorExit):
                # Closed before its end: a consumer that had all it wanted (a stop string) is OK;
                # one whose task is being cancelled (its client left) is not.
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    outcome = "CANCELLED"
            metrics = self._core.metrics
            metrics.labelled(metrics.requests, self._model, outcome).inc()
            used = self._prompt_tokens + len(self._run.record.tokens)
            if self._admission is not None:
                # Prompt plus what was generated: the rest of the max_tokens reservation returns.
                self._admission.finish(used)
            if self._flow is not None:
                self._flow.finished(used)
            span = self._run.trace
            if span is not None:
                rec = self._run.record
                tracing.end_span(
                    span,
                    error if isinstance(error, GenerateError) else None,
                    **{
                        "request.outcome": outcome,
                        "request.pools": rec.pools,
                        "request.migrations": rec.migrations,
                        "request.tokens": len(rec.tokens),
                        "request.cached_blocks": rec.cached_blocks,
                    },
                )


def _no_candidate_error(model: str, decision: Decision) -> GenerateError | None:
    if not decision.model_served:
        return GenerateError(
            grpc.StatusCode.NOT_FOUND, Reason.NO_POOL_FOR_MODEL, f"no listed pool serves model {model!r}"
        )
    if not decision.candidates:
        return GenerateError(
            grpc.StatusCode.UNAVAILABLE,
            Reason.NO_ELIGIBLE_POOL,
            f"pools serve model {model!r} but none is eligible: {describe_filtered(decision)}",
        )
    return None

"""One Generate request's life: admit with bounded tries, stream, and migrate when a pool fails mid-stream."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from globalrouter.metrics import RouterMetrics
from globalrouter.pool_state import FreshnessLimits, PoolState
from globalrouter.routing import RoutingCore, describe_filtered
from globalrouter.selection import Decision
from globalrouter.serving import (
    AdmissionFailed,
    Admitted,
    PoolRequest,
    PoolResponse,
    ServingLinks,
    StreamBroken,
)
from globalrouter.stall import FirstTokenWait, Silent, StallPolicy, StallWatch, TurnTooLong, within
from globalrouter.v1 import pool_frontend_pb2, router_pb2, sampling_pb2
from meshkit import tracing
from meshkit.blocks import DEFAULT_BLOCK_SIZE
from meshkit.errors import Reason
from meshkit.logs import get_logger

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = get_logger(module="globalrouter.migration")

_FINISH = {
    pool_frontend_pb2.POOL_FINISH_REASON_LENGTH: router_pb2.FINISH_REASON_LENGTH,
    pool_frontend_pb2.POOL_FINISH_REASON_STOP: router_pb2.FINISH_REASON_STOP,
}


def decision_attributes(decision: Decision) -> dict[str, object]:
    """A decision as span attributes: pools considered, the chosen one and its cached blocks, and
    why the others were filtered out (built only when tracing is on)."""
    best = decision.candidates[0] if decision.candidates else None
    return {
        "decision.pools_considered": [c.pool_id for c in decision.candidates],
        "decision.pools_filtered": [f"{f.pool_id}: {f.reason.name}" for f in decision.filtered],
        "decision.chosen_pool": best.pool_id if best else None,
        "decision.cached_blocks": best.cached_blocks if best else None,
        "decision.prompt_blocks": decision.prompt_blocks,
    }


def _count_cached_prefix(
    metrics: RouterMetrics, pool_id: str, prompt_blocks: int, cached_blocks: int
) -> None:
    """Counts a pool's own word on the cached prefix of one request (its admission's, or an
    OpenAI-HTTP pool's usage at the finish, in the mesh's blocks)."""
    metrics.labelled(metrics.prompt_blocks, pool_id).inc(prompt_blocks)
    metrics.labelled(metrics.cached_blocks, pool_id).inc(cached_blocks)
    if prompt_blocks:
        metrics.cached_prefix_ratio.observe(cached_blocks / prompt_blocks)


def known_busy(pool: PoolState, now: float, limits: FreshnessLimits) -> bool:
    """Whether the pool's fresh load report shows it full: requests waiting for a slot, or every run
    slot taken (counting what this frontend sent since). A request there waits its turn; a pool
    with no fresh report, or with room, that sends nothing is silent, not busy."""
    if not pool.load_fresh(now, limits) or pool.load is None:
        return False
    load = pool.load
    if load.requests_waiting > 0:
        return True
    slots = load.max_running_requests or pool.capacity.max_running_requests
    return slots > 0 and load.requests_running + pool.pending_requests >= slots


class GenerateError(Exception):
    """The request ends with this gRPC status and ErrorInfo reason (tokens already streamed stay valid)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: Reason | None,
        message: str,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata = metadata or {}


@dataclass
class RunRecord:
    """What happened to the request so far (for the summary, trailing metadata and logs)."""

    pools: list[str] = field(default_factory=list)
    refused_by: list[str] = field(default_factory=list)
    migrations: int = 0
    cached_blocks: int = 0
    prompt_blocks: int = 0
    tokens: list[int] = field(default_factory=list)
    pool_states_cache: bool = False
    """Whether cached_blocks is the first pool's own word (a mesh pool's admission states it)."""
    pool_cached_tokens: int | None = None
    """Cached prompt tokens the first pool reported with its finish (an OpenAI-HTTP pool's usage);
    None when it reported none. A migrated request keeps the first pool's figures: the prompt was
    prefilled there, later pools prefill it plus the tokens so far."""
    estimated_cached_blocks: int = 0
    """The frontend's estimate: the routing decision's cached blocks at the first pool."""

    def cached_tokens(self, prompt_tokens: int, block_size: int) -> tuple[int, str]:
        """Prompt tokens found cached at the first pool (at most `prompt_tokens`), and the source:
        "pool" when the pool stated it, else "estimate" (blocks of `block_size` tokens)."""
        if self.pool_cached_tokens is not None:
            return min(prompt_tokens, self.pool_cached_tokens), "pool"
        if self.pool_states_cache:
            return min(prompt_tokens, self.cached_blocks * block_size), "pool"
        return min(prompt_tokens, self.estimated_cached_blocks * block_size), "estimate"


@dataclass(slots=True)
class Output:
    """A piece of the request's output as plain values (no front's wire format): token ids from
    `offset` on, made by `pool_id`; `finish` (a router FinishReason number) on the last piece,
    whose ids may then be empty."""

    token_ids: list[int]
    offset: int
    pool_id: str
    finish: int | None = None


class GenerateRun:
    """Streams one request to the client as one continuous sequence, whichever pools produce it."""

    def __init__(
        self,
        core: RoutingCore,
        links: ServingLinks,
        *,
        request_id: str,
        model: str,
        prompt: Sequence[int],
        max_tokens: int,
        migration_limit: int,
        admission_tries: int,
        sampling: sampling_pb2.SamplingParams | None = None,
        stall: StallPolicy | None = None,
        adapter: str = "",
    ) -> None:
        self._core = core
        self._links = links
        self._request_id = request_id
        self._model = model
        self._adapter = adapter
        """The LoRA adapter of the model ("" for none): its pools only, its own cached blocks."""
        self._prompt = prompt  # not copied: a request's repeated field copies natively into the pool's
        self._max_tokens = max_tokens
        self._migration_limit = migration_limit
        self._admission_tries = admission_tries
        self._sampling = sampling
        self._stall = stall or StallPolicy()
        self._stalled_starts = 0
        self.record = RunRecord()
        self._estimated = 0  # the decision's cached blocks at the pool _admit() chose
        self._started = core.clock.monotonic()
        self.trace: Span | None = None
        """The request's span (tracing on): admission attempts, pool streams and migrations are its children."""

    @property
    def _log(self):
        # Bound when something is logged (a refusal, a migration), not on every request.
        return log.bind(request_id=self._request_id, model=self._model)

    async def stream(self, first: Decision) -> AsyncIterator[Output]:
        """Yields the output in pieces, the last with its finish reason (and the pool's last tokens
        when they came with its finish); raises GenerateError on failure."""
        rec = self.record
        decision = first
        failed_pools: set[str] = set()
        while True:
            admitted, watch = await self._admit(decision)
            if not rec.pools:
                rec.cached_blocks = admitted.admission.cached_blocks
                rec.prompt_blocks = admitted.admission.prompt_blocks
                rec.pool_states_cache, rec.estimated_cached_blocks = admitted.states_cache, self._estimated
            rec.pools.append(admitted.pool_id)
            span = None
            if self.trace is not None:
                span = tracing.start_span(
                    "globalrouter.pool_stream",
                    self.trace,
                    {
                        "pool.id": admitted.pool_id,
                        "pool.frontend": admitted.url,
                        "tokens.before": len(rec.tokens),
                    },
                )
            finish: pool_frontend_pb2.PoolFinish | None = None
            last: list[int] | None = None
            broken: StreamBroken | None = None
            silent: Silent | None = None
            read = admitted.stream.read
            clock = self._core.clock
            pending = admitted.first  # tokens the admission carried come first
            try:
                while True:
                    if pending is not None:
                        tokens, pending = pending, None
                    else:
                        if watch.started:
                            msg = await within(clock, read, watch.allowance(clock.monotonic()))
                        else:
                            msg = await self._first_message(admitted, watch)
                        if msg is None:
                            break
                        kind = msg.WhichOneof("payload")
                        if kind == "finish":
                            # The last message: answer the client now, not after the pool's trailers.
                            finish = msg.finish
                            break
                        if kind == "queued":
                            # The pool is busy, not hung: the request waits its turn there.
                            watch.waiting_turn(clock.monotonic(), msg.queued.position)
                            continue
                        if kind != "tokens":
                            continue
                        tokens = msg.tokens
                    watch.arrived(clock.monotonic())
                    ids = list(tokens.token_ids)[: self._max_tokens - len(rec.tokens)]
                    if tokens.HasField("finish"):
                        # Tokens and finish in one message: they go out with the finish, after
                        # the pool's call is let go.
                        finish, last = tokens.finish, ids
                        break
                    if ids:
                        offset = len(rec.tokens)
                        if not offset:
                            ttft = clock.monotonic() - self._started
                            self._core.metrics.time_to_first_token.observe(ttft)
                        rec.tokens.extend(ids)
                        yield Output(ids, offset, admitted.pool_id)
            except StreamBroken as exc:
                broken = exc
            except Silent as exc:
                silent = exc
            finally:
                await self._links.release(admitted)
                if span is not None:
                    tracing.end_span(
                        span,
                        broken or silent,
                        **{
                            "tokens.after": len(rec.tokens) + len(last or ()),
                            "stream.finished": finish is not None,
                        },
                    )
            if finish is not None and finish.HasField("cached_tokens") and len(rec.pools) == 1:
                rec.pool_cached_tokens = finish.cached_tokens
                if not rec.pool_states_cache:
                    _count_cached_prefix(
                        self._core.metrics,
                        admitted.pool_id,
                        rec.prompt_blocks,
                        min(rec.prompt_blocks, finish.cached_tokens // DEFAULT_BLOCK_SIZE),
                    )
            if finish is not None or len(rec.tokens) >= self._max_tokens:
                reason = _FINISH.get(finish.reason, router_pb2.FINISH_REASON_LENGTH) if finish else None
                offset = len(rec.tokens)
                if last and not offset:
                    self._core.metrics.time_to_first_token.observe(clock.monotonic() - self._started)
                rec.tokens.extend(last or ())
                yield Output(last or [], offset, admitted.pool_id, reason or router_pb2.FINISH_REASON_LENGTH)
                return
            pool = self._core.table.pools.get(admitted.pool_id)
            if silent is not None and not watch.started:
                # No first token in time: the pool's 'no', like a refusal (no migration counted).
                decision = self._stalled_start(admitted.pool_id, pool, silent, failed_pools)
                continue
            # The pool failed, hung or handed the request back mid-stream: continue it elsewhere.
            if silent is not None:
                detail = f"{Reason.POOL_STALLED}: no token for {silent.waited:.1f} s (the pool hangs)"
            else:
                detail = str(broken) if broken else "stream ended without a finish"
            handed_back = broken is not None and broken.reason == Reason.DRAIN_HANDED_BACK
            if pool is not None and not handed_back:
                self._links.link_failed(pool, self._core.clock.monotonic())
            failed_pools.add(admitted.pool_id)
            sent = len(rec.tokens)
            if rec.migrations >= self._migration_limit:
                self._core.metrics.migration_aborts.inc()
                raise GenerateError(
                    grpc.StatusCode.UNAVAILABLE,
                    Reason.MIGRATION_LIMIT_REACHED,
                    f"pool {admitted.pool_id} failed after {sent} tokens ({detail}) and the migration "
                    f"limit ({self._migration_limit}) is reached; the {sent} tokens sent stay valid",
                    self._error_metadata(),
                )
            rec.migrations += 1
            span = None
            if self.trace is not None:
                span = tracing.start_span(
                    "globalrouter.migration",
                    self.trace,
                    {
                        "migration.from_pool": admitted.pool_id,
                        "migration.reason": detail,
                        "migration.tokens_so_far": sent,
                        "migration.number": rec.migrations,
                    },
                )
            metrics = self._core.metrics
            metrics.labelled(metrics.migrations, admitted.pool_id).inc()
            self._event("migration", admitted.pool_id, detail=detail)
            self._log.info(
                "migrating",
                from_pool=admitted.pool_id,
                tokens_so_far=sent,
                reason=detail,
                migrations=rec.migrations,
            )
            decision = self._core.decide(
                self._model,
                [*self._prompt, *rec.tokens],
                self._max_tokens - sent,
                exclude=failed_pools,
                adapter=self._adapter,
            )
            if span is not None:
                tracing.end_span_with(span, functools.partial(decision_attributes, decision))
            if not decision.candidates:
                why = describe_filtered(decision) or "no other pool serves the model"
                raise GenerateError(
                    grpc.StatusCode.UNAVAILABLE,
                    Reason.NO_POOL_TO_CONTINUE,
                    f"pool {admitted.pool_id} failed after {sent} tokens ({detail}) and no other pool "
                    f"can continue the request ({why}); the {sent} tokens sent stay valid",
                    self._error_metadata(),
                )

    def _stalled_start(
        self, pool_id: str, pool: PoolState | None, silent: Silent, failed_pools: set[str]
    ) -> Decision:
        """A pool admitted the request but sent no first token in time: counted as its refusal; the
        next candidate is asked (at most `admission_tries` such starts). Returns the next decision.

        A silent pool's link backs off; a busy one's (TurnTooLong: the request waited its turn past
        max_queue_wait) does not, so it stays eligible for others."""
        rec = self.record
        rec.pools.pop()
        if not rec.pools:
            rec.cached_blocks = rec.prompt_blocks = 0
        rec.refused_by.append(pool_id)
        self._stalled_starts += 1
        busy = isinstance(silent, TurnTooLong)
        metrics = self._core.metrics
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if busy else grpc.StatusCode.DEADLINE_EXCEEDED
        metrics.labelled(metrics.refusals, pool_id, code.name).inc()
        if pool is not None and not busy:
            self._links.link_failed(pool, self._core.clock.monotonic())
        failed_pools.add(pool_id)
        if busy:
            detail = f"pool {pool_id} was busy: no first token after waiting its turn {silent.waited:.1f} s"
            reason = Reason.ALL_POOLS_REFUSED
        else:
            detail = f"pool {pool_id} sent no first token within {silent.waited:.1f} s"
            reason = Reason.POOL_STALLED
        self._log.info("refused", pool_id=pool_id, reason=str(reason), detail=detail)
        sent = len(rec.tokens)
        decision = self._core.decide(
            self._model,
            [*self._prompt, *rec.tokens],
            self._max_tokens - sent,
            exclude=failed_pools,
            adapter=self._adapter,
        )
        if self._stalled_starts >= self._admission_tries or not decision.candidates:
            why = describe_filtered(decision) or "no other pool serves the model"
            if sent:
                raise GenerateError(
                    grpc.StatusCode.UNAVAILABLE,
                    Reason.NO_POOL_TO_CONTINUE,
                    f"{detail} and no other pool can continue the request ({why}); "
                    f"the {sent} tokens sent stay valid",
                    self._error_metadata(),
                )
            raise GenerateError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                reason,
                f"{detail} and no other pool could take the request ({why})",
            )
        return decision

    async def _first_message(self, admitted: Admitted, watch: StallWatch) -> PoolResponse | None:
        """The stream's next message before its first token (raises Silent or StreamBroken).

        When the allowance runs out while the pool is known to be busy (its fresh load shows it
        full), the request is waiting its turn: the same read goes on under a new allowance. Raises
        Silent when the pool is silent (a stall), TurnTooLong when the request waited its turn past
        max_queue_wait. The read is shielded from the allowance (a cancelled read would end the
        pool's call) and cancelled only when the request gives up on the pool."""
        clock = self._core.clock
        reader = asyncio.ensure_future(admitted.stream.read())
        try:
            while True:
                try:
                    return await within(
                        clock, functools.partial(asyncio.shield, reader), watch.allowance(clock.monotonic())
                    )
                except Silent:
                    now = clock.monotonic()
                    pool = self._core.table.pools.get(admitted.pool_id)
                    busy = pool is not None and known_busy(pool, now, self._core.selector_limits)
                    verdict = watch.expired(now, busy=busy)
                    if verdict is FirstTokenWait.STALLED:
                        raise Silent(now - watch.asked) from None
                    if verdict is FirstTokenWait.TOO_LONG:
                        raise TurnTooLong(now - watch.asked) from None
                    if busy:
                        self._log.debug(
                            "waiting its turn at a busy pool",
                            pool_id=admitted.pool_id,
                            waited_s=round(now - watch.asked, 1),
                        )
        finally:
            if not reader.done():
                reader.cancel()
            elif not reader.cancelled():
                reader.exception()  # a failure that came as the wait was given up on: seen, not logged

    def _error_metadata(self) -> dict[str, str]:
        """ErrorInfo metadata of a mid-stream failure: what a client needs to continue the request."""
        rec = self.record
        return {"tokens_sent": str(len(rec.tokens)), "migrations": str(rec.migrations)}

    async def _admit(self, decision: Decision) -> tuple[Admitted, StallWatch]:
        """Asks the candidates in rank order, at most `admission_tries` of them; raises GenerateError.

        Returns the admitted stream and its stall allowance (begun when the pool was asked: the
        first-token allowance covers admission and first token together)."""
        rec = self.record
        prompt = [*self._prompt, *rec.tokens] if rec.tokens else self._prompt
        remaining = self._max_tokens - len(rec.tokens)
        request = PoolRequest(
            request_id=self._request_id,
            model=self._model,
            adapter=self._adapter,
            token_ids=prompt,
            max_tokens=remaining,
            sampling=self._sampling,
            # This side reads combined messages (admission with first tokens, tokens with finish).
            combine_messages=True,
            # and "queued, position N" while the request waits for a slot (busy, not hung).
            queue_updates=True,
        )
        failures: list[AdmissionFailed] = []
        metrics = self._core.metrics
        for candidate in decision.candidates[: self._admission_tries]:
            pool = self._core.table.pools.get(candidate.pool_id)
            if pool is None or not pool.frontends:
                continue
            pool.record_sent(candidate.uncached_tokens, remaining)
            metrics.labelled(metrics.decisions, pool.pool_id).inc()
            clock = self._core.clock
            watch = StallWatch(
                self._stall,
                uncached_tokens=candidate.uncached_tokens,
                prefill_rate=pool.capacity.prefill_tokens_per_second,
                begun=clock.monotonic(),
            )
            attempt = None
            if self.trace is not None:
                attempt = tracing.start_span(
                    "globalrouter.admission",
                    self.trace,
                    {"pool.id": pool.pool_id, "admission.uncached_tokens": candidate.uncached_tokens},
                )
            try:
                try:
                    admit = functools.partial(self._links.admit, pool, request)
                    if attempt is None:
                        admitted = await within(clock, admit, watch.first_allowance)
                    else:
                        with tracing.current(attempt):  # the pool call carries this span's context
                            admitted = await within(clock, admit, watch.first_allowance)
                except Silent as silent:
                    # A pool that does not even admit in time (hung, stopped) is no better than one
                    # that says no: the next candidate is asked, and its link backs off, unless the
                    # pool's fresh load shows it full: busy, not hung, it stays eligible for others.
                    now = clock.monotonic()
                    if known_busy(pool, now, self._core.selector_limits):
                        raise AdmissionFailed(
                            pool.pool_id,
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            None,
                            f"no admission within {silent.waited:.1f} s (its load shows it full)",
                            refused=True,
                        ) from None
                    self._links.link_failed(pool, now)
                    raise AdmissionFailed(
                        pool.pool_id,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        Reason.POOL_STALLED,
                        f"no admission within {silent.waited:.1f} s",
                        refused=True,
                    ) from None
            except AdmissionFailed as exc:
                failures.append(exc)
                if attempt is not None:
                    tracing.end_span(
                        attempt,
                        exc,
                        **{
                            "admission.code": exc.code.name,
                            "admission.reason": str(exc.reason) if exc.reason else None,
                            "admission.refused": exc.refused,
                        },
                    )
                if exc.refused:
                    rec.refused_by.append(exc.pool_id)
                    metrics.labelled(metrics.refusals, exc.pool_id, exc.code.name).inc()
                    self._event("refusal", exc.pool_id, detail=str(exc.reason or exc.code.name))
                    self._log.info(
                        "refused",
                        pool_id=exc.pool_id,
                        code=exc.code.name,
                        reason=exc.reason,
                        detail=exc.message,
                    )
                elif exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise GenerateError(
                        exc.code, None, f"pool {exc.pool_id} rejected the request: {exc.message}"
                    ) from None
                else:
                    self._links.link_failed(pool, self._core.clock.monotonic())
                continue
            except BaseException as exc:
                tracing.end_span(attempt, exc)
                raise
            self._links.link_ok(pool)
            self._estimated = candidate.cached_blocks
            adm = admitted.admission
            if attempt is not None:
                tracing.end_span(
                    attempt,
                    **{
                        "admission.code": "OK",
                        "admission.cached_blocks": adm.cached_blocks,
                        "admission.prompt_blocks": adm.prompt_blocks,
                    },
                )
            if admitted.states_cache:
                # An OpenAI-HTTP pool states its cache only with its finish (usage): counted there.
                _count_cached_prefix(metrics, pool.pool_id, adm.prompt_blocks, adm.cached_blocks)
            q = self._core.record_admission(decision, pool.pool_id)  # available vs achieved cache
            # cached there for the routed-prefix TTL, before its KV events can say so
            self._core.record_routed(pool, decision, prompt, self._adapter)
            self._event(
                "decision",
                pool.pool_id,
                cached_blocks=adm.cached_blocks,
                prompt_blocks=adm.prompt_blocks,
                achieved_share=q.achieved if q else None,
                available_share=q.available if q else None,
            )
            return admitted, watch
        tried = "; ".join(str(f) for f in failures) or "no candidate had a frontend"
        if rec.tokens:
            raise GenerateError(
                grpc.StatusCode.UNAVAILABLE,
                Reason.NO_POOL_TO_CONTINUE,
                f"no pool could continue the request after {len(rec.tokens)} tokens ({tried}); "
                f"the tokens sent stay valid",
                self._error_metadata(),
            )
        if any(f.refused for f in failures):
            raise GenerateError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                Reason.ALL_POOLS_REFUSED,
                f"every candidate pool refused the request: {tried}",
            )
        raise GenerateError(
            grpc.StatusCode.UNAVAILABLE,
            Reason.POOLS_UNREACHABLE,
            f"no candidate pool could be reached: {tried}",
        )

    def _event(self, kind: str, pool_id: str, **fields) -> None:
        """Records what happened in the core's ring of recent events (the status page shows it)."""
        self._core.events.add(
            kind,
            wall=self._core.clock.wall(),
            request_id=self._request_id,
            model=self._model,
            pool_id=pool_id,
            **fields,
        )

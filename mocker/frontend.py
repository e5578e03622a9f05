"""The serving link (globalrouter.v1.PoolFrontendService): validation, admission, token streaming."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

import grpc

from globalrouter.v1 import pool_frontend_pb2 as pf
from globalrouter.v1 import pool_frontend_pb2_grpc as pf_grpc
from meshkit.errors import Reason, abort_with_reason
from meshkit.logs import get_logger
from meshkit.sampling import check_sampling
from meshkit.validation import Violations, check_identifier
from mocker.pool import Pool, RefusalKind, Refused

MAX_PROMPT_TOKENS = 1_048_576
MAX_OUTPUT_TOKENS = 1_048_576
HANDED_BACK_MESSAGE = "drain deadline: handed back"
# After the last allowed tokens are written, give the transport a moment to put them on the wire
# before the process dies, so the caller holds exactly those tokens when it sees the failure.
FAIL_FLUSH_S = 0.05

REFUSALS = {
    RefusalKind.UNKNOWN_MODEL: (grpc.StatusCode.NOT_FOUND, Reason.MODEL_NOT_SERVED),
    RefusalKind.NOT_READY: (grpc.StatusCode.FAILED_PRECONDITION, Reason.MODEL_NOT_READY),
    RefusalKind.DRAINING: (grpc.StatusCode.UNAVAILABLE, Reason.POOL_DRAINING),
    RefusalKind.QUEUE_FULL: (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.QUEUE_FULL),
    RefusalKind.REFUSE_ALL: (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.POOL_REFUSING),
}
"""Each admission refusal's code and the ErrorInfo reason the global frontend decides on."""

log = get_logger(module="mocker.frontend")


def validate_generate(request: pf.PoolFrontendServiceGenerateRequest) -> Violations:
    """Every field problem of a Generate request, each naming its field."""
    v = Violations()
    check_identifier(v, "request_id", request.request_id)
    check_identifier(v, "model", request.model)
    if request.adapter:
        check_identifier(v, "adapter", request.adapter)
    n = len(request.token_ids)
    if n == 0:
        v.add("token_ids", "must hold at least one token")
    elif n > MAX_PROMPT_TOKENS:
        v.add("token_ids", f"must hold at most {MAX_PROMPT_TOKENS} tokens (got {n})")
    if request.max_tokens == 0:
        v.add("max_tokens", "must be at least 1")
    elif request.max_tokens > MAX_OUTPUT_TOKENS:
        v.add("max_tokens", f"must be at most {MAX_OUTPUT_TOKENS} (got {request.max_tokens})")
    check_sampling(v, "sampling", request.sampling)
    return v


class PoolFrontend(pf_grpc.PoolFrontendServiceServicer):
    """Generate on the simulated pool. `exit_process` is how --fail-after-tokens kills the process."""

    def __init__(self, pool: Pool, exit_process: Callable[[int], None] = os._exit) -> None:
        self.pool = pool
        self.exit_process = exit_process

    async def Generate(  # type: ignore[override]  # writes with context.write instead of yielding
        self, request: pf.PoolFrontendServiceGenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await validate_generate(request).abort_if_any(context)
        rlog = log.bind(request_id=request.request_id, model=request.model)
        faults = self.pool.faults
        if faults.added_latency > 0:
            await self.pool.clock.sleep(faults.added_latency)
        try:
            ticket = self.pool.admit(
                request.request_id,
                request.model,
                list(request.token_ids),
                request.max_tokens,
                # Temperature and top_p change nothing here: the mocker's output is a function of
                # the sequence (and seed), which is what makes a migrated stream verifiable.
                seed=request.sampling.seed,
                stop_token_ids=frozenset(request.sampling.stop_token_ids),
                adapter=request.adapter,
            )
        except Refused as refused:
            rlog.debug("refused", reason=refused.kind.value)
            code, reason = REFUSALS[refused.kind]
            await abort_with_reason(context, code, reason, refused.message)
        rlog = rlog.bind(worker=ticket.worker.worker_id)
        rlog.debug("admitted", cached_blocks=ticket.cached_blocks, prompt_blocks=ticket.prompt_blocks)
        out = _Outbox(
            context,
            pf.PoolAdmission(
                worker_id=ticket.worker.worker_id,
                cached_blocks=ticket.cached_blocks,
                prompt_blocks=ticket.prompt_blocks,
            ),
        )
        # Combined messages (when the caller understands them): the admission waits for the first
        # tokens only when they are due at once, and the finish rides on the last tokens.
        combine = request.combine_messages
        if not (combine and self.pool.first_tokens_soon(ticket)):
            await out.admit()
        sent = 0
        try:
            last: list[int] | None = None
            on_queued = out.queued if request.queue_updates else None
            async with contextlib.aclosing(self.pool.run(ticket, on_queued)) as batches:
                async for batch in batches:
                    limit = self.pool.faults.fail_after_tokens
                    if limit and sent + len(batch) >= limit:
                        await self._send_and_die(out, batch[: limit - sent], rlog)
                    stall = self.pool.faults.stall_after_tokens
                    if stall and sent + len(batch) >= stall:
                        await self._send_and_hang(out, batch[: stall - sent], rlog)
                    if combine and (ticket.stopped or ticket.generated >= ticket.max_tokens):
                        # The last batch: held until the run ends (its cache store comes before
                        # the finish, as when the finish is separate), then sent with the finish.
                        last = batch
                        continue
                    await out.tokens(pf.PoolTokens(token_ids=batch))
                    sent += len(batch)
            finish = pf.PoolFinish(
                reason=pf.POOL_FINISH_REASON_STOP if ticket.stopped else pf.POOL_FINISH_REASON_LENGTH,
                tokens_generated=sent + len(last or ()),
            )
            if last is not None:
                await out.tokens(pf.PoolTokens(token_ids=last, finish=finish))
            else:
                await out.admit()
                await context.write(pf.PoolFrontendServiceGenerateResponse(finish=finish))
        except asyncio.CancelledError:
            if not ticket.handed_back:
                raise  # the caller went away
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            rlog.info("handed back at drain deadline", tokens_sent=sent)
            await out.admit()  # handed back after admission (the caller migrates it), never before
            await abort_with_reason(
                context, grpc.StatusCode.UNAVAILABLE, Reason.DRAIN_HANDED_BACK, HANDED_BACK_MESSAGE
            )
        finally:
            self.pool.close(ticket)

    async def _send_and_hang(self, out: _Outbox, batch: list[int], rlog) -> None:
        """Fault injection: sends the tokens up to the limit, then the stream hangs until the caller
        gives up on it (the process and its other streams keep running)."""
        if batch:
            await out.tokens(pf.PoolTokens(token_ids=batch))
        await out.admit()
        rlog.warning(
            "stall-after-tokens reached: the stream hangs", limit=self.pool.faults.stall_after_tokens
        )
        await asyncio.Event().wait()

    async def _send_and_die(self, out: _Outbox, batch: list[int], rlog) -> None:
        """Fault injection: sends the tokens up to the limit, then the process exits abruptly."""
        if batch:
            await out.tokens(pf.PoolTokens(token_ids=batch))
        await out.admit()
        rlog.warning("fail-after-tokens reached: exiting abruptly", limit=self.pool.faults.fail_after_tokens)
        await asyncio.sleep(FAIL_FLUSH_S)
        self.exit_process(1)
        # Only reached when exit_process is a test double: end the stream as a failure would.
        await out.context.abort(grpc.StatusCode.UNAVAILABLE, "pool failed (fault injection)")


class _Outbox:
    """One stream's writes: the admission goes out once, before or together with the first tokens."""

    __slots__ = ("admission", "context")

    def __init__(self, context: grpc.aio.ServicerContext, admission: pf.PoolAdmission) -> None:
        self.context = context
        self.admission: pf.PoolAdmission | None = admission
        """Not yet sent."""

    async def admit(self) -> None:
        """Sends the admission on its own unless it went out already."""
        if self.admission is not None:
            admission, self.admission = self.admission, None
            await self.context.write(pf.PoolFrontendServiceGenerateResponse(admission=admission))

    async def queued(self, position: int) -> None:
        """Says the request waits for a run slot, `position` in line (after the admission)."""
        await self.admit()
        await self.context.write(
            pf.PoolFrontendServiceGenerateResponse(queued=pf.PoolQueued(position=position))
        )

    async def tokens(self, tokens: pf.PoolTokens) -> None:
        """Sends tokens, inside the admission when that is still to go."""
        if self.admission is None:
            await self.context.write(pf.PoolFrontendServiceGenerateResponse(tokens=tokens))
            return
        admission, self.admission = self.admission, None
        admission.tokens.CopyFrom(tokens)
        await self.context.write(pf.PoolFrontendServiceGenerateResponse(admission=admission))

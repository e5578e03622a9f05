"""Late binding in the live frontend (`globalrouter serve --dispatch late`): the request path
awaits its pool from the dispatch queue (`globalrouter.dispatch`) instead of deciding at once.

One task polls the queue while requests wait: at the queue's own wake-up time, and at least
every `POLL_SECONDS` (load reports and finished requests change what pools can take without
telling the queue). A request the queue sheds ends with RESOURCE_EXHAUSTED and the shed reason
in its ErrorInfo (429 and Retry-After over HTTP, RetryInfo over gRPC); one whose client leaves
while it waits is taken out of the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2

from globalrouter.dispatch import (
    DispatchConfig,
    Dispatched,
    DispatchQueue,
    DispatchRequest,
    Outcome,
    Shed,
    ShedReason,
)
from globalrouter.metrics import Flow
from globalrouter.migration import GenerateError
from globalrouter.pool_state import PoolState
from globalrouter.routing import RoutingCore, affinity_key
from globalrouter.selection import Decision
from globalrouter.tenancy import TenantRefusal
from meshkit.blocks import adapter_seed
from meshkit.errors import Reason
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.dispatch_live")

POLL_SECONDS = 0.02
"""Longest wait between two polls while requests are queued."""


class _Ask:
    """A queued request's prompt (for the KV overlaps at dispatch), its future, and the flow
    series (tenant, class) its queue time and shed are counted in."""

    __slots__ = ("flow", "future", "in_queue", "seed", "tokens")

    def __init__(
        self, tokens: Sequence[int], seed: int, future: asyncio.Future[Decision], flow: Flow | None
    ) -> None:
        self.tokens = tokens
        self.seed = seed
        self.future = future
        self.flow = flow
        self.in_queue = False
        """Counted in its flow's queue length (left it exactly once: outcome or withdrawal)."""

    def left_queue(self) -> None:
        if self.in_queue:
            self.in_queue = False
            if self.flow is not None:
                self.flow.dequeued()


def _count(outcome: Outcome[_Ask]) -> None:
    """Counts a decided request in its flow series: queue time when dispatched, else its shed."""
    ask = outcome.request.payload
    ask.left_queue()
    flow = ask.flow
    if flow is None:
        return
    if isinstance(outcome, Dispatched):
        flow.dispatched(outcome.queued_seconds)
    elif outcome.decision is None:  # a refusal with a decision is the request path's to count
        flow.shed(outcome.reason.name)


class LateBinder:
    """The dispatch queue of one frontend, fed by the request path."""

    def __init__(self, core: RoutingCore, config: DispatchConfig) -> None:
        self.core = core
        # GenerateRun records each send in PoolState itself: the queue must not count it twice.
        self.config = replace(config, record_sends=False)
        self.queue: DispatchQueue[_Ask] = DispatchQueue(
            self.config, core.clock, core.selector, self._pools, self._overlaps
        )
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _pools(self) -> list[PoolState]:
        return [p for p in self.core.table.pools.values() if p.listed]

    def _overlaps(self, request: DispatchRequest[_Ask], now: float) -> Mapping[str, int]:
        ask = request.payload
        return self.core.overlaps(self._pools(), ask.tokens, now, ask.seed)

    async def decide(
        self,
        model: str,
        tokens: Sequence[int],
        max_tokens: int,
        *,
        regions: frozenset[str] | None = None,
        adapter: str = "",
        priority: int = 0,
        tenant: str = "",
        weight: float = 1.0,
        flow: Flow | None = None,
    ) -> Decision:
        """The decision to run the request with, its chosen pool first, once a pool can start it.
        A decision without candidates (no pool serves the model or none is eligible) comes back
        at once, as `RoutingCore.decide` gives it; a shed request raises TenantRefusal. `flow`: the
        (tenant, class) series its queue time, queue presence and shed are counted in."""
        seed = adapter_seed(adapter)
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        request = DispatchRequest(
            _Ask(tokens, seed, future, flow),
            model,
            len(tokens),
            max_tokens,
            affinity_key(tokens, seed),
            priority=priority,
            tenant=tenant,
            weight=weight,
            regions=regions,
            adapter=adapter,
        )
        outcome = self.queue.enqueue(request)
        if outcome is not None:
            _count(outcome)
            return _decision(outcome)
        request.payload.in_queue = True
        if flow is not None:
            flow.enqueued()
        self._ensure_task()
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self.queue.withdraw(request)
            request.payload.left_queue()
            raise

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="late-binding")

    async def _run(self) -> None:
        clock = self.core.clock
        while True:
            try:
                outcomes = self.queue.poll()
            except Exception:  # a bug must not leave every queued request waiting forever
                log.exception("dispatch_poll_failed")
                outcomes = []
            for outcome in outcomes:
                future = outcome.request.payload.future
                if future.done():  # its caller left: not sent anywhere, not refused
                    outcome.request.payload.left_queue()
                    continue
                _count(outcome)
                try:
                    future.set_result(_decision(outcome))
                except GenerateError as exc:
                    future.set_exception(exc)
            if not self.queue.queued():
                self._wake.clear()
                await self._wake.wait()
                continue
            wake = self.queue.next_wakeup()
            delay = POLL_SECONDS if wake is None else min(POLL_SECONDS, max(0.0, wake - clock.monotonic()))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass

    async def close(self) -> None:
        """Stops the polling task; requests still queued end with UNAVAILABLE."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _decision(outcome: Outcome[_Ask]) -> Decision:
    if isinstance(outcome, Dispatched):
        chosen = outcome.pool
        rest = [c for c in outcome.decision.candidates if c.pool_id != chosen.pool_id]
        # the run tries the chosen pool first, then the rest of the ranking (admission refusals)
        return replace(outcome.decision, candidates=[chosen, *rest])
    if outcome.decision is not None:
        return outcome.decision  # the request path refuses it as it refuses an early decision
    raise shed_error(outcome)


def shed_error(shed: Shed[_Ask]) -> TenantRefusal:
    """RESOURCE_EXHAUSTED (DEADLINE_EXCEEDED's too: the frontend, not the caller's deadline, gave
    up) with the shed reason and a retry hint, in gRPC details and HTTP headers alike."""
    retry = int(shed.retry_after_seconds)
    reason = Reason.QUEUE_FULL
    return TenantRefusal(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        reason,
        f"the frontend's dispatch queue shed the request ({shed.reason.name}: {shed.detail}); "
        f"retry in {retry}s",
        details=(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=retry)),),
        headers=(("retry-after", str(retry)),),
        metadata={
            "shed_reason": shed.reason.name,
            "retry_after_seconds": str(retry),
            "queued_seconds": f"{shed.queued_seconds:.3f}",
        },
    )


__all__ = ["LateBinder", "ShedReason", "shed_error"]

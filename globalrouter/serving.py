"""Serving links to pool frontends: one keepalive channel per URL, round-robin per pool, failure back-off."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import grpc

from globalrouter.config import OpenAILinkConfig
from globalrouter.openai_link import LinkError, OpenAIClient
from globalrouter.openai_link import admission as openai_admission
from globalrouter.pool_state import PoolState
from globalrouter.v1 import pool_frontend_pb2, pool_frontend_pb2_grpc
from meshkit.channels import aio_channel
from meshkit.errors import Reason, reason_of
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.serving")

PoolRequest = pool_frontend_pb2.PoolFrontendServiceGenerateRequest


PoolResponse = pool_frontend_pb2.PoolFrontendServiceGenerateResponse

REFUSAL_REASONS = frozenset(
    {
        Reason.POOL_DRAINING,
        Reason.QUEUE_FULL,
        Reason.MODEL_NOT_READY,
        Reason.MODEL_NOT_SERVED,
        Reason.POOL_REFUSING,
    }
)
"""ErrorInfo reasons that are the pool's own 'no' before the first token (another pool may say yes)."""

_REFUSAL_CODES = frozenset(
    {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
)


class PoolStream(Protocol):
    """One admitted request's stream from a pool, whatever the link's transport (gRPC, OpenAI HTTP)."""

    async def read(self) -> PoolResponse | None:
        """The next message; None at a clean end. Raises StreamBroken when the stream fails."""
        ...

    def cancel(self) -> None:
        """Ends the stream from our side (idempotent; a no-op after its end)."""
        ...


class StreamBroken(Exception):
    """An admitted stream failed mid-way: `code`, the ErrorInfo `reason` if the pool gave one, `detail`."""

    def __init__(self, code: grpc.StatusCode, reason: str | None, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code = code
        self.reason = reason
        self.detail = detail


class GrpcPoolStream:
    """PoolStream over a gRPC PoolFrontendService.Generate call."""

    __slots__ = ("_call",)

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def read(self) -> PoolResponse | None:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise StreamBroken(exc.code(), reason_of(exc), exc.details() or "") from None
        # Anything but a response is grpc.aio.EOF (typeshed types read() as object).
        return msg if isinstance(msg, PoolResponse) else None

    def cancel(self) -> None:
        self._call.cancel()


@dataclass(slots=True)
class Admitted:
    """A pool accepted the request: its stream (positioned after the admission message), and the
    first tokens when the admission carried them (to be read before the stream's next message)."""

    pool_id: str
    url: str
    stream: PoolStream
    admission: pool_frontend_pb2.PoolAdmission
    first: pool_frontend_pb2.PoolTokens | None = None
    states_cache: bool = True
    """Whether admission.cached_blocks is the pool's word (a mesh pool's); an OpenAI-HTTP pool
    states its cached prompt tokens, if at all, in its PoolFinish."""


class AdmissionFailed(Exception):
    """The pool did not take the request. `refused` says whether it answered no (vs. was unreachable)."""

    def __init__(
        self, pool_id: str, code: grpc.StatusCode, reason: str | None, message: str, *, refused: bool
    ) -> None:
        super().__init__(f"{pool_id}: {code.name}: {message}")
        self.pool_id = pool_id
        self.code = code
        self.reason = reason
        self.message = message
        self.refused = refused


def is_refusal(code: grpc.StatusCode, reason: str | None) -> bool:
    """Whether a pre-admission error is the pool's own 'no' (so another pool may say yes).

    Decided on the ErrorInfo reason (overload, drain, model not served or not ready). A pool that
    sets no reason is still taken at its word for RESOURCE_EXHAUSTED / NOT_FOUND /
    FAILED_PRECONDITION (overloaded, or our view of its model is stale); anything else means we
    could not talk to it.
    """
    return reason in REFUSAL_REASONS or (reason is None and code in _REFUSAL_CODES)


class ServingLinks:
    """The frontend's links to every pool frontend it routes to."""

    def __init__(
        self, backoff_initial: float, backoff_max: float, openai: OpenAILinkConfig | None = None
    ) -> None:
        self._channels: dict[
            str, tuple[grpc.aio.Channel, pool_frontend_pb2_grpc.PoolFrontendServiceAsyncStub]
        ] = {}
        self._round_robin: dict[str, itertools.count] = {}
        self._failures: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        """URL -> streams open on its channel (a channel is never closed under a live stream)."""
        self._retired: set[str] = set()
        """URLs no listed pool names any more, closed when their last stream ends."""
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._openai = OpenAIClient(openai)
        """The one HTTP client (pooled keep-alive connections) for every OpenAI HTTP pool."""

    def stub(self, url: str) -> pool_frontend_pb2_grpc.PoolFrontendServiceAsyncStub:
        """The stub for `url`, its channel made on first use and kept (keepalive watches it)."""
        entry = self._channels.get(url)
        if entry is None:
            channel = aio_channel(url)
            entry = self._channels[url] = (channel, pool_frontend_pb2_grpc.PoolFrontendServiceStub(channel))
        return entry[1]

    def next_frontend(self, pool: PoolState) -> str:
        """The pool's next frontend in round-robin order (a pool's frontends share its load)."""
        counter = self._round_robin.setdefault(pool.pool_id, itertools.count())
        return pool.frontends[next(counter) % len(pool.frontends)]

    def link_failed(self, pool: PoolState, now: float) -> float:
        """Puts the pool's link in back-off (doubling per consecutive failure); returns its length."""
        n = self._failures.get(pool.pool_id, 0) + 1
        self._failures[pool.pool_id] = n
        wait = min(self._backoff_initial * 2 ** (n - 1), self._backoff_max)
        pool.link_backoff_until = now + wait
        log.warning("serving link failed; backing off", pool_id=pool.pool_id, backoff_s=wait, failures=n)
        return wait

    def link_ok(self, pool: PoolState) -> None:
        """The pool answered: its back-off ends."""
        if self._failures.pop(pool.pool_id, None):
            pool.link_backoff_until = 0.0

    async def prune(self, urls_in_use: set[str]) -> None:
        """Closes channels to URLs no listed pool names any more, once no stream runs on them
        (a drained pool leaves the directory while its handed-back streams still end)."""
        self._retired = {u for u in self._channels if u not in urls_in_use}
        for url in [u for u in self._retired if not self._in_flight.get(u)]:
            await self._close(url)

    async def _close(self, url: str) -> None:
        self._retired.discard(url)
        entry = self._channels.pop(url, None)
        if entry is not None:
            await entry[0].close()

    async def release(self, admitted: Admitted) -> None:
        """The request's stream on `admitted` ended (finished, failed or cancelled)."""
        admitted.stream.cancel()
        await self._release_url(admitted.url)

    async def _release_url(self, url: str) -> None:
        left = self._in_flight.get(url, 1) - 1
        if left > 0:
            self._in_flight[url] = left
            return
        self._in_flight.pop(url, None)
        if url in self._retired:
            await self._close(url)

    async def close(self) -> None:
        for url in list(self._channels):
            await self._close(url)
        await self._openai.close()

    async def admit(self, pool: PoolState, request: PoolRequest) -> Admitted:
        """Opens the request on one of the pool's frontends and waits for its admission.

        Raises AdmissionFailed (refused or unreachable); an unreachable link goes into back-off.
        """
        url = self.next_frontend(pool)
        if pool.openai_http:
            return await self._admit_openai(pool, url, request)
        call = self.stub(url).Generate(request)
        self._in_flight[url] = self._in_flight.get(url, 0) + 1
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            await self._release_url(url)
            code, reason = exc.code(), reason_of(exc)
            raise AdmissionFailed(
                pool.pool_id, code, reason, exc.details() or "", refused=is_refusal(code, reason)
            ) from None
        except BaseException:
            call.cancel()
            await self._release_url(url)
            raise
        # Anything but a response is grpc.aio.EOF (typeshed types read() as object).
        if (
            not isinstance(first, pool_frontend_pb2.PoolFrontendServiceGenerateResponse)
            or first.WhichOneof("payload") != "admission"
        ):
            call.cancel()
            await self._release_url(url)
            raise AdmissionFailed(
                pool.pool_id,
                grpc.StatusCode.UNAVAILABLE,
                None,
                "the pool's stream did not start with an admission",
                refused=False,
            )
        admission = first.admission
        return Admitted(
            pool_id=pool.pool_id,
            url=url,
            stream=GrpcPoolStream(call),
            admission=admission,
            first=admission.tokens if admission.HasField("tokens") else None,
        )

    async def _admit_openai(self, pool: PoolState, url: str, request: PoolRequest) -> Admitted:
        """The same admission over OpenAI HTTP: a 200 admits, anything else before the stream fails it."""
        self._in_flight[url] = self._in_flight.get(url, 0) + 1
        try:
            stream = await self._openai.open(url, request, StreamBroken)
        except LinkError as exc:
            await self._release_url(url)
            raise AdmissionFailed(
                pool.pool_id, exc.code, exc.reason, exc.message, refused=exc.refused
            ) from None
        except BaseException:
            await self._release_url(url)
            raise
        return Admitted(
            pool_id=pool.pool_id,
            url=url,
            stream=stream,
            admission=openai_admission(request),
            states_cache=False,
        )

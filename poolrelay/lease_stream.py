"""RegisterPool over one long-lived KeepAlivePools stream, with unary RegisterPool as the fallback.

Each registration is one stream message answered by one reply (in order, echoing the sequence).
A reply that does not come within the caller's timeout, or a stream that breaks, fails that call
and drops the stream; the next call opens a new one. A refused request fails only that call (the
stream stays open), with an AioRpcError carrying the code, message and details (ErrorInfo reason,
BadRequest) RegisterPool would have ended with, so callers treat both paths alike. A server that does not implement the stream
(UNIMPLEMENTED, an older discovery) is called with unary RegisterPool from then on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

import grpc
from google.rpc import status_pb2

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from meshkit.logs import get_logger

log = get_logger(module="poolrelay.lease_stream")

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_STATUS_DETAILS_KEY = "grpc-status-details-bin"  # where grpc carries a google.rpc.Status


class StreamBroken(Exception):
    """The KeepAlivePools stream ended or went silent before this call's reply came."""


class _Stream:
    """One open KeepAlivePools call, its unanswered requests in order, and the task reading replies."""

    def __init__(self, stub: dpb_grpc.DiscoveryServiceAsyncStub) -> None:
        self.call = stub.KeepAlivePools()
        self.pending: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self.reader = asyncio.get_running_loop().create_task(self._read(), name="keepalive replies")

    async def _read(self) -> None:
        error: BaseException = StreamBroken("discovery ended the KeepAlivePools stream")
        try:
            # Until grpc.aio.EOF (typeshed types read() as object, hence the isinstance).
            while isinstance(reply := await self.call.read(), dpb.KeepAlivePoolsResponse):
                sequence, waiter = self.pending.popleft()
                if reply.sequence != sequence:
                    error = StreamBroken(f"reply for sequence {reply.sequence} while {sequence} was due")
                    break
                if not waiter.done():
                    waiter.set_result(reply)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except IndexError:
            error = StreamBroken("a KeepAlivePools reply that nothing was sent for")
        except asyncio.CancelledError:
            error = StreamBroken("the KeepAlivePools stream was closed")
        finally:
            self.call.cancel()
            while self.pending:
                _, waiter = self.pending.popleft()
                if not waiter.done():
                    waiter.set_exception(error)

    @property
    def broken(self) -> bool:
        return self.reader.done()

    async def send(self, message: dpb.KeepAlivePoolsRequest) -> dpb.KeepAlivePoolsResponse:
        waiter = asyncio.get_running_loop().create_future()
        self.pending.append((message.sequence, waiter))
        # A write to a stream that just ended fails (INTERNAL or InvalidStateError); the reader
        # then fails the waiter with the status the stream really ended with.
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self.call.write(message)
        return await waiter

    async def close(self) -> None:
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader


class KeepAliveClient:
    """Registers pools over one KeepAlivePools stream; unary RegisterPool when the server lacks it."""

    def __init__(self, stub: dpb_grpc.DiscoveryServiceAsyncStub, *, unary_timeout: float) -> None:
        self._stub = stub
        self._unary_timeout = unary_timeout
        self._stream: _Stream | None = None
        self._sequence = 0
        self.unary = False
        """True once the server answered the stream with UNIMPLEMENTED: unary calls from then on."""
        self.streams_opened = 0
        """How many streams were opened (for status and tests)."""

    async def register(self, request: dpb.RegisterPoolRequest, within: float) -> dpb.RegisterPoolResponse:
        """Registers or renews; raises AioRpcError (refused, stream ended) or StreamBroken (no reply in
        `within` seconds, or the stream ended in between) on failure."""
        if self.unary:
            return await self._stub.RegisterPool(request, timeout=self._unary_timeout)
        try:
            reply = await self._over_stream(request, within)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.info("discovery has no KeepAlivePools; renewing with unary RegisterPool")
            self.unary = True
            return await self._stub.RegisterPool(request, timeout=self._unary_timeout)
        if reply.HasField("status"):
            status = reply.status
        elif reply.WhichOneof("result") == "error":  # an older discovery: same fields as a Status
            status = status_pb2.Status.FromString(reply.error.SerializeToString())
        else:
            return reply.register
        code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
        # The Status rides in the trailers, as on a unary refusal, so meshkit.errors.reason_of reads it.
        trailers = grpc.aio.Metadata((_STATUS_DETAILS_KEY, status.SerializeToString()))
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details=status.message)

    async def _over_stream(
        self, request: dpb.RegisterPoolRequest, within: float
    ) -> dpb.KeepAlivePoolsResponse:
        if self._stream is None or self._stream.broken:
            if self._stream is not None:
                await self._stream.close()
            self._stream = _Stream(self._stub)
            self.streams_opened += 1
        stream = self._stream
        self._sequence += 1
        try:
            async with asyncio.timeout(within):
                return await stream.send(dpb.KeepAlivePoolsRequest(register=request, sequence=self._sequence))
        except TimeoutError:
            # A silent stream is as good as a broken one: drop it, the next call opens another.
            await self._drop(stream)
            raise StreamBroken(f"no KeepAlivePools reply within {within:g} s") from None
        except StreamBroken:
            await self._drop(stream)
            raise

    async def _drop(self, stream: _Stream) -> None:
        if self._stream is stream:
            self._stream = None
        await stream.close()

    async def close(self) -> None:
        """Ends the stream (at stop)."""
        if self._stream is not None:
            await self._drop(self._stream)

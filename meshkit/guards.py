"""Server interceptors that run a check before a handler: the one copy of handler wrapping."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc

# Strings: grpc's classes are generic only in its type stubs, not at run time.
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

_FACTORIES: dict[str, Callable[..., Handler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}

Check = Callable[[str, object | None, Context], Awaitable[None]]
"""check(method, request or None for a client stream, context): aborts the call to refuse it."""


def wrap_handler(handler: Handler, method: str, check: Check) -> Handler:
    """`handler` with `check` awaited before its behaviour runs (same kind, same (de)serializers)."""
    kind = next(k for k in _FACTORIES if getattr(handler, k) is not None)
    inner: Callable[[Any, Context], Any] = getattr(handler, kind)
    # A client stream's messages are the servicer's to check; here the request is None.
    takes_stream = kind.startswith("stream")

    async def streaming(request: Any, context: Context) -> AsyncIterator[Any]:
        await check(method, None if takes_stream else request, context)
        async for item in inner(request, context):
            yield item

    async def single(request: Any, context: Context) -> Any:
        await check(method, None if takes_stream else request, context)
        return await inner(request, context)

    wrapped = streaming if inspect.isasyncgenfunction(inner) else single
    return _FACTORIES[kind](wrapped, handler.request_deserializer, handler.response_serializer)


class CheckingInterceptor(grpc.aio.ServerInterceptor):
    """Applies `check` to every call whose method `applies(method)` says it should."""

    def __init__(self, check: Check, applies: Callable[[str], bool] = lambda _m: True) -> None:
        self._check = check
        self._applies = applies
        # Registered handler → its wrapper, made once: interceptors outside this one (ParseRequests)
        # then see one handler object per method, and no call builds a new one.
        self._wrapped: dict[int, tuple[Handler, Handler]] = {}

    def check_for(self, handler: Handler) -> Check | None:
        """The check for calls of `handler` (None: none, the handler is served as registered)."""
        return self._check

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self._applies(method):
            return handler
        entry = self._wrapped.get(id(handler))
        if entry is not None and entry[0] is handler:
            return entry[1]
        check = self.check_for(handler)
        if check is None:
            return handler
        wrapped = wrap_handler(handler, method, check)
        self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped

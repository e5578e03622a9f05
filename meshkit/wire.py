"""Requests that do not parse end with INVALID_ARGUMENT naming the field, not grpc's UNKNOWN.

grpc turns an exception in a request deserializer (protobuf's DecodeError, e.g. a string field
holding invalid UTF-8) into UNKNOWN "Unexpected DecodeError". ParseRequests, installed on every
server by meshkit.server, parses requests itself (unary and streamed) and answers INVALID_ARGUMENT
with a BadRequest naming the string field at fault, found by walking the wire bytes.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

if TYPE_CHECKING:  # what a generated message's DESCRIPTOR is (C implementation)
    from google._upb._message import Descriptor as UpbDescriptor

from meshkit.validation import Violations

_MAX_DEPTH = 32
"""Message nesting walked when looking for the bad field (protobuf's own default limit is 100)."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def bad_utf8_field(
    descriptor: Descriptor | UpbDescriptor, data: bytes, prefix: str = "", depth: int = 0
) -> str | None:
    """The path (e.g. `prompt.text`) of the first string field in `data` that is not valid UTF-8.

    None when there is none or the bytes are malformed in some other way.
    """
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                chunk, pos = data[pos : pos + size], pos + size
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                path = prefix + field.name
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return path
                elif (
                    field.type == FieldDescriptor.TYPE_MESSAGE
                    and field.message_type is not None
                    and depth < _MAX_DEPTH
                ):
                    found = bad_utf8_field(field.message_type, chunk, path + ".", depth + 1)
                    if found is not None:
                        return found
            else:
                return None  # groups: no mesh contract uses them
    except (IndexError, ValueError):
        return None
    return None


def varint_field(data: bytes, number: int, max_fields: int = 64) -> int:
    """The value of the top-level varint field `number` in the message bytes `data`, without
    decoding the rest (a length-delimited field is skipped by its length): the last one, as
    protobuf decodes it. 0 when absent, when the bytes are malformed, or past `max_fields`
    fields (a bound: the bytes may be a sender's megabytes of one-byte fields)."""
    value = pos = 0
    try:
        for _ in range(max_fields):
            if pos >= len(data):
                break
            key, pos = _varint(data, pos)
            wire_type = key & 7
            if wire_type == 0:
                found, pos = _varint(data, pos)
                if key >> 3 == number:
                    value = found
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                pos += size
            else:
                break  # groups: no mesh contract uses them
        else:
            return 0 if pos < len(data) else value
    except (IndexError, ValueError):
        return 0
    return value if pos <= len(data) else 0


def malformed(message_type, data: bytes, error: DecodeError) -> Violations:
    """The violation to answer for request bytes that did not parse."""
    v = Violations()
    path = bad_utf8_field(message_type.DESCRIPTOR, data)
    if path is not None:
        v.add(path, "must be valid UTF-8")
    else:
        v.add("(request)", f"is not a valid {message_type.DESCRIPTOR.full_name}: {error}")
    return v


class _Parser:
    """Parses request bytes as grpc's deserializer would, but answers INVALID_ARGUMENT on failure."""

    __slots__ = ("_deserialize", "_message_type")

    def __init__(self, deserialize: Callable[[bytes], object]) -> None:
        self._deserialize = deserialize
        self._message_type = deserialize.__self__  # type: ignore[attr-defined]

    async def __call__(self, data: bytes, context: grpc.aio.ServicerContext):
        try:
            return self._deserialize(data)
        except DecodeError as exc:
            await malformed(self._message_type, data, exc).abort_if_any(context)
            raise


class _ParsingContext:
    """A servicer context whose read() returns parsed requests (the server hands over bytes)."""

    __slots__ = ("_context", "_parse")

    def __init__(self, context: grpc.aio.ServicerContext, parse: _Parser) -> None:
        self._context = context
        self._parse = parse

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    async def read(self):
        data = await self._context.read()
        if data is grpc.aio.EOF:
            return data
        return await self._parse(data, self._context)


def _parsing(parse: _Parser, behavior, request_streaming: bool):
    """`behavior` as a handler taking raw bytes: it parses them first, INVALID_ARGUMENT if they do not parse."""
    if request_streaming:

        async def requests(iterator, context):
            async for data in iterator:
                yield await parse(data, context)

        def call(request, context):
            return behavior(requests(request, context), _ParsingContext(context, parse))

        if inspect.isasyncgenfunction(behavior):

            async def stream_in_stream_out(request, context):
                async for response in call(request, context):
                    yield response

            return stream_in_stream_out

        async def stream_in(request, context):
            return await call(request, context)

        return stream_in

    if inspect.isasyncgenfunction(behavior):

        async def stream_out(data: bytes, context):
            request = await parse(data, context)
            async for response in behavior(request, context):
                yield response

        return stream_out

    async def unary(data: bytes, context):
        return await behavior(await parse(data, context), context)

    return unary


_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class ParseRequests(grpc.aio.ServerInterceptor):
    """Parses requests in the handler, so a request that does not parse is INVALID_ARGUMENT.

    Install it last (innermost): the handlers it wraps are then the registered ones, the same
    object per method, and each is wrapped once.
    """

    def __init__(self) -> None:
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        entry = self._wrapped.get(id(handler))
        if entry is not None and entry[0] is handler:
            return entry[1]
        wrapped = self._wrap(handler)
        self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        attribute, factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, attribute)
        deserializer = handler.request_deserializer
        if (
            deserializer is None
            or getattr(deserializer, "__self__", None) is None
            or not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior))
        ):
            return handler  # not a generated Message.FromString or not an aio handler: grpc's own way
        return factory(
            _parsing(_Parser(deserializer), behavior, handler.request_streaming),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )

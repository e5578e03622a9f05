"""Requests that do not parse end with INVALID_ARGUMENT naming the field, not grpc's UNKNOWN.

grpc turns an exception in a request deserializer (protobuf's DecodeError, e.g. a string field
holding invalid UTF-8) into UNKNOWN "Unexpected DecodeError". ParseRequests, installed on every
server by meshkit.server, parses unary requests itself and answers INVALID_ARGUMENT with a
BadRequest naming the string field at fault, found by walking the wire bytes.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

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


def bad_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "", depth: int = 0) -> str | None:
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
                elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < _MAX_DEPTH:
                    found = bad_utf8_field(field.message_type, chunk, path + ".", depth + 1)
                    if found is not None:
                        return found
            else:
                return None  # groups: no mesh contract uses them
    except (IndexError, ValueError):
        return None
    return None


def malformed(message_type, data: bytes, error: DecodeError) -> Violations:
    """The violation to answer for request bytes that did not parse."""
    v = Violations()
    path = bad_utf8_field(message_type.DESCRIPTOR, data)
    if path is not None:
        v.add(path, "must be valid UTF-8")
    else:
        v.add("(request)", f"is not a valid {message_type.DESCRIPTOR.full_name}: {error}")
    return v


def _parsing(deserialize: Callable[[bytes], object], behavior, streaming: bool):
    """`behavior` taking raw bytes: parses them first, INVALID_ARGUMENT when they do not parse."""
    message_type = getattr(deserialize, "__self__", None)

    async def parse(data: bytes, context: grpc.aio.ServicerContext):
        try:
            return deserialize(data)
        except DecodeError as exc:
            await malformed(message_type, data, exc).abort_if_any(context)
            raise

    if streaming and inspect.isasyncgenfunction(behavior):

        async def stream_behavior(data: bytes, context: grpc.aio.ServicerContext):
            request = await parse(data, context)
            async for response in behavior(request, context):
                yield response

        return stream_behavior

    async def unary_behavior(data: bytes, context: grpc.aio.ServicerContext):
        return await behavior(await parse(data, context), context)

    return unary_behavior


class ParseRequests(grpc.aio.ServerInterceptor):
    """Parses unary requests in the handler, so a request that does not parse is INVALID_ARGUMENT.

    Install it last (innermost): the handlers it wraps are then the registered ones, the same
    object per method, and each is wrapped once. Streaming requests are left as they are.
    """

    def __init__(self) -> None:
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        entry = self._wrapped.get(id(handler))
        if entry is not None and entry[0] is handler:
            return entry[1]
        wrapped = self._wrap(handler)
        self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if getattr(handler.request_deserializer, "__self__", None) is None or not (
            inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)
        ):
            return handler  # not a generated Message.FromString or not an aio handler: grpc's own way
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _parsing(handler.request_deserializer, handler.unary_stream, streaming=True),
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            _parsing(handler.request_deserializer, handler.unary_unary, streaming=False),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )

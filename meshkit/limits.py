"""Bounds on what one caller can consume: message sizes per RPC kind, concurrent streams, byte-bounded caches."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from google.rpc import status_pb2

from meshkit.errors import Reason, grpc_status_for, rpc_status_for
from meshkit.guards import Check, CheckingInterceptor, Context, Handler

KIB = 1024
MIB = 1024 * KIB

MESSAGE_CAPS: Mapping[str, int] = {
    # Registrations: 64 frontend URLs and a few ids; a bigger one is an attack, not a pool.
    "/globaldiscovery.v1.DiscoveryService/": 256 * KIB,
    # Telemetry: a snapshot chunk is 16,384 hashes (128 KiB); the rest are small.
    "/poolrelay.v1.TelemetryService/": 1 * MIB,
    # Prompts: token ids for a long context (the prompt cap in tokens is checked by the service).
    "/globalrouter.v1.RouterService/": 8 * MIB,
    "/globalrouter.v1.PoolFrontendService/": 8 * MIB,
}
"""Largest request message per RPC (or "/service/"): gRPC refuses bigger ones before decoding them."""

DEFAULT_MESSAGE_CAP = 1 * MIB
"""For services not listed (health, reflection, pool events, admin)."""


def message_cap(method: str) -> int:
    """The request size cap of a full method name."""
    cap = MESSAGE_CAPS.get(method)
    if cap is None:
        cap = MESSAGE_CAPS.get(method[: method.rfind("/") + 1], DEFAULT_MESSAGE_CAP)
    return cap


def server_receive_cap(service_names: list[str]) -> int:
    """The receive limit of a server hosting these services: the largest of their caps."""
    return max([DEFAULT_MESSAGE_CAP, *(message_cap(f"/{name}/") for name in service_names)])


class LimitExceeded(Exception):
    """A bound was reached: the call is refused with RESOURCE_EXHAUSTED and reason LIMIT_EXCEEDED."""

    def rpc_status(self) -> status_pb2.Status:
        """As a google.rpc.Status (for replies that carry a status in a message)."""
        return rpc_status_for(grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.LIMIT_EXCEEDED, str(self))

    def status(self) -> grpc.Status:
        """As the grpc.Status a call aborts with."""
        return grpc_status_for(grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.LIMIT_EXCEEDED, str(self))


class Slots:
    """Concurrent holders per key (an identity) and in total; a refused acquire holds nothing."""

    def __init__(self, what: str, *, per_key: int, total: int) -> None:
        self.what = what
        self.per_key = per_key
        self.total = total
        self._held: dict[Hashable, int] = {}
        self._count = 0

    @property
    def in_use(self) -> int:
        return self._count

    def acquire(self, key: Hashable) -> None:
        """Takes one slot for `key`; raises LimitExceeded naming the bound that was hit."""
        if self._count >= self.total:
            raise LimitExceeded(f"too many {self.what} open (at most {self.total}); retry later")
        held = self._held.get(key, 0)
        if held >= self.per_key:
            raise LimitExceeded(f"{key} already has {held} {self.what} open (at most {self.per_key})")
        self._held[key] = held + 1
        self._count += 1

    def release(self, key: Hashable) -> None:
        """Returns a slot taken by acquire(key)."""
        held = self._held.get(key, 0)
        if held <= 0:
            return
        self._count -= 1
        if held == 1:
            del self._held[key]  # keys leave with their last slot: the table never outgrows the holders
        else:
            self._held[key] = held - 1

    def hold(self, key: Hashable) -> _Held:
        """`with slots.hold(key):` acquires (or raises) and always releases."""
        self.acquire(key)
        return _Held(self, key)


@dataclass
class _Held:
    slots: Slots
    key: Hashable

    def __enter__(self) -> _Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.slots.release(self.key)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteBoundedCache(Generic[K, V]):
    """An LRU map bounded by the total size of its entries (as `size_of` measures them), not their count."""

    def __init__(self, max_bytes: int, size_of: Callable[[K, V], int]) -> None:
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        hit = self._items.get(key)
        if hit is None:
            return None
        self._items.move_to_end(key)
        return hit[0]

    def put(self, key: K, value: V) -> None:
        """Stores `value`, evicting the least recently used entries until the total fits."""
        self.pop(key)
        size = self._size_of(key, value)
        if size > self.max_bytes:
            return  # larger than the whole cache: not worth keeping
        self._items[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _k, (_v, s) = self._items.popitem(last=False)
            self.bytes -= s

    def pop(self, key: K) -> V | None:
        hit = self._items.pop(key, None)
        if hit is None:
            return None
        self.bytes -= hit[1]
        return hit[0]


class _SizeCaps(CheckingInterceptor):
    """See size_cap_interceptor."""

    def __init__(self) -> None:
        super().__init__(self._by_byte_size)

    def check_for(self, handler: Handler) -> Check | None:
        if not isinstance(handler.request_deserializer, SizedDeserializer):
            return self._by_byte_size
        # Measured as received: only an Oversized (unary) is left to refuse; a client stream's
        # servicer refuses its own.
        return None if handler.request_streaming else self._oversized

    @staticmethod
    async def _by_byte_size(method: str, request: object | None, context: Context) -> None:
        if request is None:
            return
        try:
            check_size(method, request)
        except LimitExceeded as exc:
            await context.abort_with_status(exc.status())

    @staticmethod
    async def _oversized(method: str, request: object | None, context: Context) -> None:
        if type(request) is Oversized:
            await context.abort_with_status(too_large(method, request.size).status())


def size_cap_interceptor() -> grpc.aio.ServerInterceptor:
    """Refuses a unary request larger than its RPC's cap (RESOURCE_EXHAUSTED, LIMIT_EXCEEDED).

    A method registered with a SizedDeserializer (add_sized_servicer) was measured as received: an
    Oversized is refused, nothing is measured again. Other methods are measured with ByteSize().
    Client streams check each message with check_size() in their servicer.
    """
    return _SizeCaps()


@dataclass(frozen=True, slots=True)
class Oversized:
    """What a sized_deserializer returns, in place of decoding them, for received bytes larger
    than their RPC's cap: the servicer refuses it (check_size) before handling anything."""

    size: int
    """Bytes received."""
    data: bytes = field(default=b"", compare=False, repr=False)
    """The bytes themselves, for a servicer that must read a field of its reply from them (e.g.
    meshkit.wire.varint_field): the refusal of a renewal echoes its sequence."""


class SizedDeserializer:
    """A request deserializer for a client stream's messages that measures each by the bytes
    received (free: len) rather than by protobuf's ByteSize() after decoding (a walk of the whole
    message, per message): larger than `method`'s cap, it is not decoded and an Oversized comes
    instead. The received length is what the peer sent, so it also holds for encodings that
    decode smaller than they arrive (unpacked repeated fields, duplicate fields)."""

    __slots__ = ("__self__", "_cap")

    def __init__(self, method: str, message_type: type[Message]) -> None:
        self.__self__ = message_type
        """The message class, named as a bound FromString names it: meshkit.wire.ParseRequests
        then parses with this deserializer too (INVALID_ARGUMENT for bytes that do not parse)."""
        self._cap = message_cap(method)

    def __call__(self, data: bytes) -> Any:
        if len(data) > self._cap:
            return Oversized(len(data), data)
        return self.__self__.FromString(data)


def sized_deserializer(method: str, message_type: type[Message]) -> SizedDeserializer:
    """See SizedDeserializer."""
    return SizedDeserializer(method, message_type)


def add_sized_servicer(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Registers every method of `service` on `server`, served by `servicer`'s method of the same
    name (as the generated add_*Servicer_to_server does), with a SizedDeserializer for each: every
    request is measured by the bytes received, and one over its method's cap is not decoded (an
    Oversized comes instead). The size-cap interceptor refuses a unary one; a client stream's
    servicer must refuse its own (check_size) before reading any field."""
    handlers = {}
    for method in service.methods:
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=SizedDeserializer(
                f"/{service.full_name}/{method.name}", message_factory.GetMessageClass(method.input_type)
            ),
            response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def too_large(method: str, size: int) -> LimitExceeded:
    """The refusal of a request of `size` bytes for `method` (larger than its cap)."""
    return LimitExceeded(f"the request is {size} bytes; {method} accepts at most {message_cap(method)}")


def check_size(method: str, message: object) -> None:
    """Raises LimitExceeded when `message` (a protobuf message, or an Oversized) is larger than
    `method`'s cap."""
    size = message.size if isinstance(message, Oversized) else message.ByteSize()  # type: ignore[attr-defined]
    if size > message_cap(method):
        raise too_large(method, size)


PAGE_BYTES = 4 * MIB
"""Largest page of a listing: half the message limit, so a page of the largest items always fits."""


def fitting(messages: Sequence[Message], budget: int = PAGE_BYTES) -> int:
    """How many of `messages` (protobuf messages) fit in `budget` bytes; at least one, so a page always moves on."""
    used = 0
    for i, message in enumerate(messages):
        used += message.ByteSize() + 8  # field tag and length prefix, at most
        if used > budget and i > 0:
            return i
    return len(messages)

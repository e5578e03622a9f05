import datetime

from google.protobuf import any_pb2 as _any_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WATCH_EVENT_TYPE_UNSPECIFIED: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_ADDED: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_UPDATED: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_REMOVED: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_SNAPSHOT_DONE: _ClassVar[WatchEventType]

class RemovalReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REMOVAL_REASON_UNSPECIFIED: _ClassVar[RemovalReason]
    REMOVAL_REASON_LEASE_EXPIRED: _ClassVar[RemovalReason]
    REMOVAL_REASON_UNREGISTERED: _ClassVar[RemovalReason]
    REMOVAL_REASON_REMOVED: _ClassVar[RemovalReason]
    REMOVAL_REASON_DRAINED: _ClassVar[RemovalReason]

class FrontendProtocol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRONTEND_PROTOCOL_UNSPECIFIED: _ClassVar[FrontendProtocol]
    FRONTEND_PROTOCOL_MESH_GRPC: _ClassVar[FrontendProtocol]
    FRONTEND_PROTOCOL_OPENAI_HTTP: _ClassVar[FrontendProtocol]
WATCH_EVENT_TYPE_UNSPECIFIED: WatchEventType
WATCH_EVENT_TYPE_ADDED: WatchEventType
WATCH_EVENT_TYPE_UPDATED: WatchEventType
WATCH_EVENT_TYPE_REMOVED: WatchEventType
WATCH_EVENT_TYPE_SNAPSHOT_DONE: WatchEventType
REMOVAL_REASON_UNSPECIFIED: RemovalReason
REMOVAL_REASON_LEASE_EXPIRED: RemovalReason
REMOVAL_REASON_UNREGISTERED: RemovalReason
REMOVAL_REASON_REMOVED: RemovalReason
REMOVAL_REASON_DRAINED: RemovalReason
FRONTEND_PROTOCOL_UNSPECIFIED: FrontendProtocol
FRONTEND_PROTOCOL_MESH_GRPC: FrontendProtocol
FRONTEND_PROTOCOL_OPENAI_HTTP: FrontendProtocol

class PoolCapacity(_message.Message):
    __slots__ = ("max_running_requests", "kv_cache_blocks", "prefill_tokens_per_second")
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    max_running_requests: int
    kv_cache_blocks: int
    prefill_tokens_per_second: int
    def __init__(self, max_running_requests: _Optional[int] = ..., kv_cache_blocks: _Optional[int] = ..., prefill_tokens_per_second: _Optional[int] = ...) -> None: ...

class PoolLease(_message.Message):
    __slots__ = ("relay_id", "incarnation", "frontends", "expire_time", "draining")
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    relay_id: str
    incarnation: int
    frontends: _containers.RepeatedScalarFieldContainer[str]
    expire_time: _timestamp_pb2.Timestamp
    draining: bool
    def __init__(self, relay_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., frontends: _Optional[_Iterable[str]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., draining: _Optional[bool] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("pool_id", "model", "region", "frontends", "draining", "drain_deadline", "capacity", "capabilities", "leases", "create_time", "revision", "frontend_protocol")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DRAIN_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    model: str
    region: str
    frontends: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    drain_deadline: _timestamp_pb2.Timestamp
    capacity: PoolCapacity
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    leases: _containers.RepeatedCompositeFieldContainer[PoolLease]
    create_time: _timestamp_pb2.Timestamp
    revision: int
    frontend_protocol: FrontendProtocol
    def __init__(self, pool_id: _Optional[str] = ..., model: _Optional[str] = ..., region: _Optional[str] = ..., frontends: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., drain_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., capacity: _Optional[_Union[PoolCapacity, _Mapping]] = ..., capabilities: _Optional[_Iterable[str]] = ..., leases: _Optional[_Iterable[_Union[PoolLease, _Mapping]]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revision: _Optional[int] = ..., frontend_protocol: _Optional[_Union[FrontendProtocol, str]] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("pool_id", "model", "region", "frontends", "relay_id", "incarnation", "capacity", "capabilities", "draining", "drain_deadline", "frontend_protocol")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DRAIN_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    model: str
    region: str
    frontends: _containers.RepeatedScalarFieldContainer[str]
    relay_id: str
    incarnation: int
    capacity: PoolCapacity
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    drain_deadline: _timestamp_pb2.Timestamp
    frontend_protocol: FrontendProtocol
    def __init__(self, pool_id: _Optional[str] = ..., model: _Optional[str] = ..., region: _Optional[str] = ..., frontends: _Optional[_Iterable[str]] = ..., relay_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., capacity: _Optional[_Union[PoolCapacity, _Mapping]] = ..., capabilities: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., drain_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., frontend_protocol: _Optional[_Union[FrontendProtocol, str]] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("heartbeat_interval", "lease_duration", "lease_expire_time", "frontends", "drain_requested", "drain_deadline", "pool")
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    DRAIN_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval: _duration_pb2.Duration
    lease_duration: _duration_pb2.Duration
    lease_expire_time: _timestamp_pb2.Timestamp
    frontends: _containers.RepeatedCompositeFieldContainer[Frontend]
    drain_requested: bool
    drain_deadline: _timestamp_pb2.Timestamp
    pool: Pool
    def __init__(self, heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., frontends: _Optional[_Iterable[_Union[Frontend, _Mapping]]] = ..., drain_requested: _Optional[bool] = ..., drain_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., pool: _Optional[_Union[Pool, _Mapping]] = ...) -> None: ...

class KeepAlivePoolsRequest(_message.Message):
    __slots__ = ("register", "sequence")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    register: RegisterPoolRequest
    sequence: int
    def __init__(self, register: _Optional[_Union[RegisterPoolRequest, _Mapping]] = ..., sequence: _Optional[int] = ...) -> None: ...

class KeepAlivePoolsResponse(_message.Message):
    __slots__ = ("sequence", "register", "error", "status")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    register: RegisterPoolResponse
    error: KeepAliveError
    status: _status_pb2.Status
    def __init__(self, sequence: _Optional[int] = ..., register: _Optional[_Union[RegisterPoolResponse, _Mapping]] = ..., error: _Optional[_Union[KeepAliveError, _Mapping]] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class KeepAliveError(_message.Message):
    __slots__ = ("code", "message", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    details: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., details: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...

class UnregisterPoolRequest(_message.Message):
    __slots__ = ("pool_id", "relay_id", "incarnation", "reason")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    relay_id: str
    incarnation: int
    reason: RemovalReason
    def __init__(self, pool_id: _Optional[str] = ..., relay_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., reason: _Optional[_Union[RemovalReason, str]] = ...) -> None: ...

class UnregisterPoolResponse(_message.Message):
    __slots__ = ("pool_removed",)
    POOL_REMOVED_FIELD_NUMBER: _ClassVar[int]
    pool_removed: bool
    def __init__(self, pool_removed: _Optional[bool] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ("model", "region", "page_size", "page_token")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    region: str
    page_size: int
    page_token: str
    def __init__(self, model: _Optional[str] = ..., region: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools", "next_page_token", "complete")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    next_page_token: str
    complete: bool
    def __init__(self, pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., complete: _Optional[bool] = ...) -> None: ...

class WatchPoolsRequest(_message.Message):
    __slots__ = ("model", "region", "start_revision")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    START_REVISION_FIELD_NUMBER: _ClassVar[int]
    model: str
    region: str
    start_revision: int
    def __init__(self, model: _Optional[str] = ..., region: _Optional[str] = ..., start_revision: _Optional[int] = ...) -> None: ...

class WatchPoolsResponse(_message.Message):
    __slots__ = ("type", "pool", "removal_reason", "complete", "revision", "resumed")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    REMOVAL_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    type: WatchEventType
    pool: Pool
    removal_reason: RemovalReason
    complete: bool
    revision: int
    resumed: bool
    def __init__(self, type: _Optional[_Union[WatchEventType, str]] = ..., pool: _Optional[_Union[Pool, _Mapping]] = ..., removal_reason: _Optional[_Union[RemovalReason, str]] = ..., complete: _Optional[bool] = ..., revision: _Optional[int] = ..., resumed: _Optional[bool] = ...) -> None: ...

class DrainPoolRequest(_message.Message):
    __slots__ = ("pool_id", "timeout")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    timeout: _duration_pb2.Duration
    def __init__(self, pool_id: _Optional[str] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class DrainPoolResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: Pool
    def __init__(self, pool: _Optional[_Union[Pool, _Mapping]] = ...) -> None: ...

class RemovePoolRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class RemovePoolResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: Pool
    def __init__(self, pool: _Optional[_Union[Pool, _Mapping]] = ...) -> None: ...

class Frontend(_message.Message):
    __slots__ = ("frontend_id", "url", "region", "incarnation", "expire_time")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    url: str
    region: str
    incarnation: int
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, frontend_id: _Optional[str] = ..., url: _Optional[str] = ..., region: _Optional[str] = ..., incarnation: _Optional[int] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RegisterFrontendRequest(_message.Message):
    __slots__ = ("frontend_id", "url", "region", "incarnation")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    url: str
    region: str
    incarnation: int
    def __init__(self, frontend_id: _Optional[str] = ..., url: _Optional[str] = ..., region: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class RegisterFrontendResponse(_message.Message):
    __slots__ = ("heartbeat_interval", "lease_duration", "lease_expire_time")
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_DURATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval: _duration_pb2.Duration
    lease_duration: _duration_pb2.Duration
    lease_expire_time: _timestamp_pb2.Timestamp
    def __init__(self, heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class UnregisterFrontendRequest(_message.Message):
    __slots__ = ("frontend_id", "incarnation")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    incarnation: int
    def __init__(self, frontend_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class UnregisterFrontendResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListFrontendsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListFrontendsResponse(_message.Message):
    __slots__ = ("frontends", "next_page_token", "complete")
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    frontends: _containers.RepeatedCompositeFieldContainer[Frontend]
    next_page_token: str
    complete: bool
    def __init__(self, frontends: _Optional[_Iterable[_Union[Frontend, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., complete: _Optional[bool] = ...) -> None: ...

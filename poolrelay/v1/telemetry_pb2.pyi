import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from poolrelay.v1 import pool_events_pb2 as _pool_events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HashScheme(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HASH_SCHEME_UNSPECIFIED: _ClassVar[HashScheme]
    HASH_SCHEME_XXH3_64_CHAINED_U32LE: _ClassVar[HashScheme]
HASH_SCHEME_UNSPECIFIED: HashScheme
HASH_SCHEME_XXH3_64_CHAINED_U32LE: HashScheme

class TelemetryHello(_message.Message):
    __slots__ = ("pool_id", "relay_id", "incarnation", "protocol_version", "block_size", "hash_scheme", "report_interval", "model", "region")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    relay_id: str
    incarnation: int
    protocol_version: int
    block_size: int
    hash_scheme: HashScheme
    report_interval: _duration_pb2.Duration
    model: str
    region: str
    def __init__(self, pool_id: _Optional[str] = ..., relay_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., protocol_version: _Optional[int] = ..., block_size: _Optional[int] = ..., hash_scheme: _Optional[_Union[HashScheme, str]] = ..., report_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., model: _Optional[str] = ..., region: _Optional[str] = ...) -> None: ...

class KvSnapshot(_message.Message):
    __slots__ = ("snapshot_id", "sequence", "chunk_index", "last", "block_hashes")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    sequence: int
    chunk_index: int
    last: bool
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, snapshot_id: _Optional[int] = ..., sequence: _Optional[int] = ..., chunk_index: _Optional[int] = ..., last: _Optional[bool] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KvDelta(_message.Message):
    __slots__ = ("sequence", "stored", "removed")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence: _Optional[int] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("load", "observe_time")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_TIME_FIELD_NUMBER: _ClassVar[int]
    load: _pool_events_pb2.PoolLoad
    observe_time: _timestamp_pb2.Timestamp
    def __init__(self, load: _Optional[_Union[_pool_events_pb2.PoolLoad, _Mapping]] = ..., observe_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReadinessReport(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_pool_events_pb2.ModelStatus]
    def __init__(self, models: _Optional[_Iterable[_Union[_pool_events_pb2.ModelStatus, _Mapping]]] = ...) -> None: ...

class DrainReport(_message.Message):
    __slots__ = ("drain",)
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    drain: _pool_events_pb2.DrainStatus
    def __init__(self, drain: _Optional[_Union[_pool_events_pb2.DrainStatus, _Mapping]] = ...) -> None: ...

class TelemetryHeartbeat(_message.Message):
    __slots__ = ("send_time",)
    SEND_TIME_FIELD_NUMBER: _ClassVar[int]
    send_time: _timestamp_pb2.Timestamp
    def __init__(self, send_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PublishPoolTelemetryRequest(_message.Message):
    __slots__ = ("hello", "kv_snapshot", "kv_delta", "load", "readiness", "drain", "heartbeat", "batch")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    KV_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    KV_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    READINESS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    hello: TelemetryHello
    kv_snapshot: KvSnapshot
    kv_delta: KvDelta
    load: LoadReport
    readiness: ReadinessReport
    drain: DrainReport
    heartbeat: TelemetryHeartbeat
    batch: TelemetryBatch
    def __init__(self, hello: _Optional[_Union[TelemetryHello, _Mapping]] = ..., kv_snapshot: _Optional[_Union[KvSnapshot, _Mapping]] = ..., kv_delta: _Optional[_Union[KvDelta, _Mapping]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., readiness: _Optional[_Union[ReadinessReport, _Mapping]] = ..., drain: _Optional[_Union[DrainReport, _Mapping]] = ..., heartbeat: _Optional[_Union[TelemetryHeartbeat, _Mapping]] = ..., batch: _Optional[_Union[TelemetryBatch, _Mapping]] = ...) -> None: ...

class TelemetryBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[PublishPoolTelemetryRequest]
    def __init__(self, messages: _Optional[_Iterable[_Union[PublishPoolTelemetryRequest, _Mapping]]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class TelemetryHelloAck(_message.Message):
    __slots__ = ("frontend_id", "accepts_batches", "batch_interval")
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCH_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    frontend_id: str
    accepts_batches: bool
    batch_interval: _duration_pb2.Duration
    def __init__(self, frontend_id: _Optional[str] = ..., accepts_batches: _Optional[bool] = ..., batch_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class PublishPoolTelemetryResponse(_message.Message):
    __slots__ = ("hello_ack", "snapshot_request")
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    hello_ack: TelemetryHelloAck
    snapshot_request: SnapshotRequest
    def __init__(self, hello_ack: _Optional[_Union[TelemetryHelloAck, _Mapping]] = ..., snapshot_request: _Optional[_Union[SnapshotRequest, _Mapping]] = ...) -> None: ...

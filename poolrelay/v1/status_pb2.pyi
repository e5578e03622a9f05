import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UnregisteredReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNREGISTERED_REASON_UNSPECIFIED: _ClassVar[UnregisteredReason]
    UNREGISTERED_REASON_NO_MODEL: _ClassVar[UnregisteredReason]
    UNREGISTERED_REASON_SEVERAL_MODELS: _ClassVar[UnregisteredReason]
    UNREGISTERED_REASON_CALL_FAILED: _ClassVar[UnregisteredReason]
    UNREGISTERED_REASON_RELAY_STOPPED: _ClassVar[UnregisteredReason]
    UNREGISTERED_REASON_POOL_UNREACHABLE: _ClassVar[UnregisteredReason]
    UNREGISTERED_REASON_POOL_DRAINED: _ClassVar[UnregisteredReason]

class TelemetryStreamState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TELEMETRY_STREAM_STATE_UNSPECIFIED: _ClassVar[TelemetryStreamState]
    TELEMETRY_STREAM_STATE_CONNECTING: _ClassVar[TelemetryStreamState]
    TELEMETRY_STREAM_STATE_STREAMING: _ClassVar[TelemetryStreamState]
    TELEMETRY_STREAM_STATE_BACKING_OFF: _ClassVar[TelemetryStreamState]
    TELEMETRY_STREAM_STATE_CLOSED: _ClassVar[TelemetryStreamState]
    TELEMETRY_STREAM_STATE_REFUSED: _ClassVar[TelemetryStreamState]
UNREGISTERED_REASON_UNSPECIFIED: UnregisteredReason
UNREGISTERED_REASON_NO_MODEL: UnregisteredReason
UNREGISTERED_REASON_SEVERAL_MODELS: UnregisteredReason
UNREGISTERED_REASON_CALL_FAILED: UnregisteredReason
UNREGISTERED_REASON_RELAY_STOPPED: UnregisteredReason
UNREGISTERED_REASON_POOL_UNREACHABLE: UnregisteredReason
UNREGISTERED_REASON_POOL_DRAINED: UnregisteredReason
TELEMETRY_STREAM_STATE_UNSPECIFIED: TelemetryStreamState
TELEMETRY_STREAM_STATE_CONNECTING: TelemetryStreamState
TELEMETRY_STREAM_STATE_STREAMING: TelemetryStreamState
TELEMETRY_STREAM_STATE_BACKING_OFF: TelemetryStreamState
TELEMETRY_STREAM_STATE_CLOSED: TelemetryStreamState
TELEMETRY_STREAM_STATE_REFUSED: TelemetryStreamState

class GetRelayStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TelemetryStreamStatus(_message.Message):
    __slots__ = ("frontend_url", "state", "last_error", "messages_sent", "queue_depth", "connects", "snapshots_sent", "messages_dropped")
    FRONTEND_URL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    CONNECTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_SENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    frontend_url: str
    state: TelemetryStreamState
    last_error: str
    messages_sent: int
    queue_depth: int
    connects: int
    snapshots_sent: int
    messages_dropped: int
    def __init__(self, frontend_url: _Optional[str] = ..., state: _Optional[_Union[TelemetryStreamState, str]] = ..., last_error: _Optional[str] = ..., messages_sent: _Optional[int] = ..., queue_depth: _Optional[int] = ..., connects: _Optional[int] = ..., snapshots_sent: _Optional[int] = ..., messages_dropped: _Optional[int] = ...) -> None: ...

class GetRelayStatusResponse(_message.Message):
    __slots__ = ("healthy", "pool_id", "relay_id", "incarnation", "registered_model", "lease_expire_time", "routing_pool_unregistered_reason", "routing_pool_unregistered_detail", "telemetry_streams", "pool_blocks", "draining", "engine_workers")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_MODEL_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    ROUTING_POOL_UNREGISTERED_REASON_FIELD_NUMBER: _ClassVar[int]
    ROUTING_POOL_UNREGISTERED_DETAIL_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_STREAMS_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    pool_id: str
    relay_id: str
    incarnation: int
    registered_model: str
    lease_expire_time: _timestamp_pb2.Timestamp
    routing_pool_unregistered_reason: UnregisteredReason
    routing_pool_unregistered_detail: str
    telemetry_streams: _containers.RepeatedCompositeFieldContainer[TelemetryStreamStatus]
    pool_blocks: int
    draining: bool
    engine_workers: _containers.RepeatedCompositeFieldContainer[EngineWorkerStatus]
    def __init__(self, healthy: _Optional[bool] = ..., pool_id: _Optional[str] = ..., relay_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., registered_model: _Optional[str] = ..., lease_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., routing_pool_unregistered_reason: _Optional[_Union[UnregisteredReason, str]] = ..., routing_pool_unregistered_detail: _Optional[str] = ..., telemetry_streams: _Optional[_Iterable[_Union[TelemetryStreamStatus, _Mapping]]] = ..., pool_blocks: _Optional[int] = ..., draining: _Optional[bool] = ..., engine_workers: _Optional[_Iterable[_Union[EngineWorkerStatus, _Mapping]]] = ...) -> None: ...

class EngineWorkerStatus(_message.Message):
    __slots__ = ("worker_id", "url", "healthy", "last_error", "consecutive_failures", "kv_event_batches", "kv_events_applied", "gaps", "replays_asked", "replays_closed", "replayed_batches", "resets", "last_reset_reason", "malformed_dropped", "duplicates_skipped", "last_sequence", "blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_ASKED_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    RESETS_FIELD_NUMBER: _ClassVar[int]
    LAST_RESET_REASON_FIELD_NUMBER: _ClassVar[int]
    MALFORMED_DROPPED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    url: str
    healthy: bool
    last_error: str
    consecutive_failures: int
    kv_event_batches: int
    kv_events_applied: int
    gaps: int
    replays_asked: int
    replays_closed: int
    replayed_batches: int
    resets: int
    last_reset_reason: str
    malformed_dropped: int
    duplicates_skipped: int
    last_sequence: int
    blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., url: _Optional[str] = ..., healthy: _Optional[bool] = ..., last_error: _Optional[str] = ..., consecutive_failures: _Optional[int] = ..., kv_event_batches: _Optional[int] = ..., kv_events_applied: _Optional[int] = ..., gaps: _Optional[int] = ..., replays_asked: _Optional[int] = ..., replays_closed: _Optional[int] = ..., replayed_batches: _Optional[int] = ..., resets: _Optional[int] = ..., last_reset_reason: _Optional[str] = ..., malformed_dropped: _Optional[int] = ..., duplicates_skipped: _Optional[int] = ..., last_sequence: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_READY: _ClassVar[ModelState]
    MODEL_STATE_NOT_READY: _ClassVar[ModelState]

class DrainState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAIN_STATE_UNSPECIFIED: _ClassVar[DrainState]
    DRAIN_STATE_ACTIVE: _ClassVar[DrainState]
    DRAIN_STATE_DRAINING: _ClassVar[DrainState]
    DRAIN_STATE_DRAINED: _ClassVar[DrainState]
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_NOT_READY: ModelState
DRAIN_STATE_UNSPECIFIED: DrainState
DRAIN_STATE_ACTIVE: DrainState
DRAIN_STATE_DRAINING: DrainState
DRAIN_STATE_DRAINED: DrainState

class WatchPoolStatusRequest(_message.Message):
    __slots__ = ("interval",)
    INTERVAL_FIELD_NUMBER: _ClassVar[int]
    interval: _duration_pb2.Duration
    def __init__(self, interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("model", "state", "adapters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    state: ModelState
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "kv_blocks_total", "kv_blocks_used", "requests_running", "max_running_requests")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kv_blocks_total: int
    kv_blocks_used: int
    requests_running: int
    max_running_requests: int
    def __init__(self, worker_id: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., requests_running: _Optional[int] = ..., max_running_requests: _Optional[int] = ...) -> None: ...

class PoolLoad(_message.Message):
    __slots__ = ("requests_waiting", "requests_running", "prefill_tokens_in_flight", "kv_blocks_used", "kv_blocks_total", "max_running_requests", "max_waiting_requests", "decode_tokens_in_flight")
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    requests_waiting: int
    requests_running: int
    prefill_tokens_in_flight: int
    kv_blocks_used: int
    kv_blocks_total: int
    max_running_requests: int
    max_waiting_requests: int
    decode_tokens_in_flight: int
    def __init__(self, requests_waiting: _Optional[int] = ..., requests_running: _Optional[int] = ..., prefill_tokens_in_flight: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., max_waiting_requests: _Optional[int] = ..., decode_tokens_in_flight: _Optional[int] = ...) -> None: ...

class DrainStatus(_message.Message):
    __slots__ = ("state", "deadline")
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    state: DrainState
    deadline: _timestamp_pb2.Timestamp
    def __init__(self, state: _Optional[_Union[DrainState, str]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WatchPoolStatusResponse(_message.Message):
    __slots__ = ("models", "workers", "load", "drain", "block_size", "pool_id", "sequence", "prefill_tokens_per_second")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    load: PoolLoad
    drain: DrainStatus
    block_size: int
    pool_id: str
    sequence: int
    prefill_tokens_per_second: int
    def __init__(self, models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., load: _Optional[_Union[PoolLoad, _Mapping]] = ..., drain: _Optional[_Union[DrainStatus, _Mapping]] = ..., block_size: _Optional[int] = ..., pool_id: _Optional[str] = ..., sequence: _Optional[int] = ..., prefill_tokens_per_second: _Optional[int] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerKvSnapshot(_message.Message):
    __slots__ = ("worker_id", "event_id", "block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    event_id: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., event_id: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerKvEvent(_message.Message):
    __slots__ = ("worker_id", "event_id", "stored", "removed", "cleared")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    event_id: int
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    cleared: bool
    def __init__(self, worker_id: _Optional[str] = ..., event_id: _Optional[int] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., cleared: _Optional[bool] = ...) -> None: ...

class WatchKvEventsResponse(_message.Message):
    __slots__ = ("snapshot", "event")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    snapshot: WorkerKvSnapshot
    event: WorkerKvEvent
    def __init__(self, snapshot: _Optional[_Union[WorkerKvSnapshot, _Mapping]] = ..., event: _Optional[_Union[WorkerKvEvent, _Mapping]] = ...) -> None: ...

class StartDrainRequest(_message.Message):
    __slots__ = ("timeout", "reason")
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    timeout: _duration_pb2.Duration
    reason: str
    def __init__(self, timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class StartDrainResponse(_message.Message):
    __slots__ = ("drain",)
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    drain: DrainStatus
    def __init__(self, drain: _Optional[_Union[DrainStatus, _Mapping]] = ...) -> None: ...

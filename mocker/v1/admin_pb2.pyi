import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SetModelReadyRequest(_message.Message):
    __slots__ = ("model", "ready")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    model: str
    ready: bool
    def __init__(self, model: _Optional[str] = ..., ready: _Optional[bool] = ...) -> None: ...

class SetModelReadyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetFaultsRequest(_message.Message):
    __slots__ = ("fail_after_tokens", "added_latency", "refuse_all", "stall_after_tokens")
    FAIL_AFTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADDED_LATENCY_FIELD_NUMBER: _ClassVar[int]
    REFUSE_ALL_FIELD_NUMBER: _ClassVar[int]
    STALL_AFTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    fail_after_tokens: int
    added_latency: _duration_pb2.Duration
    refuse_all: bool
    stall_after_tokens: int
    def __init__(self, fail_after_tokens: _Optional[int] = ..., added_latency: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., refuse_all: _Optional[bool] = ..., stall_after_tokens: _Optional[int] = ...) -> None: ...

class SetFaultsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerBlocksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerBlocks(_message.Message):
    __slots__ = ("worker_id", "block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class GetWorkerBlocksResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerBlocks]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerBlocks, _Mapping]]] = ...) -> None: ...

class GetPoolStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPoolStatsResponse(_message.Message):
    __slots__ = ("requests_admitted", "requests_refused", "requests_finished", "requests_handed_back", "prompt_blocks", "cached_blocks", "tokens_generated")
    REQUESTS_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    requests_admitted: int
    requests_refused: int
    requests_finished: int
    requests_handed_back: int
    prompt_blocks: int
    cached_blocks: int
    tokens_generated: int
    def __init__(self, requests_admitted: _Optional[int] = ..., requests_refused: _Optional[int] = ..., requests_finished: _Optional[int] = ..., requests_handed_back: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., tokens_generated: _Optional[int] = ...) -> None: ...

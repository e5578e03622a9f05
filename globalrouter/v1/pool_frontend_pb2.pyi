from globalrouter.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolFinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_FINISH_REASON_UNSPECIFIED: _ClassVar[PoolFinishReason]
    POOL_FINISH_REASON_LENGTH: _ClassVar[PoolFinishReason]
    POOL_FINISH_REASON_STOP: _ClassVar[PoolFinishReason]
POOL_FINISH_REASON_UNSPECIFIED: PoolFinishReason
POOL_FINISH_REASON_LENGTH: PoolFinishReason
POOL_FINISH_REASON_STOP: PoolFinishReason

class PoolFrontendServiceGenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "token_ids", "max_tokens", "sampling", "combine_messages", "queue_updates", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMBINE_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_UPDATES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: _sampling_pb2.SamplingParams
    combine_messages: bool
    queue_updates: bool
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., combine_messages: _Optional[bool] = ..., queue_updates: _Optional[bool] = ..., adapter: _Optional[str] = ...) -> None: ...

class PoolAdmission(_message.Message):
    __slots__ = ("worker_id", "cached_blocks", "prompt_blocks", "tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    cached_blocks: int
    prompt_blocks: int
    tokens: PoolTokens
    def __init__(self, worker_id: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., tokens: _Optional[_Union[PoolTokens, _Mapping]] = ...) -> None: ...

class PoolTokens(_message.Message):
    __slots__ = ("token_ids", "finish")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish: PoolFinish
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish: _Optional[_Union[PoolFinish, _Mapping]] = ...) -> None: ...

class PoolQueued(_message.Message):
    __slots__ = ("position",)
    POSITION_FIELD_NUMBER: _ClassVar[int]
    position: int
    def __init__(self, position: _Optional[int] = ...) -> None: ...

class PoolFinish(_message.Message):
    __slots__ = ("reason", "tokens_generated", "cached_tokens")
    REASON_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reason: PoolFinishReason
    tokens_generated: int
    cached_tokens: int
    def __init__(self, reason: _Optional[_Union[PoolFinishReason, str]] = ..., tokens_generated: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class PoolFrontendServiceGenerateResponse(_message.Message):
    __slots__ = ("admission", "tokens", "finish", "queued")
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    admission: PoolAdmission
    tokens: PoolTokens
    finish: PoolFinish
    queued: PoolQueued
    def __init__(self, admission: _Optional[_Union[PoolAdmission, _Mapping]] = ..., tokens: _Optional[_Union[PoolTokens, _Mapping]] = ..., finish: _Optional[_Union[PoolFinish, _Mapping]] = ..., queued: _Optional[_Union[PoolQueued, _Mapping]] = ...) -> None: ...

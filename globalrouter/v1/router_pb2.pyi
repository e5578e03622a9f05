import datetime

from globalrouter.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]

class CachedTokensSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHED_TOKENS_SOURCE_UNSPECIFIED: _ClassVar[CachedTokensSource]
    CACHED_TOKENS_SOURCE_POOL: _ClassVar[CachedTokensSource]
    CACHED_TOKENS_SOURCE_ESTIMATE: _ClassVar[CachedTokensSource]

class DirectoryState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTORY_STATE_UNSPECIFIED: _ClassVar[DirectoryState]
    DIRECTORY_STATE_LISTED: _ClassVar[DirectoryState]
    DIRECTORY_STATE_LEASE_LAPSED: _ClassVar[DirectoryState]
    DIRECTORY_STATE_UNLISTED: _ClassVar[DirectoryState]

class FilterReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILTER_REASON_UNSPECIFIED: _ClassVar[FilterReason]
    FILTER_REASON_OTHER_MODEL: _ClassVar[FilterReason]
    FILTER_REASON_NOT_READY: _ClassVar[FilterReason]
    FILTER_REASON_DRAINING: _ClassVar[FilterReason]
    FILTER_REASON_NO_FRONTEND: _ClassVar[FilterReason]
    FILTER_REASON_LINK_BACKOFF: _ClassVar[FilterReason]
    FILTER_REASON_REGION_NOT_ALLOWED: _ClassVar[FilterReason]
    FILTER_REASON_ADAPTER_NOT_SERVED: _ClassVar[FilterReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
CACHED_TOKENS_SOURCE_UNSPECIFIED: CachedTokensSource
CACHED_TOKENS_SOURCE_POOL: CachedTokensSource
CACHED_TOKENS_SOURCE_ESTIMATE: CachedTokensSource
DIRECTORY_STATE_UNSPECIFIED: DirectoryState
DIRECTORY_STATE_LISTED: DirectoryState
DIRECTORY_STATE_LEASE_LAPSED: DirectoryState
DIRECTORY_STATE_UNLISTED: DirectoryState
FILTER_REASON_UNSPECIFIED: FilterReason
FILTER_REASON_OTHER_MODEL: FilterReason
FILTER_REASON_NOT_READY: FilterReason
FILTER_REASON_DRAINING: FilterReason
FILTER_REASON_NO_FRONTEND: FilterReason
FILTER_REASON_LINK_BACKOFF: FilterReason
FILTER_REASON_REGION_NOT_ALLOWED: FilterReason
FILTER_REASON_ADAPTER_NOT_SERVED: FilterReason

class Prompt(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: TokenIds
    text: str
    def __init__(self, token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "max_tokens", "request_id", "sampling", "combine_messages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMBINE_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: Prompt
    max_tokens: int
    request_id: str
    sampling: _sampling_pb2.SamplingParams
    combine_messages: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., max_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., combine_messages: _Optional[bool] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "offset", "pool_id", "summary")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    pool_id: str
    summary: GenerateSummary
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., pool_id: _Optional[str] = ..., summary: _Optional[_Union[GenerateSummary, _Mapping]] = ...) -> None: ...

class GenerateSummary(_message.Message):
    __slots__ = ("finish_reason", "pools", "cached_blocks", "prompt_blocks", "migrations", "tokens_generated", "refused_by", "request_id", "cached_tokens", "cached_tokens_source")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_BY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    pools: _containers.RepeatedScalarFieldContainer[str]
    cached_blocks: int
    prompt_blocks: int
    migrations: int
    tokens_generated: int
    refused_by: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    cached_tokens: int
    cached_tokens_source: CachedTokensSource
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., pools: _Optional[_Iterable[str]] = ..., cached_blocks: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., migrations: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., refused_by: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., cached_tokens_source: _Optional[_Union[CachedTokensSource, str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "summary")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    summary: GenerateSummary
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., summary: _Optional[_Union[GenerateSummary, _Mapping]] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("model", "prompt", "max_tokens", "max_candidates")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: Prompt
    max_tokens: int
    max_candidates: int
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., max_tokens: _Optional[int] = ..., max_candidates: _Optional[int] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("pool_id", "rank", "total_cost", "prefill_cost", "load_cost", "pending_cost", "cached_blocks", "prompt_blocks", "load_known", "region", "directory_state")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COST_FIELD_NUMBER: _ClassVar[int]
    LOAD_COST_FIELD_NUMBER: _ClassVar[int]
    PENDING_COST_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_KNOWN_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_STATE_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    rank: int
    total_cost: float
    prefill_cost: float
    load_cost: float
    pending_cost: float
    cached_blocks: int
    prompt_blocks: int
    load_known: bool
    region: str
    directory_state: DirectoryState
    def __init__(self, pool_id: _Optional[str] = ..., rank: _Optional[int] = ..., total_cost: _Optional[float] = ..., prefill_cost: _Optional[float] = ..., load_cost: _Optional[float] = ..., pending_cost: _Optional[float] = ..., cached_blocks: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., load_known: _Optional[bool] = ..., region: _Optional[str] = ..., directory_state: _Optional[_Union[DirectoryState, str]] = ...) -> None: ...

class FilteredPool(_message.Message):
    __slots__ = ("pool_id", "reason", "detail")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    reason: FilterReason
    detail: str
    def __init__(self, pool_id: _Optional[str] = ..., reason: _Optional[_Union[FilterReason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("candidates", "filtered", "prompt_blocks", "candidates_total")
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    filtered: _containers.RepeatedCompositeFieldContainer[FilteredPool]
    prompt_blocks: int
    candidates_total: int
    def __init__(self, candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., filtered: _Optional[_Iterable[_Union[FilteredPool, _Mapping]]] = ..., prompt_blocks: _Optional[int] = ..., candidates_total: _Optional[int] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ("model", "page_size", "page_token")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    page_size: int
    page_token: str
    def __init__(self, model: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class SignalFreshness(_message.Message):
    __slots__ = ("fresh", "age")
    FRESH_FIELD_NUMBER: _ClassVar[int]
    AGE_FIELD_NUMBER: _ClassVar[int]
    fresh: bool
    age: _duration_pb2.Duration
    def __init__(self, fresh: _Optional[bool] = ..., age: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class PoolLoadView(_message.Message):
    __slots__ = ("requests_waiting", "requests_running", "prefill_tokens_in_flight", "kv_blocks_used", "kv_blocks_total", "max_running_requests", "decode_tokens_in_flight")
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    requests_waiting: int
    requests_running: int
    prefill_tokens_in_flight: int
    kv_blocks_used: int
    kv_blocks_total: int
    max_running_requests: int
    decode_tokens_in_flight: int
    def __init__(self, requests_waiting: _Optional[int] = ..., requests_running: _Optional[int] = ..., prefill_tokens_in_flight: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., decode_tokens_in_flight: _Optional[int] = ...) -> None: ...

class PoolView(_message.Message):
    __slots__ = ("pool_id", "model", "region", "frontends", "draining", "ready", "load", "load_freshness", "kv_freshness", "state_freshness", "indexed_blocks", "telemetry_streams", "pending_requests", "listed", "frontend_protocol", "adapters", "directory_state", "lease_grace_left")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LOAD_FRESHNESS_FIELD_NUMBER: _ClassVar[int]
    KV_FRESHNESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FRESHNESS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_STREAMS_FIELD_NUMBER: _ClassVar[int]
    PENDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LISTED_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_GRACE_LEFT_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    model: str
    region: str
    frontends: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    ready: bool
    load: PoolLoadView
    load_freshness: SignalFreshness
    kv_freshness: SignalFreshness
    state_freshness: SignalFreshness
    indexed_blocks: int
    telemetry_streams: int
    pending_requests: int
    listed: bool
    frontend_protocol: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    directory_state: DirectoryState
    lease_grace_left: _duration_pb2.Duration
    def __init__(self, pool_id: _Optional[str] = ..., model: _Optional[str] = ..., region: _Optional[str] = ..., frontends: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., ready: _Optional[bool] = ..., load: _Optional[_Union[PoolLoadView, _Mapping]] = ..., load_freshness: _Optional[_Union[SignalFreshness, _Mapping]] = ..., kv_freshness: _Optional[_Union[SignalFreshness, _Mapping]] = ..., state_freshness: _Optional[_Union[SignalFreshness, _Mapping]] = ..., indexed_blocks: _Optional[int] = ..., telemetry_streams: _Optional[int] = ..., pending_requests: _Optional[int] = ..., listed: _Optional[bool] = ..., frontend_protocol: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., directory_state: _Optional[_Union[DirectoryState, str]] = ..., lease_grace_left: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools", "next_page_token")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolView]
    next_page_token: str
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolView, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

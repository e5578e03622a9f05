"""KV event messages encoded exactly the way vLLM 0.32 encodes them (msgspec structs, same options)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class BlockMoved(KVCacheEvent):
    """An event type this relay does not know (as a newer engine might add)."""

    block_hashes: list[bytes | int]


_encoder = msgspec.msgpack.Encoder()


def stored(
    hashes: Iterable[Any], parent: Any, tokens: Iterable[int], block_size: int = 32, **extra: Any
) -> BlockStored:
    """A BlockStored event (fields vLLM may add later pass through `extra`)."""
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=extra.pop("lora_id", None),
        medium=extra.pop("medium", "GPU"),
        lora_name=extra.pop("lora_name", None),
        **extra,
    )


def removed(hashes: Iterable[Any], medium: str = "GPU") -> BlockRemoved:
    """A BlockRemoved event."""
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def encode(*events: KVCacheEvent, ts: float = 1.0, rank: int | None = 0) -> bytes:
    """One batch payload as vLLM's ZmqEventPublisher sends it."""
    return _encoder.encode(EventBatch(ts=ts, events=list(events), data_parallel_rank=rank))

"""Decodes the engines' KV event batches (vLLM KVEventBatch, SGLang's copy of it) from msgpack (pure).

A batch is `(ts, events, data_parallel_rank)`, msgpack-encoded by msgspec: as an array (vLLM's
`array_like=True`) or, from older or other publishers, as a map. Each event is a tagged struct
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`): a map with a "type" field, or an array whose
first element is the tag. Only the fields the relay needs are read; fields added later are
ignored. An event of an unknown type is reported as such (not an error); a value of the wrong
shape raises Malformed, naming what is wrong.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import msgspec

# An engine's own block hash: an int (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, SGLang) or
# the digest bytes (vLLM's default). Never interpreted, only compared.
EngineHash = int | bytes

# Positional field order of the array forms, as the structs declare them (tag first for events).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
# Bounds on what one batch may carry (outside input: a hostile or broken publisher must not make
# the relay allocate without limit).
MAX_EVENTS_PER_BATCH = 100_000
MAX_TOKENS_PER_EVENT = 1_048_576
MAX_HASHES_PER_EVENT = 65_536
MAX_ADAPTER_NAME = 1024

_decoder = msgspec.msgpack.Decoder()


class Malformed(ValueError):
    """A message that does not have the shape of a KV event batch; the text says what is wrong."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the engine now caches: `token_ids` holds block_size tokens per hash, in order."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: array
    """Unsigned 32-bit token ids (array('I'))."""
    block_size: int
    medium: str | None = None
    group_idx: int | None = None
    adapter: str = ""
    """The LoRA adapter whose KV this is (vLLM's lora_name); "" for the base model's cache."""
    unnamed_adapter: bool = False
    """True when a LoRA adapter's KV comes without its name (lora_id alone, older engines): the
    relay cannot tell which adapter's it is."""
    extra_keys: tuple[bool, ...] = ()
    """Per block: True when the block's engine hash covers more than its tokens and its adapter's
    name (multimodal inputs, cache salt, prompt embeddings); empty when the event carries none."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine no longer caches."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (prefix cache reset)."""


@dataclass(frozen=True, slots=True)
class UnknownEvent:
    """An event of a type this relay does not know (a newer engine); its tag, for the count."""

    tag: str


Event = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(frozen=True, slots=True)
class Batch:
    """One decoded KV event batch."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None


def _hash(value: object, what: str) -> EngineHash:
    if isinstance(value, bool) or not isinstance(value, (int, bytes)):
        raise Malformed(f"{what} must be an integer or bytes, got {type(value).__name__}")
    return value


def _hashes(value: object, what: str) -> tuple[EngineHash, ...]:
    if not isinstance(value, list):
        raise Malformed(f"{what} must be a list, got {type(value).__name__}")
    if len(value) > MAX_HASHES_PER_EVENT:
        raise Malformed(f"{what} has {len(value)} entries (at most {MAX_HASHES_PER_EVENT})")
    return tuple(_hash(v, what) for v in value)


def _optional_int(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Malformed(f"{what} must be an integer or nil, got {type(value).__name__}")
    return value


def _optional_str(value: object, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise Malformed(f"{what} must be a string or nil, got {type(value).__name__}")


def _fields(raw: list | dict, names: tuple[str, ...], tag: str) -> dict:
    """The event's fields by name, from either form (array: positional after the tag)."""
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:], strict=False))


def _stored(f: dict) -> BlockStored:
    for name in ("block_hashes", "token_ids", "block_size"):
        if name not in f:
            raise Malformed(f"BlockStored lacks {name}")
    hashes = _hashes(f["block_hashes"], "BlockStored.block_hashes")
    parent = f.get("parent_block_hash")
    parent = None if parent is None else _hash(parent, "BlockStored.parent_block_hash")
    raw_tokens = f["token_ids"]
    if not isinstance(raw_tokens, list) or len(raw_tokens) > MAX_TOKENS_PER_EVENT:
        raise Malformed("BlockStored.token_ids must be a list of at most 1,048,576 token ids")
    try:
        # One C loop checks every id (an unsigned 32-bit integer) and packs them for hashing.
        tokens = array("I", raw_tokens)
    except (TypeError, OverflowError) as exc:
        raise Malformed(f"BlockStored.token_ids holds a value that is not a token id ({exc})") from None
    size = f["block_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise Malformed(f"BlockStored.block_size must be a positive integer, got {size!r}")
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise Malformed("BlockStored.extra_keys must be a list or nil")
    lora_name = _optional_str(f.get("lora_name"), "BlockStored.lora_name")
    if lora_name is not None and not 0 < len(lora_name) <= MAX_ADAPTER_NAME:
        raise Malformed(f"BlockStored.lora_name must be 1 to {MAX_ADAPTER_NAME} characters")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        medium=_optional_str(f.get("medium"), "BlockStored.medium"),
        group_idx=_optional_int(f.get("group_idx"), "BlockStored.group_idx"),
        adapter=lora_name or "",
        unnamed_adapter=lora_name is None and f.get("lora_id") is not None,
        # vLLM puts the adapter's name first in every block's extra keys: a block whose keys are
        # that name alone is the adapter's plain token block, hashed from the adapter's seed.
        extra_keys=tuple(_beyond_adapter(e, lora_name) for e in extra) if extra else (),
    )


def _beyond_adapter(keys: object, lora_name: str | None) -> bool:
    """Whether a block's extra keys hold more than its adapter's name."""
    if keys is None:
        return False
    return not (
        lora_name is not None and isinstance(keys, (list, tuple)) and len(keys) == 1 and keys[0] == lora_name
    )


def _removed(f: dict) -> BlockRemoved:
    if "block_hashes" not in f:
        raise Malformed("BlockRemoved lacks block_hashes")
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"], "BlockRemoved.block_hashes"),
        medium=_optional_str(f.get("medium"), "BlockRemoved.medium"),
        group_idx=_optional_int(f.get("group_idx"), "BlockRemoved.group_idx"),
    )


def decode_event(raw: object) -> Event:
    """One event from its decoded msgpack value (a tagged map or a tag-first array)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise Malformed(f"an event must be a tagged map or array, got {type(raw).__name__}")
    if not isinstance(tag, str):
        raise Malformed("an event's type tag must be a string")
    if tag == "BlockStored":
        return _stored(_fields(raw, _STORED_FIELDS, tag))
    if tag == "BlockRemoved":
        return _removed(_fields(raw, _REMOVED_FIELDS, tag))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(tag[:64])


def decode_batch(payload: bytes) -> Batch:
    """A KV event batch from its msgpack payload; raises Malformed for anything else."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise Malformed(f"not msgpack: {exc}") from None
    if isinstance(raw, list):
        if len(raw) < 2:
            raise Malformed("a batch array needs at least ts and events")
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "events" not in raw:
            raise Malformed("a batch map needs events")
        ts, events, rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise Malformed(f"a batch must be an array or a map, got {type(raw).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise Malformed("a batch's ts must be a number")
    if not isinstance(events, list):
        raise Malformed("a batch's events must be a list")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise Malformed(f"a batch carries {len(events)} events (at most {MAX_EVENTS_PER_BATCH})")
    return Batch(
        ts=float(ts),
        events=tuple(decode_event(e) for e in events),
        data_parallel_rank=_optional_int(rank, "data_parallel_rank"),
    )

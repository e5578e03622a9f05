"""KV block hashing that pools and routers must agree on (HASH_SCHEME_XXH3_64_CHAINED_U32LE).

A block's hash covers its parent's hash and its own tokens, so it stands for the whole prefix:
two prompts share a block hash at position i exactly when their first (i + 1) blocks are equal.
The chain of a prompt served under a LoRA adapter starts from the adapter's seed instead of 0.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

DEFAULT_BLOCK_SIZE = 16
_xxh3 = xxhash.xxh3_64_intdigest
# array('I') is the fast path to bytes, but its width and byte order are the platform's: use it
# only where it already is the contract's little-endian u32, and pack explicitly elsewhere.
_NATIVE_IS_U32LE = array("I").itemsize == 4 and sys.byteorder == "little"


def u32le(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as the contract's bytes: each a little-endian unsigned 32-bit integer."""
    if _NATIVE_IS_U32LE:
        if isinstance(tokens, array) and tokens.typecode == "I":
            return tokens.tobytes()
        if not isinstance(tokens, list) and hasattr(tokens, "__array__"):
            # A request's repeated uint32 field (protobuf's upb container) hands numpy its values
            # at once (3 us for 16k tokens), where array() takes them one by one (430 us). Only a
            # uint32 result is taken as is: any other dtype (a numpy int64 array, say) goes the
            # checked way below, which refuses a value outside uint32 instead of wrapping it.
            packed = np.asarray(tokens)
            if packed.dtype == np.uint32 and packed.ndim == 1:
                return packed.tobytes()
        return array("I", tokens).tobytes()
    return struct.pack(f"<{len(tokens)}I", *tokens)


def adapter_seed(adapter: str) -> int:
    """The parent hash an adapter's chain starts from: 0 for the base model (empty name), else a
    non-zero hash of the name, so the same tokens under another adapter (or none) never share a
    block hash: an adapter's KV cache holds other keys and values than the base model's."""
    if not adapter:
        return 0
    return _xxh3(b"meshkit.lora-adapter\x00" + adapter.encode("utf-8")) or 1


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    """Chained hashes of every full block of `tokens` (a partial last block is not hashed); a
    prompt under a LoRA adapter starts from `parent=adapter_seed(name)`."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    buf = u32le(tokens)
    step = 4 * block_size
    full = (len(buf) // step) * step
    out: list[int] = []
    for start in range(0, full, step):
        parent = _xxh3(parent.to_bytes(8, "little") + buf[start : start + step])
        out.append(parent)
    return out


def prompt_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks in a prompt of `num_tokens` tokens."""
    return num_tokens // block_size


def text_to_tokens(text: str) -> list[int]:
    """The deterministic tokenizer every part uses for text prompts: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))

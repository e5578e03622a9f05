"""The KV event decoder against batches encoded the way vLLM encodes them, other forms, and garbage."""

from __future__ import annotations

from array import array

import msgspec
import pytest

from meshlaunch.vllm_wire import AllBlocksCleared as WireCleared
from meshlaunch.vllm_wire import BlockMoved, encode, removed, stored
from poolrelay.engine.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Malformed,
    UnknownEvent,
    decode_batch,
)


def test_vllm_batch_decodes_every_event_kind():
    payload = encode(
        stored([b"h1", b"h2"], None, range(64), extra_keys=[None, ("salt",)], group_idx=0, session_id="s"),
        removed([b"h1"]),
        WireCleared(),
        rank=3,
        ts=12.5,
    )
    batch = decode_batch(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 3
    st, rm, cl = batch.events
    assert st == BlockStored(
        block_hashes=(b"h1", b"h2"),
        parent_block_hash=None,
        token_ids=array("I", range(64)),
        block_size=32,
        medium="GPU",
        group_idx=0,
        adapter="",
        extra_keys=(False, True),
    )
    assert rm == BlockRemoved(block_hashes=(b"h1",), medium="GPU")
    assert cl == AllBlocksCleared()


def test_integer_hashes_and_lora_blocks():
    batch = decode_batch(encode(stored([7, 8], 6, range(64), lora_id=2, lora_name="a")))
    (ev,) = batch.events
    assert ev.block_hashes == (7, 8) and ev.parent_block_hash == 6 and ev.adapter == "a"
    assert not ev.unnamed_adapter


def test_adapter_name_in_extra_keys_is_not_an_extra_key_but_a_salt_beside_it_is():
    # vLLM ≥ 0.11 puts lora_name first in every block's extra keys (kv_cache_utils
    # generate_block_hash_extra_keys: lora + multimodal + cache salt + prompt embeds).
    ev = stored(
        [1, 2, 3],
        None,
        range(48),
        16,
        lora_id=1,
        lora_name="sql",
        extra_keys=[("sql",), ("sql", "salt"), None],
    )
    (got,) = decode_batch(encode(ev)).events
    assert got.adapter == "sql" and got.extra_keys == (False, True, False)
    # Without the event naming its adapter, a name-like key is an extra key (a cache salt).
    (plain,) = decode_batch(encode(stored([1], None, range(16), 16, extra_keys=[("sql",)]))).events
    assert plain.adapter == "" and plain.extra_keys == (True,)


def test_an_adapter_without_its_name_is_flagged_and_a_bad_name_refused():
    (ev,) = decode_batch(encode(stored([1], None, range(16), 16, lora_id=4))).events
    assert ev.unnamed_adapter and ev.adapter == ""
    with pytest.raises(Malformed, match="lora_name"):
        decode_batch(encode(stored([1], None, range(16), 16, lora_id=4, lora_name=7)))


def test_unknown_event_type_is_reported_not_an_error():
    batch = decode_batch(encode(BlockMoved(block_hashes=[1]), removed([2])))
    assert batch.events[0] == UnknownEvent("BlockMoved")
    assert isinstance(batch.events[1], BlockRemoved)


def test_fields_added_later_are_ignored_in_both_forms():
    enc = msgspec.msgpack.encode
    as_map = {
        "ts": 1.0,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": list(range(16)),
                "block_size": 16,
                "lora_id": None,
                "medium": None,
                "lora_name": None,
                "a_new_field": {"x": [1, 2]},
            }
        ],
        "data_parallel_rank": None,
        "another": 1,
    }
    (ev,) = decode_batch(enc(as_map)).events
    assert ev.block_hashes == (1,) and ev.block_size == 16
    # Array forms (SGLang / older vLLM): the tag first, fields by position, extra trailing values.
    as_array = [1.0, [["BlockRemoved", [5, 6], "GPU", None, "new"], ["AllBlocksCleared", "x"]], 0, "more"]
    rm, cl = decode_batch(enc(as_array)).events
    assert rm == BlockRemoved(block_hashes=(5, 6), medium="GPU") and cl == AllBlocksCleared()


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"\xc1\xff\x00", "not msgpack"),
        (msgspec.msgpack.encode("hello"), "array or a map"),
        (msgspec.msgpack.encode([1.0]), "at least ts and events"),
        (msgspec.msgpack.encode([1.0, "x"]), "events must be a list"),
        (msgspec.msgpack.encode(["t", []]), "ts must be a number"),
        (msgspec.msgpack.encode([1.0, [7]]), "tagged map or array"),
        (msgspec.msgpack.encode([1.0, [{"type": 3}]]), "tag must be a string"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]), "lacks token_ids"),
        (
            msgspec.msgpack.encode(
                [1.0, [{"type": "BlockStored", "block_hashes": [1.5], "token_ids": [], "block_size": 16}]]
            ),
            "integer or bytes",
        ),
        (
            msgspec.msgpack.encode(
                [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [-1], "block_size": 16}]]
            ),
            "not a token id",
        ),
        (
            msgspec.msgpack.encode(
                [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": 0}]]
            ),
            "positive integer",
        ),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]), "lacks block_hashes"),
        (msgspec.msgpack.encode([1.0, [], "rank"]), "data_parallel_rank"),
    ],
)
def test_garbage_is_malformed_with_a_reason(payload, says):
    with pytest.raises(Malformed, match=says):
        decode_batch(payload)

"""Tests of the shared kit: fake clock, block hashing, validation, page tokens, logging."""

from __future__ import annotations

import asyncio
import logging
import struct
from array import array

import grpc
import numpy as np
import pytest
import structlog
import xxhash

from meshkit import blocks, logs, pagination, validation
from meshkit.clock import FakeClock


async def test_fake_clock_wakes_sleepers_in_order():
    clock = FakeClock(start=0.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, delay: float) -> None:
        await clock.sleep(delay)
        woke.append((name, clock.monotonic()))

    tasks = [asyncio.create_task(sleeper("b", 2.0)), asyncio.create_task(sleeper("a", 1.0))]
    await clock.advance(0.5)
    assert woke == []
    await clock.advance(2.0)
    assert woke == [("a", 1.0), ("b", 2.0)]
    assert clock.monotonic() == 2.5
    await asyncio.gather(*tasks)


async def test_fake_clock_loop_that_sleeps_repeatedly_runs_each_period():
    clock = FakeClock(start=0.0)
    ticks: list[float] = []

    async def loop() -> None:
        while True:
            ticks.append(clock.monotonic())
            await clock.sleep(1.0)

    task = asyncio.create_task(loop())
    await clock.advance(3.0)
    task.cancel()
    assert ticks == [0.0, 1.0, 2.0, 3.0]


def test_block_hashes_are_chained_prefix_hashes():
    a = list(range(64))
    b = list(range(32)) + [999] * 32
    ha, hb = blocks.block_hashes(a, 16), blocks.block_hashes(b, 16)
    assert len(ha) == 4
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]
    # A partial last block is not hashed.
    assert blocks.block_hashes([*a, 1, 2, 3], 16) == ha
    # Same tokens after a different prefix hash differently (the hash stands for the prefix).
    assert blocks.block_hashes([5] * 16 + [7] * 16, 16)[1] != blocks.block_hashes([6] * 16 + [7] * 16, 16)[1]


def test_block_hash_chain_known_answers():
    """Pins HASH_SCHEME_XXH3_64_CHAINED_U32LE: pools and routers in any language must agree on these."""
    assert blocks.block_hashes(list(range(32)), 16) == [2647778289425333254, 11562412869759332027]
    tokens = [0x01020304, 4294967295, 0, 65536]
    parent = 0x1122334455667788
    assert blocks.block_hashes(tokens, 2, parent=parent) == [13112818182392813555, 14397647289243121475]
    # The same chain written out byte by byte: parent as u64 LE, then each token as u32 LE.
    first = xxhash.xxh3_64_intdigest(
        bytes.fromhex("8877665544332211") + bytes.fromhex("04030201") + bytes.fromhex("ffffffff")
    )
    second = xxhash.xxh3_64_intdigest(first.to_bytes(8, "little") + struct.pack("<2I", 0, 65536))
    assert blocks.block_hashes(tokens, 2, parent=parent) == [first, second]


def test_token_bytes_are_little_endian_u32_whatever_the_input_type():
    expected = bytes.fromhex("0100000004030201")
    assert blocks.u32le([1, 0x01020304]) == expected
    assert blocks.u32le(array("I", [1, 0x01020304])) == expected
    # A request's repeated uint32 field (the fast path: numpy takes its values at once).
    from globalrouter.v1 import router_pb2

    ids = router_pb2.TokenIds.FromString(router_pb2.TokenIds(ids=[1, 0x01020304]).SerializeToString()).ids
    assert blocks.u32le(ids) == expected
    assert blocks.u32le(np.array([1, 0x01020304], np.uint32)) == expected


def test_a_request_field_hashes_as_its_list_does():
    """The repeated field's fast path gives the chain the list gives, the largest id included."""
    from globalrouter.v1 import router_pb2

    tokens = [*range(40), 4294967295, 0, 7] * 11
    ids = router_pb2.TokenIds.FromString(router_pb2.TokenIds(ids=tokens).SerializeToString()).ids
    assert not isinstance(ids, list)
    assert blocks.block_hashes(ids, 16, parent=9) == blocks.block_hashes(tokens, 16, parent=9)
    assert blocks.u32le(router_pb2.TokenIds().ids) == b""


def test_token_ids_outside_uint32_are_refused_not_wrapped():
    """Only a uint32 array is taken as is: other arrays go the checked way, which refuses a value
    a u32 cannot hold instead of wrapping it (-1 must not hash as 4294967295)."""
    with pytest.raises(OverflowError):
        blocks.u32le(np.array([1, -1], np.int64))
    with pytest.raises(OverflowError):
        blocks.u32le(np.array([1, 2**32], np.int64))
    assert blocks.u32le(np.array([1, 0x01020304], np.int64)) == bytes.fromhex("0100000004030201")
    with pytest.raises(OverflowError):
        blocks.u32le([1, -1])


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://127.0.0.1:8000", True),
        ("https://pool.example:443", True),
        ("http://[::1]:80", True),
        ("grpc://h:1", False),
        ("http://h", True),
        ("https://pool.example.com", True),
        ("http://h:8000/v1", True),
        ("https://gw.example.com/llm/v1/", True),
        ("http://u:p@h:1", False),
        ("http://u@h:1/v1", False),
        ("http://h:1?x=1", False),
        ("http://h:1/v1?", False),
        ("http://h:1/v1#frag", False),
        ("http://h:99999", False),
        ("http://:80", False),
        ("h:1", False),
        ("", False),
    ],
)
def test_url_rules(url, ok):
    assert (validation.url_problem(url) is None) == ok


def test_url_path_refused_where_a_grpc_target_is_meant():
    assert validation.url_problem("http://h:1/v1", allow_path=False) is not None
    assert validation.url_problem("https://h", allow_path=False) is None


def test_url_without_port_dials_the_scheme_default():
    from meshkit.channels import url_to_target

    assert url_to_target("https://pool.example.com") == ("pool.example.com:443", True)
    assert url_to_target("http://h") == ("h:80", False)


def test_identifier_rules_name_the_field():
    v = validation.Violations()
    validation.check_identifier(v, "pool_id", " x")
    validation.check_identifier(v, "model", "")
    validation.check_identifier(v, "region", "a\x00b")
    validation.check_identifier(v, "relay_id", "r" * 129)
    assert [f for f, _ in v.items] == ["pool_id", "model", "region", "relay_id"]


def test_page_tokens_round_trip_and_reject_other_filters():
    token = pagination.encode_page_token("pool-7", ("m", ""))
    assert pagination.decode_page_token(token, ("m", "")) == "pool-7"
    with pytest.raises(pagination.PageTokenError):
        pagination.decode_page_token(token, ("other", ""))
    with pytest.raises(pagination.PageTokenError):
        pagination.decode_page_token("!!garbage", ("m", ""))


def test_a_logger_made_before_logging_is_configured_follows_the_configuration():
    """get_logger is lazy: a module-level logger obeys the level and processors configured later."""
    log = logs.get_logger(module="early")
    before = structlog.get_config()
    seen = []

    def keep(_logger, _method, event):
        seen.append(event)
        raise structlog.DropEvent

    try:
        structlog.configure(
            processors=[keep],
            wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
            cache_logger_on_first_use=False,
        )
        log.info("below the level")
        log.warning("kept")
    finally:
        structlog.configure(**before)
    assert seen == [{"module": "early", "event": "kept"}]


def test_bad_utf8_field_names_the_nested_string_field():
    from google.rpc import error_details_pb2

    from meshkit.wire import bad_utf8_field

    msg = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field="ok", description="fine"),
            error_details_pb2.BadRequest.FieldViolation(field="ok", description="QQQQ"),
        ]
    )
    raw = msg.SerializeToString()
    assert bad_utf8_field(msg.DESCRIPTOR, raw) is None
    broken = raw.replace(b"QQQQ", b"Q\xffQQ")
    assert bad_utf8_field(msg.DESCRIPTOR, broken) == "field_violations.description"
    assert bad_utf8_field(msg.DESCRIPTOR, broken[:-1]) == "field_violations.description"
    assert bad_utf8_field(msg.DESCRIPTOR, b"\x0a\xff") is None  # truncated: no field to name


async def test_health_and_reflection_answer_on_a_meshkit_server():
    """Every service's server parses its requests itself (meshkit.wire): the standard services still work."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from meshkit.server import create_server

    handle = create_server("127.0.0.1:0", lambda server: [])
    await handle.server.start()
    await handle.set_serving(True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

        def services() -> list[str]:
            with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as sync_channel:
                return sorted(ProtoReflectionDescriptorDatabase(sync_channel).get_services())

        assert await asyncio.to_thread(services) == [
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        ]
    finally:
        await handle.server.stop(0)


def test_invalid_argument_carries_invalid_fields_reason_and_names_the_fields() -> None:
    from meshkit.errors import Reason, reason_of_status
    from meshkit.validation import Violations

    v = Violations()
    v.add("model", "must not be empty")
    v.add("prompt.text", "must not be empty")
    status = v.to_rpc_status()
    assert reason_of_status(status) == Reason.INVALID_FIELDS
    assert "model,prompt.text" in str(status.details[1].value)


def test_an_error_naming_many_bad_fields_stays_within_grpcs_metadata_limit() -> None:
    """64 bad frontend URLs, each echoed in its description, used to make a status over 16 KiB:
    the caller saw RESOURCE_EXHAUSTED ("metadata size exceeds hard limit") instead of the fields."""
    from meshkit.validation import MAX_LISTED_VIOLATIONS, Violations, bad_request_fields

    v = Violations()
    for i in range(64):
        v.add(f"frontends[{i}]", f"must not have a path: {'http://h:1/' + 'p' * 600!r}")
    status = v.to_rpc_status()
    assert len(status.SerializeToString()) < 12 * 1024
    assert v.message().endswith(f"(and {64 - MAX_LISTED_VIOLATIONS} more)")
    assert "frontends[0]" in v.message() and "frontends[16]" not in v.message()

    class Err(grpc.RpcError):
        def trailing_metadata(self):
            return (("grpc-status-details-bin", status.SerializeToString()),)

        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return status.message

    assert bad_request_fields(Err()) == [f"frontends[{i}]" for i in range(MAX_LISTED_VIOLATIONS)]


def test_an_adapters_blocks_never_match_the_base_models_or_another_adapters():
    from meshkit.blocks import adapter_seed, block_hashes

    tokens = list(range(64))
    base = block_hashes(tokens, 16)
    assert adapter_seed("") == 0 and block_hashes(tokens, 16, adapter_seed("")) == base
    seeds = {adapter_seed(name) for name in ("sql", "chat", "sql-lora", "SQL")}
    assert len(seeds) == 4 and 0 not in seeds and adapter_seed("sql") == adapter_seed("sql")
    sql, chat = block_hashes(tokens, 16, adapter_seed("sql")), block_hashes(tokens, 16, adapter_seed("chat"))
    assert not set(sql) & set(base) and not set(sql) & set(chat) and not set(chat) & set(base)
    # Still a chain: a prefix under the adapter hashes to the prefix of the whole.
    assert block_hashes(tokens[:32], 16, adapter_seed("sql")) == sql[:2]

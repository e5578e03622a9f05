"""Property tests: no input crashes or hangs a validator or a decoder of outside input."""

from __future__ import annotations

import string

import msgspec
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from globaldiscovery import request_checks
from globaldiscovery.v1 import discovery_pb2 as dpb
from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.router_api import prompt_tokens
from globalrouter.telemetry_ingest import StreamRejected, TelemetryIngest, validate_hello
from globalrouter.v1 import router_pb2 as rpb
from meshkit import pagination
from meshkit.authz import TABLE, decide
from meshkit.clock import FakeClock
from meshkit.identity import ApiKeys, Identity, IdentityError, Role, bearer_token, parse_spiffe
from meshkit.validation import Violations, check_frontends, check_identifier, url_problem
from poolrelay.engine.events import Malformed, decode_batch
from poolrelay.v1 import telemetry_pb2 as tpb

FAST = settings(max_examples=150, deadline=None)
texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=300)


@FAST
@given(token=texts, filters=st.tuples(texts, texts))
def test_page_tokens_decode_or_say_they_are_malformed(token, filters):
    try:
        key = pagination.decode_page_token(token, filters)
    except pagination.PageTokenError:
        return
    assert key is None or isinstance(key, str)


@FAST
@given(key=texts, filters=st.tuples(texts, texts))
def test_page_tokens_round_trip(key, filters):
    assert pagination.decode_page_token(pagination.encode_page_token(key, filters), filters) == key


@FAST
@given(key=st.text(max_size=50), filters=st.tuples(texts), other=st.tuples(texts))
def test_a_page_token_for_other_filters_is_refused(key, filters, other):
    token = pagination.encode_page_token(key, filters)
    if other == filters:
        return
    try:
        pagination.decode_page_token(token, other)
    except pagination.PageTokenError:
        return
    # Only a CRC32 collision of the fingerprints lets it through; then the key is still the one issued.
    assert pagination.decode_page_token(token, other) == key


@FAST
@given(value=texts)
def test_identifiers_are_checked_without_raising(value):
    v = Violations()
    check_identifier(v, "id", value)
    if not v:
        assert 0 < len(value) <= 128 and value == value.strip()


@FAST
@given(
    urls=st.lists(
        texts | st.from_regex(r"https?://[a-z0-9.]{1,20}:[0-9]{1,6}/?", fullmatch=True), max_size=70
    )
)
def test_frontend_lists_are_checked_without_raising(urls):
    v = Violations()
    check_frontends(v, "frontends", urls)
    if not v:
        assert 1 <= len(urls) <= 64 and all(url_problem(u) is None for u in urls)


spiffe_like = st.builds(
    lambda domain, parts: f"spiffe://{domain}/" + "/".join(parts),
    st.sampled_from(["mesh.local", "other", ""]),
    st.lists(
        st.sampled_from(["relay", "frontend", "admin", "client", "p", "", " x", "\x00"]) | texts, max_size=5
    ),
)


@FAST
@given(uri=spiffe_like | texts)
def test_spiffe_ids_parse_or_say_why(uri):
    try:
        identity = parse_spiffe(uri, "mesh.local")
    except IdentityError as exc:
        assert str(exc)
        return
    assert uri.startswith(f"spiffe://mesh.local/{identity.role}/")


@FAST
@given(header=texts)
def test_authorization_headers_never_raise(header):
    token = bearer_token(header)
    assert token is None or (token and token == token.strip())


@FAST
@given(content=st.text(alphabet=string.printable + "é\x00", max_size=400))
def test_keys_files_load_or_name_the_bad_line(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(content)
    try:
        keys = ApiKeys.load(path)
    except ValueError as exc:
        assert str(path) in str(exc)
        return
    assert keys.identify("anything") is None or len(keys) > 0


identities = st.builds(
    Identity, role=st.sampled_from(list(Role)), name=st.text(max_size=10), pool=st.text(max_size=10)
)


@FAST
@given(identity=identities, method=st.sampled_from(sorted(TABLE)) | texts)
def test_decide_answers_every_identity_and_method(identity, method):
    refusal = decide(identity, method)
    assert refusal is None or refusal.code.name == "PERMISSION_DENIED"


# ---- service decoders of outside input: arbitrary bytes parsed as a request never crash them ----

wire_bytes = st.binary(max_size=600)


def _parsed(message_class, data: bytes):
    message = message_class()
    try:
        message.ParseFromString(data)
    except DecodeError:
        return None
    return message


@FAST
@given(data=wire_bytes)
def test_prompts_decode_or_name_the_field(data):
    request = _parsed(rpb.GenerateRequest, data)
    if request is None:
        return
    v = Violations()
    tokens = prompt_tokens(v, "prompt", request.prompt, max_tokens=4096)
    assert all(f.startswith("prompt") for f, _d in v.items)
    if not v:
        assert 0 < len(tokens) <= 4096


u64 = st.integers(min_value=0, max_value=2**64 - 1)
hashes = st.lists(u64, max_size=20)
telemetry_messages = st.one_of(
    wire_bytes.map(lambda b: _parsed(tpb.PublishPoolTelemetryRequest, b)).filter(lambda m: m is not None),
    st.builds(
        lambda seq, stored, removed: tpb.PublishPoolTelemetryRequest(
            kv_delta=tpb.KvDelta(sequence=seq, stored=stored, removed=removed)
        ),
        st.integers(0, 5),
        hashes,
        hashes,
    ),
    st.builds(
        lambda sid, seq, index, last, blocks: tpb.PublishPoolTelemetryRequest(
            kv_snapshot=tpb.KvSnapshot(
                snapshot_id=sid, sequence=seq, chunk_index=index, last=last, block_hashes=blocks
            )
        ),
        st.integers(0, 3),
        st.integers(0, 5),
        st.integers(0, 3),
        st.booleans(),
        hashes,
    ),
)
hellos = st.builds(
    lambda pool, block_size, incarnation: tpb.TelemetryHello(
        pool_id=pool,
        relay_id="r",
        incarnation=incarnation,
        protocol_version=1,
        block_size=block_size,
        hash_scheme=tpb.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
    ),
    st.text(min_size=1, max_size=8),
    st.integers(0, 2**32 - 1),
    u64,
)


@FAST
@given(hello=hellos, messages=st.lists(telemetry_messages, max_size=12))
def test_telemetry_streams_apply_or_reject_any_message(hello, messages):
    if validate_hello(hello):
        return
    ingest = TelemetryIngest(PoolTable(), KvIndex(), FakeClock(), RouterMetrics(), max_snapshot_blocks=50)
    stream = ingest.open(hello)
    for msg in messages:
        try:
            answer = ingest.receive(stream, msg)
        except StreamRejected:
            break
        assert answer is None or answer.HasField("snapshot_request")
        assert len(stream.snapshot_chunks) <= 50
    ingest.close(stream)
    assert not ingest.streams


_DISCOVERY_CHECKS = [
    (dpb.RegisterPoolRequest, request_checks.register_pool),
    (dpb.UnregisterPoolRequest, request_checks.unregister_pool),
    (dpb.ListPoolsRequest, lambda r: request_checks.list_pools(r)[0]),
    (dpb.ListFrontendsRequest, lambda r: request_checks.list_frontends(r)[0]),
    (dpb.DrainPoolRequest, request_checks.drain_pool),
    (dpb.RegisterFrontendRequest, request_checks.register_frontend),
    (dpb.UnregisterFrontendRequest, request_checks.unregister_frontend),
]


@FAST
@given(which=st.sampled_from(range(len(_DISCOVERY_CHECKS))), data=wire_bytes)
def test_every_discovery_request_check_answers_any_request(which, data):
    message_class, check = _DISCOVERY_CHECKS[which]
    request = _parsed(message_class, data)
    if request is None:
        return
    v = check(request)
    assert all(isinstance(f, str) and f and d for f, d in v.items)


@FAST
@given(size=st.integers(-(2**31), 2**31 - 1), token=texts)
def test_page_requests_are_read_or_name_the_field(size, token):
    v = Violations()
    page = pagination.page_request(v, size, token, ("pools", "", ""))
    assert {f for f, _d in v.items} <= {"page_size", "page_token"}
    assert 1 <= page.size <= pagination.MAX_PAGE_SIZE


# ---- engine KV events (ZeroMQ + msgpack from a vLLM/SGLang worker the relay does not control) ----

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)
event_tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
events = st.builds(
    lambda tag, rest: [tag, *rest], event_tags, st.lists(msgpack_values, max_size=10)
) | st.builds(
    lambda tag, rest: {"type": tag, **rest}, event_tags, st.dictionaries(st.text(max_size=20), msgpack_values)
)
batches = st.builds(
    lambda ts, evs, rank: [ts, evs, rank], msgpack_values, st.lists(events, max_size=5), msgpack_values
)


@settings(max_examples=80, deadline=None)
@given(payload=st.binary(max_size=400) | batches.map(msgspec.msgpack.encode))
def test_engine_kv_batches_decode_or_say_they_are_malformed(payload):
    try:
        batch = decode_batch(payload)
    except Malformed as exc:
        assert str(exc)
        return
    assert len(batch.events) <= 100_000

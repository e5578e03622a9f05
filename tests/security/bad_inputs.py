"""The bad-input table: hostile or malformed inputs to every service, each with the exact answer it gets.

This module is data plus the code that sends each input. test_bad_inputs.py runs every case against
a live mesh; SECURITY.md's table is generated from CASES (tests/security/security_doc.py).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import msgspec
from google.protobuf.duration_pb2 import Duration

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from globalrouter.v1 import pool_frontend_pb2 as ppb
from globalrouter.v1 import pool_frontend_pb2_grpc as ppb_grpc
from globalrouter.v1 import router_pb2 as rpb
from globalrouter.v1 import router_pb2_grpc as rpb_grpc
from meshkit import pagination
from meshkit.errors import reason_of, reason_of_status
from meshkit.identity import hash_api_key, new_api_key
from meshkit.timeconv import duration
from meshkit.validation import bad_request_fields
from meshlaunch import command, free_port, wait_until
from mocker.v1 import admin_pb2 as apb
from mocker.v1 import admin_pb2_grpc as apb_grpc
from poolrelay.engine.events import Malformed, decode_batch
from poolrelay.v1 import pool_events_pb2 as epb
from poolrelay.v1 import pool_events_pb2_grpc as epb_grpc
from poolrelay.v1 import telemetry_pb2 as tpb
from poolrelay.v1 import telemetry_pb2_grpc as tpb_grpc
from tests.security.secure_mesh import MODEL, SecureMesh, secure_channel, wait_serving

# Limits the bad-input mesh's router is started with (so that the cases stay small).
ROUTER_FLAGS = (
    *("--max-prompt-tokens", "2048", "--max-output-tokens", "4096"),
    *("--max-snapshot-blocks", "1000", "--max-telemetry-streams", "2"),
    *("--http-max-body-bytes", "65536", "--http-max-header-bytes", "16384", "--http-max-headers", "50"),
)


@dataclass(frozen=True)
class Outcome:
    """What a service answered: status code name, BadRequest fields, ErrorInfo reason, message."""

    code: str
    fields: tuple[str, ...] = ()
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class Case:
    """One bad input: where it goes, what it is, and the answer it must get."""

    service: str
    call: str
    attack: str
    code: str
    field: str
    """The field the answer names (BadRequest field, or named in the message); "" when none applies."""
    send: Callable[[SecureMesh], Outcome]
    reason: str = ""
    """The ErrorInfo reason the answer carries, when it must carry one."""


def _rpc(call: Callable[[], object]) -> Outcome:
    try:
        result = call()
        if isinstance(result, Iterable) and not isinstance(result, (str, bytes)):
            list(result)
    except grpc.RpcError as exc:
        fields = tuple(bad_request_fields(exc)) if exc.code() is grpc.StatusCode.INVALID_ARGUMENT else ()
        return Outcome(exc.code().name, fields, reason_of(exc) or "", exc.details() or "")
    return Outcome("OK")


def _call(target: str, cert: str, stub_class, method: str, request, *, stream: bool = False):
    """A sender of `request` to `method` of the mesh's `target` (discovery, router, pool) as `cert`."""

    def send(mesh: SecureMesh) -> Outcome:
        with secure_channel(getattr(mesh, target), mesh.config(cert)) as ch:
            rpc = getattr(stub_class(ch), method)
            return _rpc(lambda: rpc(iter(request) if stream else request, timeout=10))

    return send


_discovery = functools.partial(_call, "discovery", "admin", dpb_grpc.DiscoveryServiceStub)
_router = functools.partial(_call, "router", "client", rpb_grpc.RouterServiceStub)
_pool = functools.partial(_call, "pool", "admin")


def _telemetry(*messages: tpb.PublishPoolTelemetryRequest) -> Callable[[SecureMesh], Outcome]:
    return _call(
        "router", "relay-a", tpb_grpc.TelemetryServiceStub, "PublishPoolTelemetry", messages, stream=True
    )


def _http(path: str, body: bytes, headers: dict[str, str] | None = None) -> Callable[[SecureMesh], Outcome]:
    """A sender of one raw HTTP request to the router's OpenAI front: status, `param`, error code."""

    def send(mesh: SecureMesh) -> Outcome:
        host, _, port = mesh.http.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request(
                "POST", path, body=body, headers={"content-type": "application/json", **(headers or {})}
            )
            reply = conn.getresponse()
            error = json.loads(reply.read())["error"]
        finally:
            conn.close()
        fields = (error["param"],) if error.get("param") else ()
        return Outcome(f"HTTP {reply.status}", fields, error.get("code") or "", error["message"])

    return send


def _chat(**changes: Any) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **changes}
    ).encode()


def _completion(**changes: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": [7, 7], "max_tokens": 2, **changes}).encode()


def _invalid_utf8(target: str, method: str, message, text: str, *, stream: bool = False):
    """A sender of `message` with the string `text` in it replaced by bytes that are not UTF-8."""
    assert text.isascii() and len(text) == 2
    data = message.SerializeToString().replace(text.encode(), b"\xff\xfe")

    def send(mesh: SecureMesh) -> Outcome:
        with secure_channel(getattr(mesh, target), mesh.config("admin")) as ch:
            # Bytes as they are: the generated stubs would refuse to build such a message.
            if stream:
                streamed: grpc.StreamStreamMultiCallable[bytes, bytes] = ch.stream_stream(
                    method, request_serializer=None, response_deserializer=None
                )
                return _rpc(lambda: streamed(iter([data]), timeout=10))
            unary: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(
                method, request_serializer=None, response_deserializer=None
            )
            return _rpc(lambda: unary(data, timeout=10))

    return send


def _renewal(request: dpb.RegisterPoolRequest) -> Callable[[SecureMesh], Outcome]:
    """One renewal on a KeepAlivePools stream: a refused renewal is answered in its reply, the stream stays."""

    def send(mesh: SecureMesh) -> Outcome:
        with secure_channel(mesh.discovery, mesh.config("admin")) as ch:
            stub = dpb_grpc.DiscoveryServiceStub(ch)
            replies = list(
                stub.KeepAlivePools(
                    iter([dpb.KeepAlivePoolsRequest(sequence=1, register=request)]), timeout=10
                )
            )
        status = replies[0].status
        return Outcome(
            _CODE_NAMES[status.code], message=status.message, reason=reason_of_status(status) or ""
        )

    return send


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def _engine_batch(payload: bytes) -> Callable[[SecureMesh], Outcome]:
    """An engine KV event batch as the relay's engine feed decodes it (what a vLLM worker publishes)."""

    def send(_mesh: SecureMesh) -> Outcome:
        try:
            decode_batch(payload)
        except Malformed as exc:
            return Outcome("Malformed (batch dropped, worker's blocks reset)", message=str(exc))
        return Outcome("OK")

    return send


def _relay_flags(*flags: str) -> Callable[[SecureMesh], Outcome]:
    """`poolrelay serve` with otherwise good flags and `flags` changed: its exit code and complaint."""

    def send(mesh: SecureMesh) -> Outcome:
        base = {
            "--pool": mesh.pool,
            "--discovery": mesh.discovery,
            "--routing-pool": "pool-x",
            "--routing-pool-region": "r1",
            "--routing-pool-frontends": f"http://{mesh.pool}",
        }
        for name, value in zip(flags[::2], flags[1::2], strict=True):
            base[name] = value
        args = [command("poolrelay"), "serve", *(x for kv in base.items() for x in kv)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
        return Outcome(f"exit {done.returncode}", message=done.stderr)

    return send


def _registration(**changes: Any) -> dpb.RegisterPoolRequest:
    fields: dict[str, Any] = {
        "pool_id": "pool-x",
        "model": MODEL,
        "region": "r1",
        "frontends": ["http://127.0.0.1:1"],
        "relay_id": "relay-x",
        "incarnation": 1,
    }
    fields.update(changes)
    return dpb.RegisterPoolRequest(**fields)


def _hello(**changes: Any) -> tpb.PublishPoolTelemetryRequest:
    fields: dict[str, Any] = {
        "pool_id": "pool-a",
        "relay_id": "relay-1",
        "incarnation": 1,
        "protocol_version": 1,
        "block_size": 16,
        "hash_scheme": tpb.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
    }
    fields.update(changes)
    return tpb.PublishPoolTelemetryRequest(hello=tpb.TelemetryHello(**fields))


def _tokens(n: int, token: int = 7) -> rpb.Prompt:
    return rpb.Prompt(token_ids=rpb.TokenIds(ids=[token] * n))


def _generate(**changes: Any) -> rpb.GenerateRequest:
    fields: dict[str, Any] = {"model": MODEL, "prompt": _tokens(4), "max_tokens": 4}
    fields.update(changes)
    return rpb.GenerateRequest(**fields)


def _snapshot(chunk: int, blocks: int) -> tpb.PublishPoolTelemetryRequest:
    return tpb.PublishPoolTelemetryRequest(
        kv_snapshot=tpb.KvSnapshot(
            snapshot_id=1, sequence=1, chunk_index=chunk, last=False, block_hashes=range(blocks)
        )
    )


def _batch(*messages: tpb.PublishPoolTelemetryRequest) -> Callable[[SecureMesh], Outcome]:
    """A stream of its own (pool-w) whose second message is a TelemetryBatch of `messages`."""
    return _telemetry(
        _hello(pool_id="pool-w", relay_id="relay-w"),
        tpb.PublishPoolTelemetryRequest(batch=tpb.TelemetryBatch(messages=messages)),
    )


_BEAT = tpb.PublishPoolTelemetryRequest(heartbeat=tpb.TelemetryHeartbeat())


_FORGED = pagination.encode_page_token("pool-a", ("pools", "other-model", ""))
IA, RE = "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"

CASES: list[Case] = [
    # ---- globaldiscovery ----------------------------------------------------------------------
    Case(
        "discovery",
        "RegisterPool",
        "pool_id with a control character",
        IA,
        "pool_id",
        _discovery("RegisterPool", _registration(pool_id="pool\x07x")),
    ),
    Case(
        "discovery",
        "RegisterPool",
        "model of 129 characters",
        IA,
        "model",
        _discovery("RegisterPool", _registration(model="m" * 129)),
    ),
    Case(
        "discovery",
        "RegisterPool",
        "region with surrounding white space",
        IA,
        "region",
        _discovery("RegisterPool", _registration(region=" r1 ")),
    ),
    Case(
        "discovery",
        "RegisterPool",
        "65 frontends",
        IA,
        "frontends",
        _discovery("RegisterPool", _registration(frontends=[f"http://10.0.0.1:{p}" for p in range(1, 66)])),
    ),
    Case(
        "discovery",
        "RegisterPool",
        "a frontend that is not http(s)",
        IA,
        "frontends[0]",
        _discovery("RegisterPool", _registration(frontends=["ftp://127.0.0.1:21"])),
    ),
    Case(
        "discovery",
        "RegisterPool",
        "a frontend URL carrying credentials",
        IA,
        "frontends[0]",
        _discovery("RegisterPool", _registration(frontends=["http://user:pw@127.0.0.1:1"])),
    ),
    Case(
        "discovery",
        "RegisterPool",
        "incarnation 0",
        IA,
        "incarnation",
        _discovery("RegisterPool", _registration(incarnation=0)),
    ),
    Case(
        "discovery",
        "RegisterPool",
        "65 capabilities",
        IA,
        "capabilities",
        _discovery("RegisterPool", _registration(capabilities=[f"c{i}" for i in range(65)])),
    ),
    Case(
        "discovery",
        "RegisterPool",
        "a 300 KB message (over the 256 KiB cap)",
        RE,
        "",
        _discovery("RegisterPool", _registration(capabilities=["x" * 1000] * 300)),
        reason="LIMIT_EXCEEDED",
    ),
    Case(
        "discovery",
        "UnregisterPool",
        "empty relay_id",
        IA,
        "relay_id",
        _discovery("UnregisterPool", dpb.UnregisterPoolRequest(pool_id="pool-a", incarnation=1)),
    ),
    Case(
        "discovery",
        "ListPools",
        "a page token that is not one",
        IA,
        "page_token",
        _discovery("ListPools", dpb.ListPoolsRequest(page_token="Zm9yZ2Vk")),
    ),
    Case(
        "discovery",
        "ListPools",
        "a page token issued for other filters",
        IA,
        "page_token",
        _discovery("ListPools", dpb.ListPoolsRequest(page_token=_FORGED)),
    ),
    Case(
        "discovery",
        "ListPools",
        "negative page_size",
        IA,
        "page_size",
        _discovery("ListPools", dpb.ListPoolsRequest(page_size=-1)),
    ),
    Case(
        "discovery",
        "WatchPools",
        "model filter with a newline",
        IA,
        "model",
        _discovery("WatchPools", dpb.WatchPoolsRequest(model="a\nb")),
    ),
    Case(
        "discovery",
        "DrainPool",
        "negative timeout",
        IA,
        "timeout",
        _discovery("DrainPool", dpb.DrainPoolRequest(pool_id="pool-a", timeout=Duration(seconds=-5))),
    ),
    Case(
        "discovery",
        "DrainPool",
        "no timeout",
        IA,
        "timeout",
        _discovery("DrainPool", dpb.DrainPoolRequest(pool_id="pool-a")),
    ),
    Case(
        "discovery",
        "RegisterFrontend",
        "url with a path",
        IA,
        "url",
        _discovery(
            "RegisterFrontend",
            dpb.RegisterFrontendRequest(frontend_id="f", url="http://127.0.0.1:1/x", incarnation=1),
        ),
    ),
    # ---- globalrouter (RouterService) -----------------------------------------------------------
    Case("router", "Generate", "empty model", IA, "model", _router("Generate", _generate(model=""))),
    Case(
        "router", "Generate", "max_tokens 0", IA, "max_tokens", _router("Generate", _generate(max_tokens=0))
    ),
    Case(
        "router",
        "Generate",
        "max_tokens past the configured cap (4096)",
        IA,
        "max_tokens",
        _router("Generate", _generate(max_tokens=5000)),
    ),
    Case(
        "router",
        "Generate",
        "prompt past the configured cap (2048 tokens)",
        IA,
        "prompt",
        _router("Generate", _generate(prompt=_tokens(3000))),
    ),
    Case(
        "router", "Generate", "no prompt", IA, "prompt", _router("Generate", _generate(prompt=rpb.Prompt()))
    ),
    Case(
        "router",
        "Generate",
        "empty text prompt",
        IA,
        "prompt.text",
        _router("Generate", _generate(prompt=rpb.Prompt(text=""))),
    ),
    Case(
        "router",
        "Generate",
        "request_id with a control character",
        IA,
        "request_id",
        _router("Generate", _generate(request_id="r\x1b1")),
    ),
    Case(
        "router",
        "Generate",
        "a 10 MB message (over the 8 MiB limit)",
        RE,
        "",
        _router("Generate", _generate(prompt=_tokens(2_000_000, token=4_000_000_000))),
    ),
    Case(
        "router",
        "Route",
        "max_tokens past the configured cap",
        IA,
        "max_tokens",
        _router("Route", rpb.RouteRequest(model=MODEL, prompt=_tokens(4), max_tokens=5000)),
    ),
    Case(
        "router",
        "ListPools",
        "a forged page token",
        IA,
        "page_token",
        _router("ListPools", rpb.ListPoolsRequest(page_token="!!!")),
    ),
    # ---- globalrouter (TelemetryService) --------------------------------------------------------
    Case(
        "router",
        "PublishPoolTelemetry",
        "first message is not a hello",
        IA,
        "hello",
        _telemetry(tpb.PublishPoolTelemetryRequest(heartbeat=tpb.TelemetryHeartbeat())),
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "hello with block_size 0",
        IA,
        "hello.block_size",
        _telemetry(_hello(block_size=0)),
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "hello with an unknown protocol version",
        IA,
        "hello.protocol_version",
        _telemetry(_hello(protocol_version=2)),
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "hello with no hash scheme",
        IA,
        "hello.hash_scheme",
        _telemetry(_hello(hash_scheme=tpb.HASH_SCHEME_UNSPECIFIED)),
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "hello with incarnation 0",
        IA,
        "hello.incarnation",
        _telemetry(_hello(incarnation=0)),
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "snapshot chunks that never end (past 1000 blocks)",
        RE,
        "kv_snapshot.block_hashes",
        _telemetry(_hello(pool_id="pool-z", relay_id="relay-z"), *(_snapshot(i, 400) for i in range(4))),
    ),
    Case("router", "PublishPoolTelemetry", "an empty batch", IA, "batch.messages", _batch()),
    Case(
        "router",
        "PublishPoolTelemetry",
        "a batch of 257 messages (over 256)",
        IA,
        "batch.messages",
        _batch(*[_BEAT] * 257),
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "a hello inside a batch",
        IA,
        "batch.messages[1]",
        _batch(_BEAT, _hello(pool_id="pool-w", relay_id="relay-w")),
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "a snapshot chunk inside a batch",
        IA,
        "batch.messages[0]",
        _batch(_snapshot(0, 10)),
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "a batch inside a batch",
        IA,
        "batch.messages[0]",
        _batch(tpb.PublishPoolTelemetryRequest(batch=tpb.TelemetryBatch(messages=[_BEAT]))),
    ),
    # ---- mocker (pool frontend, pool events, admin) ---------------------------------------------
    Case(
        "mocker",
        "PoolFrontendService.Generate",
        "no token ids",
        IA,
        "token_ids",
        _pool(
            ppb_grpc.PoolFrontendServiceStub,
            "Generate",
            ppb.PoolFrontendServiceGenerateRequest(request_id="r", model=MODEL, max_tokens=1),
        ),
    ),
    Case(
        "mocker",
        "PoolFrontendService.Generate",
        "max_tokens 0",
        IA,
        "max_tokens",
        _pool(
            ppb_grpc.PoolFrontendServiceStub,
            "Generate",
            ppb.PoolFrontendServiceGenerateRequest(request_id="r", model=MODEL, token_ids=[1]),
        ),
    ),
    Case(
        "mocker",
        "PoolFrontendService.Generate",
        "request_id with a control character",
        IA,
        "request_id",
        _pool(
            ppb_grpc.PoolFrontendServiceStub,
            "Generate",
            ppb.PoolFrontendServiceGenerateRequest(
                request_id="\x00", model=MODEL, token_ids=[1], max_tokens=1
            ),
        ),
    ),
    Case(
        "mocker",
        "WatchPoolStatus",
        "interval of 1 ms",
        IA,
        "interval",
        _pool(
            epb_grpc.PoolEventsServiceStub,
            "WatchPoolStatus",
            epb.WatchPoolStatusRequest(interval=duration(0.001)),
        ),
    ),
    Case(
        "mocker",
        "StartDrain",
        "no timeout",
        IA,
        "timeout",
        _pool(epb_grpc.PoolEventsServiceStub, "StartDrain", epb.StartDrainRequest()),
    ),
    Case(
        "mocker",
        "SetModelReady",
        "empty model",
        IA,
        "model",
        _pool(apb_grpc.MockerAdminServiceStub, "SetModelReady", apb.SetModelReadyRequest(ready=True)),
    ),
    Case(
        "mocker",
        "SetFaults",
        "negative added latency",
        IA,
        "added_latency",
        _pool(
            apb_grpc.MockerAdminServiceStub,
            "SetFaults",
            apb.SetFaultsRequest(added_latency=Duration(seconds=-1)),
        ),
    ),
    # ---- poolrelay (its configuration is its outside input) -------------------------------------
    Case(
        "relay",
        "serve flags",
        "a pool frontend that is not http(s)",
        "exit 2",
        "--routing-pool-frontends",
        _relay_flags("--routing-pool-frontends", "ftp://127.0.0.1:1"),
    ),
    Case(
        "relay",
        "serve flags",
        "a discovery address without a port",
        "exit 2",
        "--discovery",
        _relay_flags("--discovery", "127.0.0.1"),
    ),
    Case(
        "relay",
        "serve flags",
        "negative report interval",
        "exit 2",
        "--report-interval",
        _relay_flags("--report-interval", "-1"),
    ),
    Case(
        "relay",
        "serve flags",
        "a certificate file that does not exist",
        "exit 2",
        "--tls-cert",
        _relay_flags("--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key"),
    ),
]


@contextlib.contextmanager
def _own_discovery(mesh: SecureMesh, *flags: str):
    """A discovery process of its own for a case that must not disturb the shared mesh; its address and process."""
    address = f"127.0.0.1:{free_port()}"
    proc = mesh.start(
        f"discovery-{len(mesh.procs)}",
        [command("globaldiscovery"), "serve", "--listen", address, *flags],
        "discovery",
    )
    try:
        wait_serving(address, mesh.config("admin"), proc)
        yield address, proc
    finally:
        proc.stop()


def _watcher_that_never_reads(mesh: SecureMesh) -> Outcome:
    """A WatchPools stream that is never read while 3,000 registrations churn: cut off, memory flat."""
    with _own_discovery(mesh, "--watch-queue-limit", "100") as (address, proc):
        rss_before = _rss_kib(proc.pid)
        # No BDP probing: the receive window stays at its 64 KiB default, as a slow reader's would.
        options = [("grpc.http2.bdp_probe", 0)]
        with (
            grpc.insecure_channel(address, options=options) as watch_ch,
            secure_channel(address, mesh.config("admin")) as ch,
        ):
            watch = dpb_grpc.DiscoveryServiceStub(watch_ch).WatchPools(dpb.WatchPoolsRequest(), timeout=60)
            stub = dpb_grpc.DiscoveryServiceStub(ch)
            for i in range(3000):
                stub.RegisterPool(_registration(pool_id=f"churn-{i}", relay_id=f"relay-{i}"), timeout=10)
            outcome = _rpc(lambda: watch)
        growth_mib = (_rss_kib(proc.pid) - rss_before) / 1024
        if growth_mib > 64:
            return Outcome("MEMORY GREW", message=f"{growth_mib:.0f} MiB")
        return outcome


def _one_watcher_too_many(mesh: SecureMesh) -> Outcome:
    """With --max-watchers 1, a second WatchPools stream while the first is open."""
    with _own_discovery(mesh, "--max-watchers", "1") as (address, _proc):
        with secure_channel(address, mesh.config("admin")) as ch:
            stub = dpb_grpc.DiscoveryServiceStub(ch)
            first = stub.WatchPools(dpb.WatchPoolsRequest(), timeout=30)
            next(first)  # the snapshot's end: the watch is open
            outcome = _rpc(lambda: stub.WatchPools(dpb.WatchPoolsRequest(), timeout=10))
            first.cancel()
        return outcome


def _one_telemetry_stream_too_many(mesh: SecureMesh) -> Outcome:
    """The router allows 2 telemetry streams (ROUTER_FLAGS); the pool's relay holds one, a test relay
    another (then ends it cleanly), and a third is refused."""
    ended = threading.Event()

    def held():
        yield _hello(pool_id="pool-q", relay_id="relay-q")
        ended.wait(30)

    with secure_channel(mesh.router, mesh.config("relay-a")) as ch:
        stub = tpb_grpc.TelemetryServiceStub(ch)
        first = stub.PublishPoolTelemetry(held(), timeout=30)
        next(first)  # hello_ack: the stream is open
        outcome = _rpc(lambda: stub.PublishPoolTelemetry(iter([_hello(pool_id="pool-r")]), timeout=10))
        ended.set()
        list(first)  # the router closes the stream (and forgets pool-q) before it answers
    return outcome


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


_DROPPED = "Malformed (batch dropped, worker's blocks reset)"
CASES += [
    Case(
        "relay",
        "engine KV events",
        "BlockStored whose token_ids is a string",
        _DROPPED,
        "token_ids",
        _engine_batch(msgspec.msgpack.encode([1.0, [["BlockStored", [1, 2], None, "abc", 16, None]], 0])),
    ),
    Case(
        "relay",
        "engine KV events",
        "BlockStored with block_size -4",
        _DROPPED,
        "block_size",
        _engine_batch(
            msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, list(range(16)), -4, None]], 0])
        ),
    ),
    Case(
        "relay",
        "engine KV events",
        "a truncated msgpack batch",
        _DROPPED,
        "msgpack",
        _engine_batch(b"\x93\xcb"),
    ),
    Case(
        "discovery",
        "KeepAlivePools",
        "a 300 KB renewal on a lease stream",
        RE,
        "",
        _renewal(_registration(frontends=["http://h:1/" + "x" * 300_000])),
        reason="LIMIT_EXCEEDED",
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "a 2 MB KV delta (over the 1 MiB cap)",
        RE,
        "",
        _telemetry(
            _hello(pool_id="pool-y", relay_id="relay-y"),
            tpb.PublishPoolTelemetryRequest(
                kv_delta=tpb.KvDelta(sequence=1, stored=range(2**40, 2**40 + 250_000))
            ),
        ),
        reason="LIMIT_EXCEEDED",
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "a 2 MB batch of small deltas (over the 1 MiB cap)",
        RE,
        "",
        _batch(
            *(
                tpb.PublishPoolTelemetryRequest(
                    kv_delta=tpb.KvDelta(sequence=i, stored=range(2**40 + i * 1000, 2**40 + (i + 1) * 1000))
                )
                for i in range(1, 251)
            )
        ),
        reason="LIMIT_EXCEEDED",
    ),
    Case(
        "discovery",
        "RegisterPool",
        "pool_id that is not UTF-8",
        IA,
        "pool_id",
        _invalid_utf8(
            "discovery",
            "/globaldiscovery.v1.DiscoveryService/RegisterPool",
            _registration(pool_id="@@"),
            "@@",
        ),
    ),
    Case(
        "router",
        "Generate",
        "text prompt that is not UTF-8",
        IA,
        "prompt.text",
        _invalid_utf8(
            "router", "/globalrouter.v1.RouterService/Generate", _generate(prompt=rpb.Prompt(text="@@")), "@@"
        ),
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "hello pool_id that is not UTF-8",
        IA,
        "hello.pool_id",
        _invalid_utf8(
            "router",
            "/poolrelay.v1.TelemetryService/PublishPoolTelemetry",
            _hello(pool_id="@@"),
            "@@",
            stream=True,
        ),
    ),
    Case(
        "mocker",
        "SetModelReady",
        "model that is not UTF-8",
        IA,
        "model",
        _invalid_utf8(
            "pool",
            "/mocker.v1.MockerAdminService/SetModelReady",
            apb.SetModelReadyRequest(model="@@", ready=True),
            "@@",
        ),
    ),
    Case(
        "discovery",
        "WatchPools",
        "a watcher that never reads while 3,000 registrations churn",
        RE,
        "",
        _watcher_that_never_reads,
    ),
    Case(
        "discovery",
        "WatchPools",
        "a second watcher past --max-watchers 1",
        RE,
        "",
        _one_watcher_too_many,
        reason="LIMIT_EXCEEDED",
    ),
    Case(
        "router",
        "PublishPoolTelemetry",
        "a third telemetry stream past --max-telemetry-streams 2",
        RE,
        "",
        _one_telemetry_stream_too_many,
        reason="LIMIT_EXCEEDED",
    ),
]

_CHAT, _COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CASES += [
    # ---- globalrouter's OpenAI HTTP front -------------------------------------------------------
    Case(
        "http",
        _CHAT,
        "a 100 KB body (over --http-max-body-bytes 65536)",
        "HTTP 413",
        "",
        _http(_CHAT, _chat(user="u" * 100_000)),
        reason="body_too_large",
    ),
    Case(
        "http",
        _CHAT,
        "20 KB of headers (over --http-max-header-bytes 16384)",
        "HTTP 431",
        "",
        _http(_CHAT, _chat(), {"x-big": "a" * 20_000}),
        reason="headers_too_large",
    ),
    Case(
        "http",
        _CHAT,
        "51 headers (over --http-max-headers 50)",
        "HTTP 431",
        "",
        _http(_CHAT, _chat(), {f"x-h{i}": "1" for i in range(51)}),
        reason="headers_too_large",
    ),
    Case(
        "http",
        _COMPLETIONS,
        "prompt past the configured cap (2048 tokens)",
        "HTTP 400",
        "prompt",
        _http(_COMPLETIONS, _completion(prompt=[7] * 2049)),
        reason="invalid_value",
    ),
    Case(
        "http",
        _CHAT,
        "max_tokens past the configured cap (4096)",
        "HTTP 400",
        "max_tokens",
        _http(_CHAT, _chat(max_tokens=4097)),
        reason="invalid_value",
    ),
    Case(
        "http",
        _COMPLETIONS,
        "a token id past 2^32-1",
        "HTTP 400",
        "prompt",
        _http(_COMPLETIONS, _completion(prompt=[2**33])),
    ),
    Case(
        "http",
        _CHAT,
        "temperature NaN",
        "HTTP 400",
        "temperature",
        _http(_CHAT, _chat(temperature=float("nan"))),
    ),
    Case(
        "http",
        _CHAT,
        "a body that is not JSON",
        "HTTP 400",
        "",
        _http(_CHAT, b'{"model": '),
        reason="invalid_json",
    ),
    Case(
        "http",
        _CHAT,
        "a body that is not UTF-8",
        "HTTP 400",
        "",
        _http(_CHAT, b'{"model": "\xff\xfe"}'),
        reason="invalid_json",
    ),
]

CASES += [
    Case(
        "router",
        "PublishPoolTelemetry",
        "a second relay of a live pool with another block size",
        "FAILED_PRECONDITION",
        "hello.block_size",
        _telemetry(_hello(relay_id="relay-other", block_size=1)),
        reason="TELEMETRY_BLOCK_SIZE_MISMATCH",
    ),
]


def _http10_stream(mesh: SecureMesh) -> Outcome:
    """A streaming chat request in HTTP/1.0 on a raw socket (no chunked encoding in that version)."""
    import socket

    host, _, port = mesh.http.rpartition(":")
    body = _chat(stream=True)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    error = json.loads(payload)["error"]
    fields = (error["param"],) if error.get("param") else ()
    return Outcome(f"HTTP {int(head.split()[1])}", fields, error.get("code") or "", error["message"])


# ---- API keys: identities, reloads ------------------------------------------------------------------


@contextlib.contextmanager
def _keyed_discovery(mesh: SecureMesh, lines: str, key: str):
    """A discovery process of its own, plain text on loopback, with an --api-keys file of `lines`;
    once it answers ListPools with `key`: its address, process and keys file."""
    tmp = tempfile.TemporaryDirectory(prefix="keys-")
    keys = Path(tmp.name) / "keys"
    keys.write_text(lines)
    address = f"127.0.0.1:{free_port()}"
    name = f"discovery-{len(mesh.procs)}"
    proc = mesh.procs[name] = mesh.group.start(
        name, [command("globaldiscovery"), "serve", "--listen", address, "--api-keys", str(keys)]
    )
    try:

        def answers() -> bool:
            proc.check_alive()
            return _keyed(address, key, "ListPools", dpb.ListPoolsRequest()).code == "OK"

        wait_until(answers, 30, message="discovery answers with an API key")
        yield address, proc, keys
    finally:
        proc.stop()
        tmp.cleanup()


def _keyed(address: str, key: str, method: str, request) -> Outcome:
    """One discovery call with `key` as `authorization: Bearer` metadata over plain text."""
    with grpc.insecure_channel(address) as ch:
        rpc = getattr(dpb_grpc.DiscoveryServiceStub(ch), method)
        return _rpc(lambda: rpc(request, timeout=10, metadata=(("authorization", f"Bearer {key}"),)))


def _relay_key_for_another_pool(mesh: SecureMesh) -> Outcome:
    """A key that stands for relay/pool-a/relay-1 registers pool-b as relay-1."""
    key = new_api_key()
    with _keyed_discovery(mesh, f"relay/pool-a/relay-1 {hash_api_key(key)}\n", key) as (address, _p, _k):
        return _keyed(address, key, "RegisterPool", _registration(pool_id="pool-b", relay_id="relay-1"))


def _keys_file_in_clear_on_sighup(mesh: SecureMesh) -> Outcome:
    """The --api-keys file is rewritten with a key in clear and SIGHUP sent: the file is refused
    (logged naming its line) and the key in force still works."""
    key = new_api_key()
    with _keyed_discovery(mesh, f"alice {hash_api_key(key)}\n", key) as (address, proc, keys):
        keys.write_text(f"alice {hash_api_key(key)}\nbob {new_api_key()}\n")
        proc.signal(signal.SIGHUP)
        wait_until(lambda: "API keys NOT reloaded" in proc.output() or not proc.alive(), 30)
        proc.check_alive()
        line = next(x for x in proc.output().splitlines() if "API keys NOT reloaded" in x)
        if _keyed(address, key, "ListPools", dpb.ListPoolsRequest()).code != "OK":
            return Outcome("KEYS LOST", message=line)
        return Outcome("file refused, current keys kept", message=line)


def _discovery_keys(lines: str) -> Callable[[SecureMesh], Outcome]:
    """`globaldiscovery serve --api-keys FILE` with `lines` in FILE: its exit code and complaint."""

    def send(_mesh: SecureMesh) -> Outcome:
        with tempfile.TemporaryDirectory(prefix="keys-") as tmp:
            keys = Path(tmp) / "keys"
            keys.write_text(lines)
            args = [command("globaldiscovery"), "serve", "--listen", f"127.0.0.1:{free_port()}"]
            done = subprocess.run(
                [*args, "--api-keys", str(keys)], capture_output=True, text=True, timeout=60, check=False
            )
        return Outcome(f"exit {done.returncode}", message=done.stderr)

    return send


CASES += [
    Case(
        "http",
        _CHAT,
        "a lone surrogate (\\ud800) in a message's content",
        "HTTP 400",
        "messages[0].content",
        _http(_CHAT, _chat(messages=[{"role": "user", "content": "hi \ud800"}])),
        reason="invalid_value",
    ),
    Case(
        "http",
        _COMPLETIONS,
        "a lone surrogate (\\ud800) in the prompt",
        "HTTP 400",
        "prompt",
        _http(_COMPLETIONS, _completion(prompt="hi \ud800")),
        reason="invalid_value",
    ),
    Case(
        "http",
        _CHAT,
        "a lone surrogate (\\ud800) in a stop string",
        "HTTP 400",
        "stop[0]",
        _http(_CHAT, _chat(stop=["\ud800"])),
        reason="invalid_value",
    ),
    Case(
        "http",
        _CHAT,
        "a text/plain body (no CORS preflight needed)",
        "HTTP 415",
        "",
        _http(_CHAT, _chat(), {"content-type": "text/plain"}),
        reason="unsupported_media_type",
    ),
    Case(
        "http",
        _COMPLETIONS,
        "a form-encoded body",
        "HTTP 415",
        "",
        _http(_COMPLETIONS, _completion(), {"content-type": "application/x-www-form-urlencoded"}),
        reason="unsupported_media_type",
    ),
    Case(
        "http",
        _CHAT,
        "stream: true over HTTP/1.0 (no chunked encoding)",
        "HTTP 400",
        "stream",
        _http10_stream,
        reason="invalid_value",
    ),
]


CASES += [
    Case(
        "discovery",
        "RegisterPool",
        "an API key standing for relay/pool-a/relay-1 registering pool-b",
        "PERMISSION_DENIED",
        "pool_id",
        _relay_key_for_another_pool,
        reason="NOT_AUTHORIZED",
    ),
    Case(
        "discovery",
        "SIGHUP",
        "an --api-keys file rewritten with a key in clear",
        "file refused, current keys kept",
        "keys:2",
        _keys_file_in_clear_on_sighup,
    ),
    Case(
        "discovery",
        "serve flags",
        "an --api-keys line naming an unknown role (robot/x)",
        "exit 2",
        "--api-keys",
        _discovery_keys(f"robot/x sha256:{'0' * 64}\n"),
    ),
]

# Issue 18: a frontend URL on port 0 (relays dialled it and backed off for good).
CASES += [
    Case(
        "discovery",
        "RegisterPool",
        "a frontend URL on port 0",
        IA,
        "frontends[0]",
        _discovery("RegisterPool", _registration(frontends=["http://127.0.0.1:0"])),
    ),
    Case(
        "discovery",
        "RegisterFrontend",
        "url on port 0",
        IA,
        "url",
        _discovery(
            "RegisterFrontend",
            dpb.RegisterFrontendRequest(frontend_id="f", url="http://127.0.0.1:0", incarnation=1),
        ),
    ),
]


def _generate_with_metadata(metadata: tuple[tuple[str, str], ...]) -> Callable[[SecureMesh], Outcome]:
    """A sender of a good Generate with `metadata` beside it (as the client certificate)."""

    def send(mesh: SecureMesh) -> Outcome:
        with secure_channel(mesh.router, mesh.config("client")) as ch:
            rpc = rpb_grpc.RouterServiceStub(ch).Generate
            return _rpc(lambda: rpc(_generate(), timeout=10, metadata=metadata))

    return send


# Issue 20: the priority class a request asks for (x-priority), checked on both fronts.
CASES += [
    Case(
        "router",
        "Generate",
        "x-priority metadata 'high' (not a class 0-9)",
        IA,
        "metadata x-priority",
        _generate_with_metadata((("x-priority", "high"),)),
    ),
    Case(
        "router",
        "Generate",
        "x-priority 5 on a frontend without --policy (only 0 may be asked for)",
        "PERMISSION_DENIED",
        "",
        _generate_with_metadata((("x-priority", "5"),)),
        reason="PRIORITY_NOT_ALLOWED",
    ),
    Case(
        "http",
        _COMPLETIONS,
        "x-priority header 10 (not a class 0-9)",
        "HTTP 400",
        "x-priority",
        _http(_COMPLETIONS, _completion(), {"x-priority": "10"}),
    ),
]

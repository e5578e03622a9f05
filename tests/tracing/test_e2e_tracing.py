"""End to end, real processes exporting to a real OTLP receiver: one trace per request across the
frontend and the pool (continuing the client's), a migration span, relay spans; nothing when off."""

from __future__ import annotations

import json
import secrets
import time
import urllib.request

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch import MODEL, Mesh, free_port
from tests.tracing.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
PROMPT = [(13 * i + 7) % 30_000 for i in range(100)]
FRONTEND_SPANS = {
    "globalrouter.request",
    "globalrouter.decide",
    "globalrouter.admission",
    "globalrouter.pool_stream",
}


@pytest.fixture
def receiver(monkeypatch):
    r = OtlpReceiver()
    # The SDK's standard knob: batches go out every 0.2 s instead of 5 s, so the test waits less.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    yield r
    r.stop()


def traceparent() -> tuple[str, str, str]:
    """A sampled W3C traceparent and its trace and span ids (hex)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def generate(address: str, max_tokens: int, metadata=(), on_tokens=None) -> list[router_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as ch:
        out = []
        for msg in router_pb2_grpc.RouterServiceStub(ch).Generate(
            router_pb2.GenerateRequest(
                model=MODEL,
                prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=PROMPT)),
                max_tokens=max_tokens,
            ),
            metadata=metadata,
            timeout=30,
        ):
            out.append(msg)
            if on_tokens is not None and msg.WhichOneof("payload") == "tokens":
                on_tokens(msg.tokens)
        return out


def of_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


def start_mesh(procs, receiver: OtlpReceiver | None, monkeypatch, *pool_flags: str, http: str | None = None):
    """Discovery, two mocker pools with relays and a frontend; all exporting to `receiver` when given
    (the relays by their environment, POOLRELAY_OTLP_ENDPOINT: the launcher passes them no extra flags)."""
    tracing = ["--otlp-endpoint", receiver.endpoint] if receiver else []
    if receiver:
        monkeypatch.setenv("POOLRELAY_OTLP_ENDPOINT", receiver.endpoint)
    mesh = Mesh(procs)
    mesh.start_discovery()
    for name in ("pool-a", "pool-b"):
        mesh.start_pool(name, "eu", *pool_flags, *tracing)
    router = mesh.start_router(*tracing, *(["--http-listen", http] if http else []))
    mesh.wait_routable(router, mesh.pools)
    return mesh, router


def test_a_request_is_one_trace_from_the_client_through_the_frontend_into_the_pool(
    procs, receiver, monkeypatch
):
    http = f"127.0.0.1:{free_port()}"
    _mesh, router = start_mesh(procs, receiver, monkeypatch, "--speedup", "20", http=http)
    tp, trace_id, client_span = traceparent()
    out = generate(router.address, 12, metadata=(("traceparent", tp), ("tracestate", "vendor=x")))
    pool = out[-1].summary.pools[0]

    def complete(spans):
        names = {s.name for s in of_trace(spans, trace_id)}
        return FRONTEND_SPANS <= names and "mocker.generate" in names

    spans = of_trace(receiver.wait_for(complete), trace_id)
    request = one(spans, "globalrouter.request")
    assert request.service == "globalrouter" and request.parent_span_id == client_span  # the client's trace
    assert request.attributes["request.outcome"] == "OK" and request.attributes["request.tokens"] == 12
    decide = one(spans, "globalrouter.decide")
    assert decide.parent_span_id == request.span_id
    assert sorted(decide.attributes["decision.pools_considered"]) == ["pool-a", "pool-b"]
    assert decide.attributes["decision.chosen_pool"] in ("pool-a", "pool-b")
    assert "decision.cached_blocks" in decide.attributes
    admission = one(spans, "globalrouter.admission")
    assert admission.parent_span_id == request.span_id and admission.attributes["pool.id"] == pool
    assert admission.attributes["admission.code"] == "OK"
    stream = one(spans, "globalrouter.pool_stream")
    assert stream.attributes["pool.id"] == pool and stream.attributes["tokens.after"] == 12
    # The pool continued the trace from the call's metadata, under the admission attempt.
    mocker = one(spans, "mocker.generate")
    assert mocker.service == "mocker" and mocker.parent_span_id == admission.span_id
    assert mocker.attributes["pool.id"] == pool

    # The HTTP front: the traceparent header continues the client's trace the same way.
    tp2, trace2, client2 = traceparent()
    body = json.dumps({"model": MODEL, "prompt": "tracing over http", "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"http://{http}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "traceparent": tp2},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
    spans2 = of_trace(
        receiver.wait_for(
            lambda s: {"globalrouter.request", "mocker.generate"} <= {x.name for x in of_trace(s, trace2)}
        ),
        trace2,
    )
    assert one(spans2, "globalrouter.request").parent_span_id == client2

    # A request without a traceparent starts its own trace.
    before = {s.trace_id for s in receiver.spans()}
    generate(router.address, 3)
    fresh = receiver.wait_for(
        lambda s: any(x.name == "globalrouter.request" and x.trace_id not in before for x in s)
    )
    new = next(x for x in fresh if x.name == "globalrouter.request" and x.trace_id not in before)
    assert new.parent_span_id == ""

    # The relays' registrations are spans of their own; a telemetry stream's span ends with the
    # stream (here: the frontend stops, so each relay's stream to it breaks).
    receiver.wait_for(
        lambda s: (
            {x.attributes.get("pool.id") for x in s if x.name == "poolrelay.register"} >= {"pool-a", "pool-b"}
        )
    )
    router.proc.terminate()
    telemetry = receiver.wait_for(
        lambda s: (
            {x.attributes.get("pool.id") for x in s if x.name == "poolrelay.telemetry_stream"}
            >= {"pool-a", "pool-b"}
        )
    )
    streams = [x for x in telemetry if x.name == "poolrelay.telemetry_stream"]
    assert all(x.service == "poolrelay" and x.attributes["frontend.url"] for x in streams)
    assert any(int(x.attributes["telemetry.messages_sent"]) > 0 for x in streams)


def test_a_migration_is_a_span_of_the_request_with_its_reason_and_tokens_so_far(procs, receiver, monkeypatch):
    mesh, router = start_mesh(procs, receiver, monkeypatch, "--speedup", "1")  # 50 tokens/s: seconds long
    tp, trace_id, _ = traceparent()
    got: list[int] = []
    serving: list[str] = []

    def on_tokens(tokens) -> None:
        got.extend(tokens.token_ids)
        serving.append(tokens.pool_id)
        if len(got) >= 10 and len(set(serving)) == 1 and mesh.pools[serving[0]].pool.alive():
            mesh.pools[serving[0]].pool.kill9()  # the serving pool crashes mid-stream

    out = generate(router.address, 60, metadata=(("traceparent", tp),), on_tokens=on_tokens)
    assert out[-1].summary.migrations == 1
    first, second = out[-1].summary.pools

    def complete(spans):
        names = [s.name for s in of_trace(spans, trace_id)]
        # Each process exports on its own schedule: wait for the surviving pool's span too.
        return (
            "globalrouter.request" in names
            and names.count("globalrouter.pool_stream") == 2
            and "mocker.generate" in names
        )

    spans = of_trace(receiver.wait_for(complete), trace_id)
    request = one(spans, "globalrouter.request")
    migration = one(spans, "globalrouter.migration")
    assert migration.parent_span_id == request.span_id
    assert migration.attributes["migration.from_pool"] == first
    assert int(migration.attributes["migration.tokens_so_far"]) >= 10
    assert migration.attributes["migration.reason"]
    assert migration.attributes["decision.chosen_pool"] == second
    streams = {s.attributes["pool.id"]: s for s in spans if s.name == "globalrouter.pool_stream"}
    assert streams[first].error and not streams[second].error
    assert streams[second].attributes["tokens.after"] == 60
    assert request.attributes["request.migrations"] == 1
    # The surviving pool's span joined the same trace (the killed one's died with its process).
    assert any(s.name == "mocker.generate" and s.attributes["pool.id"] == second for s in spans)


def test_with_tracing_off_nothing_is_exported(procs, receiver, monkeypatch):
    # The receiver listens, but no process is told about it.
    _mesh, router = start_mesh(procs, None, monkeypatch, "--speedup", "20")
    tp, _trace_id, _ = traceparent()
    out = generate(router.address, 8, metadata=(("traceparent", tp),))
    assert out[-1].summary.tokens_generated == 8
    time.sleep(2.0)  # ten export periods of a process that would be exporting
    assert receiver.spans() == [] and receiver.exports == 0
    for p in procs.procs:
        assert "tracing on" not in p.output()

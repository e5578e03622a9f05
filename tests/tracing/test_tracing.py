"""meshkit.tracing: off costs nothing (no SDK loaded, no span objects), on exports to a real OTLP
receiver (plaintext or TLS per the security flags), sampling follows the caller; flags and the
OpenAI link's traceparent header."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time

import grpc
import pytest
from aiohttp import web

from globalrouter.openai_link import OpenAIClient
from globalrouter.serving import StreamBroken
from globalrouter.v1 import pool_frontend_pb2 as pf
from meshkit import tracing
from meshkit.devcerts import write_dev_pki
from meshkit.tls import SecurityConfig
from meshkit.tracing import TracingConfig
from tests.support import free_port
from tests.tracing.otlp_receiver import OtlpReceiver


@pytest.fixture
def receiver(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    r = OtlpReceiver()
    yield r
    tracing.shutdown()
    r.stop()


def test_off_loads_no_sdk_and_makes_no_span():
    # A fresh interpreter that imports every serving module (request path, fronts, pool, relay).
    code = (
        "import sys\n"
        "import globalrouter.server, globalrouter.serve_cli, mocker.server, mocker.cli, poolrelay.cli\n"
        "from meshkit import tracing\n"
        "assert not tracing.setup('x', tracing.TracingConfig())\n"
        "assert tracing.start_span('s') is None and tracing.outgoing_metadata() is None\n"
        "assert tracing.extract_metadata([('traceparent', 'x')]) is None\n"
        "assert tracing.extract_headers({'traceparent': 'x'}) is None\n"
        "h = {}; tracing.inject_headers(h); assert h == {}\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout  # not even the API is imported


def test_spans_continue_the_callers_trace_and_reach_the_receiver(receiver):
    assert tracing.setup("svc", TracingConfig(otlp_endpoint=receiver.endpoint))
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    ctx = tracing.extract_metadata([("traceparent", f"00-{trace_id}-{parent}-01"), ("other", "x")])
    span = tracing.start_span("work", ctx, {"a": 1}, server=True)
    assert span is not None
    with tracing.current(span):
        md = dict(tracing.outgoing_metadata() or ())
    assert md["traceparent"].split("-")[1] == trace_id  # the next hop continues the same trace
    tracing.end_span(span, RuntimeError("boom"), b="two", skipped=None)
    got = receiver.wait_for(lambda s: any(x.name == "work" for x in s))
    work = next(x for x in got if x.name == "work")
    assert (work.service, work.trace_id, work.parent_span_id) == ("svc", trace_id, parent)
    assert work.attributes == {"a": 1, "b": "two"} and work.error


def test_a_malformed_traceparent_starts_a_new_trace(receiver):
    assert tracing.setup("svc", TracingConfig(otlp_endpoint=receiver.endpoint))
    span = tracing.start_span("fresh", tracing.extract_headers({"TraceParent": "00-zz-yy-01"}))
    tracing.end_span(span)
    got = receiver.wait_for(lambda s: any(x.name == "fresh" for x in s))
    assert got[0].parent_span_id == "" and len(got[0].trace_id) == 32


def test_sampling_is_parent_based(receiver):
    assert tracing.setup("svc", TracingConfig(otlp_endpoint=receiver.endpoint, sample_ratio=0.0))
    tracing.end_span(tracing.start_span("new-trace"))  # ratio 0: not recorded
    sampled = tracing.extract_metadata(
        [("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")]
    )
    tracing.end_span(tracing.start_span("caller-sampled", sampled))  # the caller's choice wins
    unsampled = tracing.extract_metadata(
        [("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00")]
    )
    tracing.end_span(tracing.start_span("caller-unsampled", unsampled))
    tracing.shutdown()  # flushes
    assert [s.name for s in receiver.spans()] == ["caller-sampled"]


def test_export_over_mutual_tls_with_the_processs_certificates(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    write_dev_pki(tmp_path, trust_domain="mesh.test", pools=[], frontends=["router-1"])
    creds = grpc.ssl_server_credentials(
        [((tmp_path / "pool.key").read_bytes(), (tmp_path / "pool.crt").read_bytes())],
        root_certificates=(tmp_path / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    r = OtlpReceiver(creds)
    try:
        security = SecurityConfig(
            tls_cert=str(tmp_path / "router-1.crt"),
            tls_key=str(tmp_path / "router-1.key"),
            tls_ca=str(tmp_path / "ca.crt"),
        )
        endpoint = r.endpoint.replace("127.0.0.1", "localhost")  # the name the dev certificate holds
        assert tracing.setup("svc", TracingConfig(otlp_endpoint=endpoint), security)
        tracing.end_span(tracing.start_span("over-tls"))
        r.wait_for(lambda s: [x.name for x in s] == ["over-tls"])
    finally:
        tracing.shutdown()
        r.stop()


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--otlp-sample-ratio", "1.5"], "must be between 0 and 1"),
        (["--otlp-sample-ratio", "half"], "expected a number between 0 and 1"),
        (["--otlp-endpoint", "collector"], "--otlp-endpoint"),
    ],
)
def test_bad_tracing_flags_are_named(argv, problem, capsys):
    from mocker.cli import parse_serve

    with pytest.raises(SystemExit):
        parse_serve(["serve", "--listen", "127.0.0.1:0", "--pool-id", "p", "--model", "m", *argv])
    assert problem in capsys.readouterr().err


def test_every_serving_binary_takes_the_flags_and_their_environment(monkeypatch):
    from globalrouter import cli as router_cli
    from globalrouter.serve_cli import router_config
    from meshkit import settings
    from mocker.cli import parse_serve

    monkeypatch.setenv("MOCKER_OTLP_ENDPOINT", "127.0.0.1:4317")
    _args, config, _faults = parse_serve(
        ["serve", "--listen", "127.0.0.1:0", "--pool-id", "p", "--model", "m", "--otlp-sample-ratio", "0.25"]
    )
    assert config.tracing == TracingConfig("127.0.0.1:4317", 0.25)
    parser = router_cli.build_parser()
    args = settings.parse_args(
        parser, ["serve", "--discovery", "127.0.0.1:1", "--otlp-endpoint", "127.0.0.1:4317"]
    )
    args.security = SecurityConfig()
    assert router_config(args).tracing == TracingConfig("127.0.0.1:4317", 1.0)
    from poolrelay.cli import build_parser, config_from_args

    relay = build_parser()
    rargs = settings.parse_args(
        relay,
        [
            "serve",
            *("--pool", "127.0.0.1:2", "--discovery", "127.0.0.1:1", "--routing-pool", "p"),
            *("--routing-pool-region", "eu", "--otlp-endpoint", "127.0.0.1:4317"),
        ],
    )
    assert config_from_args(relay, rargs).tracing.otlp_endpoint == "127.0.0.1:4317"


async def test_the_openai_link_sends_the_admission_attempts_traceparent(receiver):
    assert tracing.setup("svc", TracingConfig(otlp_endpoint=receiver.endpoint))
    seen: dict[str, str] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.update({k.lower(): v for k, v in request.headers.items()})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        body = {"choices": [{"index": 0, "text": "", "token_ids": [1], "finish_reason": "length"}]}
        await resp.write(b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = OpenAIClient()
    try:
        span = tracing.start_span("globalrouter.admission")
        assert span is not None
        with tracing.current(span):
            stream = await client.open(
                f"http://127.0.0.1:{port}",
                pf.PoolFrontendServiceGenerateRequest(request_id="r", model="m", token_ids=[1], max_tokens=1),
                StreamBroken,
            )
        while await stream.read() is not None:
            pass
        ctx = span.get_span_context()
        assert seen["traceparent"] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        tracing.end_span(span)
    finally:
        await client.close()
        await runner.cleanup()


def test_a_collector_that_is_down_does_not_hold_the_exit():
    # A free port: nothing listens; the exporter would retry each batch for up to its 10 s deadline.
    assert tracing.setup("svc", TracingConfig(otlp_endpoint=f"127.0.0.1:{free_port()}"))
    for _ in range(10):
        tracing.end_span(tracing.start_span("lost"))
    started = time.monotonic()
    tracing.shutdown(timeout=0.5)
    assert time.monotonic() - started < 2.0
    assert not tracing.enabled()


def test_a_trace_sampled_out_makes_no_child_spans_and_tells_the_next_hop(receiver):
    assert tracing.setup("svc", TracingConfig(otlp_endpoint=receiver.endpoint, sample_ratio=0.0))
    root = tracing.start_span("request")
    assert root is not None and not root.is_recording()
    child = tracing.start_span("admission", root)
    assert child is root  # no span object per child of a trace nobody records
    with tracing.current(child):
        traceparent = dict(tracing.outgoing_metadata() or ())["traceparent"]
    assert int(traceparent.rsplit("-", 1)[1], 16) & 1 == 0  # sampled flag off: the pool follows
    tracing.end_span(child)
    tracing.end_span(root)
    tracing.shutdown()
    assert receiver.spans() == []

"""A request through the mesh to a real vLLM started with --otlp-traces-endpoint is one trace: the
frontend's spans and vLLM's own llm_request span, under the client's trace id (make test-engines)."""

from __future__ import annotations

import secrets

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch.vllm_engine import MODEL, Engine
from tests.engines.test_vllm_e2e import _engines_or_skip
from tests.engines.vllm_support import make_engine_files, start_vllm_relay, wait_vllm
from tests.router.mesh import Mesh
from tests.support import ProcessGroup, free_port
from tests.tracing.otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
MESH_SERVICES = {"globalrouter", "poolrelay", "mocker"}


def test_the_mesh_and_vllm_spans_are_one_trace(tmp_path, monkeypatch):
    python = _engines_or_skip()
    model_dir = make_engine_files(python, tmp_path / "model")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    receiver = OtlpReceiver()
    group = ProcessGroup(tmp_path)
    try:
        engine = Engine("pool-a", free_port(), free_port(), free_port())
        engine.proc = group.start(
            "vllm-pool-a",
            [*engine.args(python, model_dir), "--otlp-traces-endpoint", receiver.endpoint],
            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        )
        mesh = Mesh(group)
        mesh.start_discovery(None, "--heartbeat-interval", "2", "--lease-duration", "10")
        router = mesh.start_router("--otlp-endpoint", receiver.endpoint)
        wait_vllm(engine)
        start_vllm_relay(group, engine, "pool-a", mesh.discovery, "--otlp-endpoint", receiver.endpoint)
        mesh.wait_routable(router, ["pool-a"], timeout=120)

        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        with grpc.insecure_channel(router.address) as ch:
            out = list(
                router_pb2_grpc.RouterServiceStub(ch).Generate(
                    router_pb2.GenerateRequest(
                        model=MODEL,
                        prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=list(range(10, 74)))),
                        max_tokens=8,
                    ),
                    metadata=(("traceparent", f"00-{trace_id}-{client_span}-01"),),
                    timeout=600,
                )
            )
        assert out[-1].summary.tokens_generated == 8

        def complete(spans) -> bool:
            mine = [s for s in spans if s.trace_id == trace_id]
            return any(s.name == "globalrouter.request" for s in mine) and any(
                s.service not in MESH_SERVICES for s in mine
            )

        spans = [s for s in receiver.wait_for(complete, timeout=120) if s.trace_id == trace_id]
        request = next(s for s in spans if s.name == "globalrouter.request")
        admission = next(s for s in spans if s.name == "globalrouter.admission")
        engine_spans = [s for s in spans if s.service not in MESH_SERVICES]
        assert request.parent_span_id == client_span
        # vLLM's request span continues the trace from the traceparent header the mesh sent.
        assert any(s.name == "llm_request" and s.parent_span_id == admission.span_id for s in engine_spans), [
            (s.service, s.name, s.parent_span_id) for s in engine_spans
        ]
    except BaseException:
        print(group.dump_logs(6000))
        raise
    finally:
        group.stop_all()
        receiver.stop()

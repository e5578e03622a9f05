"""End to end, real processes: a frontend's probe port (--probe-listen, --probe-http-listen) says
ready and live once it can route, and not ready as soon as SIGTERM begins the stop, while the
stop's grace runs (its loop still turns: live)."""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch import MODEL, free_port, local_mesh, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = [(17 * i + 3) % 30_000 for i in range(64)]


def health(address: str, service: str = "") -> int | None:
    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError:
            return None
        return int(reply.status)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def generate(address: str, out: dict) -> None:
    """A Generate long enough (150 tokens at 50/s) that the stop's grace is in use meanwhile."""
    request = router_pb2.GenerateRequest(
        model=MODEL, prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=PROMPT)), max_tokens=150
    )
    out["tokens"] = 0
    try:
        with grpc.insecure_channel(address) as ch:
            for msg in router_pb2_grpc.RouterServiceStub(ch).Generate(request, timeout=40):
                if msg.WhichOneof("payload") == "summary":
                    out["summary"] = msg.summary
                else:
                    out["tokens"] += len(msg.tokens.token_ids)
    except grpc.RpcError as exc:
        out["error"] = exc


def test_the_probe_port_says_ready_when_routable_and_not_ready_once_sigterm_begins(tmp_path):
    with local_mesh(tmp_path) as mesh:
        mesh.start_discovery()
        mesh.start_pool("pool-a", "eu", "--speedup", "1")
        probe, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        router = mesh.start_router("--grace", "20", "--probe-listen", probe, "--probe-http-listen", http)
        mesh.wait_routable(router, mesh.pools)
        wait_until(lambda: health(probe) == SERVING, 30, message="the probe says ready")
        assert health(probe, "liveness") == SERVING
        assert health(probe, "globalrouter.v1.RouterService") == SERVING  # the main port's names too
        status, body = get(f"http://{http}/readyz")
        assert status == 200 and body["status"] == "ready" and body["directory_synced"] is True
        assert body["loop_tick_age_s"] < 1.0
        assert get(f"http://{http}/livez")[0] == 200

        out: dict = {}
        thread = threading.Thread(target=generate, args=(router.address, out), daemon=True)
        thread.start()
        wait_until(lambda: out.get("tokens"), 15, message="the request is streaming")
        router.proc.signal(signal.SIGTERM)
        wait_until(lambda: health(probe) == NOT_SERVING, 10, message="the probe says not ready on SIGTERM")
        status, body = get(f"http://{http}/readyz")
        assert status == 503 and body["stopping"] is True
        router.proc.check_alive()  # the grace still runs for the in-flight stream
        assert "summary" not in out, "the stream outlives the probe's turn to not ready"
        # The loop still turns (the stream's tokens go out): live, so nothing kills it mid-grace.
        assert health(probe, "liveness") == SERVING and get(f"http://{http}/livez")[0] == 200
        thread.join(40)
        assert "error" not in out and out["summary"].finish_reason, out
        assert router.proc.popen.wait(timeout=30) == 0, router.proc.output_tail()

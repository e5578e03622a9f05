"""python -m meshkit.healthcheck, the in-container probe: 0 when SERVING, 1 when not, 2 unreachable."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshkit import healthcheck
from meshlaunch import free_port


@pytest.fixture
def health_server():
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_serving_is_zero_and_not_serving_is_one(health_server) -> None:
    servicer, target = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.check(target) == (0, f"{target}: SERVING")
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.check(target) == (1, f"{target}: NOT_SERVING")


def test_an_unknown_service_or_a_closed_port_is_unreachable(health_server) -> None:
    _servicer, target = health_server
    code, line = healthcheck.check(target, service="no.such.Service")
    assert code == 2 and "NOT_FOUND" in line
    closed = f"127.0.0.1:{free_port()}"
    code, line = healthcheck.check(closed, timeout=1.0)
    assert code == 2 and "UNAVAILABLE" in line


def test_the_module_runs_as_a_probe_command(health_server) -> None:
    servicer, target = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    done = subprocess.run(
        [sys.executable, "-m", "meshkit.healthcheck", "--target", target],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and done.stderr.strip() == f"{target}: SERVING"
    bad = subprocess.run(
        [sys.executable, "-m", "meshkit.healthcheck", "--target", "nowhere"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "--target" in bad.stderr

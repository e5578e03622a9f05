"""SIGTERM of a frontend holding many telemetry streams: it exits 0 within its grace."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from bench import scale_sim
from meshkit.errors import Reason, reason_of
from meshlaunch import local_mesh, wait_until
from poolrelay.v1 import telemetry_pb2, telemetry_pb2_grpc
from tests.support import start_simulated_pools

POOLS = 150
RELAYS = 2
BLOCKS = 2000
GRACE = 10.0
"""Long, so that a stop waiting on the streams (their next message, or the grace's end) shows."""
LIMIT = 4.0
"""SIGTERM to exit: unregistering, cutting every stream, closing, the interpreter's exit."""


def _idle_stream(address: str, errors: list[grpc.RpcError], acked: threading.Event, done: threading.Event):
    """One more relay stream, from the test: a hello, then silence until the frontend ends it."""
    hello = telemetry_pb2.TelemetryHello(
        pool_id="shutdown-probe",
        relay_id="relay-0",
        incarnation=1,
        protocol_version=1,
        block_size=16,
        hash_scheme=telemetry_pb2.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
    )

    def requests():
        yield telemetry_pb2.PublishPoolTelemetryRequest(hello=hello)
        done.wait(120)

    with grpc.insecure_channel(address) as channel:
        call = telemetry_pb2_grpc.TelemetryServiceStub(channel).PublishPoolTelemetry(requests())
        try:
            for _ in call:
                acked.set()
        except grpc.RpcError as exc:
            errors.append(exc)
        finally:
            done.set()


@pytest.mark.timeout(150)
def test_sigterm_with_hundreds_of_idle_telemetry_streams_exits_0_at_once(tmp_path):
    """300 telemetry streams whose relays send nothing after their snapshot (a long report
    interval): SIGTERM cuts them at once, UNAVAILABLE with reason SHUTTING_DOWN (they never
    finish, so neither their next message nor the grace's end may be waited for), and the
    process exits 0 well within its grace (nothing else is in flight)."""
    nodes = tmp_path / "nodes.npz"
    rng = np.random.default_rng(7)
    hashes = rng.integers(1, 2**63, size=(80, scale_sim.NODE_BLOCKS), dtype=np.uint64)
    np.savez(nodes, hashes=hashes, uses=np.ones(len(hashes)))
    stats = tmp_path / "sim.json"
    with local_mesh(tmp_path) as mesh:
        mesh.start_discovery()
        router = mesh.start_router("--max-telemetry-streams", str(POOLS * RELAYS + 64), "--grace", str(GRACE))
        _sim, counters = start_simulated_pools(
            mesh,
            router.address,
            nodes,
            stats,
            *("--count", str(POOLS), "--relays", str(RELAYS), "--blocks", str(BLOCKS), "--rate", "0"),
            *("--report-interval", "60", "--seconds", "140"),
        )

        wait_until(
            lambda: counters().get("hello_acks", 0) >= POOLS * RELAYS,
            90,
            interval=0.5,
            message="every simulated relay's stream acknowledged",
        )
        errors: list[grpc.RpcError] = []
        acked, done = threading.Event(), threading.Event()
        probe = threading.Thread(target=_idle_stream, args=(router.address, errors, acked, done), daemon=True)
        probe.start()
        assert acked.wait(30), "the probe stream's hello acknowledged"
        t0 = time.monotonic()
        router.proc.signal(15)
        try:
            code = router.proc.popen.wait(timeout=60)
        finally:
            took = time.monotonic() - t0
            done.set()
        probe.join(10)
        assert code == 0, router.proc.output_tail()
        assert took <= LIMIT, f"SIGTERM took {took:.1f} s with {POOLS * RELAYS} streams (grace {GRACE} s)"
        assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors
        assert reason_of(errors[0]) == Reason.SHUTTING_DOWN

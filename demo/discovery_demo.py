"""Interim demo of Global Discovery: two pools register, one keeps renewing, the other's lease lapses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from globaldiscovery.cli import format_table, pool_record  # noqa: E402
from globaldiscovery.v1 import discovery_pb2 as pb  # noqa: E402
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc  # noqa: E402
from meshkit import timeconv  # noqa: E402
from tests.support import command, free_port  # noqa: E402

HEARTBEAT = 0.5
LEASE = 1.5


def say(text: str) -> None:
    print(text, flush=True)


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"globaldiscovery exited early with code {proc.returncode}")
            with contextlib.suppress(grpc.RpcError):
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            time.sleep(0.05)
    raise RuntimeError(f"globaldiscovery did not become healthy on {address} within {timeout:g} s")


def registration(pool_id: str, model: str, port: int) -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(
        pool_id=pool_id,
        model=model,
        region="local",
        frontends=[f"http://127.0.0.1:{port}"],
        relay_id=f"{pool_id}-relay",
        incarnation=time.time_ns(),
    )


def list_table(stub: pb_grpc.DiscoveryServiceStub) -> str:
    reply = stub.ListPools(pb.ListPoolsRequest(), timeout=5)
    return format_table([pool_record(p) for p in reply.pools])


def run(address: str, proc: subprocess.Popen) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DiscoveryServiceStub(channel)
        east = registration("pool-east", "demo-model", 8001)
        west = registration("pool-west", "demo-model", 8002)

        say("\n2. Two pools register through the generated stubs (as their relays would).")
        for req in (east, west):
            reply = stub.RegisterPool(req, timeout=5)
            say(
                f"   {req.pool_id}: registered; the server says renew every "
                f"{timeconv.seconds(reply.heartbeat_interval):g} s, the lease lasts "
                f"{timeconv.seconds(reply.lease_duration):g} s"
            )

        say("\n3. The directory now lists both pools:")
        say("   " + list_table(stub).replace("\n", "\n   "))

        say(
            "\n4. A watcher opens a WatchPools stream: it gets the current pools, then a 'snapshot done' marker."
        )
        watch = stub.WatchPools(pb.WatchPoolsRequest(), timeout=15)
        for event in watch:
            if event.type == pb.WATCH_EVENT_TYPE_SNAPSHOT_DONE:
                say("   snapshot done; from now on the watcher sees changes as they happen")
                break
            say(f"   snapshot: {event.pool.pool_id}")

        say(
            f"\n5. pool-east keeps renewing every {HEARTBEAT:g} s; pool-west stops (as if its relay crashed)."
        )
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(HEARTBEAT):
                with contextlib.suppress(grpc.RpcError):
                    stub.RegisterPool(east, timeout=2)

        renewer = threading.Thread(target=renew, daemon=True)
        renewer.start()
        started = time.monotonic()
        try:
            for event in watch:
                if event.type == pb.WATCH_EVENT_TYPE_REMOVED:
                    reason = pb.RemovalReason.Name(event.removal_reason)
                    say(
                        f"   watch event after {time.monotonic() - started:.1f} s: {event.pool.pool_id} REMOVED "
                        f"({reason}) — its lease of {LEASE:g} s ran out without a renewal"
                    )
                    break
        finally:
            watch.cancel()
        time.sleep(HEARTBEAT * 2)
        say("\n6. The directory now lists only the pool that kept renewing:")
        say("   " + list_table(stub).replace("\n", "\n   "))
        stop.set()
        renewer.join(timeout=5)


def main() -> int:
    port = free_port()
    address = f"127.0.0.1:{port}"
    say("Global Discovery demo: the directory where serving pools register under leases.")
    say(
        f"\n1. Start `globaldiscovery serve` on {address} with a short lease "
        f"(heartbeat {HEARTBEAT:g} s, lease {LEASE:g} s) so the demo is quick."
    )
    proc = subprocess.Popen(
        [
            command("globaldiscovery"),
            "serve",
            "--listen",
            address,
            "--heartbeat-interval",
            str(HEARTBEAT),
            "--lease-duration",
            str(LEASE),
            "--log-level",
            "warning",
        ],
        start_new_session=True,
    )
    try:
        wait_serving(address, proc)
        run(address, proc)
        say("\n7. Stop the server with SIGTERM: it reports NOT_SERVING, closes watchers and exits.")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
        say(f"   globaldiscovery exited with code {code}")
        say("\nDone.")
        return 0 if code == 0 else 1
    except Exception as exc:
        say(f"demo failed: {exc}")
        return 1
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())

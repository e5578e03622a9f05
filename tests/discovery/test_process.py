"""`globaldiscovery` as a real process: grpcurl, generated stubs, SIGTERM, bad flags, `pools --json`."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshlaunch import command, free_port, wait_until
from tests.discovery.helpers import run_pools, start_discovery
from tests.support import BIN

pytestmark = pytest.mark.timeout(90)

GRPCURL = str(BIN / "grpcurl")


def grpcurl(*args: str) -> str:
    done = subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_grpcurl_lists_services_and_registers_then_lists(procs):
    _, address = start_discovery(procs)
    services = grpcurl(address, "list").split()
    assert "globaldiscovery.v1.DiscoveryService" in services and "grpc.health.v1.Health" in services
    body = {
        "pool_id": "pool-g",
        "model": "llama",
        "region": "eu",
        "frontends": ["http://127.0.0.1:8000"],
        "relay_id": "relay-1",
        "incarnation": "1",
    }
    reply = json.loads(
        grpcurl("-d", json.dumps(body), address, "globaldiscovery.v1.DiscoveryService/RegisterPool")
    )
    assert reply["heartbeat_interval"] == "0.500s" and reply["lease_duration"] == "1.500s"
    listing = json.loads(grpcurl("-d", "{}", address, "globaldiscovery.v1.DiscoveryService/ListPools"))
    assert [p["pool_id"] for p in listing["pools"]] == ["pool-g"]
    assert listing["pools"][0]["frontends"] == ["http://127.0.0.1:8000"]


def test_stubs_register_then_sigterm_exits_zero_quickly(procs):
    proc, address = start_discovery(procs)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DiscoveryServiceStub(channel)
        request = pb.RegisterPoolRequest(
            pool_id="p", model="m", region="r", frontends=["http://h:1"], relay_id="x", incarnation=1
        )
        stub.RegisterPool(request, timeout=10)
        watch = stub.WatchPools(pb.WatchPoolsRequest(), timeout=30)
        assert next(watch).type == pb.WATCH_EVENT_TYPE_ADDED
        assert next(watch).type == pb.WATCH_EVENT_TYPE_SNAPSHOT_DONE
        done_sending = threading.Event()

        def renewals():
            yield pb.KeepAlivePoolsRequest(register=request, sequence=1)
            done_sending.wait(30)  # keep the stream open and idle, like a relay between renewals

        keepalive = stub.KeepAlivePools(renewals(), timeout=30)
        assert next(keepalive).sequence == 1
        started = time.monotonic()
        proc.signal(signal.SIGTERM)
        # The open watch and keep-alive stream are closed cleanly with UNAVAILABLE, not cut off
        # (nor left to hold the 5 s grace period).
        for stream in (watch, keepalive):
            with pytest.raises(grpc.RpcError) as info:
                next(stream)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        done_sending.set()
        assert proc.popen.wait(timeout=5) == 0
        assert time.monotonic() - started < 4


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--heartbeat-interval", "0"], "--heartbeat-interval"),
        (["--heartbeat-interval", "-1"], "--heartbeat-interval"),
        (["--heartbeat-interval", "soon"], "--heartbeat-interval"),
        (["--heartbeat-interval", "5", "--lease-duration", "5"], "--lease-duration"),
        (["--heartbeat-interval", "5", "--lease-duration", "86401"], "--lease-duration"),
        (["--listen", "nowhere"], "--listen"),
        (["--store", "etcd"], "--etcd-endpoints"),
        (["--store", "etcd", "--etcd-endpoints", "no-port"], "--etcd-endpoints"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, named):
    done = subprocess.run(
        [command("globaldiscovery"), "serve", *flags], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert named in done.stderr


def test_pools_json_and_table(procs):
    # Leases far longer than a CLI start on a loaded machine: this test is about the listing, not expiry.
    _, address = start_discovery(procs, "--heartbeat-interval", "5", "--lease-duration", "120")
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DiscoveryServiceStub(channel)

        def register_both() -> None:
            for pool, model in (("pool-b", "m2"), ("pool-a", "m1")):
                stub.RegisterPool(
                    pb.RegisterPoolRequest(
                        pool_id=pool,
                        model=model,
                        region="eu",
                        frontends=["http://h:1"],
                        relay_id="r",
                        incarnation=1,
                    ),
                    timeout=10,
                )

        register_both()
        done = run_pools(address, "--json")
        assert done.returncode == 0, done.stderr
        lines = [json.loads(line) for line in done.stdout.splitlines()]
        assert [(r["pool_id"], r["model"], r["region"], r["frontends"], r["draining"]) for r in lines] == [
            ("pool-a", "m1", "eu", ["http://h:1"], False),
            ("pool-b", "m2", "eu", ["http://h:1"], False),
        ]
        register_both()
        table = run_pools(address)
        assert table.returncode == 0 and "POOL" in table.stdout and "pool-a" in table.stdout
    # Leases lapse without renewals: the listing empties.
    wait_until(
        lambda: run_pools(address, "--json").stdout == "",
        timeout=20,
        message="pools to lapse",
    )


def test_pools_against_nothing_fails_clearly():
    address = f"127.0.0.1:{free_port()}"
    done = run_pools(address, "--timeout", "1")
    assert done.returncode == 1
    assert "UNAVAILABLE" in done.stderr or "DEADLINE_EXCEEDED" in done.stderr

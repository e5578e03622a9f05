"""PR #18077 end to end with real processes: a running relay keeps its pool listed lease after
lease; after SIGTERM the pool leaves about one lease later (2 s heartbeat, 6 s lease: ≈ 5 s), and at
once with --unregister-on-exit; a pool registered with no frontends is listed but not routable."""

from __future__ import annotations

import time

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from meshlaunch import command, free_port, wait_healthy, wait_until

pytestmark = pytest.mark.e2e

HEARTBEAT, LEASE = 2.0, 6.0
# Discovery's expiry sweep and a loaded box may list a pool a little after its lease ends.
EXPIRY_SLACK = 1.5


def start(procs, name: str, args: list[str], health: str):
    p = procs.start(name, args)
    wait_healthy(health, proc=p, timeout=30)
    return p


def listed(discovery: str) -> dpb.Pool | None:
    with grpc.insecure_channel(discovery) as ch:
        reply = dpb_grpc.DiscoveryServiceStub(ch).ListPools(dpb.ListPoolsRequest(), timeout=5)
    return next((p for p in reply.pools if p.pool_id == "pool-a"), None)


def mesh(procs, *relay_flags: str):
    discovery = f"127.0.0.1:{free_port()}"
    start(
        procs,
        "discovery",
        [
            command("globaldiscovery"),
            "serve",
            "--listen",
            discovery,
            "--heartbeat-interval",
            str(HEARTBEAT),
            "--lease-duration",
            str(LEASE),
        ],
        discovery,
    )
    pool = f"127.0.0.1:{free_port()}"
    start(
        procs,
        "mocker",
        [
            command("mocker"),
            "serve",
            "--listen",
            pool,
            "--pool-id",
            "pool-a",
            "--model",
            "m1",
            "--speedup",
            "100",
        ],
        pool,
    )
    status = f"127.0.0.1:{free_port()}"
    relay = start(
        procs,
        "relay",
        [
            command("poolrelay"),
            "serve",
            "--pool",
            pool,
            "--discovery",
            discovery,
            "--routing-pool",
            "pool-a",
            "--routing-pool-region",
            "eu",
            "--status-listen",
            status,
            *relay_flags,
        ],
        status,
    )
    return discovery, pool, relay


@pytest.mark.timeout(120)
def test_pool_stays_listed_while_the_relay_runs_and_leaves_one_lease_after_sigterm(procs):
    discovery, _pool, relay = mesh(procs, "--routing-pool-frontends", "http://127.0.0.1:1")
    wait_until(lambda: listed(discovery), timeout=20, message="pool listed")
    watched_from = time.monotonic()
    while time.monotonic() - watched_from < 3 * LEASE:
        assert listed(discovery) is not None, f"pool dropped {time.monotonic() - watched_from:.1f} s in"
        time.sleep(0.25)
    # Renewals stop at the SIGTERM, not at the exit: timed from after terminate(), a relay slow to
    # exit on a loaded machine made the lease look shorter than it was.
    stopped = time.monotonic()
    assert relay.terminate() == 0
    assert listed(discovery) is not None, "SIGTERM does not pull the pool out of routing"
    wait_until(lambda: listed(discovery) is None, timeout=LEASE + 10, interval=0.1, message="pool gone")
    gone_after = time.monotonic() - stopped
    # The last renewal was at most one heartbeat before the stop: the lease ends 4 to 6 s later.
    assert LEASE - HEARTBEAT - 0.5 <= gone_after <= LEASE + EXPIRY_SLACK, (
        f"left {gone_after:.2f} s after SIGTERM"
    )
    print(f"pool left {gone_after:.2f} s after SIGTERM (heartbeat {HEARTBEAT} s, lease {LEASE} s)")


@pytest.mark.timeout(90)
def test_unregister_on_exit_leaves_at_once_and_no_frontends_is_listed(procs):
    discovery, _, relay = mesh(procs, "--unregister-on-exit")
    found = wait_until(lambda: listed(discovery), timeout=20, message="pool listed")
    assert list(found.frontends) == [], "a pool with no frontends is listed"
    assert relay.terminate() == 0
    assert listed(discovery) is None, "--unregister-on-exit: the pool leaves at once"

"""Hung, not dead, with real processes: a pool stopped with SIGSTOP mid-stream (or wedged by the
mocker's stall fault) is failed for the request within the stall timeout and the request migrates;
a relay stopped with SIGSTOP makes its pool's signals unknown, not zero, and the pool stays listed
until its lease lapses."""

from __future__ import annotations

import signal
import time

import pytest

from meshlaunch import Mesh, command, free_port, route, wait_healthy, wait_until
from mocker.tokens import continue_sequence
from tests.router.test_e2e_migration import stream

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
PROMPT = [(17 * i + 3) % 30_000 for i in range(90)]
STALL_TIMEOUT = 2.0
# Far below the ~60 s a hung peer used to hold a request (keepalive's ping timeout on a busy box).
MIGRATION_BOUND = STALL_TIMEOUT + 6.0


@pytest.mark.parametrize("how", ["sigstop", "stall-fault"])
def test_a_hung_pool_mid_stream_is_failed_within_the_stall_timeout(procs, how):
    mesh = Mesh(procs)
    mesh.start_discovery()
    extra = ["--stall-after-tokens", "10"] if how == "stall-fault" else []
    for name in ("pool-a", "pool-b"):
        mesh.start_pool(name, "eu", "--speedup", "1", *(extra if name == "pool-a" else []))
    router = mesh.start_router("--stall-timeout", str(STALL_TIMEOUT))
    mesh.wait_routable(router, mesh.pools)
    # pool-a first: pool-b looks busy for this prompt at this frontend.
    chunks: list[tuple[str, int]] = []
    hung: dict[str, float] = {}
    got: list[int] = []
    summary = None
    stopped = None
    try:
        for msg in stream(router.address, PROMPT, 120):
            if msg.WhichOneof("payload") == "summary":
                summary = msg.summary
                continue
            pool_id = msg.tokens.pool_id
            if hung and pool_id not in hung and "resumed" not in hung:
                hung["resumed"] = time.monotonic() - hung[next(iter(hung))]
            got.extend(msg.tokens.token_ids)
            chunks.append((pool_id, len(got)))
            if how == "sigstop" and len(got) >= 10 and not hung:
                stopped = mesh.pools[pool_id].pool
                stopped.signal(signal.SIGSTOP)
                hung[pool_id] = time.monotonic()
            elif how == "stall-fault" and not hung and pool_id == "pool-a" and len(got) >= 10:
                hung[pool_id] = time.monotonic()
    finally:
        if stopped is not None:
            stopped.signal(signal.SIGCONT)
    if how == "stall-fault" and chunks[0][0] != "pool-a":
        pytest.skip("the router chose pool-b first; the fault is on pool-a")  # rank ties are hashed
    assert got == continue_sequence(PROMPT, 120), "nothing lost or repeated"
    assert summary is not None and summary.migrations == 1
    assert "resumed" in hung
    assert hung["resumed"] <= MIGRATION_BOUND, f"the request sat {hung['resumed']:.1f} s on a hung pool"
    print(f"{how}: migrated {hung['resumed']:.2f} s after the hang (stall timeout {STALL_TIMEOUT} s)")


def test_a_hung_relay_makes_signals_unknown_and_the_pool_stays_listed_until_its_lease_lapses(procs):
    mesh = Mesh(procs)
    heartbeat, lease = 1.0, 8.0  # long enough for the load signal (3 s) to go stale first
    mesh.discovery = f"127.0.0.1:{free_port()}"
    disco = procs.start(
        "discovery",
        [
            command("globaldiscovery"),
            "serve",
            "--listen",
            mesh.discovery,
            "--heartbeat-interval",
            str(heartbeat),
            "--lease-duration",
            str(lease),
        ],
    )
    wait_healthy(mesh.discovery, proc=disco)
    for name in ("pool-a", "pool-b"):
        mesh.start_pool(name, "eu", "--speedup", "20")
    router = mesh.start_router()
    mesh.wait_routable(router, mesh.pools)
    relay = mesh.pools["pool-a"].relay
    relay.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:

        def stale():
            view = router.pools()["pool-a"]
            return view if not view.load_freshness.fresh else None

        view = wait_until(stale, timeout=15, message="pool-a's load goes stale")
        assert view.listed, "losing signals never deletes a pool"
        ranked = route(router.address, PROMPT)
        by_pool = {c.pool_id: c for c in ranked.candidates}
        assert "pool-a" in by_pool, "unknown load is not excluded"
        assert not by_pool["pool-a"].load_known and by_pool["pool-b"].load_known
        assert [c.pool_id for c in ranked.candidates][-1] == "pool-a", "unknown ranks behind known"
        wait_until(
            lambda: (p := router.pools().get("pool-a")) is None or not p.listed,
            timeout=lease + 10,
            message="pool-a leaves when its lease lapses",
        )
        left_after = time.monotonic() - stopped_at
        assert left_after >= lease - heartbeat - 1.0, (
            f"left after {left_after:.1f} s: before its lease lapsed"
        )
    finally:
        relay.signal(signal.SIGCONT)
    wait_until(
        lambda: router.pools().get("pool-a") is not None and router.pools()["pool-a"].listed,
        timeout=20,
        message="pool-a listed again once its relay runs",
    )

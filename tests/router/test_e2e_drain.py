"""End to end, real processes: drain and discovery outages."""

from __future__ import annotations

import threading

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2, discovery_pb2_grpc
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch import MODEL, Mesh, generate_cli, wait_until
from mocker.tokens import continue_sequence
from mocker.v1 import admin_pb2, admin_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
PROMPT = [(13 * i + 1) % 30_000 for i in range(80)]


class Background:
    """A Generate running in a thread, recording its tokens, pools and outcome."""

    def __init__(self, address: str, tokens: list[int], max_tokens: int) -> None:
        self.tokens: list[int] = []
        self.chunk_pools: list[str] = []
        self.summary: router_pb2.GenerateSummary | None = None
        self.error: grpc.RpcError | None = None
        self._args = (address, tokens, max_tokens)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        address, tokens, max_tokens = self._args
        request = router_pb2.GenerateRequest(
            model=MODEL,
            prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
            max_tokens=max_tokens,
        )
        try:
            with grpc.insecure_channel(address) as ch:
                for msg in router_pb2_grpc.RouterServiceStub(ch).Generate(request, timeout=40):
                    if msg.WhichOneof("payload") == "summary":
                        self.summary = msg.summary
                    else:
                        self.tokens.extend(msg.tokens.token_ids)
                        self.chunk_pools.append(msg.tokens.pool_id)
        except grpc.RpcError as exc:
            self.error = exc

    def result(self) -> router_pb2.GenerateSummary:
        self.thread.join(45)
        assert self.error is None, f"{self.error.code()}: {self.error.details()}"
        assert self.summary is not None
        return self.summary


def set_ready(mesh: Mesh, pool_id: str, ready: bool) -> None:
    with grpc.insecure_channel(mesh.pools[pool_id].address) as ch:
        admin_pb2_grpc.MockerAdminServiceStub(ch).SetModelReady(
            admin_pb2.SetModelReadyRequest(model=MODEL, ready=ready), timeout=5
        )


def test_drain_finishes_accepted_work_routes_new_work_elsewhere_and_migrates_the_rest(procs):
    mesh = Mesh(procs)
    mesh.start_discovery()
    mesh.start_pool("pool-a", "eu", "--speedup", "1")
    mesh.start_pool("pool-b", "eu", "--speedup", "1", "--not-ready", MODEL)  # everything goes to pool-a first
    router = mesh.start_router()
    mesh.wait_routable(router, mesh.pools)
    long_run = Background(router.address, PROMPT, 200)  # 4 s of decode: outlives the drain deadline
    short_run = Background(router.address, [*PROMPT, 1], 30)  # 0.6 s: finishes within it
    wait_until(lambda: long_run.tokens and short_run.tokens, 15, message="both requests streaming")
    assert long_run.chunk_pools[0] == short_run.chunk_pools[0] == "pool-a"
    set_ready(mesh, "pool-b", True)
    mesh.drain("pool-a", 2.5)
    wait_until(lambda: router.pools()["pool-a"].draining, 5, message="the router learns of the drain")
    # New work goes elsewhere at once.
    fresh = generate_cli(router, [*PROMPT, 2], 5)
    assert fresh["pools"] == ["pool-b"]
    # Accepted work finishes where it runs.
    short = short_run.result()
    assert list(short.pools) == ["pool-a"] and short.migrations == 0
    assert short_run.tokens == continue_sequence([*PROMPT, 1], 30)
    # What still runs at the deadline is handed back and migrated: nothing lost or repeated.
    long = long_run.result()
    assert list(long.pools) == ["pool-a", "pool-b"] and long.migrations == 1
    assert long_run.tokens == continue_sequence(PROMPT, 200)
    # The drained pool leaves the directory.
    wait_until(
        lambda: "pool-a" not in (views := router.pools()) or not views["pool-a"].listed,
        10,
        message="pool-a leaves the directory",
    )


def test_discovery_down_keeps_routing_and_the_watch_resumes(procs):
    mesh = Mesh(procs)
    mesh.start_discovery()
    mesh.start_pool("pool-a", "eu", "--speedup", "10")
    router = mesh.start_router()
    mesh.wait_routable(router, mesh.pools)
    mesh.discovery_proc.kill9()
    # Well past the lease: the router keeps routing on the directory it has.
    for i in range(3):
        result = generate_cli(router, [*PROMPT, i], 4)
        assert result["pools"] == ["pool-a"]
    assert router.pools()["pool-a"].listed
    mesh.start_discovery()  # same address
    mesh.start_pool("pool-b", "us", "--speedup", "10")
    mesh.wait_routable(router, mesh.pools, timeout=25)  # the watch resumed: pool-b is listed
    assert router.pools()["pool-a"].listed
    # SIGTERM: the frontend unregisters (relays stop streaming to it) and exits 0.
    wait_until(lambda: frontends(mesh), 10, message="the router re-registered with the new discovery")
    assert router.proc.terminate() == 0
    assert frontends(mesh) == []


def frontends(mesh: Mesh) -> list[str]:
    with grpc.insecure_channel(mesh.discovery) as ch:
        reply = discovery_pb2_grpc.DiscoveryServiceStub(ch).ListFrontends(
            discovery_pb2.ListFrontendsRequest(), timeout=5
        )
    return [f.frontend_id for f in reply.frontends]


def test_sigterm_lets_in_flight_streams_finish_within_the_grace_period(procs):
    mesh = Mesh(procs)
    mesh.start_discovery()
    mesh.start_pool("pool-a", "eu", "--speedup", "1")  # 150 tokens at 50/s: 3 s of decode
    router = mesh.start_router("--grace", "20")
    mesh.wait_routable(router, mesh.pools)
    run = Background(router.address, PROMPT, 150)
    wait_until(lambda: run.tokens, 15, message="the request is streaming")
    assert run.summary is None and run.error is None
    # SIGTERM mid-stream: the frontend stops taking work, but the accepted stream runs to its end
    # on the serving link, and only then does the process exit (0).
    assert router.proc.terminate(timeout=25) == 0
    run.thread.join(5)
    assert not run.thread.is_alive(), "the stream ended when the process did"
    summary = run.result()
    assert run.tokens == continue_sequence(PROMPT, 150)
    assert list(summary.pools) == ["pool-a"] and summary.migrations == 0
    assert frontends(mesh) == []  # it unregistered

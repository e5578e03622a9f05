"""The scale harness's building blocks at tiny size: simulated relays against a real frontend."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench import bench_scale, scale_sim
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshlaunch import local_mesh, wait_until
from poolrelay.v1 import telemetry_pb2 as tm
from poolrelay.v1 import telemetry_pb2_grpc as tm_grpc
from tests.support import start_simulated_pools

POOLS = 3
RELAYS = 2
BLOCKS = 100


def test_messages_are_what_protobuf_writes():
    """The simulator writes pre-encoded bytes: they must be the messages protobuf would write."""
    stored = np.array([1, 2**64 - 1, 12345], dtype=np.uint64)
    removed = np.array([7], dtype=np.uint64)
    want = tm.PublishPoolTelemetryRequest(
        kv_delta=tm.KvDelta(sequence=300, stored=stored.tolist(), removed=[7])
    )
    assert scale_sim.delta_message(300, stored, removed) == want.SerializeToString()
    empty = np.zeros(0, dtype=np.uint64)
    assert tm.PublishPoolTelemetryRequest.FromString(
        scale_sim.delta_message(1, empty, removed)
    ).kv_delta.removed == [7]
    chunk = tm.PublishPoolTelemetryRequest.FromString(scale_sim.snapshot_chunk(4, 9, 2, True, stored))
    assert chunk.kv_snapshot == tm.KvSnapshot(
        snapshot_id=4, sequence=9, chunk_index=2, last=True, block_hashes=stored.tolist()
    )


def test_a_simulated_pool_keeps_its_size_and_sends_only_transitions():
    nodes = np.arange(1, 1 + 64 * scale_sim.NODE_BLOCKS, dtype=np.uint64).reshape(-1, scale_sim.NODE_BLOCKS)
    pool = scale_sim.SimPool(0, nodes, np.ones(len(nodes)), shared_nodes=4, own_blocks=200, seed=1)
    held = set(pool.blocks().tolist())
    assert len(held) == pool.size == 4 * scale_sim.NODE_BLOCKS + 200
    for _ in range(200):
        change = pool.churn(100, 0.5)
        if change is None:
            continue
        stored, removed = (set(a.tolist()) for a in change)
        assert not stored & held and removed <= held  # 0->1 and 1->0 transitions only
        held = (held - removed) | stored
        assert held == set(pool.blocks().tolist()) and len(held) == pool.size
    assert pool.sequence > 50


def test_histogram_quantiles_between_two_scrapes():
    before = 'x_bucket{le="0.001"} 1\nx_bucket{le="0.01"} 1\nx_bucket{le="+Inf"} 1\nx_sum 0.0005\nx_count 1\n'
    after = (
        'x_bucket{le="0.001"} 51\nx_bucket{le="0.01"} 100\nx_bucket{le="+Inf"} 101\nx_sum 0.2\nx_count 101\n'
    )
    q = bench_scale.histogram_quantiles(before, after, "x")
    assert q is not None and q["p50_s"] == 0.001 and q["p99_s"] == 0.01 and q["count"] == 100
    assert q["max_le_s"] == float("inf")  # one sample past the last finite bucket
    assert q["over_10ms"] == 1  # the lag goal's count: 100 samples, 99 of them within 10 ms
    assert "1 of 100 samples over 10 ms" in bench_scale._lag_line(q)
    assert bench_scale.histogram_quantiles(before, after, "absent") is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("interval", [None, "1"], ids=["as-queued", "interval-1s"])
def test_simulated_relays_are_accepted_by_a_real_frontend(tmp_path, interval):
    """3 pools x 2 relays register with a real discovery, stream to a real frontend, churn for 2 s,
    and the frontend lists every pool with fresh KV and exactly its blocks, with no gap asked about.
    With --telemetry-batch-interval the simulated relays write at most once a second per stream."""
    nodes = tmp_path / "nodes.npz"
    rng = np.random.default_rng(5)
    hashes = rng.integers(1, 2**63, size=(40, scale_sim.NODE_BLOCKS), dtype=np.uint64)
    np.savez(nodes, hashes=hashes, uses=np.ones(len(hashes)))
    stats = tmp_path / "sim.json"
    with local_mesh(tmp_path) as mesh:
        mesh.start_discovery()
        router = mesh.start_router(*(("--telemetry-batch-interval", interval) if interval else ()))
        started = time.monotonic()
        _sim, counters = start_simulated_pools(
            mesh,
            router.address,
            nodes,
            stats,
            *("--count", str(POOLS), "--relays", str(RELAYS), "--blocks", str(BLOCKS), "--rate", "100"),
            *("--tick", "0.1", "--traffic-seconds", "2", "--seconds", "50"),
        )

        # Churn runs for 2 s after start; then every pool must show exactly its blocks.
        wait_until(lambda: counters().get("deltas", 0) > 0, 30, message="deltas sent")
        time.sleep(2.5)  # the churn stops 2 s after the simulator started

        def settled() -> bool:
            views = router.pools()
            return bench_scale.ready_count(views, POOLS, BLOCKS) == POOLS and all(
                views[f"scale-{i:04d}"].indexed_blocks == BLOCKS
                and views[f"scale-{i:04d}"].telemetry_streams == RELAYS
                for i in range(POOLS)
            )

        wait_until(settled, 30, interval=0.2, message="every simulated pool listed with its blocks")
        # Every produced delta event is written once the churn stopped (counted at the write).
        wait_until(
            lambda: counters()["written_events"] == counters()["delta_events"],
            10,
            message="every produced delta event written",
        )
        c = counters()
        assert c["registered"] == POOLS * RELAYS
        assert c["hello_acks"] == POOLS * RELAYS and c["streaming"] == POOLS * RELAYS
        assert c["snapshot_blocks"] >= POOLS * RELAYS * BLOCKS
        assert c["deltas"] > 0 and c["delta_events"] > 0
        assert c["snapshot_requests"] == 0 and c["stream_errors"] == 0, c["last_error"]
        assert router.metric("globalrouter_telemetry_snapshot_requests_total") == 0
        if interval:
            # A delta every 0.1 s and the reports every second, yet one write a second per stream
            # after its snapshot (as queued, the churn alone would take 20 a stream).
            streams, elapsed = POOLS * RELAYS, time.monotonic() - started
            assert c["batches"] > 0
            assert c["writes"] - c["snapshots"] <= streams * (elapsed + 1), (c, elapsed)


def test_a_pool_is_ready_holding_nearly_all_its_blocks_as_the_summary_counts_them():
    from globalrouter.v1 import router_pb2

    def view(indexed: int) -> router_pb2.PoolView:
        return router_pb2.PoolView(
            pool_id="scale-0000",
            listed=True,
            kv_freshness=router_pb2.SignalFreshness(fresh=True),
            indexed_blocks=indexed,
        )

    assert bench_scale.ready_count({"scale-0000": view(99_999)}, 1, 100_000) == 1  # a collision or two
    assert bench_scale.ready_count({"scale-0000": view(99_000)}, 1, 100_000) == 0
    assert bench_scale.ready_count({"scale-0000": view(0)}, 1, 100_000) == 0


def test_the_probe_port_is_found_in_the_frontend_flags_and_shown_when_measured():
    flags = ["--max-telemetry-streams", "2256", "--probe-listen", "127.0.0.1:7001", "--kv-state", "summary"]
    assert bench_scale.flag_value(flags, "--probe-listen") == "127.0.0.1:7001"
    assert bench_scale.flag_value(["--probe-listen"], "--probe-listen") is None
    measured = {"probe_health": {"checks": 9, "p50_ms": 1.2, "p99_ms": 3.45, "max_ms": 12.0}}
    assert bench_scale.probe_cells(measured) == "1.2 / 3.5 / 12.0 ms"
    assert bench_scale.probe_cells({"probe_health": None}) == "not measured"
    assert bench_scale.probe_line({}) == ""


def test_a_storms_main_port_health_is_the_own_process_checkers_where_it_ran():
    own = {"checks": 5, "p50_ms": 2.0, "p99_ms": 40.0, "max_ms": 61.0}
    harness = {"checks": 5, "p50_ms": 3.0, "p99_ms": 400.0, "max_ms": 650.0}
    part = {"health": harness, "main_health": own, "probe_health": None}
    assert bench_scale.main_port_health(part) is own
    assert bench_scale.probe_cells(part, "main_health") == "2.0 / 40.0 / 61.0 ms"
    assert bench_scale.probe_line(part) == "; main port (own process) p50/p99/max 2.0/40.0/61.0 ms"
    # A SCALE.json written before the own-process checker: the harness loop's figures.
    assert bench_scale.main_port_health({"health": harness}) is harness


_PLACED = """
import json, sys
from bench.scale_sim import lower_priority, placement
lower_priority(int(sys.argv[1]), frozenset(int(c) for c in sys.argv[2].split(",") if c))
print(json.dumps(placement()))
"""


def test_a_simulator_takes_a_lower_priority_for_its_whole_session(tmp_path):
    """Started in a session of its own (as meshlaunch starts it), a simulator's nice must hold
    against the frontend's session too: under autogroup scheduling the process's nice alone
    changed nothing (the sessions shared the CPU equally)."""
    cpu = min(os.sched_getaffinity(0))
    run = subprocess.run(
        [sys.executable, "-c", _PLACED, "7", str(cpu)],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(Path(bench_scale.__file__).resolve().parent.parent)},
        check=True,
    )
    got = json.loads(run.stdout)
    assert got["nice"] == os.nice(0) + 7 or got["nice"] == 19
    assert got["cpus"] == [cpu]
    if Path("/proc/self/autogroup").exists():
        assert got["autogroup"].endswith(f"nice {got['nice']}")


def test_bad_placements_are_refused_by_name():
    with pytest.raises(ValueError, match=r"--nice must be 0\.\.19"):
        scale_sim.lower_priority(20, frozenset())
    with pytest.raises(ValueError, match="--cpus takes comma-separated CPU numbers, got 'x'"):
        scale_sim.parse_cpus("0,x")
    with pytest.raises(ValueError, match="not all available"):
        scale_sim.lower_priority(0, frozenset({10_000}))
    assert scale_sim.parse_cpus(" 1, 0,") == frozenset({0, 1})


def test_the_simulators_are_started_niced_and_off_the_frontends_cpu(tmp_path):
    cfg = bench_scale.parse(["--quick", "--log-dir", str(tmp_path)])
    assert cfg.sim_nice == bench_scale.SIM_NICE == 10 and cfg.frontend_cpu is None
    assert bench_scale.sim_placement_flags(cfg) == ["--nice", "10"]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        pinned = bench_scale.parse(["--quick", "--log-dir", str(tmp_path), f"--frontend-cpu={cpus[0]}"])
        others = ",".join(map(str, cpus[1:]))
        assert bench_scale.sim_placement_flags(pinned) == ["--nice", "10", "--cpus", others]
    flat = bench_scale.parse(["--quick", "--log-dir", str(tmp_path), "--sim-nice=0"])
    assert bench_scale.sim_placement_flags(flat) == []
    with pytest.raises(SystemExit):
        bench_scale.parse(["--quick", "--log-dir", str(tmp_path), "--sim-nice=20"])


def test_route_dry_runs_ask_for_the_candidates_set_on_the_command_line(tmp_path):
    assert bench_scale.parse(["--quick", "--log-dir", str(tmp_path)]).route_candidates == 0  # all, as before
    cfg = bench_scale.parse(["--quick", "--log-dir", str(tmp_path), "--route-candidates", "1"])
    assert cfg.route_candidates == 1
    with pytest.raises(SystemExit):
        bench_scale.parse(["--quick", "--log-dir", str(tmp_path), "--route-candidates", "-1"])
    tokens = [list(range(20_000)), list(range(2_000))]
    reqs = bench_scale.route_requests(tokens, 1)
    assert [len(r.prompt.token_ids.ids) for r in reqs["1k"]] == [1024, 1024]
    assert [len(r.prompt.token_ids.ids) for r in reqs["16k"]] == [16384]
    assert {r.max_candidates for v in reqs.values() for r in v} == {1}
    assert {r.max_candidates for v in bench_scale.route_requests(tokens).values() for r in v} == {0}


def test_steady_route_dry_runs_are_paced_and_counted(tmp_path):
    """--steady-routes RATE: Route dry runs at RATE a second beside the steady ingest (1k and 16k
    prompts alternating), each one answered, failed or skipped counted."""
    assert bench_scale.parse(["--quick", "--log-dir", str(tmp_path)]).steady_routes == 0  # off by default
    assert (
        bench_scale.parse(["--quick", "--log-dir", str(tmp_path), "--steady-routes", "200"]).steady_routes
        == 200
    )
    with pytest.raises(SystemExit):
        bench_scale.parse(["--quick", "--log-dir", str(tmp_path), "--steady-routes", "-1"])
    seen: list[int] = []

    class Router(router_pb2_grpc.RouterServiceServicer):
        async def Route(self, request, context):
            seen.append(len(request.prompt.token_ids.ids))
            if len(seen) == 3:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "one refused")
            return router_pb2.RouteResponse()

    async def run() -> dict:
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServiceServicer_to_server(Router(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            reqs = bench_scale.route_requests([list(range(20_000))], 1)
            return await bench_scale.paced_routes(f"127.0.0.1:{port}", reqs, 100.0, 0.3)
        finally:
            await server.stop(None)

    out = asyncio.run(run())
    assert out["sent"] == 30 and out["answered"] == 29 and out["failed"] == 1 and out["skipped"] == 0
    assert seen[:4] == [1024, 16384, 1024, 16384]  # the sizes alternate


@pytest.mark.parametrize("spelling", ["--render=FILE", "--render FILE"])
def test_render_rewrites_the_markdown_from_a_runs_json_without_measuring(tmp_path, monkeypatch, spelling):
    """`--render FILE` (either spelling) rewrites the report from the JSON and measures nothing:
    the spaced spelling used to start a whole new run."""
    result = json.loads((Path(bench_scale.__file__).parent / "results" / "scale_fleet.json").read_text())
    out = tmp_path / "scale.md"
    result["config"]["out"] = str(out)
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(result))

    def no_run(cfg):
        raise AssertionError("a render must not run the harness")

    monkeypatch.setattr(bench_scale, "amain", no_run)
    flag, _, value = spelling.replace("FILE", str(saved)).partition(" ")
    assert bench_scale.main([flag, value] if value else [flag]) == 0
    text = out.read_text()
    assert text.startswith("# Scale: one global frontend against a fleet of simulated pools")
    assert f"{result['fleets'][0]['pools']:,} x" in text


@pytest.mark.timeout(90)
def test_leases_kept_apart_outlive_a_stalled_simulator(tmp_path):
    """A `pools` worker with --leases-apart leaves its relays' leases to a `leases` process: stopped
    outright (SIGSTOP, as a starved worker streaming hundreds of snapshots) for three lease
    durations, its pools stay listed (no lease lapses) and its streams carry on when it resumes."""
    import signal

    from meshlaunch.mesh import LEASE

    nodes = tmp_path / "nodes.npz"
    rng = np.random.default_rng(6)
    hashes = rng.integers(1, 2**63, size=(40, scale_sim.NODE_BLOCKS), dtype=np.uint64)
    np.savez(nodes, hashes=hashes, uses=np.ones(len(hashes)))
    stats, lease_stats = tmp_path / "sim.json", tmp_path / "leases.json"
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    sizes = ("--count", str(POOLS), "--relays", str(RELAYS), "--blocks", str(BLOCKS))
    with local_mesh(tmp_path) as mesh:
        mesh.start_discovery()
        router = mesh.start_router()
        mesh.group.start(
            "leases",
            [
                *(sys.executable, "-m", "bench.scale_sim", "leases", "--discovery", mesh.discovery, *sizes),
                *("--incarnation", "77", "--stats", str(lease_stats), "--seconds", "80"),
            ],
            env=env,
        )
        sim, counters = start_simulated_pools(
            mesh,
            router.address,
            nodes,
            stats,
            *sizes,
            *("--rate", "20", "--seconds", "80", "--register-first"),
            *("--leases-apart", str(lease_stats), "--incarnation", "77"),
        )
        pool_ids = [f"scale-{i:04d}" for i in range(POOLS)]

        def all_ready() -> bool:
            views = router.pools()
            return bench_scale.ready_count(views, POOLS, BLOCKS) == POOLS and all(
                views[p].telemetry_streams == RELAYS for p in pool_ids
            )

        wait_until(all_ready, 30, interval=0.2, message="every pool listed with its blocks")
        assert counters()["registered"] == 0  # the worker registered nothing itself
        assert json.loads(lease_stats.read_text())["registered"] == POOLS * RELAYS
        sim.signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 3 * float(LEASE)
            while time.monotonic() < deadline:
                views = router.pools()
                assert all(p in views and views[p].listed for p in pool_ids), "a lease lapsed"
                time.sleep(0.5)
        finally:
            sim.signal(signal.SIGCONT)
        wait_until(all_ready, 30, interval=0.2, message="the streams carried on")
        assert json.loads(lease_stats.read_text())["register_errors"] == 0


class _RefuseAfterSnapshot(tm_grpc.TelemetryServiceServicer):
    """A frontend's TelemetryService that takes a stream's whole snapshot, then refuses the stream
    (RESOURCE_EXHAUSTED, as a frontend over its snapshot budget ends it)."""

    async def PublishPoolTelemetry(self, request_iterator, context):
        import asyncio

        import grpc

        yield tm.PublishPoolTelemetryResponse(hello_ack=tm.TelemetryHelloAck(frontend_id="refuser"))
        async for req in request_iterator:
            if req.WhichOneof("payload") == "kv_snapshot" and req.kv_snapshot.last:
                await asyncio.sleep(0.5)  # the relay has finished writing it: a stream that worked
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "over this frontend's snapshot budget"
                )


@pytest.mark.timeout(30)
async def test_a_simulated_relay_refused_after_its_snapshot_backs_off_like_the_relay():
    """A stream the frontend refuses after the snapshot went out fails the session (so the relay
    waits out its back-off, as poolrelay's publisher does on a refusal) instead of redialling at once
    and resending a whole snapshot into the same refusal."""
    import grpc

    server = grpc.aio.server()
    tm_grpc.add_TelemetryServiceServicer_to_server(_RefuseAfterSnapshot(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        rng = np.random.default_rng(7)
        nodes = rng.integers(1, 2**63, size=(8, scale_sim.NODE_BLOCKS), dtype=np.uint64)
        pool = scale_sim.SimPool(0, nodes, np.ones(len(nodes)), 2, 50, 1)
        stats = scale_sim.PoolStats()
        relay = scale_sim.SimRelay(pool, 0, f"http://127.0.0.1:{port}", 1, stats)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await relay._session(relay.hello(1.0))
        finally:
            await relay.channel.close()
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stats.snapshots == 1 and stats.breaks == {"RESOURCE_EXHAUSTED": 1}
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    ("flag", "value"), [("--count", "0"), ("--relays", "0"), ("--blocks", "0"), ("--incarnation", "-1")]
)
def test_a_leases_process_refuses_bad_sizes_by_name(flag, value, capsys):
    argv = ["leases", "--discovery", "127.0.0.1:1", "--count", "2", "--blocks", "10", "--stats", "/dev/null"]
    with pytest.raises(SystemExit):
        scale_sim.main([*argv, flag, value])
    assert f"{flag} must be at least" in capsys.readouterr().err


def test_another_process_and_its_session_are_reniced_with_every_thread():
    """--frontend-nice / --discovery-nice: set_nice changes every thread of a process started in a
    session of its own (as meshlaunch starts it) and that session's autogroup, which is what
    weighs against the other sessions under autogroup scheduling."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        tasks = Path(f"/proc/{child.pid}/task")
        wait_until(lambda: len(list(tasks.iterdir())) == 2, 10, message="the child's second thread")
        applied = bench_scale.set_nice(child.pid, 5)
        for task in tasks.iterdir():
            assert os.getpriority(os.PRIO_PROCESS, int(task.name)) == 5
        if Path(f"/proc/{child.pid}/autogroup").exists():
            assert applied.endswith("nice 5") and Path(
                f"/proc/{child.pid}/autogroup"
            ).read_text().strip().endswith("nice 5")
    finally:
        child.kill()
        child.wait(10)


def test_frontend_and_discovery_niceness_are_flags_checked_by_range(tmp_path):
    cfg = bench_scale.parse(["--quick", "--log-dir", str(tmp_path)])
    assert cfg.frontend_nice == 0 and cfg.discovery_nice == 0
    cfg = bench_scale.parse(
        ["--quick", "--log-dir", str(tmp_path), "--frontend-nice=-10", "--discovery-nice=10"]
    )
    assert (cfg.frontend_nice, cfg.discovery_nice) == (-10, 10)
    assert "The frontend ran at nice -10" in bench_scale.sim_placement_text(cfg)
    for bad in ("--frontend-nice=-21", "--frontend-nice=20", "--discovery-nice=-1"):
        with pytest.raises(SystemExit):
            bench_scale.parse(["--quick", "--log-dir", str(tmp_path), bad])


@pytest.mark.timeout(60)
async def test_a_checker_started_before_a_restart_counts_only_from_its_count_from_time():
    # Started before the kill, it must say nothing of the old process: its SERVING before the
    # count_from time would otherwise read as the new process's ready time.
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        waiting = bench_scale.ProcessHealthProbe(f"127.0.0.1:{port}", gap=0.02, timeout=5)
        never = bench_scale.ProcessHealthProbe(f"127.0.0.1:{port}", gap=0.02, timeout=5)
        bench_scale.start_probes(waiting, never, counting=False)
        await asyncio.sleep(0.5)  # answered SERVING all along: none of it counts yet
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        waiting.count_from(time.monotonic())
        await asyncio.sleep(0.3)
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await asyncio.sleep(0.3)
        counted, ignored = await bench_scale.stop_probes(waiting, never)
    finally:
        server.stop(0)
    assert counted is not None and ignored is not None
    assert counted["checks"] >= 5 and ignored["checks"] == 0
    # The first SERVING counted is the one after NOT_SERVING, 0.3 s after count_from.
    assert waiting.first_serving is not None and waiting.first_serving >= 0.25
    assert counted["not_ready_after_ready"] == 0

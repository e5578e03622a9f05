"""The health probe off the serving loop: its liveness/readiness rules on a fake clock, its gRPC and
HTTP answers from its own threads (a fake loop that stops ticking; a real loop kept busy), the flags."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from globalrouter.cli import build_parser
from globalrouter.config import ProbeConfig, RouterConfig
from globalrouter.health_probe import LIVENESS_SERVICE, LoopState, ProbeServer, ProbeStatus, _Handler, judge
from globalrouter.loop_lag import sample_loop_lag
from globalrouter.serve_cli import router_config
from globalrouter.server import create_server
from meshkit import settings
from meshkit.clock import FakeClock

pytestmark = pytest.mark.timeout(60)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BOUNDS = {"live_within": 10.0, "ready_within": 1.0}


# -- the rules: a pure function of the last tick, now and the readiness state --------------------


def test_live_while_the_loop_ticked_within_the_bound_whatever_the_readiness():
    for state in (LoopState(100.0), LoopState(100.0, serving=True), LoopState(100.0, stopping=True)):
        assert judge(state, 100.0, **BOUNDS).live
        assert judge(state, 110.0, **BOUNDS).live  # a slow loop is alive
        assert not judge(state, 110.01, **BOUNDS).live  # a wedged one is restarted


def test_ready_only_when_serving_not_stopping_and_the_loop_ticked_recently():
    serving = LoopState(100.0, serving=True, directory_synced=True)
    assert judge(serving, 100.5, **BOUNDS).ready
    assert judge(serving, 101.0, **BOUNDS).ready
    slow = judge(serving, 101.2, **BOUNDS)
    assert slow.live and not slow.ready and slow.tick_age == pytest.approx(1.2)
    assert not judge(LoopState(100.0, directory_synced=True), 100.0, **BOUNDS).ready  # syncing
    assert not judge(LoopState(100.0, serving=True, stopping=True), 100.0, **BOUNDS).ready
    assert judge(serving, 99.0, **BOUNDS).tick_age == 0.0  # clocks read on two threads


def test_the_status_follows_what_the_loop_publishes():
    clock = FakeClock(start=50.0)
    status = ProbeStatus(clock.monotonic, **BOUNDS)
    state, verdict = status.read()
    assert verdict.live and not verdict.ready and state.ticked_at == 50.0  # alive from the start
    status.beat(directory_synced=True, pools_without_kv=3)
    status.set_serving(True)
    clock.set(50.5)
    state, verdict = status.read()
    assert verdict.ready and state.pools_without_kv == 3
    status.set_stopping()
    state, verdict = status.read()
    assert not verdict.ready and verdict.live and state.stopping and not state.serving
    status.set_serving(True)  # a late readiness cannot undo the stop
    assert not status.read()[1].ready


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="ready_within"):
        ProbeStatus(live_within=1.0, ready_within=2.0)
    with pytest.raises(ValueError, match="--probe-ready-within"):
        ProbeConfig(listen="127.0.0.1:0", live_within=1.0, ready_within=2.0)


# -- the threads: gRPC health and HTTP, from a status a (fake or busy) loop publishes ----------


def check(port: int, service: str = "", timeout: float = 5.0) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    return int(reply.status)


def get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def served() -> Iterator[tuple[FakeClock, ProbeStatus, ProbeServer]]:
    clock = FakeClock(start=10.0)
    status = ProbeStatus(clock.monotonic, **BOUNDS)
    server = ProbeServer(
        status,
        grpc_listen="127.0.0.1:0",
        http_listen="127.0.0.1:0",
        ready_names=("globalrouter.v1.RouterService",),
    )
    server.start()
    try:
        yield clock, status, server
    finally:
        server.stop()


def test_a_loop_that_stops_ticking_turns_not_ready_then_not_live(served):
    clock, status, server = served
    status.beat(directory_synced=True, pools_without_kv=0)
    status.set_serving(True)
    g, h = server.grpc_port, server.http_port
    assert check(g) == SERVING and check(g, "globalrouter.v1.RouterService") == SERVING
    assert check(g, LIVENESS_SERVICE) == SERVING
    assert get(h, "/readyz") == (
        200,
        {
            "status": "ready",
            "loop_tick_age_s": 0.0,
            "serving": True,
            "stopping": False,
            "directory_synced": True,
            "pools_without_kv": 0,
        },
    )
    assert get(h, "/livez") == (200, {"status": "live", "loop_tick_age_s": 0.0})
    clock.set(12.0)  # the loop stopped ticking: 2 s without a tick
    assert check(g) == NOT_SERVING and check(g, LIVENESS_SERVICE) == SERVING
    assert get(h, "/readyz")[0] == 503 and get(h, "/livez")[0] == 200
    clock.set(20.5)  # 10.5 s: wedged
    assert check(g, LIVENESS_SERVICE) == NOT_SERVING
    assert get(h, "/livez") == (503, {"status": "not live", "loop_tick_age_s": 10.5})
    status.beat(directory_synced=True, pools_without_kv=0)  # it turns again
    assert check(g) == SERVING and get(h, "/livez")[0] == 200


def test_not_ready_while_syncing_and_once_stopping(served):
    _clock, status, server = served
    status.beat(directory_synced=False, pools_without_kv=0)
    assert check(server.grpc_port) == NOT_SERVING
    status.beat(directory_synced=True, pools_without_kv=7)
    code, body = get(server.http_port, "/readyz")
    assert code == 503 and body["directory_synced"] and body["pools_without_kv"] == 7
    status.set_serving(True)
    assert check(server.grpc_port) == SERVING
    status.set_stopping()
    assert check(server.grpc_port) == NOT_SERVING and check(server.grpc_port, LIVENESS_SERVICE) == SERVING
    assert get(server.http_port, "/readyz")[1]["stopping"] is True


def test_unknown_names_and_paths_are_refused(served):
    _clock, _status, server = served
    with pytest.raises(grpc.RpcError) as err:
        check(server.grpc_port, "no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    code, body = get(server.http_port, "/metrics")
    assert code == 404 and "/livez" in body["error"]


def test_watch_streams_changes_and_only_one_at_a_time(served):
    clock, status, server = served
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        stream = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=20)
        assert next(stream).status == NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Watch(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=5))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert check(server.grpc_port) == NOT_SERVING  # Check keeps its thread
        status.set_serving(True)
        assert next(stream).status == SERVING
        clock.set(30.0)
        assert next(stream).status == NOT_SERVING
        stream.cancel()


def test_a_busy_loop_thread_still_gets_its_probe_answered_within_milliseconds():
    """A real asyncio loop, beating through the loop-lag sampler, then busy in pure Python for 3 s
    (as a snapshot storm's callbacks would be): the probe thread answers all along, within a few
    milliseconds (the GIL switches every 5 ms), says not ready once the loop stopped ticking for
    ready_within, and stays live."""
    status = ProbeStatus(live_within=10.0, ready_within=0.5)
    server = ProbeServer(status, grpc_listen="127.0.0.1:0", http_listen="")
    server.start()
    loop = asyncio.new_event_loop()
    beats = threading.Event()

    def beat() -> None:
        status.beat(directory_synced=True, pools_without_kv=0)
        beats.set()

    def busy(seconds: float) -> None:
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:  # the loop's thread, holding the GIL but for switches
            n += 1

    def run() -> None:
        asyncio.set_event_loop(loop)
        ticker = loop.create_task(sample_loop_lag(lambda _lag: None, interval=0.05, on_tick=beat))
        loop.run_forever()
        ticker.cancel()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert beats.wait(10)
        status.set_serving(True)
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
            loop.call_soon_threadsafe(busy, 3.0)
            time.sleep(0.1)
            latencies, answers, lives = [], [], []
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                t0 = time.perf_counter()
                answers.append(stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status)
                latencies.append(time.perf_counter() - t0)
                lives.append(
                    stub.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=5).status
                )
                time.sleep(0.02)
        latencies.sort()
        # Measured 2-15 ms at p50 here (load average 5-20); the bounds are generous for a loaded
        # 2-core machine, and still well under the 3 s a check through the blocked loop would take.
        assert latencies[len(latencies) // 2] < 0.1 and latencies[-1] < 2.0, latencies[-5:]
        assert NOT_SERVING in answers, "a loop silent past ready_within is not ready"
        assert set(lives) == {SERVING}, "a busy loop is alive"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        server.stop()
        loop.close()


def test_http_connections_past_the_bound_are_closed_not_queued(served, monkeypatch):
    """Silent clients hold the 2 handler threads and the 2 waiting places (for the request
    timeout, 30 s here so that a loaded machine cannot blur it); one more connection is closed
    at once; once they leave, probes are answered again."""
    monkeypatch.setattr(_Handler, "timeout", 30.0)
    _clock, _status, server = served
    http = server._http
    waiting = http._accepted  # the hand-over queue: each step is waited for, not timed
    accepted = []
    hand_over = http.process_request

    def counted(request, address) -> None:
        accepted.append(address)
        hand_over(request, address)

    monkeypatch.setattr(http, "process_request", counted)
    silent = []
    try:
        for n, queued in ((1, 0), (2, 0), (3, 1), (4, 2)):  # two held by the handler threads, two wait
            silent.append(socket.create_connection(("127.0.0.1", server.http_port)))
            deadline = time.monotonic() + 10
            while len(accepted) != n or waiting.qsize() != queued:
                assert time.monotonic() < deadline, "the connection was not handed over"
                time.sleep(0.01)
        extra = socket.create_connection(("127.0.0.1", server.http_port))
        extra.settimeout(15.0)  # well inside the 30 s a handled connection would be held
        assert extra.recv(1) == b"", "closed unanswered"
        extra.close()
    finally:
        for conn in silent:
            conn.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert get(server.http_port, "/livez")[0] == 200
            break
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline


def test_a_taken_port_is_an_error_naming_the_flag():
    status = ProbeStatus()
    first = ProbeServer(status, grpc_listen="127.0.0.1:0", http_listen="127.0.0.1:0")
    try:
        with pytest.raises(RuntimeError, match="--probe-http-listen"):
            ProbeServer(status, grpc_listen="", http_listen=f"127.0.0.1:{first.http_port}")
        with pytest.raises(RuntimeError, match="--probe-listen"):  # no SO_REUSEPORT share of a port
            ProbeServer(status, grpc_listen=f"127.0.0.1:{first.grpc_port}", http_listen="")
    finally:
        first.stop()


# -- the frontend: flags, config, the probe bound and fed by the loop --------------------------


def test_the_flags_reach_the_config_and_round_trip_through_print_config(tmp_path: Path):
    argv = [
        *("serve", "--discovery", "127.0.0.1:1", "--probe-listen", "127.0.0.1:7001"),
        *("--probe-http-listen", "127.0.0.1:7002", "--probe-live-within", "20", "--probe-ready-within", "2"),
    ]
    args = settings.parse_args(build_parser(), argv, environ={})
    args.security = RouterConfig().security
    assert router_config(args).probe == ProbeConfig("127.0.0.1:7001", "127.0.0.1:7002", 20.0, 2.0)
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_:
        settings.parse_args(build_parser(), [*argv, "--print-config"], environ={}, out=out)
    assert exit_.value.code == 0
    path = tmp_path / "c.toml"
    path.write_text(out.getvalue())
    again = settings.parse_args(build_parser(), ["serve", "--config", str(path)], environ={})
    again.security = RouterConfig().security
    assert router_config(again).probe == router_config(args).probe
    default = build_parser().parse_args(["serve", "--discovery", "h:1"])
    default.security = RouterConfig().security
    assert router_config(default).probe == ProbeConfig() and not ProbeConfig().enabled


async def test_the_frontend_beats_and_says_stopping_on_its_probe():
    router = create_server(
        RouterConfig(probe=ProbeConfig(listen="127.0.0.1:0", http_listen="127.0.0.1:0", ready_within=1.0))
    )
    assert router.probe is not None and router.probe.grpc_port and router.probe.http_port
    seen: list[tuple[bool, bool]] = []
    status = router.probe.status
    real_leave = router.leave

    async def leave() -> None:  # what the probe says once the stop has begun
        await real_leave()
        state, verdict = status.read()
        seen.append((state.stopping, verdict.ready))

    router.leave = leave  # type: ignore[method-assign]
    task = asyncio.create_task(router.run())
    try:
        port = router.probe.grpc_port

        async def answer(service: str = "") -> int:
            return await asyncio.to_thread(check, port, service)

        deadline = time.monotonic() + 10
        while await answer() != SERVING:  # no discovery: ready once its server runs
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        first = router.probe.status.read()[0].ticked_at
        deadline = time.monotonic() + 10  # the sampler beats every 0.1 s: waited for, not timed
        while router.probe.status.read()[0].ticked_at <= first:
            assert time.monotonic() < deadline, "the loop-lag sampler beats"
            await asyncio.sleep(0.02)
        router.stop_requested.set()  # what SIGTERM does
        await task
        assert seen == [(True, False)]
        with pytest.raises(grpc.RpcError):  # closed with the frontend
            await answer()
    finally:
        if not task.done():
            router.stop_requested.set()
            await task


def test_a_ready_bound_past_the_live_bound_stops_the_start_naming_both_flags(monkeypatch):
    from globalrouter import serve_cli

    said: list[tuple[str, dict]] = []

    class Log:
        def error(self, event: str, **fields) -> None:
            said.append((event, fields))

    # Not the process's logging set-up: it would outlive this test.
    monkeypatch.setattr(serve_cli, "configure_logging", lambda *a, **k: None)
    monkeypatch.setattr(serve_cli, "log", Log())
    argv = ["serve", "--discovery", "127.0.0.1:1", "--probe-live-within", "1", "--probe-ready-within", "2"]
    args = build_parser().parse_args(argv)
    args.security = RouterConfig().security
    assert serve_cli._run(args) == 2
    [(event, fields)] = said
    assert event == "cannot start"
    assert "--probe-ready-within" in fields["error"] and "--probe-live-within" in fields["error"]

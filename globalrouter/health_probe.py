"""A health answer off the serving loop: gRPC health and HTTP /livez, /readyz on their own threads, from a status the loop publishes with proof that it turns."""

from __future__ import annotations

import json
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshkit.logs import get_logger

log = get_logger(module="globalrouter.health_probe")

LIVENESS_SERVICE = "liveness"
"""The gRPC health service name that answers liveness (a kubelet grpc probe's `service`); "" and
the main port's service names answer readiness."""
THREADS = 2
"""Threads answering gRPC health, and HTTP requests handled at once: a probe takes microseconds."""
MAX_RPCS = 4
"""gRPC health calls in progress or waiting for a thread; one more is RESOURCE_EXHAUSTED at once
(no queue grows behind a flood of checks)."""
MAX_WATCHES = 1
"""Health Watch streams at once: each holds a thread for its life, so one thread always stays for
Check (a kubelet only checks)."""
WATCH_POLL_S = 0.1
"""How often a Watch looks at the status (the loop publishes it every ~0.1 s anyway)."""
SWITCH_INTERVAL_S = 0.001
"""The process's GIL switch interval while the probe serves (Python's default is 5 ms): a probe
thread that wakes while the serving loop runs Python waits up to this long for the GIL, at each of
the three or four hand-offs of a call (gRPC's poller thread, the handler's thread, the reply). At
5 ms a probe took ~15 ms at p50 beside a busy loop, at 1 ms ~4 ms. Threads that do not want the
GIL cost nothing more: the interval only cuts a holder short when another thread is waiting."""
HTTP_TIMEOUT_S = 2.0
"""Seconds an HTTP probe client may take to send its request line and headers."""


@dataclass(frozen=True, slots=True)
class LoopState:
    """What the serving loop last published (replaced whole, never mutated: a reader on another
    thread sees one consistent state)."""

    ticked_at: float
    """Monotonic time of the loop's last heartbeat (its start before the first one)."""
    serving: bool = False
    """The main port's health says SERVING: ready (globalrouter.readiness) and its server started."""
    stopping: bool = False
    """SIGTERM (or a failed background task) began the stop: never ready again."""
    directory_synced: bool = False
    pools_without_kv: int = 0
    """Listed pools whose KV state had not arrived at the readiness check before the last tick."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The probe's answer at one moment."""

    live: bool
    ready: bool
    tick_age: float
    """Seconds since the loop's last heartbeat."""

    def body(self, state: LoopState, what: str) -> dict[str, Any]:
        """The /livez or /readyz JSON: counts and ages only (probes carry no credentials)."""
        ok = self.live if what == "live" else self.ready
        out: dict[str, Any] = {
            "status": ("live" if ok else "not live") if what == "live" else ("ready" if ok else "not ready"),
            "loop_tick_age_s": round(self.tick_age, 3),
        }
        if what == "ready":
            out.update(
                serving=state.serving,
                stopping=state.stopping,
                directory_synced=state.directory_synced,
                pools_without_kv=state.pools_without_kv,
            )
        return out


def judge(state: LoopState, now: float, *, live_within: float, ready_within: float) -> Verdict:
    """Live while the loop ticked within `live_within` seconds (a wedged loop is not live, so a
    kubelet restarts the process; a slow one is); ready when the main port would say SERVING
    (ready, not stopping) and the loop ticked within `ready_within` seconds (a SERVING that does
    not prove the loop turns would keep a wedged frontend in rotation). Liveness holds while
    stopping: the loop still turns, finishing the in-flight streams."""
    age = max(0.0, now - state.ticked_at)
    return Verdict(
        live=age <= live_within,
        ready=state.serving and not state.stopping and age <= ready_within,
        tick_age=age,
    )


class ProbeStatus:
    """The status the serving loop publishes and the probe threads read, under one lock."""

    def __init__(
        self,
        now: Callable[[], float] = time.monotonic,
        *,
        live_within: float = 10.0,
        ready_within: float = 1.0,
    ) -> None:
        if not 0 < ready_within <= live_within:
            raise ValueError(
                f"probe bounds: need 0 < ready_within <= live_within (got {ready_within}, {live_within})"
            )
        self._now = now
        self.live_within = live_within
        self.ready_within = ready_within
        self._lock = threading.Lock()
        self._state = LoopState(ticked_at=now())

    def beat(self, *, directory_synced: bool, pools_without_kv: int) -> None:
        """From the loop: it turns (called by the loop-lag sampler on each wake-up)."""
        self._publish(
            ticked_at=self._now(), directory_synced=directory_synced, pools_without_kv=pools_without_kv
        )

    def set_serving(self, serving: bool) -> None:
        """From the loop: the main port's health turned SERVING (or NOT_SERVING)."""
        self._publish(serving=serving)

    def set_stopping(self) -> None:
        """From the loop: the stop began; readiness never comes back."""
        self._publish(stopping=True, serving=False)

    def _publish(self, **changes: Any) -> None:
        with self._lock:
            self._state = replace(self._state, **changes)

    def read(self) -> tuple[LoopState, Verdict]:
        """From a probe thread: the last published state and the verdict on it now."""
        with self._lock:
            state = self._state
        return state, judge(state, self._now(), live_within=self.live_within, ready_within=self.ready_within)


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class ProbeHealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 on the probe port: "liveness" is liveness; "" and the main port's service
    names are readiness (the same names the main port answers); others are NOT_FOUND."""

    def __init__(self, status: ProbeStatus, ready_names: tuple[str, ...]) -> None:
        self._status = status
        self._ready_names = frozenset(("", *ready_names))
        self._watches = threading.BoundedSemaphore(MAX_WATCHES)

    def _answer(self, service: str) -> health_pb2.HealthCheckResponse.ServingStatus | None:
        _state, verdict = self._status.read()
        if service == LIVENESS_SERVICE:
            return _SERVING if verdict.live else _NOT_SERVING
        if service in self._ready_names:
            return _SERVING if verdict.ready else _NOT_SERVING
        return None

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext):
        answer = self._answer(request.service)
        if answer is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=answer)

    def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> Iterator[health_pb2.HealthCheckResponse]:
        if not self._watches.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {MAX_WATCHES} health Watch stream(s) at once on the probe port; use Check",
            )
        try:
            last = None
            while context.is_active():
                answer = self._answer(request.service)
                status = _UNKNOWN if answer is None else answer
                if status != last:
                    last = status
                    yield health_pb2.HealthCheckResponse(status=status)
                time.sleep(WATCH_POLL_S)
        finally:
            self._watches.release()


class _Handler(BaseHTTPRequestHandler):
    """GET /livez and /readyz: 200 or 503 with a small JSON body; anything else 404."""

    timeout = HTTP_TIMEOUT_S  # a client that sends nothing does not hold a thread
    server: _HttpServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/livez", "/readyz"):
            self._send(404, {"error": f"no route {path}; the probe port serves /livez and /readyz"})
            return
        state, verdict = self.server.status.read()
        what = "live" if path == "/livez" else "ready"
        ok = verdict.live if what == "live" else verdict.ready
        self._send(200 if ok else 503, verdict.body(state, what))

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("cache-control", "no-store")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a probe every few seconds is not worth a log line; refusals are logged below


class _HttpServer(HTTPServer):
    """HTTP/1.0 (one request per connection) handled by THREADS long-lived threads; a connection
    accepted while they are all busy and THREADS more wait is closed unanswered, not queued. Long-lived, not a thread per request: starting a thread waits for it to take the GIL,
    one more wait beside a busy serving loop."""

    def __init__(self, address: tuple[str, int], status: ProbeStatus, family: socket.AddressFamily) -> None:
        self.address_family = family
        self.status = status
        self._accepted: queue.Queue[tuple[Any, Any] | None] = queue.Queue(maxsize=THREADS)
        self._workers: list[threading.Thread] = []
        super().__init__(address, _Handler)

    def start_workers(self) -> None:
        for i in range(THREADS):
            worker = threading.Thread(target=self._work, name=f"health-probe-http-{i}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            self._accepted.put_nowait((request, client_address))
        except queue.Full:
            log.warning("probe HTTP connection refused: every handler busy", client=str(client_address))
            self.shutdown_request(request)

    def _work(self) -> None:
        while (item := self._accepted.get()) is not None:
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def stop_workers(self) -> None:
        for _ in self._workers:
            self._accepted.put(None)
        for worker in self._workers:
            worker.join(HTTP_TIMEOUT_S + 1)


def _split(listen: str) -> tuple[str, int, socket.AddressFamily]:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return host, int(port), family


class ProbeServer:
    """The probe listeners: gRPC health on `grpc_listen` and HTTP on `http_listen` (either may be
    empty), plaintext: they say two booleans and an age, nothing about requests, pools or
    identities, and a kubelet's grpc probe cannot speak TLS. Bound at construction (a taken port is
    a RuntimeError naming the flag), served from `start()` until `stop()`."""

    def __init__(
        self, status: ProbeStatus, *, grpc_listen: str, http_listen: str, ready_names: tuple[str, ...] = ()
    ) -> None:
        self.status = status
        self.grpc_port = 0
        self.http_port = 0
        self._grpc: grpc.Server | None = None
        self._http: _HttpServer | None = None
        self._http_thread: threading.Thread | None = None
        if grpc_listen:
            server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="health-probe"),
                maximum_concurrent_rpcs=MAX_RPCS,
                # A port already taken (the main one, say) is an error, not a silent share of it.
                options=[("grpc.so_reuseport", 0)],
            )
            health_pb2_grpc.add_HealthServicer_to_server(ProbeHealthServicer(status, ready_names), server)
            try:
                port = server.add_insecure_port(grpc_listen)
            except RuntimeError as exc:
                raise RuntimeError(f"cannot listen on {grpc_listen} (--probe-listen): {exc}") from exc
            if port == 0:
                raise RuntimeError(
                    f"cannot listen on {grpc_listen} (--probe-listen): address in use or invalid"
                )
            self._grpc, self.grpc_port = server, port
        if http_listen:
            host, port, family = _split(http_listen)
            try:
                self._http = _HttpServer((host, port), status, family)
            except OSError as exc:
                if self._grpc is not None:
                    self._grpc.stop(0)
                raise RuntimeError(f"cannot listen on {http_listen} (--probe-http-listen): {exc}") from exc
            self.http_port = self._http.server_address[1]

    def start(self) -> None:
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        if self._grpc is not None:
            self._grpc.start()
        if self._http is not None:
            self._http.start_workers()
            self._http_thread = threading.Thread(
                target=self._http.serve_forever,
                kwargs={"poll_interval": 0.2},
                name="health-probe-http",
                daemon=True,
            )
            self._http_thread.start()
        log.info(
            "health probe served off the serving loop (plaintext: liveness and readiness only)",
            grpc_port=self.grpc_port or None,
            http_port=self.http_port or None,
            live_within_s=self.status.live_within,
            ready_within_s=self.status.ready_within,
            gil_switch_interval_s=sys.getswitchinterval(),
        )

    def stop(self) -> None:
        """Stops both listeners (after the main server: the probe says 'not ready' until the end)."""
        if self._grpc is not None:
            self._grpc.stop(0).wait(5)
        if self._http is not None:
            if self._http_thread is not None:
                self._http.shutdown()
                self._http.stop_workers()
            self._http.server_close()

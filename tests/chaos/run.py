"""`make chaos`: a replicated mesh under steady streamed load while each fault is applied and healed
in turn; every request goes into a ledger; CHAOS.md gets one row per fault.

The mesh: a 3-member etcd cluster, two discovery replicas on it, three mocker pools in two regions
(each with its relay, which knows both replicas), two global frontends (which know both replicas),
and several clients that each know both frontends. Exit code 1 when a request was lost, when a
phase completed no request exactly, or when the run overran its time bound.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from globalrouter.client import FailoverClient, FailoverError
from meshkit.timeconv import seconds
from meshlaunch import MODEL, Mesh, Proc, ProcessGroup, free_port, process_group, wait_healthy
from meshlaunch.etcd_cluster import EtcdCluster
from meshlaunch.mesh import etcd_discovery_argv
from mocker.tokens import continue_sequence
from poolrelay.v1 import telemetry_pb2_grpc
from tests.chaos.ledger import EXACT, Ledger, RequestRecord, classify, render_table

HEARTBEAT, LEASE = 1.0, 4.0
STALL_TIMEOUT = 2.0
FIRST_TOKEN_TIMEOUT = 3.0
POOLS = {"pool-a": "eu", "pool-b": "eu", "pool-c": "us"}
MAX_TOKENS = 24
PROMPT_PREFIXES = 4  # clients share a few prefixes, so the KV index has something to route on
REQUEST_TIMEOUT = 30.0
SETTLE_TIMEOUT = 60.0


@dataclass
class Fault:
    """One row of CHAOS.md: apply, hold, heal, then wait until the mesh is whole again."""

    name: str
    apply: Callable[[], None]
    heal: Callable[[], None]
    hold: float


class SlowConsumer(telemetry_pb2_grpc.TelemetryServiceServicer):
    """A 'global frontend' that accepts telemetry streams and never reads them."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.streams = 0

    def PublishPoolTelemetry(self, request_iterator, context):
        self.streams += 1
        self.released.wait()  # never reads: the relay's sends back up until it gives up on us
        return iter(())


class ChaosMesh:
    """The processes of the run and how to hurt and heal each."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.etcd = EtcdCluster(group, 3)
        self.replicas = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        self.discovery_procs: list[Proc] = []
        self.mesh = Mesh(group)
        self.slow: tuple[grpc.Server, SlowConsumer, threading.Event] | None = None

    # ----- start -----

    def start(self) -> None:
        self.etcd.start()
        self.discovery_procs = [self._start_replica(a) for a in self.replicas]
        self.mesh.discovery = ",".join(self.replicas)
        for pool_id, region in POOLS.items():
            self.mesh.start_pool(pool_id, region, "--speedup", "4", "--max-queue", "256")
        for _ in range(2):
            self.mesh.start_router(
                "--stall-timeout", str(STALL_TIMEOUT), "--first-token-timeout", str(FIRST_TOKEN_TIMEOUT)
            )
        self.settle()

    def _start_replica(self, address: str) -> Proc:
        proc = self.group.start(
            "discovery", etcd_discovery_argv(address, self.etcd.endpoints_flag, HEARTBEAT, LEASE)
        )
        wait_healthy(address, proc=proc)
        return proc

    def settle(self) -> None:
        """Until both frontends route to every pool with fresh telemetry again."""
        for router in self.mesh.routers:
            self.mesh.wait_routable(router, POOLS, timeout=SETTLE_TIMEOUT)

    @property
    def routers(self) -> list[str]:
        return [r.address for r in self.mesh.routers]

    # ----- faults -----

    def _restart(self, proc: Proc, health: str | None = None) -> Proc:
        """Starts `proc`'s command again (same flags, same port); replaces it everywhere it is held."""
        new = self.group.start(proc.name, proc.args)
        if health is not None:
            wait_healthy(health, proc=new)
        for pool in self.mesh.pools.values():
            if pool.pool is proc:
                pool.pool = new
            if pool.relay is proc:
                pool.relay = new
        for router in self.mesh.routers:
            if router.proc is proc:
                router.proc = new
        self.discovery_procs = [new if p is proc else p for p in self.discovery_procs]
        return new

    def faults(self) -> list[Fault]:
        pools = self.mesh.pools
        state: dict[str, int] = {}  # the killed etcd member, for its restart

        def kill_replica() -> None:
            self.discovery_procs[0].kill9()

        def restart_replica() -> None:
            self._restart(self.discovery_procs[0], self.replicas[0])

        def kill_etcd_leader() -> None:
            leader = self.etcd.leader()
            state["etcd"] = leader if leader is not None else 0
            self.etcd.kill9(state["etcd"])

        def restart_etcd() -> None:
            self.etcd.restart(state["etcd"])

        def kill(pool_id: str, which: str) -> Callable[[], None]:
            def apply() -> None:
                getattr(pools[pool_id], which).kill9()

            return apply

        def restart(pool_id: str, which: str) -> Callable[[], None]:
            def heal() -> None:
                procs = pools[pool_id]
                self._restart(getattr(procs, which), procs.address if which == "pool" else None)

            return heal

        def kill_frontend() -> None:
            self.mesh.routers[0].proc.kill9()

        def restart_frontend() -> None:
            router = self.mesh.routers[0]
            self._restart(router.proc, router.address)

        def signal_to(pool_id: str, which: str, sig: int) -> Callable[[], None]:
            def send() -> None:
                getattr(pools[pool_id], which).signal(sig)

            return send

        def discovery_down() -> None:
            for proc in self.discovery_procs:
                proc.kill9()

        def discovery_up() -> None:
            for address, proc in zip(self.replicas, list(self.discovery_procs), strict=True):
                self._restart(proc, address)

        return [
            Fault("kill -9 + restart a discovery replica", kill_replica, restart_replica, 8.0),
            Fault("kill -9 + restart the etcd leader", kill_etcd_leader, restart_etcd, 8.0),
            Fault(
                "kill -9 + restart a relay (pool-a)", kill("pool-a", "relay"), restart("pool-a", "relay"), 6.0
            ),
            Fault(
                "kill -9 + restart a pool (pool-b)", kill("pool-b", "pool"), restart("pool-b", "pool"), 6.0
            ),
            Fault("kill -9 + restart a global frontend", kill_frontend, restart_frontend, 6.0),
            Fault(
                "SIGSTOP + SIGCONT a pool (pool-a)",
                signal_to("pool-a", "pool", signal.SIGSTOP),
                signal_to("pool-a", "pool", signal.SIGCONT),
                6.0,
            ),
            Fault(
                "SIGSTOP + SIGCONT a relay (pool-c)",
                signal_to("pool-c", "relay", signal.SIGSTOP),
                signal_to("pool-c", "relay", signal.SIGCONT),
                8.0,
            ),
            Fault("60 s discovery outage (both replicas)", discovery_down, discovery_up, 60.0),
            Fault(
                "a telemetry consumer that stops reading",
                self.start_slow_consumer,
                self.stop_slow_consumer,
                10.0,
            ),
        ]

    def start_slow_consumer(self) -> None:
        """Serves TelemetryService without reading and registers it as a frontend, so relays dial it."""
        consumer = SlowConsumer()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(consumer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        stop = threading.Event()
        request = dpb.RegisterFrontendRequest(
            frontend_id="chaos-slow-consumer", url=f"http://127.0.0.1:{port}", incarnation=time.time_ns()
        )

        def renew() -> None:
            with grpc.insecure_channel(self.replicas[1]) as ch:
                stub = dpb_grpc.DiscoveryServiceStub(ch)
                while not stop.is_set():
                    wait = HEARTBEAT
                    with contextlib.suppress(grpc.RpcError):
                        wait = seconds(stub.RegisterFrontend(request, timeout=3).heartbeat_interval)
                    stop.wait(wait)
                with contextlib.suppress(grpc.RpcError):
                    stub.UnregisterFrontend(
                        dpb.UnregisterFrontendRequest(
                            frontend_id=request.frontend_id, incarnation=request.incarnation
                        ),
                        timeout=3,
                    )

        threading.Thread(target=renew, daemon=True, name="slow-consumer lease").start()
        self.slow = (server, consumer, stop)

    def stop_slow_consumer(self) -> None:
        if self.slow is None:
            return
        server, consumer, stop = self.slow
        stop.set()
        consumer.released.set()
        server.stop(0)
        self.slow = None


class Load:
    """Clients that each stream requests, one after another, through both frontends."""

    def __init__(self, routers: list[str], ledger: Ledger, clients: int) -> None:
        self.routers = routers
        self.ledger = ledger
        self.clients = clients
        self.phase = "starting"
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True, name=f"client-{i}")
            for i in range(clients)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=REQUEST_TIMEOUT + 10)

    def _client(self, index: int) -> None:
        with FailoverClient(self.routers, start=index) as client:
            for seq in itertools.count():
                if self._stop.is_set():
                    return
                self._one(client, index, seq)
                self._stop.wait(0.05)

    def _one(self, client: FailoverClient, index: int, seq: int) -> None:
        prefix = [1000 + (index + seq) % PROMPT_PREFIXES] * 48
        prompt = [*prefix, *(10_000 + index * 1_000_000 + seq * 7 + k for k in range(8))]
        expected = continue_sequence(prompt, MAX_TOKENS)
        started = time.monotonic()
        received: list[int] = []
        failovers = migrations = 0
        code: str | None = None
        message = ""
        finished = False
        try:
            result = client.generate(
                MODEL, prompt, MAX_TOKENS, timeout=REQUEST_TIMEOUT, request_id=f"chaos-{index}-{seq}"
            )
            received, failovers, migrations, finished = (
                result.tokens,
                result.failovers,
                result.migrations,
                True,
            )
        except FailoverError as exc:
            received, code, message = exc.tokens, exc.code.name, exc.message
        except Exception as exc:
            code, message = type(exc).__name__, str(exc)
        outcome, detail = classify(
            expected, received, finished=finished, error_code=code, error_message=message
        )
        if outcome == EXACT and failovers:
            detail = "fail-over after " + "; ".join(result.errors)
        self.ledger.add(
            RequestRecord(
                index,
                self.phase,  # read when the request ended
                started,
                time.monotonic() - started,
                outcome,
                len(received),
                failovers,
                migrations,
                detail,
            )
        )


def write_report(path: Path, ledger: Ledger, took: float, clients: int, command_line: str) -> None:
    rows = ledger.rows()
    total = sum(r.requests for r in rows)
    lines = [
        "# Chaos run",
        "",
        f"Made by `{command_line}` on {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')} "
        f"in {took:.0f} s.",
        "",
        f"A 3-member etcd cluster, two discovery replicas on it (heartbeat {HEARTBEAT:g} s, lease {LEASE:g} s), "
        f"three mocker pools in two regions ({', '.join(f'{p} {r}' for p, r in POOLS.items())}), each with a relay "
        f"that knows both replicas, two global frontends (stall timeout {STALL_TIMEOUT:g} s, first-token timeout {FIRST_TOKEN_TIMEOUT:g} s) and {clients} clients "
        f"that each know both frontends and stream requests of {MAX_TOKENS} tokens one after another. Each fault "
        "is applied, held, healed, and the mesh is waited on until both frontends route to every pool again; a "
        "request belongs to the phase in which it ended, so one a fault hit counts in that fault's row.",
        "",
        "- **completed exact**: the client's stream holds exactly the tokens of an uninterrupted run "
        "(`mocker.tokens.continue_sequence`), whatever fail-overs and migrations happened;",
        "- **clean errors**: the request failed with a status code and a message, and every token it received "
        "was right;",
        "- **lost**: anything else (a wrong, missing or repeated token, an unexplained failure, a hang past the "
        f"{REQUEST_TIMEOUT:g} s deadline). Must be 0.",
        "- **p99**: of completed requests in the phase, against the quiet baseline of the same run.",
        "",
        render_table(rows),
        "",
        f"{total} requests, {ledger.lost} lost.",
    ]
    errors = [(r.phase, e) for r in rows for e in r.errors]
    if errors:
        lines += ["", "Errors and losses seen (up to five kinds per phase):", ""]
        lines += [f"- {phase}: {error}" for phase, error in errors]
    causes = [(r.phase, c) for r in rows for c in r.failover_causes]
    if causes:
        lines += [
            "",
            "Why clients failed over (up to three kinds per phase; each request still completed exactly):",
            "",
        ]
        lines += [f"- {phase}: {cause}" for phase, cause in causes]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("CHAOS.md"), help="where to write the report")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--baseline", type=float, default=15.0, help="seconds of quiet load first")
    parser.add_argument("--time-bound", type=float, default=480.0, help="fail when the run takes longer")
    parser.add_argument(
        "--only", action="append", default=[], help="run only faults whose name contains this"
    )
    parser.add_argument("--logs", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args(argv)
    began = time.monotonic()
    ledger = Ledger()
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"chaos: logs in {log_dir}", flush=True)
    ok = True
    with process_group(log_dir) as group:
        chaos = ChaosMesh(group)
        try:
            chaos.start()
            load = Load(chaos.routers, ledger, args.clients)
            ledger.begin("quiet")
            load.phase = "quiet"
            load.start()
            time.sleep(args.baseline)
            for fault in chaos.faults():
                if args.only and not any(o in fault.name for o in args.only):
                    continue
                print(f"chaos: {fault.name}", flush=True)
                ledger.begin(fault.name)
                load.phase = fault.name
                fault.apply()
                time.sleep(fault.hold)
                fault.heal()
                chaos.settle()
            ledger.begin("quiet again")
            load.phase = "quiet again"
            time.sleep(min(args.baseline, 10.0))
            load.stop()
        finally:
            chaos.stop_slow_consumer()
            chaos.etcd.remove_data()
    took = time.monotonic() - began
    ledger.dump(log_dir / "ledger.jsonl")
    command_line = "make chaos"
    write_report(args.out, ledger, took, args.clients, command_line)
    for row in ledger.rows():
        print(
            f"chaos: {row.phase}: {row.requests} requests, {row.exact} exact, {row.clean_errors} clean errors, "
            f"{row.lost} lost",
            flush=True,
        )
        if row.requests and not row.exact:
            print(f"chaos: FAIL: no request completed during {row.phase!r}", file=sys.stderr)
            ok = False
    if ledger.lost:
        print(f"chaos: FAIL: {ledger.lost} requests lost (see {args.out})", file=sys.stderr)
        ok = False
    if took > args.time_bound:
        print(
            f"chaos: FAIL: the run took {took:.0f} s, over its {args.time_bound:.0f} s bound", file=sys.stderr
        )
        ok = False
    print(f"chaos: wrote {args.out} ({took:.0f} s)", flush=True)
    return 0 if ok else 1

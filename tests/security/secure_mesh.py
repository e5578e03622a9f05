"""A whole mesh over mutual TLS on one machine, for the security end-to-end tests."""

from __future__ import annotations

import ssl
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from globalrouter.v1 import router_pb2 as rpb
from globalrouter.v1 import router_pb2_grpc as rpb_grpc
from meshkit.tls import SecurityConfig, channel_credentials
from meshlaunch import Proc, ProcessGroup, command, free_port, wait_until
from meshlaunch.mesh import discovery_argv, relay_argv, router_argv
from tests.security.pki import Pki

MODEL = "demo-model"


def secure_channel(address: str, config: SecurityConfig | None) -> grpc.Channel:
    """A blocking channel presenting `config`'s certificate (plain text when `config` is None)."""
    if config is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, channel_credentials(config))


def wait_serving(address: str, config: SecurityConfig | None, proc: Proc, timeout: float = 30.0) -> None:
    """Until `address` answers its health check over TLS; fails with the process log if it exits."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    with secure_channel(address, config) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if not proc.alive():
                raise AssertionError(f"{proc.args[:2]} exited:\n{proc.output()[-3000:]}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.05)
    raise AssertionError(f"{address} not serving within {timeout}s ({last})\n{proc.output()[-3000:]}")


@dataclass
class SecureMesh:
    """Discovery, one mocker pool with its relay, one global frontend: every link mutual TLS
    (plain text on loopback when `pki` is None)."""

    pki: Pki | None
    group: ProcessGroup
    router_flags: tuple[str, ...] = ()
    discovery: str = ""
    pool: str = ""
    router: str = ""
    http: str = ""
    """HOST:PORT of the router's OpenAI HTTP front (TLS when the mesh has a PKI)."""
    relay_status: str = ""
    metrics_port: int = 0
    procs: dict[str, Proc] = field(default_factory=dict)

    def config(self, cert: str) -> SecurityConfig | None:
        """How a caller presenting `cert` connects (None: plain text)."""
        return self.pki.config(cert) if self.pki else None

    def start(self, name: str, args: list[str], cert: str) -> Proc:
        flags = self.pki.flags(cert) if self.pki else []
        self.procs[name] = self.group.start(name, [*args, *flags])
        return self.procs[name]

    def start_all(self) -> SecureMesh:
        admin = self.config("admin")
        self.discovery = f"127.0.0.1:{free_port()}"
        proc = self.start("discovery", discovery_argv(self.discovery), "discovery")
        wait_serving(self.discovery, admin, proc)
        self.pool = f"127.0.0.1:{free_port()}"
        proc = self.start(
            "pool",
            [command("mocker"), "serve", "--listen", self.pool, "--pool-id", "pool-a", "--model", MODEL],
            "pool",
        )
        wait_serving(self.pool, admin, proc)
        self.router = f"127.0.0.1:{free_port()}"
        self.metrics_port = free_port()
        self.http = f"127.0.0.1:{free_port()}"
        proc = self.start(
            "router",
            router_argv(
                self.router,
                self.discovery,
                "--frontend-id",
                "router-1",
                "--metrics-listen",
                f"127.0.0.1:{self.metrics_port}",
                "--grace",
                "1",
                "--http-listen",
                self.http,
                *self.router_flags,
            ),
            "frontend",
        )
        wait_serving(self.router, admin, proc)
        self.relay_status = f"127.0.0.1:{free_port()}"
        self.start(
            "relay",
            relay_argv(
                self.pool, self.discovery, "pool-a", "r1", "relay-1", "--status-listen", self.relay_status
            ),
            "relay-a",
        )
        wait_until(self.routable, 30, message="pool-a routable over mutual TLS")
        return self

    @property
    def metrics_url(self) -> str:
        """The router's /metrics: HTTPS under the process's TLS flags, like every listener."""
        return f"{'https' if self.pki else 'http'}://127.0.0.1:{self.metrics_port}/metrics"

    def scraper_tls(self, cert: str | None = "admin") -> ssl.SSLContext | None:
        """What a scraper trusts (the mesh's CA) and presents (`cert`, or nothing); None: plain text."""
        return self.pki.client_context(cert) if self.pki else None

    def router_metric(self, name: str, **labels: str) -> float:
        """One sample of the router's /metrics (0 when absent)."""
        with urllib.request.urlopen(self.metrics_url, timeout=5, context=self.scraper_tls()) as reply:
            for family in text_string_to_metric_families(reply.read().decode()):
                for sample in family.samples:
                    if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                        return sample.value
        return 0.0

    def directory(self) -> list[dpb.Pool]:
        """The pools discovery lists (asked as an admin)."""
        with secure_channel(self.discovery, self.config("admin")) as ch:
            return list(dpb_grpc.DiscoveryServiceStub(ch).ListPools(dpb.ListPoolsRequest(), timeout=5).pools)

    def router_view(self) -> dict[str, rpb.PoolView]:
        """The router's pools (asked as a client)."""
        with secure_channel(self.router, self.config("client")) as ch:
            reply = rpb_grpc.RouterServiceStub(ch).ListPools(rpb.ListPoolsRequest(), timeout=5)
        return {p.pool_id: p for p in reply.pools}

    def routable(self) -> bool:
        view = self.router_view().get("pool-a")
        return bool(view and view.listed and view.load_freshness.fresh and view.kv_freshness.fresh)

    def state(self) -> tuple:
        """What a refused call must not change: the directory's pools and the router's signals about them."""
        pools = tuple(
            (p.pool_id, p.model, tuple(p.frontends), p.draining, tuple(lease.relay_id for lease in p.leases))
            for p in self.directory()
        )
        view = self.router_view()
        signals = tuple(
            (v.pool_id, v.listed, v.draining, v.ready, v.telemetry_streams) for v in view.values()
        )
        return pools, signals

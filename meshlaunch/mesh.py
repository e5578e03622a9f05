"""A whole mesh on one machine: discovery, mocker pools with their relays, global frontends."""

from __future__ import annotations

import contextlib
import json
import ssl
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from globaldiscovery.v1 import discovery_pb2, discovery_pb2_grpc
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.channels import client_security, sync_channel
from meshkit.devcerts import relay_cert_name
from meshkit.timeconv import duration
from meshkit.tls import SecurityConfig
from meshlaunch.process import (
    LaunchError,
    Proc,
    ProcessGroup,
    command,
    free_port,
    process_group,
    wait_healthy,
    wait_until,
)

MODEL = "demo-model"
# Short leases so that a lapse shows within seconds (discovery's defaults are for production).
HEARTBEAT = "0.5"
LEASE = "1.5"
# Seconds a started service gets to answer its health check as SERVING.
START_TIMEOUT = 30.0


def discovery_argv(listen: str, *extra: str) -> list[str]:
    """`globaldiscovery serve` on `listen` with short leases (HEARTBEAT, LEASE), then `extra`."""
    return [
        command("globaldiscovery"),
        "serve",
        "--listen",
        listen,
        "--heartbeat-interval",
        HEARTBEAT,
        "--lease-duration",
        LEASE,
        *extra,
    ]


def etcd_discovery_argv(listen: str, endpoints: str, heartbeat: float, lease: float) -> list[str]:
    """`globaldiscovery serve --store etcd` on `listen` over the etcd members `endpoints` (as
    `--etcd-endpoints` takes them), with the given heartbeat interval and lease (seconds)."""
    return [
        command("globaldiscovery"),
        "serve",
        "--listen",
        listen,
        "--store",
        "etcd",
        "--etcd-endpoints",
        endpoints,
        "--heartbeat-interval",
        str(heartbeat),
        "--lease-duration",
        str(lease),
    ]


def router_argv(listen: str, discovery: str, *extra: str) -> list[str]:
    """`globalrouter serve` on `listen` reading pools from `discovery`, then `extra`."""
    return [command("globalrouter"), "serve", "--listen", listen, "--discovery", discovery, *extra]


def relay_argv(pool: str, discovery: str, pool_id: str, region: str, relay_id: str, *extra: str) -> list[str]:
    """`poolrelay serve` for the mocker pool at `pool` (its own frontend), registering it with
    `discovery` as `pool_id` in `region` and reporting every 0.2 s, then `extra`."""
    return [
        command("poolrelay"),
        "serve",
        "--pool",
        pool,
        "--discovery",
        discovery,
        "--routing-pool",
        pool_id,
        "--routing-pool-region",
        region,
        "--routing-pool-frontends",
        f"http://{pool}",
        "--relay-id",
        relay_id,
        "--report-interval",
        "0.2",
        *extra,
    ]


@dataclass
class PoolProcs:
    """One mocker pool and its relay (None when started without one)."""

    pool_id: str
    address: str
    pool: Proc
    relay: Proc | None

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@dataclass
class RouterProc:
    """One global frontend."""

    address: str
    proc: Proc
    metrics_port: int
    scraper: SecurityConfig | None = None
    """The certificate /metrics is read with when the frontend runs over TLS (it then serves HTTPS)."""

    def stub(self, channel: grpc.Channel) -> router_pb2_grpc.RouterServiceStub:
        return router_pb2_grpc.RouterServiceStub(channel)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample on /metrics (0 when absent)."""
        tls = None
        if self.scraper is not None:
            tls = ssl.create_default_context(cafile=self.scraper.tls_ca or None)
            tls.load_cert_chain(self.scraper.tls_cert, self.scraper.tls_key)
        url = f"{'https' if tls else 'http'}://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5, context=tls) as reply:
            text = reply.read().decode()
        want = name + (
            "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""
        )
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def pools(self) -> dict[str, router_pb2.PoolView]:
        """The router's view of every pool (ListPools), by pool id."""
        with sync_channel(self.address) as ch:
            reply = self.stub(ch).ListPools(router_pb2.ListPoolsRequest(), timeout=5)
        return {p.pool_id: p for p in reply.pools}


def sees_with_telemetry(views: Mapping[str, router_pb2.PoolView], pool_ids: Iterable[str]) -> bool:
    """Whether a router's ListPools views list each pool with fresh load and KV telemetry."""
    return all(
        p in views and views[p].listed and views[p].load_freshness.fresh and views[p].kv_freshness.fresh
        for p in pool_ids
    )


@dataclass
class Mesh:
    """Processes of one mesh; the ProcessGroup stops them all."""

    group: ProcessGroup
    discovery: str = ""
    discovery_proc: Proc | None = None
    pools: dict[str, PoolProcs] = field(default_factory=dict)
    routers: list[RouterProc] = field(default_factory=list)
    start_timeout: float = START_TIMEOUT
    certs: Path | None = None
    """A dev PKI (meshkit.devcerts.write_dev_pki): every process then runs over mutual TLS."""

    def _tls(self, name: str) -> list[str]:
        """The flags that make a process present certificate NAME (none without `certs`)."""
        if self.certs is None:
            return []
        c = self.certs
        return [
            "--tls-cert",
            str(c / f"{name}.crt"),
            "--tls-key",
            str(c / f"{name}.key"),
            "--tls-ca",
            str(c / "ca.crt"),
        ]

    def _admin(self) -> SecurityConfig | None:
        """How this launcher dials as an operator (drains), when the mesh runs over TLS."""
        if self.certs is None:
            return None
        c = self.certs
        return SecurityConfig(
            tls_cert=str(c / "admin.crt"), tls_key=str(c / "admin.key"), tls_ca=str(c / "ca.crt")
        )

    def start_discovery(self, port: int | None = None, *extra: str) -> str:
        """Starts `globaldiscovery serve` (short leases unless `extra` sets others) and waits until
        it serves; its address."""
        self.discovery = self.discovery or f"127.0.0.1:{port or free_port()}"
        self.discovery_proc = self.group.start(
            "discovery", discovery_argv(self.discovery, *self._tls("discovery"), *extra)
        )
        wait_healthy(self.discovery, self.start_timeout, proc=self.discovery_proc)
        return self.discovery

    def start_pool(
        self,
        pool_id: str,
        region: str = "r1",
        *extra: str,
        relay: bool = True,
        model: str = MODEL,
        relay_flags: Sequence[str] = (),
    ) -> PoolProcs:
        """Starts a mocker pool of `model` (waits until it serves) and, unless `relay` is False, its
        relay (with `relay_flags` added, e.g. `--api-key-file`)."""
        if relay and not self.discovery:
            raise LaunchError(f"pool {pool_id}: start discovery before a relay that registers with it")
        address = f"127.0.0.1:{free_port()}"
        pool = self.group.start(
            pool_id,
            [
                *(command("mocker"), "serve", "--listen", address, "--pool-id", pool_id, "--model", model),
                *extra,
                *self._tls("pool"),
            ],
        )
        wait_healthy(address, self.start_timeout, proc=pool)
        relay_proc = (
            self.group.start(
                f"relay-{pool_id}",
                relay_argv(
                    address,
                    self.discovery,
                    pool_id,
                    region,
                    f"relay-{pool_id}",
                    *self._tls(relay_cert_name(pool_id)),
                    *relay_flags,
                ),
            )
            if relay
            else None
        )
        self.pools[pool_id] = PoolProcs(pool_id, address, pool, relay_proc)
        return self.pools[pool_id]

    def _frontend_identity(self) -> list[str]:
        """Over TLS, the next frontend's id and certificate (router-1, router-2, ...): they must match."""
        if self.certs is None:
            return []
        frontend_id = f"router-{len(self.routers) + 1}"
        return ["--frontend-id", frontend_id, *self._tls(frontend_id)]

    def start_router(self, *extra: str) -> RouterProc:
        """Starts a global frontend on discovery (grace 1 s, metrics on a free port); waits until it serves."""
        if not self.discovery:
            raise LaunchError("start discovery before a global frontend")
        address = f"127.0.0.1:{free_port()}"
        metrics_port = free_port()
        proc = self.group.start(
            "router",
            router_argv(
                address,
                self.discovery,
                "--metrics-listen",
                f"127.0.0.1:{metrics_port}",
                "--grace",
                "1",
                *self._frontend_identity(),
                *extra,
            ),
        )
        wait_healthy(address, self.start_timeout, proc=proc)
        router = RouterProc(address, proc, metrics_port, scraper=self._admin())
        self.routers.append(router)
        return router

    def wait_routable(self, router: RouterProc, pool_ids: Iterable[str], timeout: float = 20.0) -> None:
        """Until the router lists each pool with fresh load and KV telemetry.

        ProcessDied at once if the router, or a pool or relay of `pool_ids`, exits meanwhile.
        """
        wanted = sorted(pool_ids)

        def ready() -> bool:
            router.proc.check_alive()
            for pool_id in wanted:
                procs = self.pools.get(pool_id)
                if procs is not None:
                    procs.pool.check_alive()
                    if procs.relay is not None:
                        procs.relay.check_alive()
            return sees_with_telemetry(router.pools(), wanted)

        wait_until(ready, timeout, message=f"{router.address} sees {wanted} with telemetry")

    def drain(self, pool_id: str, seconds: float) -> None:
        """Asks discovery to drain `pool_id` with a deadline `seconds` from now."""
        with sync_channel(self.discovery, self._admin()) as ch:
            discovery_pb2_grpc.DiscoveryServiceStub(ch).DrainPool(
                discovery_pb2.DrainPoolRequest(pool_id=pool_id, timeout=duration(seconds)), timeout=5
            )


@contextlib.contextmanager
def local_mesh(log_dir: Path | None = None, certs: Path | None = None) -> Iterator[Mesh]:
    """An empty Mesh whose processes are all stopped when the block ends.

    Logs go to `log_dir`, or to a temporary directory removed at the end. With `certs` (a dev PKI)
    every process runs over mutual TLS; this process then dials as meshkit.channels.use_security says.
    """
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mesh-")))
        group = stack.enter_context(process_group(log_dir))
        yield Mesh(group, certs=certs)


def _client_flags() -> list[str]:
    """The security flags of this process's client identity, for the CLIs it runs."""
    s = client_security()
    flags = [
        ("--tls-cert", s.tls_cert),
        ("--tls-key", s.tls_key),
        ("--tls-ca", s.tls_ca),
        ("--api-key-file", s.api_key),
    ]
    return [x for flag, value in flags if value for x in (flag, value)]


def route(address: str, tokens: list[int]) -> router_pb2.RouteResponse:
    """A dry run (Route) of a prompt at the global frontend at `address`."""
    with sync_channel(address) as channel:
        reply: router_pb2.RouteResponse = router_pb2_grpc.RouterServiceStub(channel).Route(
            router_pb2.RouteRequest(
                model=MODEL, prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens))
            ),
            timeout=5,
        )
        return reply


def generate_cli(router: RouterProc, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """`globalrouter generate --json` as a user runs it; its JSON. LaunchError if it fails."""
    args = [
        command("globalrouter"),
        "generate",
        "--router",
        router.address,
        "--model",
        MODEL,
        "--tokens",
        ",".join(map(str, tokens)),
        "--max-tokens",
        str(max_tokens),
        "--json",
        *_client_flags(),
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise LaunchError(f"globalrouter generate exited with {out.returncode}:\n{out.stderr}{out.stdout}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result

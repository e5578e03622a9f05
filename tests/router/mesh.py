"""A real mesh for end-to-end tests: discovery, mocker pools with their relays, global frontends."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from dataclasses import dataclass, field

import grpc

from globaldiscovery.v1 import discovery_pb2, discovery_pb2_grpc
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.timeconv import duration
from tests.support import Proc, ProcessGroup, command, free_port, wait_healthy, wait_until

MODEL = "demo-model"
HEARTBEAT = "0.5"
LEASE = "1.5"


@dataclass
class PoolProcs:
    """One mocker pool and its relay."""

    pool_id: str
    address: str
    pool: Proc
    relay: Proc

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@dataclass
class RouterProc:
    """One global frontend."""

    address: str
    proc: Proc
    metrics_port: int

    def stub(self, channel: grpc.Channel) -> router_pb2_grpc.RouterServiceStub:
        return router_pb2_grpc.RouterServiceStub(channel)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample on /metrics (0 when absent)."""
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        )
        want = name + (
            "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""
        )
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def pools(self) -> dict[str, router_pb2.PoolView]:
        with grpc.insecure_channel(self.address) as ch:
            reply = self.stub(ch).ListPools(router_pb2.ListPoolsRequest(), timeout=5)
        return {p.pool_id: p for p in reply.pools}


@dataclass
class Mesh:
    """Processes of one mesh; the ProcessGroup stops them all."""

    group: ProcessGroup
    discovery: str = ""
    discovery_proc: Proc | None = None
    pools: dict[str, PoolProcs] = field(default_factory=dict)
    routers: list[RouterProc] = field(default_factory=list)

    def start_discovery(self, port: int | None = None) -> str:
        self.discovery = self.discovery or f"127.0.0.1:{port or free_port()}"
        self.discovery_proc = self.group.start(
            "discovery",
            [
                command("globaldiscovery"),
                "serve",
                "--listen",
                self.discovery,
                "--heartbeat-interval",
                HEARTBEAT,
                "--lease-duration",
                LEASE,
            ],
        )
        wait_healthy(self.discovery, proc=self.discovery_proc)
        return self.discovery

    def start_pool(self, pool_id: str, region: str = "r1", *extra: str, relay: bool = True) -> PoolProcs:
        address = f"127.0.0.1:{free_port()}"
        pool = self.group.start(
            pool_id,
            [command("mocker"), "serve", "--listen", address, "--pool-id", pool_id, "--model", MODEL, *extra],
        )
        wait_healthy(address, proc=pool)
        relay_proc = (
            self.group.start(
                f"relay-{pool_id}",
                [
                    command("poolrelay"),
                    "serve",
                    "--pool",
                    address,
                    "--discovery",
                    self.discovery,
                    "--routing-pool",
                    pool_id,
                    "--routing-pool-region",
                    region,
                    "--routing-pool-frontends",
                    f"http://{address}",
                    "--relay-id",
                    f"relay-{pool_id}",
                    "--report-interval",
                    "0.2",
                ],
            )
            if relay
            else None
        )
        self.pools[pool_id] = PoolProcs(pool_id, address, pool, relay_proc)  # type: ignore[arg-type]
        return self.pools[pool_id]

    def start_router(self, *extra: str) -> RouterProc:
        address = f"127.0.0.1:{free_port()}"
        metrics_port = free_port()
        proc = self.group.start(
            "router",
            [
                command("globalrouter"),
                "serve",
                "--listen",
                address,
                "--discovery",
                self.discovery,
                "--metrics-listen",
                f"127.0.0.1:{metrics_port}",
                "--grace",
                "1",
                *extra,
            ],
        )
        wait_healthy(address, proc=proc)
        router = RouterProc(address, proc, metrics_port)
        self.routers.append(router)
        return router

    def wait_routable(self, router: RouterProc, pool_ids, timeout: float = 20.0) -> None:
        """Until the router lists each pool with fresh load and KV telemetry."""

        def ready():
            views = router.pools()
            return all(
                p in views
                and views[p].listed
                and views[p].load_freshness.fresh
                and views[p].kv_freshness.fresh
                for p in pool_ids
            )

        wait_until(ready, timeout, message=f"{router.address} sees {sorted(pool_ids)} with telemetry")

    def drain(self, pool_id: str, seconds: float) -> None:
        with grpc.insecure_channel(self.discovery) as ch:
            discovery_pb2_grpc.DiscoveryServiceStub(ch).DrainPool(
                discovery_pb2.DrainPoolRequest(pool_id=pool_id, timeout=duration(seconds)), timeout=5
            )


def route(address: str, tokens: list[int]) -> router_pb2.RouteResponse:
    """A dry run (Route) of a prompt at the global frontend at `address`."""
    with grpc.insecure_channel(address) as channel:
        return router_pb2_grpc.RouterServiceStub(channel).Route(
            router_pb2.RouteRequest(
                model=MODEL, prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens))
            ),
            timeout=5,
        )


def generate_cli(router: RouterProc, tokens: list[int], max_tokens: int) -> dict:
    """`globalrouter generate --json` as a user runs it."""
    out = subprocess.run(
        [
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
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    return json.loads(out.stdout)

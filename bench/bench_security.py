"""Benchmark: the added cost of mutual TLS (and authorization) on the paths that matter.

Two meshes of real processes, one plain (loopback, nothing checked) and one over mutual TLS with
every call authorized, measured in the same run, alternating rounds:
- renewals/s: 32 relays (each with its own certificate) renewing their pool over KeepAlivePools
  streams, pipelined with a window of 8, at one discovery server;
- TTFT p50 through the global frontend: sequential Generate calls (128-token prompts, 1 token);
- telemetry events/s at the global frontend: one relay stream carrying KV deltas of 16 blocks;
- the OpenAI HTTP front of the same global frontend (HTTPS under its TLS flags): TTFT p50 of
  sequential streamed /v1/completions (128-token id prompts, 1 token) and requests/s of a closed
  loop of keep-alive clients (16-token outputs), bounded in time and count. Server-only TLS is not
  a mesh configuration (a frontend with a CA requires client certificates), so the HTTP rows
  compare plain HTTP with mutual TLS (a client certificate).
Writes bench/results/bench_security.md.

Run: .venv/bin/python -m bench.bench_security
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.bench_http import VOCAB, Http
from bench.measure import closed_loop
from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from globalrouter.tokenizer_train import train_tokenizer
from globalrouter.v1 import router_pb2 as rpb
from globalrouter.v1 import router_pb2_grpc as rpb_grpc
from meshkit import devcerts
from meshkit.identity import Role, spiffe_id
from meshkit.tls import DEFAULT_TRUST_DOMAIN, SecurityConfig, channel_credentials
from meshlaunch import MODEL, command, free_port, process_group
from meshlaunch.mesh import relay_argv, router_argv
from poolrelay.v1 import telemetry_pb2 as tpb
from poolrelay.v1 import telemetry_pb2_grpc as tpb_grpc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "bench_security.md"
RELAYS = 32
WINDOW = 8
HTTP_OUTPUT_TOKENS = 16


class Certs:
    """A dev CA and the certificates the benchmark's processes and clients present."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = devcerts.new_authority()
        (root / "ca.crt").write_bytes(self.ca.cert_pem)

    def make(self, name: str, role: Role | None, *names: str) -> SecurityConfig:
        uri = spiffe_id(DEFAULT_TRUST_DOMAIN, role, *names) if role else None
        cert, key = devcerts.issue(self.ca, uri).write(self.root, name)
        return SecurityConfig(tls_cert=str(cert), tls_key=str(key), tls_ca=str(self.root / "ca.crt"))


def flags(config: SecurityConfig | None) -> list[str]:
    if config is None:
        return []
    return ["--tls-cert", config.tls_cert, "--tls-key", config.tls_key, "--tls-ca", config.tls_ca]


# Each channel its own connection: plain channels to one address would otherwise share one.
_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def channel(address: str, config: SecurityConfig | None) -> grpc.aio.Channel:
    if config is None:
        return grpc.aio.insecure_channel(address, options=_OWN_CONNECTION)
    return grpc.aio.secure_channel(address, channel_credentials(config), options=_OWN_CONNECTION)


async def wait_serving(address: str, config: SecurityConfig | None, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    async with channel(address, config) as ch:
        while True:
            try:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)


class Mesh:
    """discovery + mocker pool + relay + global frontend, plain or over mutual TLS."""

    def __init__(self, group, certs: Certs | None, tokenizer: Path) -> None:
        self.group = group
        self.secure = certs is not None
        self.tokenizer = tokenizer
        c = certs
        self.server = {
            name: (c.make(name, role, *names) if c else None)
            for name, role, names in (
                ("discovery", None, ()),
                ("pool", None, ()),
                ("router", Role.FRONTEND, ("router-1",)),
                ("relay", Role.RELAY, ("pool-a", "relay-1")),
                ("client", Role.CLIENT, ("bench",)),
                ("admin", Role.ADMIN, ("bench",)),
            )
        }
        self.relays = [
            c.make(f"relay-{i}", Role.RELAY, f"renew-{i}", "relay-1") if c else None for i in range(RELAYS)
        ]
        self.telemetry_relay = c.make("relay-t", Role.RELAY, "telemetry-pool", "relay-1") if c else None

    async def start(self) -> None:
        s = self.server
        self.discovery = f"127.0.0.1:{free_port()}"
        self.group.start(
            "discovery",
            [command("globaldiscovery"), "serve", "--listen", self.discovery, *flags(s["discovery"])],
        )
        self.pool = f"127.0.0.1:{free_port()}"
        self.group.start(
            "pool",
            [
                command("mocker"),
                "serve",
                "--listen",
                self.pool,
                "--pool-id",
                "pool-a",
                "--model",
                MODEL,
                "--speedup",
                "100",
                "--vocab-size",
                str(VOCAB),
                *flags(s["pool"]),
            ],
        )
        await wait_serving(self.discovery, s["admin"])
        await wait_serving(self.pool, s["admin"])
        self.router = f"127.0.0.1:{free_port()}"
        self.http = f"127.0.0.1:{free_port()}"
        self.group.start(
            "router",
            router_argv(
                self.router,
                self.discovery,
                "--frontend-id",
                "router-1",
                "--http-listen",
                self.http,
                "--tokenizer",
                f"{MODEL}={self.tokenizer}",
                *flags(s["router"]),
            ),
        )
        await wait_serving(self.router, s["admin"])
        self.group.start(
            "relay",
            relay_argv(self.pool, self.discovery, "pool-a", "r1", "relay-1", *flags(s["relay"])),
        )
        client = s["client"]
        tls = None
        if client is not None:
            tls = ssl.create_default_context(cafile=client.tls_ca)
            tls.load_cert_chain(client.tls_cert, client.tls_key)
        # One lean keep-alive HTTP/1.1 client (bench_http's); HTTPS with the client certificate.
        self.http_client = Http(self.http, tls)
        async with channel(self.router, client) as ch:
            stub = rpb_grpc.RouterServiceStub(ch)
            deadline = time.monotonic() + 60
            while True:
                pools = {
                    p.pool_id: p for p in (await stub.ListPools(rpb.ListPoolsRequest(), timeout=5)).pools
                }
                p = pools.get("pool-a")
                if p and p.listed and p.load_freshness.fresh and p.kv_freshness.fresh:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError("the mesh never became routable")
                await asyncio.sleep(0.1)

    async def renewals(self, seconds: float, warmup: float = 1.0) -> float:
        """Renewals per second: RELAYS streams, each renewing its own pool with WINDOW in flight.

        Streams are opened (and TLS handshakes done) during `warmup`; only replies after it count."""
        counted = 0
        begin = time.perf_counter() + warmup
        stop = begin + seconds

        async def relay(i: int) -> None:
            nonlocal counted
            request = dpb.RegisterPoolRequest(
                pool_id=f"renew-{i}",
                model=MODEL,
                region="r1",
                frontends=[f"http://10.0.0.{i}:8000"],
                relay_id="relay-1",
                incarnation=1,
            )
            async with channel(self.discovery, self.relays[i]) as ch:
                call = dpb_grpc.DiscoveryServiceStub(ch).KeepAlivePools()
                sent = 0
                for _ in range(WINDOW):
                    sent += 1
                    await call.write(dpb.KeepAlivePoolsRequest(sequence=sent, register=request))
                while True:
                    reply = await call.read()
                    assert isinstance(reply, dpb.KeepAlivePoolsResponse), reply
                    assert reply.HasField("register"), reply.status
                    now = time.perf_counter()
                    if now >= stop:
                        break
                    counted += now >= begin
                    sent += 1
                    await call.write(dpb.KeepAlivePoolsRequest(sequence=sent, register=request))
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:
                    pass

        await asyncio.gather(*(relay(i) for i in range(RELAYS)))
        return counted / seconds

    async def ttft(self, n: int) -> list[float]:
        """Time to first token of `n` sequential Generates through the global frontend (after warm-up)."""
        out = []
        async with channel(self.router, self.server["client"]) as ch:
            stub = rpb_grpc.RouterServiceStub(ch)
            for i in range(-20, n):
                ids = [(i * 7919 + k * 31) % VOCAB for k in range(128)]  # within the --tokenizer's vocabulary
                started = time.perf_counter()
                call = stub.Generate(
                    rpb.GenerateRequest(
                        model=MODEL, prompt=rpb.Prompt(token_ids=rpb.TokenIds(ids=ids)), max_tokens=1
                    ),
                    timeout=30,
                )
                first = None
                async for msg in call:
                    if first is None and msg.HasField("tokens"):
                        first = time.perf_counter() - started
                if i >= 0:
                    assert first is not None, "a Generate without tokens"
                    out.append(first)
        return out

    async def telemetry(self, deltas: int) -> float:
        """KV events (block transitions) per second one telemetry stream delivers into the frontend."""
        hello = tpb.TelemetryHello(
            pool_id="telemetry-pool",
            relay_id="relay-1",
            incarnation=time.time_ns(),
            protocol_version=1,
            block_size=16,
            hash_scheme=tpb.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
        )

        def messages():
            yield tpb.PublishPoolTelemetryRequest(hello=hello)
            yield tpb.PublishPoolTelemetryRequest(
                kv_snapshot=tpb.KvSnapshot(snapshot_id=1, sequence=0, chunk_index=0, last=True)
            )
            for seq in range(1, deltas + 1):
                base = seq * 16
                yield tpb.PublishPoolTelemetryRequest(
                    kv_delta=tpb.KvDelta(sequence=seq, stored=range(base, base + 16))
                )

        async with channel(self.router, self.telemetry_relay) as ch:
            started = time.perf_counter()
            call = tpb_grpc.TelemetryServiceStub(ch).PublishPoolTelemetry(messages(), timeout=120)
            async for reply in call:
                assert not reply.HasField("snapshot_request"), reply
            elapsed = time.perf_counter() - started
        return deltas * 16 / elapsed

    async def http_ttft(self, n: int, round_: int) -> list[float]:
        """TTFT of `n` sequential streamed /v1/completions (1 token) through the HTTP front (after warm-up)."""
        base = 1_000_000 * (round_ + 1)  # prompts distinct across rounds: no run is a pure cache hit
        for i in range(20):
            await self.http_client.one(base + 500_000 + i, 1)
        return [(await self.http_client.one(base + i, 1))[0] for i in range(n)]

    async def http_rps(self, seconds: float, concurrency: int) -> float:
        """Requests/s of `concurrency` keep-alive clients, each sending the next when the last ends."""
        rate, _ = await closed_loop(self.http_client, seconds, concurrency, 100_000, HTTP_OUTPUT_TOKENS)
        return rate


def p50(values: list[float]) -> float:
    return statistics.median(values)


async def run(args) -> dict:
    results: dict[str, dict[str, list[float]]] = {"plain": {}, "mtls": {}}
    with tempfile.TemporaryDirectory(prefix="bench-security-") as tmp, process_group(Path(tmp)) as group:
        certs = Certs(Path(tmp))
        tokenizer = train_tokenizer(Path(tmp) / "tokenizer", vocab_size=VOCAB)
        meshes = {"plain": Mesh(group, None, tokenizer), "mtls": Mesh(group, certs, tokenizer)}
        for mesh in meshes.values():
            await mesh.start()
        for round_ in range(args.rounds):
            order = ("plain", "mtls") if round_ % 2 == 0 else ("mtls", "plain")
            for name in order:
                mesh, r = meshes[name], results[name]
                r.setdefault("renewals", []).append(await mesh.renewals(args.seconds))
                r.setdefault("ttft", []).extend(await mesh.ttft(args.ttft_requests))
                r.setdefault("telemetry", []).append(await mesh.telemetry(args.deltas))
                r.setdefault("http_ttft", []).extend(await mesh.http_ttft(args.ttft_requests, round_))
                r.setdefault("http_rps", []).append(
                    await mesh.http_rps(args.http_seconds, args.http_concurrency)
                )
                print(name, round_, {k: round(v[-1], 4) for k, v in r.items()}, flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of renewals per round")
    parser.add_argument("--ttft-requests", type=int, default=100, help="Generates per round")
    parser.add_argument("--deltas", type=int, default=5000, help="KV deltas per telemetry round")
    parser.add_argument("--http-seconds", type=float, default=3.0, help="seconds of HTTP load per round")
    parser.add_argument("--http-concurrency", type=int, default=8, help="HTTP clients in the closed loop")
    args = parser.parse_args()
    r = asyncio.run(run(args))
    plain, mtls = r["plain"], r["mtls"]
    # (label, plain samples, mTLS samples, scale): rates are per round; TTFT per request.
    rows = [
        ("renewals/s (32 relays, KeepAlivePools, window 8)", plain["renewals"], mtls["renewals"], 1.0),
        ("TTFT p50 through the global frontend (ms)", plain["ttft"], mtls["ttft"], 1e3),
        ("telemetry KV events/s (one stream, 16 per delta)", plain["telemetry"], mtls["telemetry"], 1.0),
        ("HTTP front: TTFT p50 of streamed /v1/completions (ms)", plain["http_ttft"], mtls["http_ttft"], 1e3),
        (
            f"HTTP front: requests/s ({args.http_concurrency} keep-alive clients, "
            f"{HTTP_OUTPUT_TOKENS}-token streamed /v1/completions)",
            plain["http_rps"],
            mtls["http_rps"],
            1.0,
        ),
    ]
    lines = [
        "## Mutual TLS: added cost (bench_security)",
        "",
        f"`.venv/bin/python -m bench.bench_security` on {platform.machine()}, {platform.python_version()}; "
        f"{args.rounds} alternating rounds per mesh: median of rounds, and the range of the rounds (TTFT: "
        f"median of all {args.rounds * args.ttft_requests} requests, and the range of the rounds' medians). "
        "Plain: loopback, nothing checked. mTLS: every link mutual TLS, every call authorized (renewals: "
        "each message checked against the relay's identity; HTTP: HTTPS with a client certificate, server-only "
        "TLS is not a mesh configuration). The machine is shared: where the ranges of "
        "the two meshes overlap, the difference is within the noise of this run.",
        "",
        "| path | plain | mutual TLS | mTLS / plain |",
        "|---|---|---|---|",
    ]
    for label, a_samples, b_samples, scale in rows:
        a, b = p50(a_samples) * scale, p50(b_samples) * scale
        if "TTFT" in label:
            n = args.ttft_requests
            a_rounds = [p50(a_samples[i : i + n]) * scale for i in range(0, len(a_samples), n)]
            b_rounds = [p50(b_samples[i : i + n]) * scale for i in range(0, len(b_samples), n)]
        else:
            a_rounds, b_rounds = [x * scale for x in a_samples], [x * scale for x in b_samples]
        lines.append(
            f"| {label} | {a:,.1f} ({min(a_rounds):,.1f}–{max(a_rounds):,.1f}) "
            f"| {b:,.1f} ({min(b_rounds):,.1f}–{max(b_rounds):,.1f}) | {b / a:.2f} |"
        )
        print(f"{label}: plain {a:,.1f} {a_rounds}  mtls {b:,.1f} {b_rounds}  ratio {b / a:.2f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

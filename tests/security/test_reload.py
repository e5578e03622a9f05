"""SIGHUP on every server, with TLS or without: what can be re-read is (certificates, API keys), nothing
stops; a revoked API key is refused at once; a relay authenticates by key to a loopback router with
--api-keys, and a relay that cannot is counted and logged on both sides (never routing blind in silence)."""

from __future__ import annotations

import http.client as http_client
import json
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from globalrouter.v1 import router_pb2 as rpb
from globalrouter.v1 import router_pb2_grpc as rpb_grpc
from meshkit.identity import hash_api_key, new_api_key
from meshlaunch import Proc, free_port, wait_healthy, wait_until
from meshlaunch.mesh import MODEL, Mesh, RouterProc, generate_cli, local_mesh, relay_argv, router_argv
from poolrelay.v1 import status_pb2, status_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def router_pools(address: str, key: str) -> dict[str, rpb.PoolView]:
    """The router's ListPools, asked with API key `key` over plain text."""
    with grpc.insecure_channel(address) as ch:
        reply = rpb_grpc.RouterServiceStub(ch).ListPools(
            rpb.ListPoolsRequest(), timeout=5, metadata=bearer(key)
        )
    return {p.pool_id: p for p in reply.pools}


def grpc_code(address: str, key: str) -> grpc.StatusCode:
    """The status of a ListPools with `key`: OK or why not."""
    try:
        router_pools(address, key)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def http_status(http: str, key: str) -> int:
    """The status of GET /v1/models with `key`."""
    request = urllib.request.Request(f"http://{http}/v1/models", headers={"authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        for family in text_string_to_metric_families(reply.read().decode()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
    return 0.0


def log_lines(proc: Proc, event: str) -> list[str]:
    return [line for line in proc.output().splitlines() if event in line]


def sighup_and_wait(proc: Proc, event: str, count: int) -> str:
    """Sends SIGHUP and waits until the log has `count` lines with `event` (the process must live on)."""
    proc.signal(signal.SIGHUP)

    def logged() -> bool:
        proc.check_alive()  # the old code died of SIGHUP (its default action) without TLS
        return len(log_lines(proc, event)) >= count

    wait_until(logged, 30, message=f"{proc.name} logs {event!r} after SIGHUP")
    return log_lines(proc, event)[count - 1]


def keyed_router(mesh: Mesh, key: str, *extra: str) -> RouterProc:
    """A global frontend with `extra` (its --api-keys among them), once it answers ListPools with `key`
    (its health check too wants an identity)."""
    address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    args = router_argv(address, mesh.discovery, "--metrics-listen", f"127.0.0.1:{metrics_port}", *extra)
    proc = mesh.group.start("router", [*args, "--grace", "1"])

    def serving() -> bool:
        proc.check_alive()
        return grpc_code(address, key) == grpc.StatusCode.OK

    wait_until(serving, 30, message="the router answers with a key")
    return RouterProc(address, proc, metrics_port)


def test_every_server_without_tls_survives_sighup_and_still_serves(tmp_path):
    with local_mesh(tmp_path) as mesh:
        discovery = mesh.start_discovery()
        pool = mesh.start_pool("pool-a")
        http = f"127.0.0.1:{free_port()}"
        router = mesh.start_router("--http-listen", http)
        mesh.wait_routable(router, ["pool-a"])
        assert pool.relay is not None and mesh.discovery_proc is not None
        procs = {
            "discovery": mesh.discovery_proc,
            "pool": pool.pool,
            "relay": pool.relay,
            "router": router.proc,
        }
        for name, proc in procs.items():
            line = sighup_and_wait(proc, '"SIGHUP"', 1)
            assert "nothing to reload" in line, (name, line)
        # Again (one signal at a time: signals sent faster than handled count once).
        for proc in procs.values():
            sighup_and_wait(proc, '"SIGHUP"', 2)
        for name, proc in procs.items():
            assert proc.alive(), name
        for address, proc in (
            (discovery, procs["discovery"]),
            (pool.address, pool.pool),
            (router.address, router.proc),
        ):
            wait_healthy(address, 10, proc=proc)
        mesh.wait_routable(router, ["pool-a"])  # the relay still registers and streams telemetry
        assert generate_cli(router, list(range(40)), 4)["finish_reason"]
        with urllib.request.urlopen(f"http://{http}/health", timeout=5) as reply:
            assert reply.status == 200


def test_a_revoked_api_key_is_refused_after_sighup_and_a_bad_keys_file_keeps_the_current_keys(tmp_path):
    alice, bob, carol = new_api_key(), new_api_key(), new_api_key()
    keys = tmp_path / "api-keys"
    keys.write_text(f"alice {hash_api_key(alice)}\nbob {hash_api_key(bob)}\n")
    with local_mesh(tmp_path) as mesh:
        mesh.start_discovery()
        http = f"127.0.0.1:{free_port()}"
        router = keyed_router(mesh, bob, "--api-keys", str(keys), "--http-listen", http)
        proc = router.proc
        wait_until(lambda: http_status(http, bob) == 200, 30, message="the HTTP front serves bob")
        assert grpc_code(router.address, bob) == grpc.StatusCode.OK
        assert grpc_code(router.address, carol) == grpc.StatusCode.UNAUTHENTICATED

        # bob's key is removed from the file, carol's added: after SIGHUP bob is refused at once.
        keys.write_text(f"alice {hash_api_key(alice)}\ncarol {hash_api_key(carol)}\n")
        line = sighup_and_wait(proc, "API keys reloaded", 1)
        assert grpc_code(router.address, bob) == grpc.StatusCode.UNAUTHENTICATED
        assert http_status(http, bob) == 401
        for key in (alice, carol):
            assert grpc_code(router.address, key) == grpc.StatusCode.OK
            assert http_status(http, key) == 200
        event = json.loads(line)
        assert (event["added"], event["removed"], event["rekeyed"]) == (["client/carol"], ["client/bob"], [])
        for key in (alice, bob, carol):  # identities in the log, never keys
            assert key not in proc.output() and hash_api_key(key) not in proc.output()

        # alice's key is replaced: the identity stays, the old key no longer works.
        alice2 = new_api_key()
        keys.write_text(f"alice {hash_api_key(alice2)}\ncarol {hash_api_key(carol)}\n")
        line = sighup_and_wait(proc, "API keys reloaded", 2)
        assert json.loads(line)["rekeyed"] == ["client/alice"]
        assert grpc_code(router.address, alice) == grpc.StatusCode.UNAUTHENTICATED
        assert grpc_code(router.address, alice2) == grpc.StatusCode.OK

        # A keys file with a key in clear is refused whole, with a line naming it; the keys in force stay.
        keys.write_text(f"carol {hash_api_key(carol)}\nmallory {new_api_key()}\n")
        line = sighup_and_wait(proc, "API keys NOT reloaded", 1)
        assert "api-keys:2" in line and "never in clear" in line
        assert grpc_code(router.address, alice2) == grpc.StatusCode.OK
        assert http_status(http, alice2) == 200
        # A file that is gone: the same.
        keys.unlink()
        sighup_and_wait(proc, "API keys NOT reloaded", 2)
        assert grpc_code(router.address, carol) == grpc.StatusCode.OK
        proc.check_alive()


def test_a_relay_authenticates_by_api_key_to_a_loopback_router_with_api_keys(tmp_path):
    """Router with --api-keys and no TLS: relay-a's key maps to relay/pool-a/relay-a, so its KV and load
    arrive; relay-b has no key: its streams are refused, counted by reason and logged on the router,
    and its own status says it was refused."""
    client, relay_key = new_api_key(), new_api_key()
    keys = tmp_path / "api-keys"
    keys.write_text(f"ops {hash_api_key(client)}\nrelay/pool-a/relay-a {hash_api_key(relay_key)}\n")
    key_file = tmp_path / "relay-a.apikey"
    key_file.write_text(relay_key + "\n")
    with local_mesh(tmp_path) as mesh:
        mesh.start_discovery()
        router = keyed_router(mesh, client, "--api-keys", str(keys))
        relays = {}
        for pool_id, relay_id, extra in (
            ("pool-a", "relay-a", ["--api-key-file", str(key_file)]),
            ("pool-b", "relay-b", []),
        ):
            pool = mesh.start_pool(pool_id, relay=False)
            status = f"127.0.0.1:{free_port()}"
            relays[pool_id] = (
                mesh.group.start(
                    relay_id,
                    relay_argv(
                        pool.address,
                        mesh.discovery,
                        pool_id,
                        "r1",
                        relay_id,
                        "--status-listen",
                        status,
                        *extra,
                    ),
                ),
                status,
            )

        def pool_a_fresh() -> bool:
            router.proc.check_alive()
            view = router_pools(router.address, client).get("pool-a")
            return bool(view and view.listed and view.kv_freshness.fresh and view.load_freshness.fresh)

        wait_until(pool_a_fresh, 40, message="pool-a's KV and load reach the router by the relay's key")

        # relay-b: listed (discovery needs no key) but blind, and never silently so.
        wait_until(
            lambda: (
                metric(
                    router.metrics_port,
                    "globalrouter_telemetry_streams_refused_total",
                    reason="UNAUTHENTICATED",
                )
                >= 1
            ),
            30,
            message="the router counts relay-b's refused stream",
        )
        view = router_pools(router.address, client)["pool-b"]
        assert view.listed and not view.kv_freshness.fresh
        assert log_lines(router.proc, "telemetry stream refused")
        relay_b, status_b = relays["pool-b"]
        wait_until(lambda: log_lines(relay_b, "telemetry stream refused by the frontend"), 30)

        def streams_b() -> list[tuple[int, str]]:
            with grpc.insecure_channel(status_b) as ch:
                reply = status_pb2_grpc.RelayStatusServiceStub(ch).GetRelayStatus(
                    status_pb2.GetRelayStatusRequest(), timeout=5
                )
            return [(s.state, s.last_error.split(":")[0]) for s in reply.telemetry_streams]

        # Between redials (a refused stream waits out the back-off; it is CONNECTING only while it dials).
        refused = [(status_pb2.TELEMETRY_STREAM_STATE_REFUSED, "UNAUTHENTICATED")]
        wait_until(lambda: streams_b() == refused, 30, message="relay-b's status shows the refusal")
        # The relay key stands for relay-a of pool-a only: it is no client key.
        assert grpc_code(router.address, relay_key) == grpc.StatusCode.PERMISSION_DENIED

        # The relay key is revoked: relay-a's open stream ends at once, and it is refused from then on.
        keys.write_text(f"ops {hash_api_key(client)}\n")
        event = json.loads(sighup_and_wait(router.proc, "API keys reloaded", 1))
        assert (event["removed"], event["open_calls_ended"]) == (["relay/pool-a/relay-a"], 1)
        relay_a = relays["pool-a"][0]
        wait_until(lambda: log_lines(relay_a, "telemetry stream refused by the frontend"), 30)
        assert "the API key was revoked" in log_lines(relay_a, "telemetry stream refused by the frontend")[0]


def test_the_open_calls_of_a_revoked_key_end_at_once(tmp_path):
    """bob's gRPC Generate stream and HTTP completion stream (60 s of tokens each) end within seconds
    of the SIGHUP that revokes his key: gRPC with UNAUTHENTICATED, HTTP cut before its end."""
    bob, alice = new_api_key(), new_api_key()
    keys = tmp_path / "api-keys"
    keys.write_text(f"alice {hash_api_key(alice)}\nbob {hash_api_key(bob)}\n")
    with local_mesh(tmp_path) as mesh:
        mesh.start_discovery()
        mesh.start_pool("pool-a")  # its relay has no key: the router routes blind, Generate works
        http = f"127.0.0.1:{free_port()}"
        router = keyed_router(mesh, bob, "--api-keys", str(keys), "--http-listen", http)
        request = rpb.GenerateRequest(
            model=MODEL, prompt=rpb.Prompt(token_ids=rpb.TokenIds(ids=[7] * 8)), max_tokens=3000
        )

        def generates() -> bool:
            with grpc.insecure_channel(router.address) as ch:
                stub = rpb_grpc.RouterServiceStub(ch)
                try:
                    short = rpb.GenerateRequest(model=MODEL, prompt=request.prompt, max_tokens=2)
                    list(stub.Generate(short, timeout=10, metadata=bearer(bob)))
                except grpc.RpcError:
                    return False
            return True

        wait_until(generates, 30, message="the router generates on pool-a")
        with grpc.insecure_channel(router.address) as ch:
            stream = rpb_grpc.RouterServiceStub(ch).Generate(request, timeout=120, metadata=bearer(bob))
            next(stream)  # the stream is open
            host, _, port = http.rpartition(":")
            conn = http_client.HTTPConnection(host, int(port), timeout=120)
            body = json.dumps({"model": MODEL, "prompt": [7] * 8, "max_tokens": 3000, "stream": True})
            conn.request(
                "POST",
                "/v1/completions",
                body=body,
                headers={"content-type": "application/json", "authorization": f"Bearer {bob}"},
            )
            reply = conn.getresponse()
            assert reply.status == 200
            assert reply.readline().startswith(b"data: ")

            keys.write_text(f"alice {hash_api_key(alice)}\n")
            revoked_at = time.monotonic()
            line = sighup_and_wait(router.proc, "API keys reloaded", 1)
            assert json.loads(line)["open_calls_ended"] == 1  # the gRPC stream (HTTP ends at its next chunk)
            with pytest.raises(grpc.RpcError) as ended:
                for _ in stream:
                    pass
            assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "revoked" in (ended.value.details() or "")
            try:
                rest = reply.read()
            except http_client.IncompleteRead as exc:
                rest = exc.partial
            conn.close()
            assert b"[DONE]" not in rest
            assert time.monotonic() - revoked_at < 30  # the whole streams would take 60 s
        assert grpc_code(router.address, alice) == grpc.StatusCode.OK

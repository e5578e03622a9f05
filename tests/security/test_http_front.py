"""The OpenAI HTTP front under the mesh's security: TLS (mutual with a CA), identities by certificate or
API key, the one authorization table, the shared stream limit, head and prompt bounds, rotation."""

from __future__ import annotations

import asyncio
import json
import ssl
from contextlib import asynccontextmanager

import httpx2
import openai
import pytest

from globalrouter.config import RouterConfig
from globalrouter.http_api.config import HttpConfig
from globalrouter.server import create_server
from meshkit import devcerts
from meshkit.clock import SystemClock
from meshkit.identity import hash_api_key, new_api_key
from meshkit.tls import SecurityConfig
from mocker.config import Faults, PoolConfig
from mocker.pool import Pool
from mocker.server import build_server
from tests.router.fakes import pool_msg

pytestmark = pytest.mark.timeout(60)

MODEL = "m"
MSG = [{"role": "user", "content": "hi"}]


@asynccontextmanager
async def front(security: SecurityConfig, **limits):
    """A global frontend with its HTTP front under `security`, routing to one in-process mocker pool."""
    config = RouterConfig(
        listen="127.0.0.1:0",
        grace=0.5,
        security=security,
        max_streams_per_client=limits.pop("max_streams_per_client", 64),
        max_prompt_tokens=limits.pop("max_prompt_tokens", 1_048_576),
        max_output_tokens=limits.pop("max_output_tokens", 1_048_576),
        http=HttpConfig(listen="127.0.0.1:0", **limits),
    )
    router = create_server(config)
    await router.handle.server.start()
    router.start_background()
    pool = Pool(
        PoolConfig(pool_id="p1", models=(MODEL,), vocab_size=128, speedup=50.0), SystemClock(), Faults()
    )
    handle = build_server("127.0.0.1:0", pool, exit_process=lambda code: None)
    await handle.server.start()
    router.core.table.apply_listed(pool_msg("p1", f"http://127.0.0.1:{handle.port}", model=MODEL))
    try:
        yield router
    finally:
        await router.leave()
        await router.close()
        await router.handle.server.stop(0)
        await handle.server.stop(0)


def client_context(pki, cert: str | None) -> ssl.SSLContext:
    """What a client trusts (the test CA) and presents (`cert`, or nothing)."""
    return pki.client_context(cert)


async def call(base: str, path: str, *, verify=False, key: str | None = None, body=None):
    """(status, JSON or text) of one request."""
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    async with httpx2.AsyncClient(verify=verify, timeout=10) as http:
        if body is None:
            reply = await http.get(base + path, headers=headers)
        else:
            reply = await http.post(base + path, headers=headers, json=body)
    try:
        return reply.status_code, reply.json()
    except ValueError:
        return reply.status_code, reply.text


def refusals(router, code: str) -> float:
    return sum(
        s.value
        for family in router.metrics.registry.collect()
        for s in family.samples
        if s.name == "mesh_auth_refusals_total" and s.labels.get("code") == code
    )


CHAT = {"model": MODEL, "messages": MSG, "max_tokens": 3}


@pytest.fixture
def keys(tmp_path):
    key = new_api_key()
    path = tmp_path / "keys"
    path.write_text(f"bob {hash_api_key(key)}\n")
    return key, str(path)


async def test_mutual_tls_accepts_a_client_certificate_and_refuses_every_other_caller(pki):
    async with front(pki.config("frontend")) as router:
        assert router.http is not None
        base = f"https://127.0.0.1:{router.http.port}"
        good = client_context(pki, "client")
        # The official client, presenting a client certificate.
        async with httpx2.AsyncClient(verify=good) as http:
            sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", http_client=http, max_retries=0)
            reply = await sdk.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)  # type: ignore[arg-type]
            assert reply.choices[0].finish_reason == "length"
            assert [m.id for m in (await sdk.models.list()).data] == [MODEL]
        requests_before = sum(s.value for s in router.metrics.requests.collect()[0].samples)
        # No certificate, one from another CA, an expired one: the server ends the connection.
        for cert in (None, "other-ca", "expired"):
            with pytest.raises(httpx2.TransportError):  # TLS 1.3: refused right after the handshake
                await call(base, "/v1/models", verify=client_context(pki, cert))
        # Trusted, but no mesh identity, or another trust domain: 401.
        for cert in ("no-id", "other-domain"):
            status, body = await call(
                base, "/v1/chat/completions", verify=client_context(pki, cert), body=CHAT
            )
            assert status == 401, body
            assert body["error"]["code"] == "UNAUTHENTICATED"
        # A mesh identity that is not a client: 403, for every generation path.
        for cert in ("relay-a", "frontend", "admin"):
            for path in ("/v1/chat/completions", "/v1/completions"):
                status, body = await call(base, path, verify=client_context(pki, cert), body=CHAT)
                assert status == 403, body
                assert body["error"]["code"] == "NOT_AUTHORIZED"
                assert "may not call HTTP " + path in body["error"]["message"]
        # /metrics is for operators; /health needs no credentials beyond the handshake.
        assert (await call(base, "/metrics", verify=good))[0] == 403
        assert (await call(base, "/metrics", verify=client_context(pki, "admin")))[0] == 200
        assert (await call(base, "/", verify=client_context(pki, "admin")))[0] == 200
        assert (await call(base, "/health", verify=client_context(pki, "relay-a")))[0] == 200
        # Every refusal was counted, and none reached the routing core.
        assert refusals(router, "PERMISSION_DENIED") == 7
        assert refusals(router, "UNAUTHENTICATED") == 2
        assert sum(s.value for s in router.metrics.requests.collect()[0].samples) == requests_before
        assert router.http.front.streams.in_use == 0


async def test_api_keys_over_server_tls(pki, keys):
    key, path = keys
    server = pki.config("frontend")
    security = SecurityConfig(tls_cert=server.tls_cert, tls_key=server.tls_key, api_keys=path)
    async with front(security) as router:
        assert router.http is not None
        base = f"https://127.0.0.1:{router.http.port}"
        verify = client_context(pki, None)
        async with httpx2.AsyncClient(verify=verify) as http:
            sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, http_client=http, max_retries=0)
            reply = await sdk.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            assert reply.choices[0].finish_reason == "length"
            for bad in ("mk_wrong", key[:-1]):
                wrong = openai.AsyncOpenAI(
                    base_url=base + "/v1", api_key=bad, http_client=http, max_retries=0
                )
                with pytest.raises(openai.AuthenticationError) as err:
                    await wrong.models.list()
                assert err.value.code == "UNAUTHENTICATED"
        status, body = await call(base, "/v1/models", verify=verify)  # no key at all
        assert status == 401 and "no identity" in body["error"]["message"]
        assert (await call(base, "/health", verify=verify))[0] == 200  # probes need no key
        assert (await call(base, "/metrics", verify=verify, key=key))[0] == 403  # a client, not an admin
        assert refusals(router, "UNAUTHENTICATED") == 3


async def test_plain_http_with_api_keys_on_loopback(keys):
    key, path = keys
    async with front(SecurityConfig(api_keys=path)) as router:
        assert router.http is not None
        base = f"http://127.0.0.1:{router.http.port}"
        assert (await call(base, "/v1/models"))[0] == 401
        assert (await call(base, "/v1/models", key=key))[0] == 200


async def test_the_stream_limit_per_identity_is_shared_with_grpc_generate(pki):
    async with front(pki.config("frontend"), max_streams_per_client=1) as router:
        assert router.http is not None
        base = f"https://127.0.0.1:{router.http.port}"
        streams = router.http.front.streams
        streams.acquire("client/alice")  # alice's one stream, as gRPC Generate holds it
        status, body = await call(
            base, "/v1/chat/completions", verify=client_context(pki, "client"), body=CHAT
        )
        assert status == 429, body
        assert body["error"]["code"] == "LIMIT_EXCEEDED"
        streams.release("client/alice")
        for stream in (False, True):
            status, _ = await call(
                base,
                "/v1/chat/completions",
                verify=client_context(pki, "client"),
                body={**CHAT, "stream": stream},
            )
            assert status == 200
        assert streams.in_use == 0  # released when each response ended


async def test_prompt_and_max_tokens_caps_are_the_configured_ones():
    async with front(SecurityConfig(), max_prompt_tokens=64, max_output_tokens=8) as router:
        assert router.http is not None
        base = f"http://127.0.0.1:{router.http.port}"
        status, body = await call(base, "/v1/completions", body={"model": MODEL, "prompt": [5] * 65})
        assert (status, body["error"]["param"]) == (400, "prompt")
        status, body = await call(base, "/v1/chat/completions", body={**CHAT, "max_tokens": 9})
        assert (status, body["error"]["param"]) == (400, "max_tokens")
        status, body = await call(base, "/v1/chat/completions", body={**CHAT, "max_completion_tokens": 9})
        assert (status, body["error"]["param"]) == (400, "max_completion_tokens")
        status, body = await call(base, "/v1/completions", body={"model": MODEL, "prompt": [5] * 64})
        assert status == 200 and body["usage"]["completion_tokens"] == 8  # default max_tokens capped


async def test_oversized_heads_get_431_and_the_front_stays_healthy():
    async with front(SecurityConfig(), max_head_bytes=4096, max_headers=20) as router:
        assert router.http is not None
        port = router.http.port
        for head in (
            b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 5000 + b"\r\n\r\n",
            b"GET /health HTTP/1.1\r\n" + b"".join(b"x-h%d: 1\r\n" % i for i in range(21)) + b"\r\n",
            b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nhost: x\r\n\r\n",
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            reply = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
            body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "headers_too_large"
        assert (await call(f"http://127.0.0.1:{port}", "/health"))[0] == 200


async def _reply_within(reader: asyncio.StreamReader, seconds: float) -> tuple[bytes, float]:
    """All the server sends until it closes the connection, and how long that took."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    reply = await asyncio.wait_for(reader.read(), seconds)
    return reply, loop.time() - started


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "mutual-tls"])
async def test_a_head_never_finished_is_cut_off_with_408_while_requests_go_on(pki, tls):
    """Slow loris: a connection that sends part of a head (or nothing), or trickles it, is answered
    408 and closed at the head timeout; complete requests meanwhile are served."""
    security = pki.config("frontend") if tls else SecurityConfig()
    context = client_context(pki, "client") if tls else None
    async with front(security, head_timeout=1.0) as router:
        assert router.http is not None
        port = router.http.port
        base = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        partial = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        partial[1].write(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # no blank line: never complete
        silent = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        trickle = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        trickle[1].write(b"GET /health HTTP/1.1\r\n")

        async def drip() -> None:
            # One header line every 0.2 s: each arrives well inside any per-read timeout.
            for i in range(50):
                if trickle[1].is_closing() or trickle[0].at_eof():
                    return
                trickle[1].write(b"x-slow-%d: 1\r\n" % i)
                await asyncio.sleep(0.2)

        dripping = asyncio.create_task(drip())
        # Meanwhile a complete request is served.
        assert (await call(base, "/health", verify=context or False))[0] == 200
        for reader, writer in (partial, silent, trickle):
            reply, took = await _reply_within(reader, 10)
            writer.close()
            assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
            assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "head_timeout"
            assert took < 10
        await dripping
        # A kept-alive connection: the first request is served; the deadline of the next head
        # starts at its first byte.
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
        writer.write(b"GET /health HTTP/1.1\r\n")
        reply, _ = await _reply_within(reader, 10)
        writer.close()
        assert b"HTTP/1.1 408 " in reply
        assert (await call(base, "/health", verify=context or False))[0] == 200


def _partial_client_hello(context: ssl.SSLContext) -> bytes:
    """The first half of a real ClientHello (a handshake begun and never finished)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    return hello[: len(hello) // 2]


async def _closed_by(reader: asyncio.StreamReader, deadline: float) -> float:
    """The loop time at which the server closed a raw connection (nothing may be sent to it)."""
    loop = asyncio.get_running_loop()
    try:
        assert await asyncio.wait_for(reader.read(), deadline - loop.time()) == b""
    except ConnectionResetError:
        pass
    return loop.time()


async def test_a_tls_handshake_never_finished_is_cut_off_at_the_head_timeout(pki):
    """A client that connects and never starts its TLS handshake, or sends half a ClientHello, is
    closed at --http-header-timeout (not asyncio's 60 s), while HTTPS requests are served."""
    context = client_context(pki, "client")
    async with front(pki.config("frontend"), head_timeout=1.0) as router:
        assert router.http is not None
        port = router.http.port
        loop = asyncio.get_running_loop()
        started = loop.time()
        silent = await asyncio.open_connection("127.0.0.1", port)
        partial = await asyncio.open_connection("127.0.0.1", port)
        partial[1].write(_partial_client_hello(context))
        # Meanwhile a complete request with a client certificate is served.
        assert (await call(f"https://127.0.0.1:{port}", "/health", verify=context))[0] == 200
        for reader, writer in (silent, partial):
            closed = await _closed_by(reader, started + 10)  # asyncio's own bound would be 60 s
            writer.close()
            assert closed - started > 0.9  # cut off by the deadline, not refused at once
        assert (await call(f"https://127.0.0.1:{port}", "/health", verify=context))[0] == 200


async def test_connections_past_the_cap_get_503_at_once_and_slots_come_back():
    async with front(SecurityConfig(), max_connections=3, head_timeout=30.0) as router:
        assert router.http is not None
        port = router.http.port
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for _reader, writer in held:
            writer.write(b"GET /health HTTP/1.1\r\n")  # heads that would take 30 s to time out
        extra_reader, extra_writer = await asyncio.open_connection("127.0.0.1", port)
        reply, _ = await _reply_within(extra_reader, 10)  # answered without sending anything
        extra_writer.close()
        assert reply.startswith(b"HTTP/1.1 503 "), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "server_busy"
        for _reader, writer in held:
            writer.close()

        async def served() -> bool:
            return (await call(f"http://127.0.0.1:{port}", "/health"))[0] == 200

        deadline = asyncio.get_running_loop().time() + 10
        while not await served():
            assert asyncio.get_running_loop().time() < deadline, "slots never came back"
            await asyncio.sleep(0.05)


async def test_a_rotated_certificate_is_served_to_new_http_connections(pki, tmp_path):
    import shutil

    for suffix in ("crt", "key"):
        shutil.copy(pki.root / f"frontend.{suffix}", tmp_path / f"server.{suffix}")
    security = SecurityConfig(
        tls_cert=str(tmp_path / "server.crt"), tls_key=str(tmp_path / "server.key"), tls_ca=pki.ca_path
    )

    async def served_serial(port: int) -> int:
        _r, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context(pki, "client"))
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        from cryptography import x509

        return x509.load_der_x509_certificate(der).serial_number

    async with front(security) as router:
        assert router.http is not None
        port = router.http.port
        first = await served_serial(port)
        # An open connection is kept across the rotation.
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context(pki, "client"))
        fresh = devcerts.issue(pki.ca, None)
        (tmp_path / "server.key").write_bytes(fresh.key_pem)
        (tmp_path / "server.crt").write_bytes(fresh.cert_pem)
        second = await served_serial(port)
        assert second != first
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_without_tls_the_http_front_binds_loopback_only_unless_insecure():
    config = RouterConfig(listen="127.0.0.1:0", http=HttpConfig(listen="0.0.0.0:0"))
    with pytest.raises(RuntimeError, match="--http-listen"):
        create_server(config)
    insecure = RouterConfig(
        listen="127.0.0.1:0", http=HttpConfig(listen="0.0.0.0:0"), security=SecurityConfig(insecure=True)
    )
    router = create_server(insecure)
    assert router.http is not None and not router.http.tls
    await router.close()


async def test_tls_handshakes_in_progress_count_against_the_connection_cap(pki):
    """Connections that never send a ClientHello hold no more than the cap: one past it is closed
    at accept (not at the head timeout), and the slots come back when they go."""
    context = client_context(pki, "client")
    async with front(pki.config("frontend"), max_connections=3, head_timeout=30.0) as router:
        assert router.http is not None
        port = router.http.port
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while router.http.handshakes < 3:
            assert loop.time() < deadline, "the handshakes were never counted"
            await asyncio.sleep(0.02)
        extra_reader, extra_writer = await asyncio.open_connection("127.0.0.1", port)
        started = loop.time()
        closed = await _closed_by(extra_reader, started + 10)  # the head timeout is 30 s
        extra_writer.close()
        assert closed - started < 10
        with pytest.raises(httpx2.TransportError):  # an HTTPS client too, while the cap is full
            await call(f"https://127.0.0.1:{port}", "/health", verify=context)
        for _reader, writer in held:
            writer.close()

        async def served() -> bool:
            try:
                return (await call(f"https://127.0.0.1:{port}", "/health", verify=context))[0] == 200
            except httpx2.TransportError:
                return False

        while not await served():
            assert loop.time() < deadline + 10, "slots never came back"
            await asyncio.sleep(0.05)
        assert router.http.handshakes == 0


async def test_the_allocator_is_trimmed_once_a_burst_of_handshakes_is_over(monkeypatch):
    """After a burst of at least trim_after handshakes falls to an eighth of its peak, one trim;
    none for the small numbers of steady traffic."""
    from globalrouter.http_api import server as http_server

    calls: list[int] = []
    monkeypatch.setattr(http_server, "_malloc_trim", lambda: calls.append(1))
    handshakes = http_server.Handshakes(trim_after=16, trim_interval=0.0)
    small = [object() for _ in range(8)]
    for c in small:
        handshakes.add(c)  # type: ignore[arg-type]
    for c in small:
        handshakes.discard(c)  # type: ignore[arg-type]
    burst = [object() for _ in range(32)]
    for c in burst:
        handshakes.add(c)  # type: ignore[arg-type]
    for c in burst[:27]:
        handshakes.discard(c)  # type: ignore[arg-type]
    assert len(handshakes) == 5  # above an eighth of 32: the burst is not over
    handshakes.discard(burst[27])  # type: ignore[arg-type]  # 4 left: over
    deadline = asyncio.get_running_loop().time() + 10
    while not calls:
        assert asyncio.get_running_loop().time() < deadline, "never trimmed"
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.5)
    assert calls == [1] and handshakes.trims == 1

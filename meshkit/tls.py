"""TLS for every link: server and client credentials from PEM files, re-read on change or SIGHUP.

Servers use grpc's dynamic certificate fetcher: it is asked before each new handshake, so a
rotated certificate is served to new connections while open connections (and their streams)
carry on undisturbed. Mutual TLS is on when a CA is configured: peers must then present a
certificate that CA signed.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc

from meshkit.identity import ApiKeys, Identity, IdentityError, identity_from_certificate
from meshkit.logs import get_logger

log = get_logger(module="meshkit.tls")

DEFAULT_TRUST_DOMAIN = "mesh.local"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "[::1]", "localhost"})


@dataclass(frozen=True)
class SecurityConfig:
    """How one process authenticates: its certificate, key and CA files, trust domain, API keys."""

    tls_cert: str = ""
    """PEM certificate chain this process presents (as a server and as a client)."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_ca: str = ""
    """PEM CA bundle peers' certificates must chain to; turns on mutual TLS."""
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    """The SPIFFE trust domain peer identities must be in."""
    api_keys: str = ""
    """File of API keys (`NAME sha256:HEX` lines, NAME the identity a key stands for), accepted as
    `authorization: Bearer KEY`; re-read on SIGHUP and when it changes."""
    api_key: str = ""
    """Path of a file holding the API key this process sends (CLIs; a relay on its telemetry streams)."""
    insecure: bool = False
    """Allows serving without TLS on a non-loopback address (logged loudly)."""

    @property
    def tls(self) -> bool:
        """True when this process serves and dials TLS."""
        return bool(self.tls_cert)

    @property
    def dials_tls(self) -> bool:
        """True when this process dials its peers over TLS (a client may have a CA and no certificate)."""
        return self.tls or bool(self.tls_ca)

    @property
    def mutual(self) -> bool:
        """True when peers must present a certificate (mutual TLS)."""
        return self.tls and bool(self.tls_ca)

    @property
    def enforced(self) -> bool:
        """True when callers must authenticate and every call is authorized."""
        return self.tls or bool(self.api_keys)

    def problems(self) -> list[str]:
        """What is wrong with this configuration (empty when it is usable)."""
        out = []
        if bool(self.tls_cert) != bool(self.tls_key):
            out.append("--tls-cert and --tls-key go together")
        for flag, path in (
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
            ("--tls-ca", self.tls_ca),
            ("--api-keys", self.api_keys),
            ("--api-key-file", self.api_key),
        ):
            if path and not os.path.isfile(path):
                out.append(f"{flag} {path}: no such file")
        if not out and self.tls:
            try:
                CertificateFiles(self.tls_cert, self.tls_key, self.tls_ca).read()
            except ValueError as exc:
                out.append(str(exc))
        if not out and self.api_keys:
            # Checked here so that a bad line stops the start with a usage error naming it (it
            # used to surface as a traceback from the server's constructor).
            try:
                ApiKeys.load(self.api_keys)
            except (OSError, ValueError) as exc:
                out.append(f"--api-keys {exc}")
        return out


def is_loopback(listen: str) -> bool:
    """True when HOST:PORT names a loopback host."""
    host = listen.rpartition(":")[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def check_listen(listen: str, security: SecurityConfig, flag: str = "--listen") -> None:
    """Safe by default: without TLS only loopback, unless --insecure (then logged). Raises RuntimeError."""
    if security.tls_ca and not security.tls:
        raise RuntimeError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key to serve")
    if not security.tls and not is_loopback(listen):
        if not security.insecure:
            raise RuntimeError(
                f"cannot listen on {listen} ({flag}) without TLS: give --tls-cert and --tls-key (and "
                "--tls-ca for mutual TLS), listen on 127.0.0.1, or pass --insecure"
            )
        log.warning("serving WITHOUT TLS on a non-loopback address (--insecure)", listen=listen, flag=flag)


@dataclass(frozen=True)
class Material:
    """One consistent read of the certificate files."""

    cert: bytes
    key: bytes
    ca: bytes | None


class CertificateFiles:
    """The cert, key and CA files of one process; notices when they change on disk."""

    def __init__(self, cert: str, key: str, ca: str = "") -> None:
        self.paths = [Path(cert), Path(key)] + ([Path(ca)] if ca else [])

    def stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        """What changes when any file is replaced or rewritten (mtime, size, inode)."""
        out: list[tuple[int, int, int] | None] = []
        for p in self.paths:
            try:
                st = p.stat()
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def read(self) -> Material:
        """Reads and checks the files: the key must match the certificate. Raises ValueError saying why not."""
        # cryptography loads only when certificates are read: it would cost every CLI start otherwise.
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        try:
            blobs = [p.read_bytes() for p in self.paths]
        except OSError as exc:
            raise ValueError(f"cannot read {exc.filename}: {exc.strerror}") from exc
        cert, key = blobs[0], blobs[1]
        try:
            leaf = x509.load_pem_x509_certificate(cert)
            private = serialization.load_pem_private_key(key, password=None)
        except ValueError as exc:
            raise ValueError(
                f"{self.paths[0]} / {self.paths[1]}: not a PEM certificate and key ({exc})"
            ) from exc
        if leaf.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ) != private.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ):
            raise ValueError(f"{self.paths[1]} is not the key of {self.paths[0]}")
        ca = blobs[2] if len(blobs) > 2 else None
        if ca is not None:
            try:
                x509.load_pem_x509_certificates(ca)
            except ValueError as exc:
                raise ValueError(f"{self.paths[2]}: not a PEM CA bundle ({exc})") from exc
        return Material(cert=cert, key=key, ca=ca)


class ServerCertificates:
    """Server credentials whose certificate is re-read when its files change or on request (SIGHUP).

    One instance serves both listeners of a process (gRPC and HTTP): a reload bumps `generation`,
    and each listener installs the new material before its next handshake.
    """

    def __init__(self, config: SecurityConfig) -> None:
        self.config = config
        self.files = CertificateFiles(config.tls_cert, config.tls_key, config.tls_ca)
        self._lock = threading.Lock()
        self._stamp = self.files.stamp()
        self._material = self.files.read()
        self._forced = False
        self.generation = 0
        """Bumped each time new material is read (listeners compare it with what they serve)."""
        self._grpc_generation = 0
        self.reloads = 0
        """How many times a new certificate was picked up (tests and logs)."""

    def _configuration(self, m: Material) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.ca)

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials for add_secure_port; client certificates are required when a CA is set."""
        # grpc takes None from the fetcher as "keep the current one"; its type stubs do not say so.
        fetch = cast(Callable[[], grpc.ServerCertificateConfiguration], self._fetch)
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(self._material),
            fetch,
            require_client_authentication=self.config.mutual,
        )

    def request_reload(self) -> None:
        """Re-read the files before the next handshake even if they look unchanged (SIGHUP)."""
        self._forced = True

    def current(self) -> tuple[Material, int]:
        """The current material and its generation, re-read first when the files changed. Never raises."""
        with self._lock:
            stamp = self.files.stamp()
            if stamp == self._stamp and not self._forced:
                return self._material, self.generation
            self._forced = False
            try:
                material = self.files.read()
            except ValueError as exc:
                # Half-written files (a cert without its new key yet) are retried next handshake.
                log.warning("certificate reload failed; keeping the current one", error=str(exc))
                return self._material, self.generation
            self._stamp = stamp
            if material != self._material:
                self._material = material
                self.generation += 1
                self.reloads += 1
                log.info("certificate reloaded", cert=self.config.tls_cert, reloads=self.reloads)
            return self._material, self.generation

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's fetcher: called before handshakes; None keeps the current certificate."""
        # Called on a gRPC core thread: it must be quick and must never raise.
        try:
            material, generation = self.current()
            if generation == self._grpc_generation:
                return None
            self._grpc_generation = generation
            return self._configuration(material)
        except Exception as exc:  # never let an exception into grpc core
            log.warning("certificate fetch failed", error=repr(exc))
            return None

    def _ssl_context(self, m: Material) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # load_cert_chain takes files only; the pair was just checked by read(), and a pair that
        # changes again in between fails to load here and is retried at the next handshake.
        ctx.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        if m.ca is not None:
            ctx.load_verify_locations(cadata=m.ca.decode())
            ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: no certificate, no handshake
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def ssl_context(self) -> ssl.SSLContext:
        """A Python server context (the HTTP listener) that serves the current certificate.

        Its SNI callback runs at every ClientHello (with or without SNI) and swaps in a context
        built from reloaded files, so new connections get the rotated certificate and CA while
        open connections keep theirs.
        """
        material, generation = self.current()
        base = self._ssl_context(material)
        serving = [generation, base]

        def pick(conn: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, ctx: ssl.SSLContext) -> None:
            material, generation = self.current()
            if generation != serving[0]:
                try:
                    serving[1] = self._ssl_context(material)
                    serving[0] = generation
                except (OSError, ssl.SSLError) as exc:
                    log.warning("HTTP certificate reload failed; keeping the current one", error=str(exc))
            if serving[1] is not ctx:
                conn.context = serving[1]  # type: ignore[assignment]

        base.sni_callback = pick
        return base


def channel_credentials(config: SecurityConfig) -> grpc.ChannelCredentials:
    """Client credentials: trust the configured CA (or the system roots), present our certificate."""
    if not config.tls:
        ca = Path(config.tls_ca).read_bytes() if config.tls_ca else None
        return grpc.ssl_channel_credentials(root_certificates=ca)
    m = CertificateFiles(config.tls_cert, config.tls_key, config.tls_ca).read()
    return grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert)


def client_ssl_context(config: SecurityConfig) -> ssl.SSLContext:
    """A Python ssl context with the same trust and client certificate (for HTTP and peer checks)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.tls_ca or None)
    if config.tls:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    ctx.set_alpn_protocols(["h2"])
    return ctx


async def peer_identity(
    host: str, port: int, config: SecurityConfig, *, handshake_seconds: float = 5.0
) -> Identity:
    """The identity in the certificate the server at host:port presents (after verifying it).

    gRPC's Python client does not expose the server's certificate, so a caller that must know
    whom it talks to (a relay sending telemetry only to frontends) checks with one handshake of its own.
    Raises IdentityError, or OSError / TimeoutError / ssl.SSLError when the handshake fails.
    """
    ctx = client_ssl_context(config)
    _reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host.strip("[]"), port, ssl=ctx, server_hostname=host.strip("[]")),
        handshake_seconds,
    )
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    finally:
        # No TLS close handshake: a gRPC server never answers one, and nothing was sent.
        writer.transport.abort()
    if not der:
        raise IdentityError(f"{host}:{port} presented no certificate")
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    pem = x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)
    return identity_from_certificate(pem, config.trust_domain)

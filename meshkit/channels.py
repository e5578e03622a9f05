"""Client channels: one way to turn a URL or HOST:PORT into a gRPC channel with shared keepalive and TLS.

A process that was given TLS flags (meshkit.cli.security_config) dials every peer over TLS with its
own certificate, whatever scheme a URL names: a mesh configured for TLS never falls back to plain text.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import grpc

from meshkit.identity import Identity
from meshkit.keepalive import CLIENT_OPTIONS
from meshkit.tls import SecurityConfig, channel_credentials, peer_identity

_security = SecurityConfig()
_credentials: grpc.ChannelCredentials | None = None


def use_security(config: SecurityConfig) -> None:
    """Sets how this process dials its peers (once, at start, from its flags)."""
    global _security, _credentials
    _security = config
    _credentials = None


def client_security() -> SecurityConfig:
    """The process's client security settings."""
    return _security


def _tls_credentials(security: SecurityConfig | None = None) -> grpc.ChannelCredentials:
    """Channel credentials of `security` (the process's when None; those are read once). An API key
    is sent as `authorization: Bearer KEY`."""
    global _credentials
    if security is None and _credentials is not None:
        return _credentials
    config = security or _security
    creds = channel_credentials(config)
    if config.api_key:
        with open(config.api_key) as f:
            token = f.read().strip()
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    if security is None:
        _credentials = creds
    return creds


def url_to_target(url: str, security: SecurityConfig | None = None) -> tuple[str, bool]:
    """Maps `http://host[:port]` / `https://host[:port]` / `host:port` to (gRPC target, use TLS)."""
    tls = (security or _security).dials_tls
    if "://" in url:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        scheme_tls = parts.scheme == "https"
        port = parts.port or (443 if scheme_tls else 80)  # a URL without a port means the scheme's default
        return f"{host}:{port}", scheme_tls or tls
    return url, tls


def aio_channel(url: str, security: SecurityConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `url` (a URL or HOST:PORT) with the shared keepalive options; TLS as the
    process (or `security`, when given) says."""
    target, tls = url_to_target(url, security)
    if tls:
        return grpc.aio.secure_channel(target, _tls_credentials(security), options=CLIENT_OPTIONS)
    return grpc.aio.insecure_channel(target, options=CLIENT_OPTIONS)


def sync_channel(url: str, security: SecurityConfig | None = None) -> grpc.Channel:
    """A blocking channel to `url` (for CLIs and tests) with the shared keepalive options; TLS as the
    process (or `security`, when given) says."""
    target, tls = url_to_target(url, security)
    if tls:
        return grpc.secure_channel(target, _tls_credentials(security), options=CLIENT_OPTIONS)
    return grpc.insecure_channel(target, options=CLIENT_OPTIONS)


async def peer_identity_of(url: str) -> Identity | None:
    """The identity the server at `url` proves with its certificate; None when this process does not
    use mutual TLS (nothing to check). Raises IdentityError, OSError or ssl.SSLError when it cannot."""
    if not _security.mutual:
        return None
    target, _tls = url_to_target(url)
    host, _, port = target.rpartition(":")
    return await peer_identity(host, int(port), _security)

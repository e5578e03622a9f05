"""Client channels: one way to turn a URL or HOST:PORT into a gRPC channel with shared keepalive."""

from __future__ import annotations

from urllib.parse import urlsplit

import grpc

from meshkit.keepalive import CLIENT_OPTIONS


def url_to_target(url: str) -> tuple[str, bool]:
    """Maps `http://host[:port]` / `https://host[:port]` / `host:port` to (gRPC target, use TLS)."""
    if "://" in url:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)  # a URL without a port means the scheme's default
        return f"{host}:{port}", tls
    return url, False


def aio_channel(url: str) -> grpc.aio.Channel:
    """An asyncio channel to `url` (a URL or HOST:PORT) with the shared keepalive options."""
    target, tls = url_to_target(url)
    if tls:
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(), options=CLIENT_OPTIONS)
    return grpc.aio.insecure_channel(target, options=CLIENT_OPTIONS)


def sync_channel(url: str) -> grpc.Channel:
    """A blocking channel to `url` (for CLIs and tests) with the shared keepalive options."""
    target, tls = url_to_target(url)
    if tls:
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(), options=CLIENT_OPTIONS)
    return grpc.insecure_channel(target, options=CLIENT_OPTIONS)

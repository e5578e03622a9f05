"""Configuration of the HTTP front (`globalrouter serve --http-listen`); no web imports, so config loads light."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The OpenAI-compatible HTTP front: where it listens and its bounds."""

    listen: str = ""
    """HOST:PORT of the HTTP front (OpenAI API, /health, /metrics, the status page); empty: off."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Request bodies larger than this are refused with 413 before they are parsed."""
    body_timeout: float = 30.0
    """Seconds a client may take to send its request body (then 408)."""
    write_timeout: float = 30.0
    """Seconds one write to a streaming client may wait for it to read; then the request is ended
    (a client that stops reading cannot hold a pool slot and server memory for ever)."""
    default_max_tokens: int = 256
    """Output tokens when a request sets neither max_tokens nor max_completion_tokens."""
    max_connections: int = 1024
    """Concurrent HTTP connections, TLS handshakes in progress included; one more is answered 503 and
    closed as soon as it is made (with TLS, closed at accept: no handshake, no reply)."""
    head_timeout: float = 10.0
    """Seconds a client has to send a complete request head (request line and headers), from the
    connection's accept (a TLS handshake included, which is cut off at this bound too) and then
    from each next request's first byte; then 408 and closed."""
    max_head_bytes: int = 32 * 1024
    """Request line and headers of one request, in bytes; more is answered 431."""
    max_headers: int = 100
    """Headers of one request; more are answered 431."""

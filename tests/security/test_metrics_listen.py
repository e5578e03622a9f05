"""The router's separate /metrics listener follows the process's TLS flags like every other listener."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import pytest

from globalrouter.metrics import RouterMetrics
from meshkit.tls import SecurityConfig


def _context(pki, client: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki.ca_path)
    ctx.check_hostname = False  # the dev certificates name identities, not this host
    if client is not None:
        ctx.load_cert_chain(str(pki.root / f"{client}.crt"), str(pki.root / f"{client}.key"))
    return ctx


def test_metrics_over_mutual_tls_need_a_certificate_of_the_ca(pki) -> None:
    metrics = RouterMetrics()
    port = metrics.serve("127.0.0.1:0", pki.config("frontend"))
    url = f"https://127.0.0.1:{port}/metrics"
    try:
        with urllib.request.urlopen(url, context=_context(pki, "admin"), timeout=10) as resp:
            assert resp.status == 200 and b"globalrouter_" in resp.read()
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, context=_context(pki, None), timeout=10).read()
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, context=_context(pki, "other-ca"), timeout=10).read()
    finally:
        metrics.close()


def test_metrics_without_tls_bind_only_loopback_unless_insecure() -> None:
    with pytest.raises(RuntimeError, match="--metrics-listen"):
        RouterMetrics().serve("0.0.0.0:0", SecurityConfig())
    metrics = RouterMetrics()
    try:
        assert metrics.serve("127.0.0.1:0", SecurityConfig()) > 0
    finally:
        metrics.close()

"""The relay's --metrics-listen under the process's TLS flags: HTTPS with the relay's own certificate,
to scrapers presenting a certificate of the mesh's CA only."""

from __future__ import annotations

import http.client
import ssl
import urllib.error

import pytest

from meshlaunch import command, free_port, wait_until
from meshlaunch.mesh import discovery_argv, relay_argv
from tests.relay.test_metrics_e2e import registered, scrape
from tests.security.secure_mesh import wait_serving

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_the_relays_metrics_port_serves_https_to_certificates_of_the_ca_only(pki, procs) -> None:
    admin = pki.config("admin")
    discovery = f"127.0.0.1:{free_port()}"
    proc = procs.start("discovery", [*discovery_argv(discovery), *pki.flags("discovery")])
    wait_serving(discovery, admin, proc)
    pool = f"127.0.0.1:{free_port()}"
    mocker = (command("mocker"), "serve", "--listen", pool, "--pool-id", "pool-a", "--model", "m1")
    proc = procs.start("pool", [*mocker, *pki.flags("pool")])
    wait_serving(pool, admin, proc)
    status, port = f"127.0.0.1:{free_port()}", free_port()
    proc = procs.start(
        "relay",
        [
            *relay_argv(pool, discovery, "pool-a", "r1", "relay-1", "--status-listen", status),
            *("--metrics-listen", f"127.0.0.1:{port}", *pki.flags("relay-a")),
        ],
    )
    wait_serving(status, admin, proc)
    url = f"https://127.0.0.1:{port}/metrics"
    samples = wait_until(lambda: registered(url, pki.client_context("admin")), 30, message="registered")
    assert samples["poolrelay_registered"] == [({"pool_id": "pool-a", "relay_id": "relay-1"}, 1.0)]

    # A scraper presenting nothing, or a certificate the CA does not vouch for, is refused in the
    # handshake; so is plain HTTP.
    for cert in (None, "other-ca", "expired"):
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            scrape(url, pki.client_context(cert))
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        scrape(url.replace("https://", "http://"))
    # The refusals did not wedge it.
    assert scrape(url, pki.client_context("client"))["poolrelay_registered"][0][1] == 1.0

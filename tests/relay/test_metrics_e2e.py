"""End to end: `poolrelay serve --metrics-listen` serves its status as Prometheus metrics, refuses a
plain port off loopback, and stops serving on SIGTERM."""

from __future__ import annotations

import ssl
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshlaunch import command, free_port, wait_until
from tests.relay.test_e2e import LEASE, start_discovery, start_mocker, start_relay

pytestmark = pytest.mark.e2e


def scrape(url: str, context: ssl.SSLContext | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of one scrape, by name: (labels, value)."""
    with urllib.request.urlopen(url, timeout=5, context=context) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def registered(url: str, context: ssl.SSLContext | None = None):
    """The scrape once it says the pool is registered, else None."""
    samples = scrape(url, context)
    return samples if [v for _, v in samples.get("poolrelay_registered", [])] == [1.0] else None


@pytest.mark.timeout(90)
def test_a_relay_serves_its_status_at_metrics_until_sigterm(procs) -> None:
    discovery = start_discovery(procs)
    pool = start_mocker(procs)
    port = free_port()
    relay, _ = start_relay(
        procs, pool, discovery, "--relay-id", "relay-9", "--metrics-listen", f"127.0.0.1:{port}"
    )
    url = f"http://127.0.0.1:{port}/metrics"
    samples = wait_until(lambda: registered(url), timeout=20, message="poolrelay_registered 1")
    ((labels, _),) = samples["poolrelay_registered"]
    assert labels == {"pool_id": "pool-a", "relay_id": "relay-9"}
    ((_, left),) = samples["poolrelay_lease_seconds_left"]
    assert left <= LEASE  # at most one lease ahead (not > 0: a loaded box may renew late)
    assert samples["poolrelay_draining"] == [(labels, 0.0)]
    assert "poolrelay_engine_worker_healthy" not in samples  # a mocker pool has no engine workers

    assert relay.terminate() == 0
    assert "stop hook failed" not in relay.output()
    with pytest.raises(OSError):
        scrape(url)


@pytest.mark.timeout(60)
def test_a_plain_metrics_port_off_loopback_is_refused_before_serving() -> None:
    done = subprocess.run(
        [
            *(command("poolrelay"), "serve", "--pool", "127.0.0.1:1", "--discovery", "127.0.0.1:1"),
            *("--routing-pool", "pool-a", "--routing-pool-region", "eu-west"),
            *("--status-listen", f"127.0.0.1:{free_port()}", "--metrics-listen", f"0.0.0.0:{free_port()}"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert "--metrics-listen" in done.stderr and "without TLS" in done.stderr

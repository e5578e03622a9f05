"""The live status page in headless Chromium: every pool of a running mesh is listed by region, and
the page updates by itself when one drains. Screenshots are kept in the test's tmp_path."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from tests.openai.cdp import Browser
from tests.router.mesh import MODEL, Mesh
from tests.support import free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

POOLS = {"pool-a": "eu-west", "pool-b": "eu-west", "pool-c": "us-east"}
STATES = "Object.fromEntries([...document.querySelectorAll('[data-pool]')].map(e => [e.dataset.pool, e.textContent]))"


def wait_for(browser: Browser, predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = browser.evaluate(STATES)
        if predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not shown within {timeout}s; the page shows {value}")
        time.sleep(0.2)


def decided_pool(http: str, request_id: str) -> str | None:
    """The pool the frontend chose for `request_id`, from /status.json."""
    status = json.loads(urllib.request.urlopen(f"http://{http}/status.json", timeout=5).read())
    return next((e["pool_id"] for e in status["decisions"] if e["request_id"] == request_id), None)


def test_status_page_lists_every_pool_and_follows_a_drain(procs, browser, tmp_path):
    mesh = Mesh(procs)
    mesh.start_discovery()
    for pool_id, region in POOLS.items():
        mesh.start_pool(pool_id, region)
    http = f"127.0.0.1:{free_port()}"
    router = mesh.start_router("--http-listen", http)
    mesh.wait_routable(router, mesh.pools)
    browser.open(f"http://{http}/")
    wait_for(
        browser,
        lambda s: s and set(s) == set(POOLS) and set(s.values()) == {"ready"},
        20,
        "every pool ready",
    )
    regions = browser.evaluate("[...document.querySelectorAll('#pools h3')].map(e => e.textContent)")
    assert regions == ["region eu-west", "region us-east"]
    shot = browser.screenshot(tmp_path / "status-ready.png")
    assert shot.stat().st_size > 10_000
    # A request of a few seconds (50 tokens/s) keeps its pool busy while it drains.
    body = json.dumps({"model": MODEL, "prompt": "status page", "max_tokens": 200, "stream": True}).encode()
    post = urllib.request.Request(
        f"http://{http}/v1/completions", body, {"content-type": "application/json", "x-request-id": "long-1"}
    )
    reader = threading.Thread(target=lambda: urllib.request.urlopen(post, timeout=30).read(), daemon=True)
    reader.start()
    busy = wait_until(lambda: decided_pool(http, "long-1") or "", 10, message="the long request's pool")
    mesh.drain(busy, 30)
    others = set(POOLS) - {busy}
    states = wait_for(
        browser, lambda s: s.get(busy) == "draining", 10, f"{busy} draining while its request runs"
    )
    assert all(states[p] == "ready" for p in others)
    browser.screenshot(tmp_path / "status-draining.png")
    reader.join(timeout=30)
    wait_for(browser, lambda s: busy not in s and set(s) == others, 20, f"{busy} gone once drained")
    browser.screenshot(tmp_path / "status-drained.png")
    print("screenshots in", tmp_path)

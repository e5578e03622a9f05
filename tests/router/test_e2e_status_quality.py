"""Router-quality telemetry on a running mesh (issue 19 item 5): the status page (headless Chromium)
shows each pool's KV view age and, per decision, the cached share achieved against the best
available; /status.json and /metrics carry the same figures."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from tests.openai.cdp import Browser
from tests.router.mesh import Mesh, generate_cli
from tests.support import free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
PROMPT = list(range(1000, 1000 + 4 * 16))  # four full blocks at the mocker's block size
KV_AGES = "Object.fromEntries([...document.querySelectorAll('[data-kv-pool]')].map(e => [e.dataset.kvPool, e.textContent]))"
DECISION_ROW = (
    "[...document.querySelectorAll('#decisions tr')].slice(1).map(r => [...r.cells].map(c => c.textContent))"
)


def status(http: str) -> dict:
    return json.loads(urllib.request.urlopen(f"http://{http}/status.json", timeout=5).read())


def shown(browser: Browser, expression: str, predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = browser.evaluate(expression)
        if value and predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not shown within {timeout}s; the page shows {value}")
        time.sleep(0.2)


def test_status_page_shows_kv_view_ages_and_available_vs_achieved(procs, browser, tmp_path):
    mesh = Mesh(procs)
    mesh.start_discovery()
    for pool_id in ("pool-a", "pool-b"):
        mesh.start_pool(pool_id, "eu-west")
    http = f"127.0.0.1:{free_port()}"
    router = mesh.start_router("--http-listen", http)
    mesh.wait_routable(router, mesh.pools)
    browser.open(f"http://{http}/")
    ages = shown(
        browser,
        KV_AGES,
        lambda v: set(v) == {"pool-a", "pool-b"} and all(re.fullmatch(r"\d+\.\d s", t) for t in v.values()),
        20,
        "a fresh KV view age for each pool",
    )
    assert all(float(t.split()[0]) < 30 for t in ages.values()), ages
    pools = {p["pool_id"]: p for r in status(http)["regions"] for p in r["pools"]}
    assert all(p["kv_fresh"] and 0 <= p["kv_age_s"] < 30 for p in pools.values()), pools
    for _ in range(
        2
    ):  # the second time the prompt's blocks are cached somewhere (once the KV events arrived)
        generate_cli(router, PROMPT, 4)
    decisions = wait_until(lambda: status(http)["decisions"][:2] or None, 10, message="two decisions")
    assert decisions is not None and len(decisions) == 2
    first, second = decisions[::-1]
    for d in (first, second):
        assert d["achieved_share"] is not None and 0 <= d["achieved_share"] <= d["available_share"] <= 1, d
    summary = status(http)["cached_prefix"]
    assert summary["decisions"] == 2 and summary["available_mean"] >= summary["achieved_mean"], summary
    rows = shown(browser, DECISION_ROW, lambda v: len(v) == 2, 10, "two decisions")
    assert all(re.fullmatch(r"\d+%", row[-1]) and re.fullmatch(r"\d+%", row[-2]) for row in rows), rows
    assert "achieved" in browser.evaluate("document.getElementById('prefix').textContent")
    assert router.metric("globalrouter_cached_prefix_available_ratio_count") == 2
    metrics = (
        urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=5).read().decode()
    )
    ages_exported = dict(
        re.findall(r'^globalrouter_pool_kv_age_seconds\{pool="([^"]+)"\} (\S+)$', metrics, re.M)
    )
    assert set(ages_exported) == {"pool-a", "pool-b"} and all(float(v) < 30 for v in ages_exported.values())
    browser.screenshot(tmp_path / "status-quality.png")

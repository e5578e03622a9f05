"""The status page's data (pure): pool states from signal freshness, regions, and the bounded event ring."""

from __future__ import annotations

from globalrouter.http_api.status_page import status
from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import LoadSignal
from globalrouter.recent_events import RecentEvents
from globalrouter.routing import RoutingCore
from globalrouter.selection import SelectionConfig, Selector
from tests.router.fakes import pool_msg


def core(clock) -> RoutingCore:
    return RoutingCore(PoolTable(), KvIndex(), Selector(SelectionConfig()), clock, RouterMetrics())


def states(c: RoutingCore) -> dict[str, str]:
    return {p["pool_id"]: p["state"] for r in status(c, "f")["regions"] for p in r["pools"]}


def test_states_follow_signal_freshness_and_drain(fake_clock):
    c = core(fake_clock)
    for pool_id, region in (("a", "eu"), ("b", "eu"), ("c", "us")):
        c.table.apply_listed(pool_msg(pool_id, f"http://127.0.0.1:{len(pool_id)}", region=region))
    now = fake_clock.monotonic()
    for pool_id in ("a", "b", "c"):
        pool = c.table.pools[pool_id]
        pool.record_load(LoadSignal(requests_running=2, kv_blocks_used=5, kv_blocks_total=100), now)
        pool.models_ready, pool.state_at = {"m": True}, now
    c.table.pools["b"].directory_draining = True
    c.table.pools["c"].models_ready = {"m": False}
    assert states(c) == {"a": "ready", "b": "draining", "c": "not-ready"}
    data = status(c, "f")
    assert [r["region"] for r in data["regions"]] == ["eu", "us"]
    a = data["regions"][0]["pools"][0]
    assert (a["requests_running"], a["kv_blocks_used"], a["kv_blocks_total"], a["telemetry_age_s"]) == (
        2,
        5,
        100,
        0,
    )
    fake_clock.set(fake_clock.monotonic() + 60)  # every signal is now older than its freshness limit
    assert states(c) == {"a": "stale", "b": "draining", "c": "stale"}
    assert status(c, "f")["regions"][0]["pools"][0]["telemetry_age_s"] == 60


def test_recent_events_are_bounded_and_newest_first():
    ring = RecentEvents(capacity=5)
    for i in range(12):
        ring.add(
            "decision" if i % 3 else "refusal", wall=float(i), request_id=f"r{i}", model="m", pool_id="p"
        )
    latest = ring.latest()
    assert [e.request_id for e in latest] == ["r11", "r10", "r9", "r8", "r7"]
    assert [e.request_id for e in ring.latest(kind="refusal")] == ["r9"]
    assert latest[0].seq == 12

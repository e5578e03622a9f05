"""globalrouter_pool_kv_age_seconds{pool} as a real frontend exports it: wired by create_server, read
at scrape time from the pool table (issue 19 item 5)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from globaldiscovery.v1 import discovery_pb2
from globalrouter.config import RouterConfig
from globalrouter.server import create_server
from meshkit.clock import FakeClock


def kv_ages(router) -> dict[str, float]:
    text = generate_latest(router.metrics.registry).decode()
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "globalrouter_pool_kv_age_seconds"
    ]
    return {s.labels["pool"]: s.value for s in family.samples}


async def test_a_frontend_exports_each_listed_pools_kv_view_age() -> None:
    clock = FakeClock(start=100.0)
    router = create_server(RouterConfig(), clock=clock)
    table = router.core.table
    assert kv_ages(router) == {}, "the family is declared before any pool (a dashboard query finds it)"
    for pool_id in ("a", "b"):
        table.apply_listed(discovery_pb2.Pool(pool_id=pool_id, model="m", region="r"))
    table.pools["a"].kv_at = 90.0
    assert kv_ages(router) == {"a": 10.0}, "b has no KV stream yet: no series"
    clock.set(130.0)
    assert kv_ages(router) == {"a": 40.0}
    table.apply_removed("a")
    assert kv_ages(router) == {}

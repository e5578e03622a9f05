"""globalrouter_pools{state}: the directory's listed pools by the state the status page shows, read at
scrape time; and the TTFT histogram a dashboard reads."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from globaldiscovery.v1 import discovery_pb2
from globalrouter.config import RouterConfig
from globalrouter.server import create_server
from meshkit.clock import FakeClock


def pools_metric(router) -> dict[str, float]:
    text = generate_latest(router.metrics.registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "globalrouter_pools"]
    return {s.labels["state"]: s.value for s in family.samples}


async def test_pools_are_counted_by_state_and_unlisted_ones_are_not() -> None:
    # async: create_server needs an event loop, and a sync test has none once an async test ran
    router = create_server(RouterConfig(), clock=FakeClock())
    table = router.core.table
    assert pools_metric(router) == {"ready": 0, "not-ready": 0, "draining": 0, "stale": 0}
    table.apply_listed(discovery_pb2.Pool(pool_id="a", model="m", region="r"))
    table.apply_listed(discovery_pb2.Pool(pool_id="b", model="m", region="r", draining=True))
    table.apply_listed(discovery_pb2.Pool(pool_id="c", model="m", region="r"))
    table.apply_removed("c")
    # No telemetry yet: a listed pool without fresh signals is stale, as on the status page.
    assert pools_metric(router) == {"ready": 0, "not-ready": 0, "draining": 1, "stale": 1}

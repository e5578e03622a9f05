"""Repeated readiness and drain reports: the pool's combined view is rebuilt only when one changes."""

from __future__ import annotations

from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import TelemetryIngest
from meshkit.clock import FakeClock
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import telemetry_pb2 as tm


def _hello(relay: str) -> tm.TelemetryHello:
    return tm.TelemetryHello(
        pool_id="p",
        relay_id=relay,
        incarnation=1,
        protocol_version=1,
        block_size=16,
        hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
    )


def _readiness(state: pe.ModelState, adapters: tuple[str, ...] = ()) -> tm.PublishPoolTelemetryRequest:
    return tm.PublishPoolTelemetryRequest(
        readiness=tm.ReadinessReport(models=[pe.ModelStatus(model="m", state=state, adapters=adapters)])
    )


def _drain(state: pe.DrainState) -> tm.PublishPoolTelemetryRequest:
    return tm.PublishPoolTelemetryRequest(drain=tm.DrainReport(drain=pe.DrainStatus(state=state)))


def test_an_unchanged_report_does_not_rebuild_the_pools_view_a_changed_one_does():
    table = PoolTable()
    clock = FakeClock()
    ingest = TelemetryIngest(table, KvIndex(), clock, RouterMetrics())
    a, b = ingest.open(_hello("a")), ingest.open(_hello("b"))
    rebuilds = []
    combine = ingest._combine_state

    def counted(pool) -> None:
        rebuilds.append(pool.pool_id)
        combine(pool)

    ingest._combine_state = counted  # type: ignore[method-assign]
    for _ in range(10):  # every report interval, the same words
        ingest.receive(a, _readiness(pe.MODEL_STATE_READY))
        ingest.receive(a, _drain(pe.DRAIN_STATE_ACTIVE))
        clock.set(clock.monotonic() + 1.0)
    assert len(rebuilds) == 1  # the first readiness report; ACTIVE was already the stream's state
    pool = table.get("p")
    assert pool.models_ready == {"m": True} and not pool.telemetry_draining
    assert pool.state_at == clock.monotonic() - 1.0  # every report still counts as fresh state

    ingest.receive(b, _readiness(pe.MODEL_STATE_NOT_READY, ("lora-x",)))
    assert pool.models_ready == {"m": True} and pool.adapters == {"m": frozenset({"lora-x"})}
    ingest.receive(a, _readiness(pe.MODEL_STATE_NOT_READY))
    assert pool.models_ready == {"m": False}
    ingest.receive(b, _drain(pe.DRAIN_STATE_DRAINING))
    assert pool.telemetry_draining
    ingest.receive(b, _drain(pe.DRAIN_STATE_DRAINING))
    assert len(rebuilds) == 4

"""Readiness and drain are kept per telemetry stream: one relay replica's report never overwrites another's."""

from __future__ import annotations

import grpc
import pytest

from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.pool_directory import PoolTable
from globalrouter.telemetry_ingest import StreamRejected, TelemetryIngest
from meshkit.clock import FakeClock
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import telemetry_pb2 as tm

READY, NOT_READY = pe.MODEL_STATE_READY, pe.MODEL_STATE_UNSPECIFIED


def hello(relay: str) -> tm.TelemetryHello:
    return tm.TelemetryHello(
        pool_id="p",
        relay_id=relay,
        incarnation=1,
        protocol_version=1,
        block_size=16,
        hash_scheme=tm.HASH_SCHEME_XXH3_64_CHAINED_U32LE,
    )


def readiness(state) -> tm.PublishPoolTelemetryRequest:
    return tm.PublishPoolTelemetryRequest(
        readiness=tm.ReadinessReport(models=[pe.ModelStatus(model="m", state=state)])
    )


def drain(state) -> tm.PublishPoolTelemetryRequest:
    return tm.PublishPoolTelemetryRequest(drain=tm.DrainReport(drain=pe.DrainStatus(state=state)))


@pytest.fixture
def ingest():
    table = PoolTable()
    return TelemetryIngest(table, KvIndex(), FakeClock(), RouterMetrics(), max_snapshot_blocks=10), table


def test_a_pool_drains_while_any_stream_says_so_and_stops_when_that_stream_ends(ingest):
    ingest, table = ingest
    a, b = ingest.open(hello("a")), ingest.open(hello("b"))
    ingest.receive(a, drain(pe.DRAIN_STATE_DRAINING))
    ingest.receive(b, drain(pe.DRAIN_STATE_ACTIVE))  # b's report does not undo a's
    assert table.pools["p"].telemetry_draining
    ingest.close(a)
    assert not table.pools["p"].telemetry_draining


def test_a_model_is_ready_when_a_stream_reports_it_ready(ingest):
    ingest, table = ingest
    a, b = ingest.open(hello("a")), ingest.open(hello("b"))
    ingest.receive(a, readiness(READY))
    ingest.receive(b, readiness(NOT_READY))
    assert table.pools["p"].models_ready == {"m": True}
    ingest.close(a)
    assert table.pools["p"].models_ready == {"m": False}


def test_snapshot_chunks_that_never_end_are_refused_and_dropped(ingest):
    ingest, _table = ingest
    s = ingest.open(hello("a"))
    chunk = tm.KvSnapshot(snapshot_id=1, sequence=1, chunk_index=0, block_hashes=range(6))
    ingest.receive(s, tm.PublishPoolTelemetryRequest(kv_snapshot=chunk))
    chunk.chunk_index = 1
    with pytest.raises(StreamRejected) as err:
        ingest.receive(s, tm.PublishPoolTelemetryRequest(kv_snapshot=chunk))
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert s.snapshot_chunks == []

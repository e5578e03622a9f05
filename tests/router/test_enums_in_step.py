"""Python enums that mirror proto enums stay in step with them (names and values)."""

from __future__ import annotations

from globalrouter import migration, router_api
from globalrouter.selection import FilterReason
from globalrouter.v1 import pool_frontend_pb2, router_pb2


def _proto_names(enum_descriptor, prefix: str) -> dict[str, int]:
    """Every value of a proto enum but UNSPECIFIED, by its name without the prefix."""
    return {
        v.name.removeprefix(prefix): v.number
        for v in enum_descriptor.values
        if not v.name.endswith("_UNSPECIFIED")
    }


def test_filter_reason_mirrors_the_proto_enum_both_ways():
    proto = _proto_names(router_pb2.DESCRIPTOR.enum_types_by_name["FilterReason"], "FILTER_REASON_")
    assert {r.name: r.value for r in FilterReason} == proto
    assert {r.name: v for r, v in router_api.FILTER_REASONS.items()} == proto


def test_every_pool_finish_reason_maps_to_a_client_finish_reason():
    proto = pool_frontend_pb2.DESCRIPTOR.enum_types_by_name["PoolFinishReason"]
    sent = {v.number for v in proto.values if not v.name.endswith("_UNSPECIFIED")}
    assert set(migration._FINISH) == sent
    client = router_pb2.DESCRIPTOR.enum_types_by_name["FinishReason"]
    for pool_value, client_value in migration._FINISH.items():
        assert (
            proto.values_by_number[pool_value].name.removeprefix("POOL_")
            == client.values_by_number[client_value].name
        )

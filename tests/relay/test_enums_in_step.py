"""Python enums that mirror proto enums stay in step with them (names and values)."""

from __future__ import annotations

from poolrelay.model_choice import Reason
from poolrelay.v1 import status_pb2


def test_unregistered_reason_mirrors_the_proto_enum_both_ways():
    proto = {
        v.name.removeprefix("UNREGISTERED_REASON_"): v.number
        for v in status_pb2.DESCRIPTOR.enum_types_by_name["UnregisteredReason"].values
    }
    # NONE is the proto's UNSPECIFIED (0): the pool is registered.
    assert {("UNSPECIFIED" if r is Reason.NONE else r.name): r.value for r in Reason} == proto

"""The mocker's drain states map onto every proto DrainState a pool can be in."""

from __future__ import annotations

from mocker import events, frontend
from mocker.pool import DrainState, RefusalKind
from poolrelay.v1 import pool_events_pb2


def test_every_drain_state_maps_to_the_proto_value_of_the_same_name():
    proto = pool_events_pb2.DESCRIPTOR.enum_types_by_name["DrainState"]
    assert set(events._DRAIN_STATES) == set(DrainState)
    assert {s.name: proto.values_by_number[v].name for s, v in events._DRAIN_STATES.items()} == {
        v.name.removeprefix("DRAIN_STATE_"): v.name
        for v in proto.values
        if not v.name.endswith("_UNSPECIFIED")
    }


def test_every_refusal_kind_has_a_code_and_an_error_reason():
    assert set(frontend.REFUSALS) == set(RefusalKind)
    assert len({reason for _code, reason in frontend.REFUSALS.values()}) == len(RefusalKind)

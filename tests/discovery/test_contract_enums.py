"""The Python enums that mirror globaldiscovery.v1 enums stay in step with the contract."""

from __future__ import annotations

from globaldiscovery import convert
from globaldiscovery.records import EventKind, Removal
from globaldiscovery.v1 import discovery_pb2 as pb


def _proto_members(enum_name: str, prefix: str) -> dict[str, int]:
    descriptor = pb.DESCRIPTOR.enum_types_by_name[enum_name]
    return {value.name.removeprefix(prefix): value.number for value in descriptor.values}


def test_removal_mirrors_removal_reason():
    assert {m.name: m.value for m in Removal} == _proto_members("RemovalReason", "REMOVAL_REASON_")


def test_event_kind_mirrors_watch_event_type():
    proto = _proto_members("WatchEventType", "WATCH_EVENT_TYPE_")
    assert proto.pop("UNSPECIFIED") == 0  # the proto3 zero value: never sent
    assert {m.name: m.value for m in EventKind} == proto
    # And the wire mapping sends each kind as the value of the same name.
    for kind in EventKind:
        assert convert._EVENT_TYPES[kind] == proto[kind.name]

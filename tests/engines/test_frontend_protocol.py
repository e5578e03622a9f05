"""The registration says which protocol a pool's frontends speak; discovery checks it and lists it."""

from __future__ import annotations

from globaldiscovery import convert
from globaldiscovery import request_checks as validation
from globaldiscovery.lease_state import Directory
from globaldiscovery.v1 import discovery_pb2 as pb


def request(protocol: int, *frontends: str) -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(
        pool_id="p",
        model="m",
        region="r",
        frontends=list(frontends),
        relay_id="relay",
        incarnation=1,
        frontend_protocol=protocol,  # type: ignore[arg-type]
    )


def fields(v) -> list[str]:
    return [f for f, _ in v.items]


def test_openai_frontends_may_have_a_base_path_and_no_port():
    req = request(pb.FRONTEND_PROTOCOL_OPENAI_HTTP, "https://pool.example.com", "http://h:8000/v1")
    assert not validation.register_pool(req)


def test_a_grpc_frontend_has_no_path_and_unknown_protocols_are_refused():
    assert fields(validation.register_pool(request(pb.FRONTEND_PROTOCOL_MESH_GRPC, "http://h:1/v1"))) == [
        "frontends[0]"
    ]
    assert fields(validation.register_pool(request(pb.FRONTEND_PROTOCOL_UNSPECIFIED, "http://h:1/x"))) == [
        "frontends[0]"
    ]
    assert fields(validation.register_pool(request(7, "http://h:1"))) == ["frontend_protocol"]
    bad = request(pb.FRONTEND_PROTOCOL_OPENAI_HTTP, "http://u:p@h:1/v1", "http://h:1/v1?k=1")
    assert fields(validation.register_pool(bad)) == ["frontends[0]", "frontends[1]"]


def test_the_listed_pool_carries_the_protocol_of_its_registration():
    directory = Directory(15.0, started_at=0.0, wall_offset=1000.0)
    reg = convert.registration(request(pb.FRONTEND_PROTOCOL_OPENAI_HTTP, "http://h:8000"))
    result = directory.register_pool(reg, 1.0)
    assert convert.pool(result.pool).frontend_protocol == pb.FRONTEND_PROTOCOL_OPENAI_HTTP
    # An older relay states none: the pool is a mesh gRPC pool.
    old = convert.registration(request(pb.FRONTEND_PROTOCOL_UNSPECIFIED, "http://h:8000"))
    assert convert.pool(directory.register_pool(old, 2.0).pool).frontend_protocol == 0


def test_the_global_frontend_learns_which_link_a_pool_needs():
    from globalrouter.pool_directory import PoolTable

    table = PoolTable()
    openai = table.apply_listed(
        pb.Pool(pool_id="a", model="m", frontend_protocol=pb.FRONTEND_PROTOCOL_OPENAI_HTTP)
    )
    grpc_pool = table.apply_listed(pb.Pool(pool_id="b", model="m"))
    assert openai.openai_http and not grpc_pool.openai_http

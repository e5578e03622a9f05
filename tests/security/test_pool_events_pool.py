"""A mocker's pool events are for its own pool's relays: a relay certificate of another pool is refused."""

from __future__ import annotations

import grpc
import pytest

from meshkit.errors import Reason, reason_of
from meshkit.timeconv import duration
from meshlaunch import command, free_port, process_group
from poolrelay.v1 import pool_events_pb2 as pe
from poolrelay.v1 import pool_events_pb2_grpc as pe_grpc
from tests.security.pki import make_pki
from tests.security.secure_mesh import secure_channel, wait_serving

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """(address, pki) of a real mocker serving pool-a over mutual TLS."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    address = f"127.0.0.1:{free_port()}"
    argv = [command("mocker"), "serve", "--listen", address, "--pool-id", "pool-a", "--model", "m"]
    with process_group(tmp_path_factory.mktemp("logs")) as group:
        proc = group.start("pool", [*argv, *pki.flags("pool")])
        wait_serving(address, pki.config("admin"), proc)
        yield address, pki


def _first_status(address, config) -> pe.WatchPoolStatusResponse:
    with secure_channel(address, config) as ch:
        call = pe_grpc.PoolEventsServiceStub(ch).WatchPoolStatus(pe.WatchPoolStatusRequest(), timeout=10)
        try:
            return next(call)
        finally:
            call.cancel()


def test_the_pools_own_relay_reads_its_status(pool):
    address, pki = pool
    status = _first_status(address, pki.config("relay-a"))
    assert status.pool_id == "pool-a"
    assert status.drain.state == pe.DRAIN_STATE_ACTIVE


CALLS = {
    "WatchPoolStatus": lambda stub: next(stub.WatchPoolStatus(pe.WatchPoolStatusRequest(), timeout=10)),
    "WatchKvEvents": lambda stub: next(stub.WatchKvEvents(pe.WatchKvEventsRequest(), timeout=10)),
    "StartDrain": lambda stub: stub.StartDrain(
        pe.StartDrainRequest(timeout=duration(1), reason="attack"), timeout=10
    ),
}


@pytest.mark.parametrize("method", sorted(CALLS))
def test_a_relay_of_another_pool_is_refused_and_changes_nothing(pool, method):
    address, pki = pool
    with secure_channel(address, pki.config("relay-b")) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            CALLS[method](pe_grpc.PoolEventsServiceStub(ch))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert reason_of(refused.value) == Reason.NOT_AUTHORIZED
    assert "pool-a" in refused.value.details()
    # Nothing changed: the pool's own relay still reads it, and it is not draining.
    assert _first_status(address, pki.config("relay-a")).drain.state == pe.DRAIN_STATE_ACTIVE

"""A listing of pools with many long frontend URLs is paged by bytes: every page fits a message, none is lost."""

from __future__ import annotations

import grpc
import pytest

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from meshkit.limits import PAGE_BYTES
from meshlaunch import command, free_port
from tests.security.secure_mesh import wait_serving

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_a_listing_larger_than_a_message_comes_in_pages_that_fit(procs):
    address = f"127.0.0.1:{free_port()}"
    proc = procs.start("discovery", [command("globaldiscovery"), "serve", "--listen", address])
    wait_serving(address, None, proc)
    # Frontends are host and port only: the length is in the host names (~2 KB each).
    frontends = [f"http://{'h' * 60}{i}.{'x' * 1900}.example:{i + 1}" for i in range(64)]
    with grpc.insecure_channel(address) as ch:
        stub = dpb_grpc.DiscoveryServiceStub(ch)
        for i in range(40):  # 40 pools x ~125 KB: 5 MB, more than a page
            stub.RegisterPool(
                dpb.RegisterPoolRequest(
                    pool_id=f"pool-{i:02d}",
                    model="m",
                    region="r",
                    frontends=frontends,
                    relay_id="r",
                    incarnation=1,
                ),
                timeout=10,
            )
        seen, pages, token = [], 0, ""
        while True:
            reply = stub.ListPools(dpb.ListPoolsRequest(page_size=1000, page_token=token), timeout=10)
            assert reply.ByteSize() <= PAGE_BYTES + 64 * 1024
            seen += [p.pool_id for p in reply.pools]
            pages += 1
            token = reply.next_page_token
            if not token:
                break
    assert seen == [f"pool-{i:02d}" for i in range(40)]
    assert pages >= 2

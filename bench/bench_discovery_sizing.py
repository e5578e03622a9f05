"""CPU per KeepAlivePools renewal in-process: the registered request deserializer, then the servicer's reply.

For 2,000 (pool, relay) leases (1,000 pools x 2 relays) renewed in turn on a memory store, thread
time per renewal, and per receive-and-measure step alone (the deserializer, then the size check as
the servicer makes it). Works with either tree on PYTHONPATH, to compare interleaved with main:
  mkdir /tmp/old && git archive main | tar -x -C /tmp/old
  for r in 1 2 3; do PYTHONPATH=/tmp/old python bench/bench_discovery_sizing.py; \
    PYTHONPATH=$PWD python bench/bench_discovery_sizing.py; done
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from globaldiscovery.server import DiscoveryServicer
from globaldiscovery.store import MemoryStore
from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshkit.clock import SystemClock
from meshkit.limits import check_size


class Capture:
    """A stand-in server that keeps the handlers registered on it."""

    handlers: dict

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service, handlers) -> None:
        self.handlers = handlers


def renewal(i: int, seq: int) -> bytes:
    return pb.KeepAlivePoolsRequest(
        register=pb.RegisterPoolRequest(
            pool_id=f"pool-{i // 2:04d}",
            model="llama-3-8b",
            region="eu-west-1",
            frontends=[f"http://10.0.{i // 512}.{i // 2 % 256}:8000"],
            relay_id=f"relay-{i % 2}",
            incarnation=1_733_100_000_000_000_000 + i,
            capacity=pb.PoolCapacity(
                max_running_requests=64, kv_cache_blocks=100_000, prefill_tokens_per_second=20_000
            ),
            frontend_protocol=pb.FRONTEND_PROTOCOL_MESH_GRPC,
        ),
        sequence=seq,
    ).SerializeToString()


async def main(rounds: int) -> None:
    store = MemoryStore(SystemClock(), heartbeat_interval=5.0, lease_duration=15.0)
    await store.start()
    servicer = DiscoveryServicer(store)
    cap = Capture()
    server: Any = cap  # stands in for a grpc server
    if hasattr(servicer, "add_to_server"):
        servicer.add_to_server(server)
    else:
        pb_grpc.add_DiscoveryServiceServicer_to_server(servicer, server)
    deserialize = cap.handlers["KeepAlivePools"].request_deserializer
    data = [renewal(i, 1) for i in range(2000)]
    for d in data:  # registered once, so what follows are renewals (the steady state)
        reply = await servicer._keepalive_reply(deserialize(d))
        assert reply.WhichOneof("result") == "register", reply
    best = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for d in data:
            await servicer._keepalive_reply(deserialize(d))
        best.append((time.thread_time() - t0) / len(data) * 1e6)
    # only the receive-and-measure step: deserializer, then the size check as the servicer does it
    method = "/globaldiscovery.v1.DiscoveryService/KeepAlivePools"
    sized = getattr(servicer, "sized_on_receipt", False)
    recv = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(5):
            for d in data:
                m = deserialize(d)
                if not sized:
                    check_size(method, m)
        recv.append((time.thread_time() - t0) / (5 * len(data)) * 1e6)
    await store.close()
    best.sort()
    recv.sort()
    print(  # a bench prints its figures
        f"{'new' if sized else 'old'} bytes={len(data[0])} renewal_us median={best[len(best) // 2]:.2f} "
        f"min={best[0]:.2f}  receive+measure_us median={recv[len(recv) // 2]:.3f} min={recv[0]:.3f}"
    )


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 15))

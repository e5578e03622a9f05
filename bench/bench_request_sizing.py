"""CPU per request in-process where requests are measured by the bytes received (or were not).

`discovery` (the default): for 2,000 (pool, relay) leases (1,000 pools x 2 relays) renewed in turn
on a memory store, thread time per KeepAlivePools renewal (the registered deserializer, then the
servicer's reply), and per receive-and-measure step alone (the deserializer, then the size check
as the servicer makes it). `route`: process time per Route call with a 16,384-token prompt
through a real in-process frontend and client (one listed pool). Works with either tree on
PYTHONPATH, to compare interleaved with main:
  mkdir /tmp/old && git archive main | tar -x -C /tmp/old
  for r in 1 2 3; do PYTHONPATH=/tmp/old python bench/bench_request_sizing.py [route]; \
    PYTHONPATH=$PWD python bench/bench_request_sizing.py [route]; done
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import grpc

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


async def discovery(rounds: int) -> None:
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


async def route(rounds: int) -> None:
    from globalrouter.config import RouterConfig
    from globalrouter.server import create_server
    from globalrouter.v1 import router_pb2, router_pb2_grpc

    router = create_server(RouterConfig(listen="127.0.0.1:0"))
    await router.handle.server.start()
    router.core.table.apply_listed(
        pb.Pool(pool_id="p1", model="m", region="r1", frontends=["http://127.0.0.1:1"])
    )
    request = router_pb2.RouteRequest(
        model="m", prompt=router_pb2.Prompt(token_ids={"ids": [(i * 7919) % 150_000 for i in range(16_384)]})
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for _ in range(50):
            await stub.Route(request)
        per_call = []
        for _ in range(rounds):
            t0 = time.process_time()
            for _ in range(100):
                await stub.Route(request)
            per_call.append((time.process_time() - t0) / 100 * 1e6)
    await router.handle.server.stop(0)
    per_call.sort()
    sized = _sized_router()
    print(
        f"{'new' if sized else 'old'} route 16k tokens ({request.ByteSize()} bytes) process_us a call "
        f"median={per_call[len(per_call) // 2]:.0f} min={per_call[0]:.0f}"
    )


def _sized_router() -> bool:
    """Whether this tree registers RouterService with add_sized_servicer."""
    import inspect

    from globalrouter import server

    return "add_sized_servicer(server, router_servicer" in inspect.getsource(server)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].isdigit() else "discovery"
    count = int(sys.argv[-1]) if sys.argv[-1].isdigit() else 15
    asyncio.run(route(count) if mode == "route" else discovery(count))

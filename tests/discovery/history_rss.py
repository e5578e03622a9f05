"""Measures a discovery process's RSS before and after 400 registrations of ~240 KB (64 long
frontend URLs each) that then leave (issue 18's probe): `python -m tests.discovery.history_rss
[serve flags...]`, e.g. `--watch-history-bytes 8388608`. Not a test: it prints one line."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc

from globaldiscovery.v1 import discovery_pb2 as pb
from globaldiscovery.v1 import discovery_pb2_grpc as pb_grpc
from meshlaunch import command, free_port, wait_healthy

POOLS = 400


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def main(extra: list[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    timing = ["--lease-duration", "600", "--heartbeat-interval", "60"]
    argv = [command("globaldiscovery"), "serve", "--listen", address, *timing, *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(address)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.DiscoveryServiceStub(channel)
            time.sleep(1)  # settled after start
            start = rss_mb(proc.pid)
            size = 0
            for i in range(POOLS):
                request = pb.RegisterPoolRequest(
                    pool_id=f"big-{i}",
                    model="m",
                    region="eu",
                    relay_id="r",
                    incarnation=1,
                    frontend_protocol=pb.FRONTEND_PROTOCOL_OPENAI_HTTP,  # base paths allowed
                    frontends=[f"http://h{i}-{j}.example:8000/" + "x" * 3700 for j in range(64)],
                )
                size = request.ByteSize()
                stub.RegisterPool(request, timeout=30)
                stub.UnregisterPool(
                    pb.UnregisterPoolRequest(pool_id=f"big-{i}", relay_id="r", incarnation=1), timeout=30
                )
            time.sleep(2)
            after = rss_mb(proc.pid)
        print(
            f"{POOLS} registrations of {size / 1000:.0f} KB registered and gone: "
            f"RSS {start:.0f} MB at start, {after:.0f} MB after ({' '.join(extra) or 'defaults'})"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main(sys.argv[1:])

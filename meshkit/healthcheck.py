"""`python -m meshkit.healthcheck`: exit 0 when a mesh server's gRPC health says SERVING (container probes).

Kubernetes' own gRPC and HTTPS probes cannot present a client certificate, so under mutual TLS a
probe must run inside the container with a certificate of its own; this is that probe. It dials
like every mesh process (the shared security flags), asks `grpc.health.v1.Health/Check` once and
exits 0 (SERVING), 1 (any other status, NOT_SERVING) or 2 (unreachable, timed out, an unknown service,
refused). One line on stderr says which, so `kubectl describe pod` shows why a probe failed.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshkit.channels import sync_channel
from meshkit.cli import add_security_flags, host_port, positive_seconds, security_config

SERVING = 0
NOT_SERVING = 1
UNREACHABLE = 2


def build_parser() -> argparse.ArgumentParser:
    """The probe's flags: the target, the service name, a deadline and the shared security flags."""
    parser = argparse.ArgumentParser(
        prog="python -m meshkit.healthcheck",
        description="Exit 0 when the server's gRPC health check says SERVING (1: not serving, 2: unreachable).",
    )
    parser.add_argument("--target", type=host_port, required=True, help="HOST:PORT of the server")
    parser.add_argument(
        "--service", default="", help="the health service name to ask about (default: the whole server)"
    )
    parser.add_argument(
        "--timeout", type=positive_seconds, default=2.0, help="seconds to wait for the answer (default 2)"
    )
    add_security_flags(parser, server=False)
    return parser


def check(target: str, service: str = "", timeout: float = 2.0) -> tuple[int, str]:
    """(exit code, one line saying why) of one health check of `target`, dialled with the process's
    security settings (meshkit.channels.use_security)."""
    channel = sync_channel(target)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
        detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        return UNREACHABLE, f"{target}: health check failed: {code.name}: {detail}"
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return (SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING), (
        f"{target}: {status}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    security_config(parser, args)  # sets how this process dials (TLS, client certificate, API key)
    code, line = check(args.target, args.service, args.timeout)
    # A probe's whole output is this line: the kubelet keeps it as the failure's message.
    sys.stderr.write(line + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())

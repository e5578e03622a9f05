"""Several addresses of one replicated service (discovery replicas, etcd members) as one gRPC channel
that moves to another replica when its own fails.

The channel spreads calls over every address it can reach (gRPC's round_robin policy) and skips
an address whose connection failed until it answers again: a call that was on a replica that died
fails with UNAVAILABLE, and the caller's retry (a relay's next heartbeat, a frontend's re-watch)
lands on a live one. No call waits on a dead address while another is up.

Host names are resolved once, when the channel is made (gRPC's multi-address targets take IP
literals); a single address is dialled as it is, so DNS keeps working for one-replica setups.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from collections.abc import Sequence

import grpc

from meshkit import channels
from meshkit.channels import url_to_target
from meshkit.keepalive import CLIENT_OPTIONS

MAX_ENDPOINTS = 16
LB_OPTIONS: list[tuple[str, str]] = [("grpc.lb_policy_name", "round_robin")]


def parse_endpoints(value: str) -> tuple[str, ...]:
    """`A,B,C` (HOST:PORT or http(s)://HOST:PORT each) as a tuple; ValueError naming what is wrong."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise ValueError("expected at least one HOST:PORT")
    if len(items) > MAX_ENDPOINTS:
        raise ValueError(f"at most {MAX_ENDPOINTS} addresses (got {len(items)})")
    for item in items:
        target, _ = url_to_target(item)
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"expected HOST:PORT, got {item!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"names an address twice: {value!r}")
    return tuple(items)


def endpoints_arg(value: str) -> str:
    """argparse type: one or several HOST:PORT, comma-separated; kept as the string (config fields)."""
    try:
        parse_endpoints(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def _literal(host: str, port: str) -> tuple[int, str]:
    """(IP version, "ip:port") for a host that is an IP literal or resolves to one."""
    bare = host.strip("[]")
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        infos = socket.getaddrinfo(bare, int(port), type=socket.SOCK_STREAM)
        if not infos:
            raise ValueError(f"{host!r} does not resolve") from None
        ip = ipaddress.ip_address(infos[0][4][0])
    return (6, f"[{ip}]:{port}") if ip.version == 6 else (4, f"{ip}:{port}")


def channel_target(endpoints: Sequence[str]) -> tuple[str, bool]:
    """The gRPC target for `endpoints` and whether it uses TLS (all must agree)."""
    targets = [url_to_target(e) for e in endpoints]
    tls = {t[1] for t in targets}
    if len(tls) != 1:
        raise ValueError("the addresses mix https:// and plain ones")
    if len(targets) == 1:
        return targets[0][0], targets[0][1]
    resolved = []
    for target, _ in targets:
        host, _, port = target.rpartition(":")
        resolved.append(_literal(host, port))
    versions = {v for v, _ in resolved}
    if len(versions) != 1:
        raise ValueError("the addresses mix IPv4 and IPv6")
    scheme = "ipv6" if versions == {6} else "ipv4"
    return f"{scheme}:{','.join(a for _, a in resolved)}", tls.pop()


def channel_options(endpoints: Sequence[str]) -> list[tuple[str, object]]:
    """The shared keepalive options, plus round_robin over several addresses."""
    return [*CLIENT_OPTIONS, *(LB_OPTIONS if len(endpoints) > 1 else [])]


def aio_channel(value: str | Sequence[str]) -> grpc.aio.Channel:
    """An asyncio channel to one or several replicas (`"A,B,C"` or a sequence of addresses), with
    the process's TLS settings (meshkit.channels)."""
    endpoints = parse_endpoints(value) if isinstance(value, str) else tuple(value)
    if len(endpoints) == 1:
        return channels.aio_channel(endpoints[0])
    target, tls = channel_target(endpoints)
    options: list[tuple[str, object]] = channel_options(endpoints)
    if tls:
        # Every replica's certificate is checked against the first address's host name, so
        # replicas behind several addresses carry a shared name (e.g. a DNS SAN of the service).
        host = url_to_target(endpoints[0])[0].rpartition(":")[0].strip("[]")
        options = [*options, ("grpc.ssl_target_name_override", host), ("grpc.default_authority", host)]
        return grpc.aio.secure_channel(target, channels._tls_credentials(), options=options)
    return grpc.aio.insecure_channel(target, options=options)

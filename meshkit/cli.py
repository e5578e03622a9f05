"""Flag parsing helpers shared by every command line (HOST:PORT, seconds, URL lists)."""

from __future__ import annotations

import argparse

from meshkit.validation import url_problem


def host_port(value: str) -> str:
    """argparse type: HOST:PORT with a numeric port."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return value


def positive_seconds(value: str) -> float:
    """argparse type: a number of seconds > 0 (fractions allowed)."""
    try:
        s = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from exc
    if not s > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {value!r}")
    return s


def url_list(value: str) -> list[str]:
    """argparse type: comma-separated http(s) URLs with host and port; names the bad one."""
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("expected at least one URL")
    for u in urls:
        problem = url_problem(u)
        if problem:
            raise argparse.ArgumentTypeError(f"frontend {u!r} {problem}")
    return urls

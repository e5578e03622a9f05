"""argparse types shared by every command line: the one copy of each flag validator."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from meshkit.validation import Violations, check_identifier, url_problem


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


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """argparse type: a whole number >= `minimum` (and <= `maximum` when given)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from exc
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {n}")
        if maximum is not None and n > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {n}")
        return n

    return parse


def number_above(minimum: float, *, inclusive: bool) -> Callable[[str], float]:
    """argparse type: a finite number > `minimum` (or >= it when `inclusive`)."""
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from exc
        if not (x >= minimum if inclusive else x > minimum) or x == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {value!r}")
        return x

    return parse


non_negative_number = number_above(0, inclusive=True)
positive_number = number_above(0, inclusive=False)


def url(value: str) -> str:
    """argparse type: one http(s) frontend URL."""
    problem = url_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(f"{value!r} {problem}")
    return value


def identifier(value: str) -> str:
    """argparse type: an id (non-empty, at most 128 characters, no surrounding space or control characters)."""
    v = Violations()
    check_identifier(v, "id", value)
    if v:
        raise argparse.ArgumentTypeError("; ".join(d for _f, d in v.items))
    return value

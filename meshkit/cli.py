"""argparse types shared by every command line: the one copy of each flag validator."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from meshkit.channels import use_security
from meshkit.tls import SecurityConfig
from meshkit.validation import Violations, check_identifier, host_port_problem, url_problem


def host_port(value: str) -> str:
    """argparse type: HOST:PORT with a numeric port."""
    problem = host_port_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
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


def fraction(value: str) -> float:
    """argparse type: a number strictly between 0 and 1 (a share, a quantile)."""
    try:
        x = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {value!r}") from exc
    if not 0 < x < 1:
        raise argparse.ArgumentTypeError(f"must be strictly between 0 and 1, got {value!r}")
    return x


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


LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level(value: str) -> str:
    """argparse type: a log level, debug/info/warning/error (any case)."""
    level = value.strip().lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return level


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    """--log-level, the same on every binary."""
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="info",
        help="debug, info, warning or error (default %(default)s)",
    )


_SECURITY_DEFAULTS = SecurityConfig()


def add_security_flags(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """The TLS, identity and API-key flags, named the same on every binary (`server`: also --insecure, --api-keys)."""
    group = parser.add_argument_group("security")
    d = _SECURITY_DEFAULTS
    group.add_argument(
        "--tls-cert", default=d.tls_cert, metavar="PEM", help="certificate this process presents"
    )
    group.add_argument("--tls-key", default=d.tls_key, metavar="PEM", help="private key of --tls-cert")
    group.add_argument(
        "--tls-ca",
        default=d.tls_ca,
        metavar="PEM",
        help="CA that peers' certificates must chain to (mutual TLS)",
    )
    group.add_argument(
        "--trust-domain",
        type=identifier,
        default=d.trust_domain,
        help="SPIFFE trust domain of peer identities (default %(default)s)",
    )
    group.add_argument(
        "--api-key-file",
        default=d.api_key,
        metavar="FILE",
        help="file holding the API key this process sends (a CLI on its calls, a relay on its telemetry streams)",
    )
    if server:
        group.add_argument(
            "--api-keys",
            default=d.api_keys,
            metavar="FILE",
            help="API keys, one `NAME sha256:HEX` a line (NAME: a client, or relay/POOL/RELAY, admin/NAME, "
            "frontend/NAME); re-read on SIGHUP and when the file changes",
        )
        group.add_argument(
            "--insecure",
            action="store_true",
            default=d.insecure,
            help="allow listening on a non-loopback address without TLS (logged as a warning)",
        )


def security_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SecurityConfig:
    """The SecurityConfig the security flags name (parser.error when they are wrong); also sets how
    this process dials its peers."""
    config = SecurityConfig(
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        trust_domain=args.trust_domain,
        api_keys=getattr(args, "api_keys", ""),
        api_key=args.api_key_file,
        insecure=getattr(args, "insecure", False),
    )
    problems = config.problems()
    if problems:
        parser.error("; ".join(problems))
    use_security(config)
    return config

"""structlog configured once per process: JSON lines when not on a terminal, readable lines on one."""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def configure_logging(service: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    """Configures structlog for this process (idempotent) and returns a logger bound to `service`.

    Logs go to stderr so that a command's stdout stays for its results.
    """
    global _configured
    if not _configured:
        numeric = getattr(logging, level.upper(), logging.INFO)
        renderer: structlog.typing.Processor
        if sys.stderr.isatty():
            renderer = structlog.dev.ConsoleRenderer()
        else:
            renderer = structlog.processors.JSONRenderer()
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.StackInfoRenderer(),
                structlog.processors.format_exc_info,
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(numeric),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=True,
        )
        _configured = True
    logger: structlog.stdlib.BoundLogger = structlog.get_logger().bind(service=service)
    return logger


def get_logger(**context: object) -> structlog.stdlib.BoundLogger:
    """A logger with `context` bound (per module or per RPC).

    Lazy: a module-level logger created at import time, before `configure_logging`, still uses
    the configuration (renderer, level) set later (`.bind()` here would freeze the defaults).
    """
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(**context)
    return logger

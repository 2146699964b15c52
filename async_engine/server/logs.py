"""structlog set-up for the server process: one JSON object per line on stderr."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info") -> None:
    """Process-wide, so only entry points (the CLI) call it; libraries just get loggers."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def ensure_logging(level: str = "info") -> None:
    """Give an embedded server (tests, benchmarks) JSON logs on stderr unless the host
    application configured structlog itself; structlog's default would print to stdout."""
    if not structlog.is_configured():
        configure_logging(level)

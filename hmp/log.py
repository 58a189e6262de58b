"""structlog configuration, done once per process in its ``main``."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "auto", level: int = logging.INFO, stream=None) -> None:
    """Console rendering on a terminal, JSON lines otherwise (``fmt`` auto | console | json)."""
    stream = stream or sys.stderr
    use_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )

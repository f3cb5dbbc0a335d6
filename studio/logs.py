"""structlog set-up: readable console lines by default, JSON lines on request."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(*, json_lines: bool = False, level: int = logging.INFO) -> None:
    """Route structlog to stderr as console or JSON lines."""
    renderer = (
        structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )

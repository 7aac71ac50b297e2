"""structlog set-up: library modules call ``get_logger``; only the CLI configures output."""

from __future__ import annotations

import logging
import sys

import structlog


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


def configure_logging(level: str = "info", json_lines: bool = False) -> None:
    """Console rendering in a terminal (dev), JSON lines otherwise or when asked."""
    renderer = (structlog.processors.JSONRenderer() if json_lines or not sys.stderr.isatty()
                else structlog.dev.ConsoleRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )

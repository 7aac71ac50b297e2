"""structlog set-up: library modules call ``get_logger``; only the CLI configures output."""

from __future__ import annotations

import logging
import sys

import structlog


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


def configure_logging(level: str = "info", json_lines: bool = False) -> None:
    """Console rendering in a terminal (dev), JSON lines otherwise or when asked."""
    as_json = json_lines or not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    if as_json:
        processors.append(structlog.processors.format_exc_info)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # No file bound here: the logger writes to whatever sys.stderr is at call time, so a
        # CLI called in-process (tests) never holds on to a closed capture stream.
        logger_factory=lambda *args: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )

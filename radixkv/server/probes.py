"""Quiet handling of HTTP/2 connection prefaces (gRPC probes) sent to the HTTP/1.1 port.

sglang-router probes each worker's HTTP port with gRPC when it registers it: an HTTP/2
connection preface, ``PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n``. aiohttp answers ``400 Bad
Request`` and closes the connection, which is the right answer (the router then uses HTTP),
but it logs the parse error as an ERROR with a traceback on the ``aiohttp.server`` logger.
``quiet_http2_probes`` installs a filter on that logger that turns exactly this case into one
debug line; every other parse error is logged as aiohttp logs it.

How the preface shows up depends on aiohttp's parser: the C parser (llhttp) raises
``BadHttpMessage`` "Pause on PRI/Upgrade"; the pure-Python one (``AIOHTTP_NO_EXTENSIONS``)
raises ``InvalidURLError`` for the ``*`` target, which HTTP/1.1 only allows on OPTIONS.
"""

from __future__ import annotations

import logging

import structlog
from aiohttp.http_exceptions import HttpProcessingError, InvalidURLError

__all__ = ["Http2ProbeFilter", "is_http2_preface_error", "quiet_http2_probes"]

log = structlog.get_logger(__name__)
AIOHTTP_SERVER_LOGGER = "aiohttp.server"


def is_http2_preface_error(exc: BaseException | None) -> bool:
    """True when aiohttp's request parser failed on an HTTP/2 connection preface."""
    if not isinstance(exc, HttpProcessingError):
        return False
    if isinstance(exc, InvalidURLError):
        return exc.message.strip() == "*"
    return "PRI/Upgrade" in exc.message


class Http2ProbeFilter(logging.Filter):
    """Drops aiohttp's traceback record for an HTTP/2 preface, logging one debug line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not is_http2_preface_error(exc):
            return True
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else None
        log.debug("http2_probe_refused", peer=peer,
                  note="an HTTP/2 (gRPC) preface on the HTTP/1.1 port; answered 400")
        return False


def quiet_http2_probes() -> None:
    """Install ``Http2ProbeFilter`` on aiohttp's server logger (once per process)."""
    logger = logging.getLogger(AIOHTTP_SERVER_LOGGER)
    if not any(isinstance(f, Http2ProbeFilter) for f in logger.filters):
        logger.addFilter(Http2ProbeFilter())

"""``X-Request-Id``: every response carries one, and every log line of the request too.

A client's ``X-Request-Id`` is echoed when it is 1–128 visible ASCII characters (``!`` to
``~``: no spaces, no control characters, nothing a log line or a header could be split by);
otherwise, or when absent, the server generates one (32 hex digits, a UUID4). The id is
stored on the request (``request[REQUEST_ID]``, or ``request_id_of(request)``) for handlers,
bound into structlog's context variables as ``request_id`` for the request's duration (so
every log line the request's task writes carries it), and set on the response just before its
headers go out (``on_response_prepare``): JSON answers, errors, 404s and SSE streams alike.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

HEADER = "X-Request-Id"
MAX_LENGTH = 128
_VALID = re.compile(rf"[\x21-\x7e]{{1,{MAX_LENGTH}}}")
# Request-scoped key (web.RequestKey from aiohttp 3.12, a str before), as in radixkv.server.auth.
_REQUEST_KEY = getattr(web, "RequestKey", None)
REQUEST_ID: Any = _REQUEST_KEY("radixkv_request_id", str) if _REQUEST_KEY else "radixkv_request_id"


def valid_request_id(value: str | None) -> str:
    """``value`` when it is an acceptable id, else a freshly generated one."""
    if value is not None and _VALID.fullmatch(value):
        return value
    return uuid.uuid4().hex


def request_id_of(request: web.Request) -> str | None:
    """The id ``request_id_middleware`` gave this request (None outside it)."""
    return request.get(REQUEST_ID)


@web.middleware
async def request_id_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Give the request its id and bind it to the logs (install as the outermost middleware,
    so error answers and their log lines carry it too)."""
    rid = valid_request_id(request.headers.get(HEADER))
    request[REQUEST_ID] = rid
    with structlog.contextvars.bound_contextvars(request_id=rid):
        return await handler(request)


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: the id goes out with the headers of every response."""
    rid = request.get(REQUEST_ID)
    response.headers[HEADER] = rid if rid is not None else valid_request_id(
        request.headers.get(HEADER))


def install(app: web.Application) -> None:
    """Hook the response header into ``app`` (the middleware goes in its middleware list)."""
    app.on_response_prepare.append(add_request_id_header)

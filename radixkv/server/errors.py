"""OpenAI-shaped errors and the middleware that turns every failure into one.

Every error body is ``{"error": {"message", "type", "param", "code"}}``, except under the
Anthropic routes (``/v1/messages`` and below), where it is Anthropic's
``{"type": "error", "error": {"type", "message"}, "request_id"}`` with Anthropic's statuses
and types (``anthropic_error``: a 503 becomes 529 ``overloaded_error``). Client mistakes are
4xx with ``type = "invalid_request_error"``; an unexpected exception is logged with its traceback
and the request id, counted (``server_errors_total``, through the application's
``SERVER_FAULT_HOOK``) and answered 500 ``server_error`` / ``internal_error`` without leaking
internals.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web

from radixkv.server import request_id as request_ids

log = structlog.get_logger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """A failure to report to the client in OpenAI's error shape.

    Attributes:
        status: HTTP status code.
        message: Human-readable explanation (names the offending field where there is one).
        type: OpenAI error type, e.g. ``invalid_request_error``.
        param: The request field at fault (dotted path, e.g. ``messages[2].role``) or None.
        code: Machine-readable code (e.g. ``model_not_found``) or None.
        headers: Extra response headers (``Retry-After``, ``WWW-Authenticate``).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = INVALID_REQUEST,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return APIError(400, message, param=param, code=code)


def json_response(body: object, status: int = 200, headers: dict | None = None) -> web.Response:
    """Serialise ``body`` with orjson into an ``application/json`` response."""
    return web.Response(body=orjson.dumps(body), status=status, headers=headers,
                        content_type="application/json")


def error_response(err: APIError, request: web.Request | None = None) -> web.Response:
    """``err`` as a response: OpenAI's shape, or Anthropic's for a request to an Anthropic
    route (``is_anthropic_path``)."""
    if request is not None and is_anthropic_path(request.path):
        status, body = anthropic_error(err, request_ids.request_id_of(request))
        return json_response(body, status=status, headers=err.headers)
    return json_response(err.to_dict(), status=err.status, headers=err.headers)


ANTHROPIC_PREFIX = "/v1/messages"
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         529: "overloaded_error"}
ANTHROPIC_OVERLOADED = 529


def is_anthropic_path(path: str) -> bool:
    """True for ``/v1/messages`` and every path below it (their errors are Anthropic's)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error(err: APIError, request_id: str | None = None) -> tuple[int, dict]:
    """``(status, body)`` of ``err`` in Anthropic's shape.

    A 503 (queue full, draining, engine dead or unhealthy, aborted) becomes 529
    ``overloaded_error``, which Anthropic's clients retry; any other status keeps its number,
    typed by ``ANTHROPIC_ERROR_TYPES`` (other 4xx: ``invalid_request_error``, other 5xx:
    ``api_error``). The message names the field at fault, as OpenAI's ``param`` does.
    """
    status = ANTHROPIC_OVERLOADED if err.status == 503 else err.status
    type_ = ANTHROPIC_ERROR_TYPES.get(status, INVALID_REQUEST if status < 500 else "api_error")
    body: dict[str, Any] = {"type": "error", "error": {"type": type_, "message": err.message}}
    if request_id is not None:
        body["request_id"] = request_id
    return status, body


RETRY_AFTER_S = 1
INTERNAL_ERROR = "internal_error"
REQUEST_ID_HEADER = "X-Request-Id"
# ``app[SERVER_FAULT_HOOK](request)`` is called once per request answered 500 for a fault in
# the server's own code (the application counts it); absent: not counted.
SERVER_FAULT_HOOK: web.AppKey[Any] = web.AppKey("radixkv_server_fault_hook")


def internal_error(message: str = "internal server error") -> APIError:
    """500 ``internal_error``: a fault on our side ended this request (nothing leaked)."""
    return APIError(500, message, type=SERVER_ERROR, code=INTERNAL_ERROR)


def request_id_of(request: web.Request) -> str:
    """The id logs carry for ``request``: the one ``request_id_middleware`` gave it, else its
    ``X-Request-Id`` header, else its path."""
    return (request_ids.request_id_of(request) or request.headers.get(REQUEST_ID_HEADER)
            or request.path)


def server_fault(request: web.Request, event: str, **fields: Any) -> APIError:
    """Log the exception being handled (traceback, request id), count it, and return the 500
    ``internal_error`` to answer. Call from an ``except`` block."""
    log.exception(event, request_id=request_id_of(request), path=request.path,
                  method=request.method, **fields)
    hook = request.app.get(SERVER_FAULT_HOOK)
    if hook is not None:
        try:
            hook(request)
        except Exception:  # noqa: BLE001 - counting must never turn a 500 into another fault
            log.exception("server_fault_hook_failed", request_id=request_id_of(request))
    return internal_error()


def queue_full(message: str) -> APIError:
    """503: the engine's admission queue is full; retry after ``RETRY_AFTER_S``."""
    return APIError(503, message, type=SERVER_ERROR, code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def tenant_limit(tenant: str | None, limit: int) -> APIError:
    """429: the tenant already has ``limit`` requests in flight."""
    who = f"tenant '{tenant}'" if tenant else "this server's tenant"
    return APIError(429, f"Too many concurrent requests: {who} may have {limit} in flight",
                    type="requests", code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def shutting_down() -> APIError:
    """503 while the server drains before exiting."""
    return APIError(503, "the server is shutting down", type=SERVER_ERROR, code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def _from_http_exception(exc: web.HTTPException) -> APIError:
    """Map aiohttp's own HTTP errors (unknown route, wrong method, body too large)."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return APIError(413, f"request body is larger than the server's limit: {exc.text}",
                        code="request_too_large")
    if isinstance(exc, web.HTTPNotFound):
        return APIError(404, "unknown endpoint", code="not_found")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return APIError(405, f"method {exc.method} is not allowed here; "
                             f"allowed: {', '.join(sorted(exc.allowed_methods))}",
                        code="method_not_allowed")
    type_ = INVALID_REQUEST if exc.status < 500 else SERVER_ERROR
    return APIError(exc.status, exc.reason, type=type_)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Answer every failure in OpenAI's error shape (Anthropic's under ``/v1/messages``); 500
    only for real server faults."""
    try:
        return await handler(request)
    except APIError as err:
        # A 5xx is ours (an engine fault, a dead engine): worth a warning, not an info line.
        report = log.warning if err.status >= 500 else log.info
        report("request_rejected", path=request.path, status=err.status, param=err.param,
               code=err.code, message=err.message)
        return error_response(err, request)
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like pass through untouched
            raise
        api_err = _from_http_exception(exc)
        log.info("request_rejected", path=request.path, status=api_err.status,
                 message=api_err.message)
        return error_response(api_err, request)
    except Exception:
        # CancelledError (client gone) is a BaseException and is deliberately not caught here.
        return error_response(server_fault(request, "unhandled_server_error"), request)

"""Operator routes for retention: warm and retain a prefix without generating, list and release.

Routes (radixkv's own; OpenAI, vLLM and SGLang have no equivalent):

    POST   /v1/cache/retain                    warm a prefix and retain it for ``ttl``
    GET    /v1/cache/retentions                the caller's live retentions (admin: all)
    DELETE /v1/cache/retentions/{retention_id} release one
    DELETE /v1/cache/retentions                release all of the caller's (admin: all)

``POST /v1/cache/retain`` takes ``{"messages", "tools"?, "chat_template_kwargs"?}`` (rendered
exactly as a chat request with the same fields renders them, generation prompt included) or
``{"prompt"}`` (one text or token-id prompt, encoded as ``/v1/completions`` encodes it), with
``"ttl"`` (``"5m"``, ``"1h"`` or ``"24h"``, required) and optional ``"model"`` (the base model
or a loaded LoRA adapter) and ``"cache_salt"``. It runs an ordinary engine request with
``max_tokens = 1`` and a retention breakpoint at the prompt's length, drops its output, and
answers ``{"id", "object": "cache.retention", "ttl", "num_prompt_tokens", "num_cached_tokens",
"num_retained_tokens", "cache_creation_tokens", "expires_in_s"}``: ``num_retained_tokens`` is
the prompt's block-aligned prefix under a live retention (less than asked when a budget
refused the rest; ``id`` and ``expires_in_s`` are null when nothing was retained). ``id`` is
the retention the breakpoint made or refreshed (``RequestOutput.retention_ids``), whatever
happened to it since; ``expires_in_s`` is read from the live listing, 0 when it already ended
(released, expired or dropped under pressure before the answer). The request
is admitted like a completion (503 while draining, 429 at the tenant's concurrency limit, 503
``queue_full``) and bad input is a 400 naming the field, with nothing retained.

Isolation: the cache salt is the tenant's (``auth.cache_salt_for``), narrowed by ``cache_salt``,
so a warm request retains only what the same tenant with the same salt can hit. With
``--api-keys`` a non-admin key lists and releases its own tenant's retentions only (another
tenant's id answers 404, as an unknown one does; ``?tenant=`` naming another tenant is 403);
an admin key sees and releases every tenant's, or one tenant's with ``?tenant=NAME``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from radixkv.cache.retention import TTL_CLASSES, RetentionBreakpoint, RetentionInfo
from radixkv.engine.faults import FAILED
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import EngineDeadError, QueueFullError
from radixkv.server import adapters, param_policy
from radixkv.server.auth import REQUEST_TENANT, TENANT_NAME, Tenant, cache_salt_for
from radixkv.server.body import read_body
from radixkv.server.completions import parse_completion_request
from radixkv.server.errors import (
    SERVER_ERROR,
    APIError,
    bad_request,
    internal_error,
    json_response,
    queue_full,
)
from radixkv.server.generation import (
    ENGINE_FAULT_MESSAGE,
    ServerState,
    engine_dead,
    engine_value_error,
)
from radixkv.server.params import parse_json_object, refuse_unknown_keys
from radixkv.server.prompts import chat_prompt, completion_prompts
from radixkv.server.protocol import parse_chat_request

if TYPE_CHECKING:
    from radixkv.engine.async_engine import AsyncEngine, RequestOutput

__all__ = ["RETAIN_KEYS", "add_retention_routes"]

RETAIN_KEYS = frozenset({"model", "messages", "tools", "chat_template_kwargs", "prompt", "ttl",
                         "cache_salt"})
_CHAT_KEYS = ("model", "messages", "tools", "chat_template_kwargs", "cache_salt")
_PROMPT_KEYS = ("model", "prompt", "cache_salt")
RETENTION_OBJECT = "cache.retention"
T = TypeVar("T")


def _tenant(request: web.Request) -> Tenant:
    tenant = request.get(REQUEST_TENANT)
    assert tenant is not None  # none of these routes is public (auth_middleware)
    return tenant


async def _engine_call(call: Awaitable[T]) -> T:
    """The engine's answer to a call run on its thread (503 ``engine_dead`` once it died)."""
    try:
        return await call
    except EngineDeadError:
        raise engine_dead() from None


def parse_ttl(body: dict[str, Any]) -> str:
    """The retain body's ``ttl``: a key of ``TTL_CLASSES``.

    Raises:
        APIError: 400 naming ``ttl`` when it is missing or another value.
    """
    ttl = body.get("ttl")
    allowed = ", ".join(f"'{k}'" for k in TTL_CLASSES)
    if ttl is None:
        raise bad_request(f"'ttl' is required: one of {allowed}", "ttl")
    if not isinstance(ttl, str) or ttl not in TTL_CLASSES:
        raise bad_request(f"'ttl' must be one of {allowed}, got {ttl!r}", "ttl")
    return ttl


def _retention_json(info: RetentionInfo) -> dict[str, Any]:
    return {"id": info.retention_id, "object": RETENTION_OBJECT, "tenant": info.tenant,
            "ttl": info.ttl_class, "num_tokens": info.num_tokens,
            "expires_in_s": round(info.expires_in_s, 3), "num_refreshes": info.num_refreshes}


def _scope(request: web.Request) -> tuple[str | None, bool]:
    """``(tenant, all_tenants)`` for the engine's list / release calls.

    A non-admin key is held to its own tenant; an admin key (and a server without keys) sees
    every tenant, or only ``?tenant=NAME``.

    Raises:
        APIError: 400 naming ``tenant`` for a malformed name; 403 when a non-admin key names
            another tenant.
    """
    tenant = _tenant(request)
    wanted = request.query.get("tenant")
    if wanted is not None and not TENANT_NAME.fullmatch(wanted):
        raise bad_request(f"'tenant' must match {TENANT_NAME.pattern}", "tenant")
    if not tenant.admin:
        if wanted is not None and wanted != tenant.name:
            raise APIError(403, "only an admin key can name another tenant",
                           param="tenant", code="insufficient_permissions")
        return tenant.name, False
    if wanted is not None:
        return wanted, False
    return tenant.name, True


async def _prompt_ids(state: ServerState, body: dict[str, Any], salt: str | None
                      ) -> tuple[list[int], str]:
    """The token ids a retain body warms, and the body field they came from (for errors)."""
    engine = state.engine
    has_messages, has_prompt = "messages" in body, "prompt" in body
    if has_messages == has_prompt:
        raise bad_request("send exactly one of 'messages' and 'prompt'",
                          "prompt" if has_prompt else "messages")
    names = adapters.model_names(engine)
    if has_messages:
        chat = {k: body[k] for k in _CHAT_KEYS if k in body}
        with param_policy.unrecorded():  # a warm request is not a chat request
            req = parse_chat_request(chat, names)
        return (await chat_prompt(state, req, chat, salt)).ids, "messages"
    for key in ("tools", "chat_template_kwargs"):
        if body.get(key) is not None:
            raise bad_request(f"'{key}' needs 'messages'", key)
    text = {k: body[k] for k in _PROMPT_KEYS if k in body}
    with param_policy.unrecorded():
        creq = parse_completion_request(text, names)
    if len(creq.prompts) > 1:
        raise bad_request(f"'prompt' must be one prompt (a string or a list of token ids), got "
                          f"{len(creq.prompts)}", "prompt")
    built = await completion_prompts(state, creq, salt)
    return built.ids[0], built.prompts[0].param


async def _warm(engine: AsyncEngine, ids: list[int], param: str, ttl: str, *, request_id: str,
                salt: str | None, tenant: str | None, lora: str | None) -> RequestOutput:
    """Run the warm request (``max_tokens = 1``, greedy) to its end; its last output."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        stream = engine.generate(ids, params, cache_salt=salt, request_id=request_id,
                                 tenant=tenant, lora_name=lora,
                                 retention=(RetentionBreakpoint(len(ids), ttl),))
    except QueueFullError as exc:
        raise queue_full(str(exc)) from exc
    except EngineDeadError:
        raise engine_dead() from None
    except ValueError as exc:
        raise engine_value_error(exc, param) from exc
    last: RequestOutput | None = None
    try:
        async for out in stream:
            last = out
    except EngineDeadError:
        raise engine_dead() from None
    finally:
        stream.close()
    if last is None:
        raise internal_error("the engine ended the request without output")
    if last.finish_reason == FAILED:
        raise internal_error(ENGINE_FAULT_MESSAGE)
    if last.finish_reason == "abort":
        raise APIError(503, "the request was aborted by the server", type=SERVER_ERROR,
                       code="aborted")
    return last


async def _created_retention(engine: AsyncEngine, out: RequestOutput, tenant: str | None
                             ) -> tuple[str | None, float | None]:
    """``(id, expires_in_s)`` of the retention the warm request's breakpoint made or
    refreshed: the id from the output (``RequestOutput.retention_ids``), the expiry from the
    live listing (0.0 when it ended since: released, expired or dropped under pressure);
    ``(None, None)`` when nothing was retained."""
    if not out.retention_ids:
        return None, None
    retention_id = out.retention_ids[-1]
    live = await _engine_call(engine.list_retentions(tenant))
    info = next((r for r in live if r.retention_id == retention_id), None)
    return retention_id, round(info.expires_in_s, 3) if info is not None else 0.0


def add_retention_routes(app: web.Application,
                         state_of: Callable[[web.Request], ServerState]) -> None:
    """Register the ``/v1/cache/*`` routes (see the module doc) on ``app``;
    ``state_of(request)`` returns the application's ``ServerState``."""

    async def retain(request: web.Request) -> web.Response:
        state, tenant = state_of(request), _tenant(request)
        engine = state.engine
        body = parse_json_object(await read_body(request), request.content_type)
        refuse_unknown_keys(body, RETAIN_KEYS)
        ttl = parse_ttl(body)
        salt_field = body.get("cache_salt")
        if not engine.is_healthy:
            raise APIError(503, "the engine is not healthy", type=SERVER_ERROR, code="unhealthy")
        state.admit(tenant.name)
        try:
            # The client salt is validated with the chat / completions fields (_prompt_ids).
            salt = cache_salt_for(tenant, salt_field if isinstance(salt_field, str) else None)
            ids, param = await _prompt_ids(state, body, salt)
            lora = adapters.selected_lora(body, engine)
            adapters.require_lora(engine, lora)
            out = await _warm(engine, ids, param, ttl, request_id=f"retain-{uuid.uuid4().hex}",
                              salt=salt, tenant=tenant.name, lora=lora)
            retention_id, expires_in_s = await _created_retention(engine, out, tenant.name)
        finally:
            state.release(tenant.name)
        return json_response({
            "id": retention_id,
            "object": RETENTION_OBJECT, "ttl": ttl,
            "num_prompt_tokens": out.num_prompt_tokens,
            "num_cached_tokens": out.num_cached_tokens,
            "num_retained_tokens": out.num_retained_tokens,
            "cache_creation_tokens": sum(out.cache_creation_tokens_by_ttl.values()),
            "expires_in_s": expires_in_s})

    async def list_retentions(request: web.Request) -> web.Response:
        tenant, all_tenants = _scope(request)
        live = await _engine_call(
            state_of(request).engine.list_retentions(tenant, all_tenants=all_tenants))
        return json_response({"object": "list", "data": [_retention_json(r) for r in live]})

    async def release_one(request: web.Request) -> web.Response:
        retention_id = request.match_info["retention_id"]
        tenant, all_tenants = _scope(request)
        released = await _engine_call(state_of(request).engine.release_retentions(
            tenant, retention_id, all_tenants=all_tenants))
        if not released:
            raise APIError(404, f"No retention '{retention_id}'", param="retention_id",
                           code="retention_not_found")
        return json_response({"id": retention_id, "object": f"{RETENTION_OBJECT}.deleted",
                              "deleted": True})

    async def release_all(request: web.Request) -> web.Response:
        tenant, all_tenants = _scope(request)
        released = await _engine_call(state_of(request).engine.release_retentions(
            tenant, None, all_tenants=all_tenants))
        return json_response({"object": f"{RETENTION_OBJECT}.deleted", "deleted": True,
                              "num_released": released})

    app.router.add_post("/v1/cache/retain", retain)
    app.router.add_get("/v1/cache/retentions", list_retentions)
    app.router.add_delete("/v1/cache/retentions", release_all)
    app.router.add_delete("/v1/cache/retentions/{retention_id}", release_one)

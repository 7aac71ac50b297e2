"""The aiohttp application: OpenAI chat and text completions, tokenize, models, health, stats,
metrics and the OpenAPI document.

Routes:
    POST /v1/chat/completions  chat completion, one JSON or SSE (``stream: true``)
    POST /v1/completions       text completion; the prompt is text or token ids, or a list of
                               those (one choice set per prompt)
    POST /v1/chat/completions/render, /v1/completions/render
                               the prompt ids either would run, no generation (``prompts``)
    GET  /v1/models            the served model and its loaded LoRA adapters
    POST /v1/load_lora_adapter     vLLM's shapes; admin-only with API keys (``adapters``)
    POST /v1/unload_lora_adapter
    POST /tokenize             vLLM's shape: ``{"model", "messages"}`` or ``{"prompt"}`` →
                               ``{"tokens", "count", "max_model_len"}``
    POST /detokenize           vLLM's shape: ``{"model"?, "tokens"}`` → ``{"prompt"}``
    GET  /health               200 ``{"status": "ok"}``; 503 while draining or when the engine
                               is dead (public)
    GET  /stats                docs/design.md §7; per tenant with API keys (admin: all + tenants)
    GET  /metrics              Prometheus text (admin key with API keys)
    GET  /openapi.json         the hand-written OpenAPI 3.1 document (public)
    GET  /version              ``{"version": "<package version>"}``
    POST /v1/messages          Anthropic's Messages API, one message or SSE (``stream: true``);
                               ``cache_control`` breakpoints retain prefixes
                               (``radixkv.server.anthropic``); errors in Anthropic's shape
    POST /v1/messages/count_tokens  ``{"input_tokens": N}`` for a messages body
    POST /v1/cache/retain, GET/DELETE /v1/cache/retentions[/{retention_id}]
                               warm and retain a prefix, list and release retentions
                               (``radixkv.server.retention_routes``)
    GET  /dashboard, /dashboard/api/summary, /dashboard/api/tree
                               the live dashboard and its radix-tree explorer
                               (``radixkv.server.dashboard``)

Every response carries ``X-Request-Id`` (``radixkv.server.request_id``).

Client disconnects: the server must run with ``handler_cancellation=True`` (``serve`` does;
aiohttp's default is False since 3.7), so a client that goes away cancels the handler task;
closing the engine stream in the handler's ``finally`` aborts the request and frees its blocks.

Shutdown (SIGTERM / SIGINT, or ``stop``): admission stops (503 ``shutting_down``, /health 503),
in-flight completion requests drain for up to ``shutdown_timeout_s``, the rest are aborted (a
JSON request gets 503 ``aborted``, a stream an in-band error event), then the server closes.
A second signal during the drain (or ``force``) aborts everything in flight at once.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from radixkv.config import check_int
from radixkv.server import adapters, anthropic, fleet, request_id
from radixkv.server.auth import REQUEST_TENANT, KeyStore, Tenant, auth_middleware, cache_salt_for
from radixkv.server.body import HANDLER_ARGS, read_body
from radixkv.server.completions import parse_completion_request
from radixkv.server.dashboard import add_dashboard_routes
from radixkv.server.detokenize import parse_detokenize_request
from radixkv.server.errors import (
    SERVER_ERROR,
    SERVER_FAULT_HOOK,
    APIError,
    error_middleware,
    json_response,
)
from radixkv.server.generation import (
    ServerState,
    counted,
    generate_response,
    remember_outputs,
)
from radixkv.server.listen import ShutdownSignals, unless_forced
from radixkv.server.metrics import make_registry, render
from radixkv.server.openapi import openapi_document
from radixkv.server.prefix_memory import remember_texts
from radixkv.server.probes import quiet_http2_probes
from radixkv.server.prompts import chat_prompt, completion_prompts, render_routes
from radixkv.server.protocol import parse_chat_request, parse_json_object, parse_tokenize_request
from radixkv.server.responses import ChatCompletion, TextCompletion
from radixkv.server.retention_routes import add_retention_routes
from radixkv.server.tokenization import (
    tenant_queue_middleware,
    tokenize_chat,
    tokenize_errors,
    tokenize_text,
)
from radixkv.server.version import version

if TYPE_CHECKING:
    from radixkv.engine.async_engine import AsyncEngine

log = structlog.get_logger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
ABORT_GRACE_S = 5.0  # after aborting at the shutdown deadline: time for handlers to answer
FORCE_GRACE_S = 1.0  # after a forced exit's abort: the same, shorter (the user asked twice)
STATE_KEY: web.AppKey[ServerState] = web.AppKey("radixkv_state", ServerState)
REGISTRY_KEY: web.AppKey[Any] = web.AppKey("radixkv_metrics_registry")
STARTED_KEY: web.AppKey[int] = web.AppKey("radixkv_started_s", int)


def _state(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]


def _tenant(request: web.Request) -> Tenant | None:
    return request.get(REQUEST_TENANT)


async def _read_json(request: web.Request) -> dict[str, Any]:
    # Decoded (Content-Encoding) and held to --max-body-bytes before and after decoding.
    return parse_json_object(await read_body(request), request.content_type)


def _check_healthy(engine: AsyncEngine) -> None:
    if not engine.is_healthy:
        raise APIError(503, "the engine is not healthy", type=SERVER_ERROR, code="unhealthy")


def completion_route(handler: Callable[[web.Request, ServerState, Tenant | None],
                                       Awaitable[web.StreamResponse]]):
    """Admission (draining, per-tenant limit) and outcome counting around a completion route."""

    async def admitted(request: web.Request) -> web.StreamResponse:
        state, tenant = _state(request), _tenant(request)
        name = tenant.name if tenant is not None else None
        state.admit(name)
        try:
            return await handler(request, state, tenant)
        finally:
            state.release(name)

    return counted(_state, admitted)


async def chat_completions(request: web.Request, state: ServerState, tenant: Tenant | None
                           ) -> web.StreamResponse:
    engine = state.engine
    body = await _read_json(request)
    req = parse_chat_request(body, adapters.model_names(engine))
    lora = adapters.selected_lora(body, engine)
    _check_healthy(engine)
    salt = cache_salt_for(tenant, req.cache_salt)
    prompt = await chat_prompt(state, req, body, salt)  # the ids /render answers (prompts.py)
    shape = ChatCompletion(model=lora or engine.model_name, include_usage=req.include_usage,
                           tools=prompt.tools)
    adapters.require_lora(engine, lora)  # may have been unloaded while tokenizing
    return await generate_response(request, state, shape, prompt=prompt.ids, sampling=req,
                                   max_tokens=prompt.max_tokens, tenant=tenant, cache_salt=salt,
                                   prompt_param="messages", session_key=req.session_key,
                                   remember=remember_outputs(state, salt, prompt.tools,
                                                             prompt.forced),
                                   lora_name=lora)


async def completions(request: web.Request, state: ServerState, tenant: Tenant | None
                      ) -> web.StreamResponse:
    engine = state.engine
    body = await _read_json(request)
    req = parse_completion_request(body, adapters.model_names(engine))
    lora = adapters.selected_lora(body, engine)
    _check_healthy(engine)
    salt = cache_salt_for(tenant, req.cache_salt)
    built = await completion_prompts(state, req, salt)  # the ids /render answers (prompts.py)
    prompts, ids = built.prompts, built.ids
    shape = TextCompletion(model=lora or engine.model_name, include_usage=req.include_usage,
                           n=req.n, return_token_ids=req.return_token_ids, prompt_token_ids=ids)
    if req.echo:
        shape.echoes.update((i, p.text) for i, p in enumerate(prompts) if p.text is not None)
    remember = remember_texts(engine, state.prefixes, (salt, req.add_special_tokens),
                              [(p.text, prompt) for p, prompt in zip(prompts, ids)], req.n)
    adapters.require_lora(engine, lora)  # may have been unloaded while tokenizing
    return await generate_response(
        request, state, shape, prompt=ids[0], sampling=req, max_tokens=built.max_tokens,
        tenant=tenant, cache_salt=salt, prompt_param=prompts[0].param, remember=remember,
        lora_name=lora, session_key=req.session_key,
        batch=list(zip(ids, (p.param for p in prompts))) if len(ids) > 1 else (),
        echo_prompts=[i for i, p in enumerate(prompts) if req.echo and p.text is None])


async def anthropic_messages(request: web.Request, state: ServerState, tenant: Tenant | None
                             ) -> web.StreamResponse:
    body = await _read_json(request)
    _check_healthy(state.engine)
    return await anthropic.create_message(request, state, tenant, body)


async def anthropic_count_tokens(request: web.Request) -> web.Response:
    return await anthropic.count_tokens(request, _state(request), _tenant(request),
                                        await _read_json(request))


async def detokenize(request: web.Request) -> web.Response:
    engine = _state(request).engine
    tokens = parse_detokenize_request(await _read_json(request), adapters.model_names(engine),
                                      engine.tokenizer.vocab_size)
    with tokenize_errors():  # a full tokenizer queue: 503
        return json_response({"prompt": await engine.detokenize(tokens,
                                                                skip_special_tokens=False)})


async def tokenize(request: web.Request) -> web.Response:
    state = _state(request)
    engine = state.engine
    req = parse_tokenize_request(await _read_json(request), adapters.model_names(engine))
    if req.messages is not None:
        # Exactly what a chat request with the same salt would send to the engine.
        known = state.outputs.lookup_in(cache_salt_for(_tenant(request), req.cache_salt))
        tokens = await tokenize_chat(engine, req.messages, req.tools, known, fit=False,
                                     template_kwargs=req.chat_template_kwargs)
    else:  # the engine encodes on its tokenizer pool, off the event loop
        assert req.prompt is not None  # exactly one of messages / prompt (parser)
        tokens = await tokenize_text(engine, req.prompt, fit=False,
                                     add_special_tokens=req.add_special_tokens)
    return json_response({"tokens": list(tokens), "count": len(tokens),
                          "max_model_len": engine.max_model_len})


async def list_models(request: web.Request) -> web.Response:
    """The served model and its adapters, each with the KV pool dtype actually allocated
    (``kv_cache_dtype``) and one token's K+V bytes over all layers (``kv_bytes_per_token``)."""
    engine = _state(request).engine
    kv = {"kv_cache_dtype": engine.kv_cache_dtype, "kv_bytes_per_token": engine.kv_bytes_per_token}
    data = [{**entry, **kv} for entry in adapters.model_entries(engine, request.app[STARTED_KEY])]
    return json_response({"object": "list", "data": data})


async def load_lora_adapter(request: web.Request) -> web.Response:
    return await adapters.load_adapter(await _read_json(request), _state(request).engine)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    return await adapters.unload_adapter(await _read_json(request), _state(request).engine)


async def health(request: web.Request) -> web.Response:
    state = _state(request)
    if state.draining:
        return json_response({"status": "draining"}, status=503)
    if state.engine.is_healthy:
        return json_response({"status": "ok"})
    return json_response({"status": "unhealthy"}, status=503)


async def stats(request: web.Request) -> web.Response:
    """docs/design.md §7. With API keys: admin sees everything plus ``tenants``; any other key only
    its tenant's counters, rates and latency (no pool or tree gauges, no miss causes)."""
    state, tenant = _state(request), _tenant(request)
    engine = state.engine
    if state.keys is None:
        return json_response(engine.stats())
    assert tenant is not None and tenant.name is not None  # keys on: a named tenant (auth)
    if tenant.admin:
        out = engine.stats()
        names = sorted(set(state.keys.tenant_names) | set(engine.engine_stats.tenant_names()))
        out["tenants"] = {name: engine.tenant_stats(name) for name in names}
        return json_response(out)
    return json_response({"tenant": tenant.name, **engine.tenant_stats(tenant.name)})


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    if registry is None:
        raise APIError(503, "/metrics needs the prometheus-client package", type=SERVER_ERROR,
                       code="metrics_unavailable")
    body, content_type = render(registry)
    return web.Response(body=body, headers={"Content-Type": content_type})


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document(_state(request).engine.model_name))


def _count_server_fault(request: web.Request) -> None:
    """A 500 for a fault in our own per-request code: ``server_errors_total`` (its tenant's too)."""
    tenant = _tenant(request)
    _state(request).engine.record_server_error(tenant.name if tenant is not None else None)


def create_app(engine: AsyncEngine, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               api_keys: dict[str, Tenant] | None = None,
               max_concurrency_per_tenant: int | None = None) -> web.Application:
    """Build the application around a started engine (the caller owns its lifecycle).

    Args:
        engine: The engine serving requests; must be started before the first request.
        max_body_bytes: Largest accepted request body in bytes, on the wire and again once
            its Content-Encoding is undone; larger bodies get 413 (``radixkv.server.body``).
        api_keys: Key → tenant (``auth.load_api_keys``); None serves a single tenant, no keys.
        max_concurrency_per_tenant: Most in-flight completion requests per tenant (429 past).

    Returns:
        The aiohttp application. Serve it with ``handler_cancellation=True`` so that client
        disconnects abort requests (``serve`` and ``aiohttp.test_utils`` both do).
    """
    check_int("max_body_bytes", max_body_bytes, minimum=1)
    if max_concurrency_per_tenant is not None:
        check_int("max_concurrency_per_tenant", max_concurrency_per_tenant, minimum=1)
    keys = KeyStore(api_keys) if api_keys else None
    state = ServerState(engine, keys=keys, max_concurrency_per_tenant=max_concurrency_per_tenant)
    # Outermost first: the request id covers errors and their log lines; the tokenizer queue
    # key needs the tenant that auth found.
    app = web.Application(client_max_size=max_body_bytes, handler_args=HANDLER_ARGS,
                          middlewares=[request_id.request_id_middleware, error_middleware,
                                       auth_middleware(keys), tenant_queue_middleware])
    request_id.install(app)
    app[STATE_KEY] = state
    app[REGISTRY_KEY] = make_registry(state)
    app[STARTED_KEY] = int(time.time())
    app[SERVER_FAULT_HOOK] = _count_server_fault
    app.router.add_post("/v1/chat/completions", completion_route(chat_completions))
    app.router.add_post("/v1/completions", completion_route(completions))
    app.router.add_routes(render_routes(_state, _read_json))  # the prompt ids, no generation
    app.router.add_post("/v1/messages", completion_route(anthropic_messages))
    app.router.add_post("/v1/messages/count_tokens", anthropic_count_tokens)
    add_retention_routes(app, _state)  # /v1/cache/*: warm, list, release retentions
    add_dashboard_routes(app, _state)  # /dashboard and its data routes (docs/operations.md#dashboard)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/version", version)
    fleet.add_routes(app, lambda request: _state(request).engine)
    return app


async def drain(state: ServerState, timeout_s: float) -> None:
    """Stop admission, wait up to ``timeout_s`` for in-flight requests, abort the rest."""
    state.draining = True
    log.info("server_draining", in_flight=state.in_flight, timeout_s=timeout_s)
    if await state.wait_idle(timeout_s):
        return
    aborted = state.engine.abort_all()
    log.warning("shutdown_aborting", in_flight=state.in_flight, aborted_requests=aborted)
    if not await state.wait_idle(ABORT_GRACE_S):
        log.warning("shutdown_handlers_still_running", in_flight=state.in_flight)


async def serve(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8000, *,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_timeout_s: float = 30.0,
                api_keys: dict[str, Tenant] | None = None,
                max_concurrency_per_tenant: int | None = None,
                stop: asyncio.Event | None = None, force: asyncio.Event | None = None,
                ready: Callable[[int], None] | None = None,
                sockets: list[socket.socket] | None = None) -> bool:
    """Serve until ``stop`` is set (default: until SIGINT/SIGTERM), then drain and close.

    The engine is neither started nor shut down here (see ``run_server``).

    Args:
        engine: A started engine.
        host: Interface to bind (unused with ``sockets``).
        port: TCP port; 0 picks a free one (reported through ``ready``).
        max_body_bytes: Request body limit (413 beyond).
        shutdown_timeout_s: How long in-flight requests may run on after the stop signal
            before they are aborted.
        api_keys: See ``create_app``.
        max_concurrency_per_tenant: See ``create_app``.
        stop: Event ending the server; None installs SIGINT/SIGTERM handlers that set it (and,
            on a second signal, ``force``).
        force: Event that, set during the drain, aborts the in-flight requests at once.
        ready: Called with the bound port once the server accepts connections.
        sockets: Bound sockets to listen on (``listen.bind_listeners``) instead of binding
            ``host``:``port`` here.

    Returns:
        True when the drain was cut short by ``force``.
    """
    app = create_app(engine, max_body_bytes=max_body_bytes, api_keys=api_keys,
                     max_concurrency_per_tenant=max_concurrency_per_tenant)
    quiet_http2_probes()  # sglang-router's gRPC probe: a 400, not a logged traceback
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=ABORT_GRACE_S)
    await runner.setup()
    engine.tokenize_pool.start()  # tokenizer copies made now, not on the first request
    force = force or asyncio.Event()
    signals = None
    if stop is None:
        stop = asyncio.Event()
        signals = ShutdownSignals(stop, force)
    try:
        for site in ([web.SockSite(runner, sock) for sock in sockets] if sockets
                     else [web.TCPSite(runner, host, port)]):
            await site.start()
        bound_port = runner.addresses[0][1]
        log.info("server_listening", url=f"http://{host}:{bound_port}", model=engine.model_name,
                 tenants=len(keys.tenant_names) if (keys := app[STATE_KEY].keys) is not None else None)
        if ready is not None:
            ready(bound_port)
        await stop.wait()
        state = app[STATE_KEY]
        if await unless_forced(drain(state, shutdown_timeout_s), force):
            return False
        state.draining = True  # forced: abort everything in flight, a short grace to answer
        aborted = state.engine.abort_all()
        log.warning("shutdown_forced_aborting", in_flight=state.in_flight, aborted_requests=aborted)
        await state.wait_idle(FORCE_GRACE_S)
        return True
    finally:
        log.info("server_stopping")
        if signals is not None:
            signals.close()
        await runner.cleanup()


def run_server(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8000, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_timeout_s: float = 30.0,
               api_keys: dict[str, Tenant] | None = None,
               max_concurrency_per_tenant: int | None = None,
               sockets: list[socket.socket] | None = None) -> bool:
    """Blocking entry point for ``radixkv serve``: start the engine, serve, shut down.

    Returns ``serve``'s answer: True when a second signal forced the exit during the drain.
    """

    async def main() -> bool:
        engine.start()
        try:
            return await serve(engine, host, port, max_body_bytes=max_body_bytes,
                               shutdown_timeout_s=shutdown_timeout_s, api_keys=api_keys,
                               max_concurrency_per_tenant=max_concurrency_per_tenant,
                               sockets=sockets)
        finally:
            await engine.shutdown()

    return asyncio.run(main())

"""The aiohttp application: OpenAI chat completions, tokenize, models, health and stats.

Routes:
    POST /v1/chat/completions  chat completion, one JSON or SSE (``stream: true``)
    GET  /v1/models            the served model
    POST /tokenize             vLLM's shape: ``{"model", "messages"}`` or ``{"prompt"}`` →
                               ``{"tokens", "count", "max_model_len"}``
    GET  /health               200 ``{"status": "ok"}``; 503 when the engine is unhealthy
    GET  /stats                ``engine.stats()`` (DESIGN.md §7)

Client disconnects: the server must run with ``handler_cancellation=True`` (``run_server``
does; aiohttp's default is False since 3.7), so a client that goes away cancels the handler
task; the cancellation reaches the engine's output iterator, which aborts the request and frees
its blocks. A write to a closed stream ends the handler the same way.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from radixkv.engine import EngineDeadError
from radixkv.server.errors import SERVER_ERROR, APIError, bad_request, error_middleware, json_response
from radixkv.server.protocol import (
    ChatRequest, parse_chat_request, parse_json_object, parse_tokenize_request,
)
from radixkv.server.responses import SSE_DONE, ChatCompletion, usage

if TYPE_CHECKING:
    from radixkv.engine import AsyncEngine, RequestOutput

def _engine_dead() -> APIError:
    return APIError(503, "the engine is not running", type=SERVER_ERROR, code="engine_dead")

log = structlog.get_logger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
ENGINE_KEY: web.AppKey[Any] = web.AppKey("radixkv_engine")
STARTED_KEY: web.AppKey[int] = web.AppKey("radixkv_started_s")


async def _read_json(request: web.Request) -> dict[str, Any]:
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"request body of {request.content_length} bytes exceeds the "
                            f"server's limit of {limit} bytes", code="request_too_large")
    raw = await request.read()  # aiohttp itself raises 413 past client_max_size (chunked)
    return parse_json_object(raw, request.content_type)


async def _tokenize_chat(engine: AsyncEngine, messages: list[dict], tools: list | None) -> list[int]:
    try:
        return await engine.tokenize_chat(messages, tools)
    except ValueError as exc:  # the chat template rejected these messages
        raise bad_request(f"could not apply the chat template: {exc}", "messages")


def _resolve_max_tokens(req: ChatRequest, body: dict, num_prompt_tokens: int,
                        engine: AsyncEngine) -> int:
    """The output cap: as requested, or what the context leaves; 400 naming the limit."""
    limit = engine.max_model_len
    if num_prompt_tokens >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; the messages "
                          f"have {num_prompt_tokens} tokens", "messages",
                          "context_length_exceeded")
    if req.max_tokens is None:
        return engine.default_max_tokens(num_prompt_tokens)
    if num_prompt_tokens + req.max_tokens > limit:
        param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
        raise bad_request(f"This model's maximum context length is {limit} tokens; you requested "
                          f"{num_prompt_tokens + req.max_tokens} tokens ({num_prompt_tokens} in "
                          f"the messages, {req.max_tokens} in the completion)", param,
                          "context_length_exceeded")
    return req.max_tokens


def _engine_value_error(exc: ValueError) -> APIError:
    """The engine refused the request (ValueError names the field first, e.g. ``prompt: ...``)."""
    msg = str(exc)
    head = msg.split(":", 1)[0]
    param = {"prompt": "messages"}.get(head, head) if head.isidentifier() else None
    return bad_request(msg, param)


async def _first_output(gen) -> RequestOutput:
    """Wait for the engine's first output; admission errors (ValueError) become 400."""
    try:
        return await gen.__anext__()
    except ValueError as exc:
        raise _engine_value_error(exc)
    except EngineDeadError:
        raise _engine_dead()
    except StopAsyncIteration:
        raise APIError(500, "the engine ended the request without output", type=SERVER_ERROR)


async def _close(gen) -> None:
    """Close the engine iterator; for an unfinished request this aborts it in the engine."""
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await aclose()


def _usage(outputs: dict[int, RequestOutput]) -> dict:
    """The prompt (and its cached tokens) once, completion tokens summed over choices."""
    first = outputs[0]
    return usage(first.num_prompt_tokens, sum(o.num_generated_tokens for o in outputs.values()),
                 first.num_cached_tokens)


async def _respond_json(completion: ChatCompletion, gen, first: RequestOutput, n: int
                        ) -> web.Response:
    texts: dict[int, list[str]] = {i: [] for i in range(n)}
    last: dict[int, RequestOutput] = {}
    out: RequestOutput | None = first
    while out is not None:
        texts[out.index].append(out.new_text)
        last[out.index] = out
        try:
            out = await gen.__anext__()
        except StopAsyncIteration:
            out = None
        except EngineDeadError:
            raise _engine_dead()
    if len(last) < n or any(o.finish_reason == "abort" for o in last.values()):
        raise APIError(503, "the request was aborted by the server", type=SERVER_ERROR,
                       code="aborted")
    choices = [("".join(texts[i]), last[i].finish_reason) for i in range(n)]
    return json_response(completion.response(choices, _usage(last)))


async def _respond_stream(request: web.Request, completion: ChatCompletion, gen,
                          first: RequestOutput, n: int) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    last: dict[int, RequestOutput] = {}
    try:
        for index in range(n):
            await resp.write(completion.role_chunk(index))
        out: RequestOutput | None = first
        while out is not None:
            last[out.index] = out
            if out.new_text:
                await resp.write(completion.content_chunk(out.new_text, out.index))
            if out.finished:
                await resp.write(completion.finish_chunk(out.finish_reason, out.index))
            try:
                out = await gen.__anext__()
            except StopAsyncIteration:
                out = None
        if completion.include_usage:
            await resp.write(completion.usage_chunk(_usage(last)))
        await resp.write(SSE_DONE)
        await resp.write_eof()
    except ConnectionResetError:
        # The client went away mid-stream; the caller's finally closes (aborts) the request.
        log.info("client_disconnected", request_id=completion.id)
    except Exception:
        # Headers are sent: report in-band, then end the stream.
        log.exception("stream_failed", request_id=completion.id)
        try:
            await resp.write(ChatCompletion.error_event("internal server error", SERVER_ERROR))
            await resp.write_eof()
        except ConnectionResetError:
            pass
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await _read_json(request)
    req = parse_chat_request(body, engine.model_name)
    if not engine.is_healthy:
        raise APIError(503, "the engine is not healthy", type=SERVER_ERROR, code="unhealthy")
    prompt = await _tokenize_chat(engine, req.messages, req.tools)
    max_tokens = _resolve_max_tokens(req, body, len(prompt), engine)
    try:
        params = req.sampling_params(max_tokens)
    except ValueError as exc:  # SamplingParams names the field first ("top_k: ...")
        raise bad_request(str(exc), str(exc).split(":", 1)[0])
    completion = ChatCompletion(model=engine.model_name, include_usage=req.include_usage)
    try:
        gen = engine.generate(prompt, params, cache_salt=req.cache_salt, request_id=completion.id)
    except ValueError as exc:
        raise _engine_value_error(exc)
    except EngineDeadError:
        raise _engine_dead()
    try:
        first = await _first_output(gen)
        if req.stream:
            return await _respond_stream(request, completion, gen, first, req.n)
        return await _respond_json(completion, gen, first, req.n)
    finally:
        await _close(gen)


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    req = parse_tokenize_request(await _read_json(request), engine.model_name)
    if req.messages is not None:
        tokens = await _tokenize_chat(engine, req.messages, req.tools)
    else:  # the engine encodes in its tokenizer thread, off the event loop
        tokens = await engine.tokenize_text(req.prompt)
    return json_response({"tokens": list(tokens), "count": len(tokens),
                          "max_model_len": engine.max_model_len})


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return json_response({"object": "list", "data": [{
        "id": engine.model_name, "object": "model", "created": request.app[STARTED_KEY],
        "owned_by": "radixkv", "max_model_len": engine.max_model_len}]})


async def health(request: web.Request) -> web.Response:
    if request.app[ENGINE_KEY].is_healthy:
        return json_response({"status": "ok"})
    return json_response({"status": "unhealthy"}, status=503)


async def stats(request: web.Request) -> web.Response:
    return json_response(request.app[ENGINE_KEY].stats())


def create_app(engine: AsyncEngine, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
               ) -> web.Application:
    """Build the application around a started engine (the caller owns its lifecycle).

    Args:
        engine: The engine serving requests; must be started before the first request.
        max_body_bytes: Largest accepted request body in bytes; larger bodies get 413.

    Returns:
        The aiohttp application. Serve it with ``handler_cancellation=True`` so that client
        disconnects abort requests (``run_server`` and ``aiohttp.test_utils`` both do).
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    app = web.Application(client_max_size=max_body_bytes, middlewares=[error_middleware])
    app[ENGINE_KEY] = engine
    app[STARTED_KEY] = int(time.time())
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    return app


async def serve(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8000, *,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_timeout_s: float = 30.0,
                stop: asyncio.Event | None = None,
                ready: Callable[[int], None] | None = None) -> None:
    """Serve until ``stop`` is set (default: until SIGINT/SIGTERM), then drain and close.

    The engine is neither started nor shut down here (see ``run_server``).

    Args:
        engine: A started engine.
        host: Interface to bind.
        port: TCP port; 0 picks a free one (reported through ``ready``).
        max_body_bytes: Request body limit (413 beyond).
        shutdown_timeout_s: How long in-flight handlers may run on after the stop signal.
        stop: Event ending the server; None installs SIGINT/SIGTERM handlers that set one.
        ready: Called with the bound port once the server accepts connections.
    """
    app = create_app(engine, max_body_bytes=max_body_bytes)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
        log.info("server_listening", url=f"http://{host}:{bound_port}", model=engine.model_name)
        if ready is not None:
            ready(bound_port)
        await stop.wait()
    finally:
        log.info("server_stopping")
        await runner.cleanup()  # stops accepting, waits up to shutdown_timeout_s for handlers


def run_server(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8000, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Blocking entry point for ``radixkv serve``: start the engine, serve, shut down."""

    async def main() -> None:
        engine.start()
        try:
            await serve(engine, host, port, max_body_bytes=max_body_bytes)
        finally:
            await engine.shutdown()

    asyncio.run(main())

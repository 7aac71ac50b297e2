"""Admission and the generate → respond flow shared by chat and text completions.

Admission, in order: a draining server answers 503 ``shutting_down``; a tenant at its
concurrency limit 429 ``rate_limit_exceeded``; a full engine queue 503 ``queue_full`` (both
with ``Retry-After``); an unhealthy engine 503. A request that passes holds one in-flight slot
(server-wide and for its tenant) until its handler ends — normally, on error, or cancelled by a
client disconnect, in which case closing the engine stream aborts the request and frees its
blocks.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from aiohttp import web

from radixkv.engine.faults import FAILED
from radixkv.errors import EngineDeadError, QueueFullError
from radixkv.server.auth import KeyStore, Tenant
from radixkv.server.errors import (
    INTERNAL_ERROR,
    SERVER_ERROR,
    APIError,
    bad_request,
    internal_error,
    json_response,
    queue_full,
    server_fault,
    shutting_down,
    tenant_limit,
)
from radixkv.server.multi_prompt import PromptAdmissionError, admit_prompts
from radixkv.server.output_memory import OutputMemory, ids_for_text, off_engine_thread
from radixkv.server.params import Sampling
from radixkv.server.prefix_memory import PrefixMemory
from radixkv.server.responses import SSE_DONE, ChatCompletion, TextCompletion, sse_event, usage
from radixkv.server.tokenization import tokenize_errors
from radixkv.server.tool_calls import ToolCallOptions, memory_key

if TYPE_CHECKING:
    from radixkv.cache.retention import RetentionBreakpoint
    from radixkv.engine.async_engine import AsyncEngine, RequestOutput, RequestStream

log = structlog.get_logger(__name__)

#: The response builder of a request (ids, chunks, the final body) for its endpoint.
ResponseShape = ChatCompletion | TextCompletion

OUTCOMES = ("stop", "length", "abort", "rejected", "overloaded", "error")
# Request-scoped key: how a completion request ended (web.RequestKey from aiohttp 3.12).
_REQUEST_KEY = getattr(web, "RequestKey", None)
OUTCOME: Any = _REQUEST_KEY("radixkv_outcome") if _REQUEST_KEY else "radixkv_outcome"


@dataclass
class ServerState:
    """Per-application admission state (event-loop thread only).

    Attributes:
        engine: The engine serving requests.
        keys: API keys, or None for a single-tenant server.
        max_concurrency_per_tenant: Most in-flight completion requests per tenant (None: no
            limit); without keys the single tenant is limited the same way.
        draining: Set on shutdown: new completion requests get 503, /health turns 503.
        in_flight: Completion requests admitted and not yet finished.
        outcomes: Completion requests by outcome (``OUTCOMES``), for /metrics.
        outputs: token ids of recent chat replies per cache salt, so that a reply sent back
            as history is tokenized as it was generated (``radixkv.server.output_memory``).
        prefixes: recent text prompts + replies of ``/v1/completions`` per cache salt, so that
            a prompt extending one reuses its ids (``radixkv.server.prefix_memory``).
    """

    engine: AsyncEngine
    keys: KeyStore | None = None
    max_concurrency_per_tenant: int | None = None
    draining: bool = False
    in_flight: int = 0
    per_tenant: dict[str | None, int] = field(default_factory=dict)
    outcomes: Counter = field(default_factory=Counter)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    outputs: OutputMemory = field(default_factory=OutputMemory)
    prefixes: PrefixMemory = field(default_factory=PrefixMemory)

    def __post_init__(self) -> None:
        self.idle.set()

    def admit(self, tenant: str | None) -> None:
        if self.draining:
            raise shutting_down()
        limit = self.max_concurrency_per_tenant
        if limit is not None and self.per_tenant.get(tenant, 0) >= limit:
            raise tenant_limit(tenant, limit)
        self.per_tenant[tenant] = self.per_tenant.get(tenant, 0) + 1
        self.in_flight += 1
        self.idle.clear()

    def release(self, tenant: str | None) -> None:
        left = self.per_tenant[tenant] - 1
        if left:
            self.per_tenant[tenant] = left
        else:
            del self.per_tenant[tenant]
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no completion request is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False


Remember = Callable[[dict[int, list[int]], dict[int, str]], Awaitable[None]]
"""``remember(ids, texts)``: per choice index, the generated token ids and the text sent."""


def remember_outputs(state: ServerState, scope: str | None, tools: ToolCallOptions | None = None,
                     prefix_ids: Sequence[int] = ()) -> Remember:
    """A ``remember`` for chat replies: ids that decode to each choice's text go into
    ``state.outputs`` under ``scope`` (the request's cache salt). Decoding runs in a worker
    thread, off the event loop.

    With ``tools``, a choice's text starts with the forced prefix (``tools.prefix``, sent to
    the engine as ``prefix_ids``), and a reply with tool calls is remembered under the
    content its returned message renders as when sent back (``tool_calls.memory_key``), so
    the next prompt holds the generated ids, calls and text after them included."""
    prefix = tools.prefix if tools is not None else ""

    def record(tokenizer: Any, ids: dict[int, list[int]], texts: dict[int, str]) -> None:
        for index, text in texts.items():
            raw = prefix + text
            key = memory_key(raw, tools)
            if key is None:
                continue
            exact = ids_for_text(tokenizer, [*prefix_ids, *ids[index]], raw,
                                 tokenizer.eos_token_ids)
            if exact is not None:
                state.outputs.record(scope, key, exact)

    return off_engine_thread(state.engine, record)


def outcome_of(err: APIError | web.HTTPException) -> str:
    status = err.status
    code = getattr(err, "code", None)
    if status == 429 or code in ("queue_full", "shutting_down"):
        return "overloaded"
    if code == "aborted":
        return "abort"
    return "rejected" if status < 500 else "error"


def counted(state_of: Callable[[web.Request], ServerState],
            handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Wrap a completion handler so that every request is counted once by outcome."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        outcomes = state_of(request).outcomes
        try:
            resp = await handler(request)
        except (APIError, web.HTTPException) as err:
            outcomes[outcome_of(err)] += 1
            raise
        except asyncio.CancelledError:  # the client went away
            outcomes["abort"] += 1
            raise
        except Exception:
            outcomes["error"] += 1
            raise
        outcomes[request.get(OUTCOME, "stop")] += 1
        return resp

    return wrapped


def engine_dead() -> APIError:
    return APIError(503, "the engine is not running", type=SERVER_ERROR, code="engine_dead")


# What a client learns of an engine-side fault of its request (details are in the log).
ENGINE_FAULT_MESSAGE = "the request failed in the engine; other requests are unaffected"


def engine_value_error(exc: ValueError, prompt_param: str) -> APIError:
    """The engine refused the request (ValueError names the field first, e.g. ``prompt: ...``,
    or one prompt token, ``prompt[3]: ...``: under ``/v1/completions`` that is the param)."""
    msg = str(exc)
    head = msg.split(":", 1)[0]
    code = "context_length_exceeded" if "maximum context length" in msg else None
    if head.isidentifier():
        param: str | None = prompt_param if head == "prompt" else head
    elif re.fullmatch(r"prompt\[\d+\]", head):
        if prompt_param.startswith("prompt"):  # the ids sit at prompt[i] or prompt[0][i]
            param = prompt_param + head[len("prompt"):]
            msg = param + msg[len(head):]
        else:
            param = prompt_param
    else:
        param = "max_tokens" if code else None
    return bad_request(msg, param, code)


def resolve_max_tokens(requested: int | None, default: int | None, param: str,
                       num_prompt_tokens: int, engine: AsyncEngine, prompt_param: str) -> int:
    """The output cap: as requested, else ``default`` (None: what the context leaves), within
    the context; 400 ``context_length_exceeded`` naming the limit otherwise."""
    limit = engine.max_model_len
    if num_prompt_tokens >= limit:
        verb = "have" if prompt_param == "messages" else "has"  # or prompt / prompt[i]
        raise bad_request(f"This model's maximum context length is {limit} tokens; the "
                          f"{prompt_param} {verb} {num_prompt_tokens} tokens", prompt_param,
                          "context_length_exceeded")
    room = engine.default_max_tokens(num_prompt_tokens)
    if requested is None:
        return room if default is None else max(1, min(default, room))
    if num_prompt_tokens + requested > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; you requested "
                          f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                          f"{prompt_param}, {requested} in the completion)", param,
                          "context_length_exceeded")
    return requested


async def generate_response(request: web.Request, state: ServerState, shape: ResponseShape, *,
                            prompt: list[int], sampling: Sampling, max_tokens: int,
                            tenant: Tenant | None, cache_salt: str | None, prompt_param: str,
                            remember: Remember | None = None,
                            lora_name: str | None = None,
                            batch: Sequence[tuple[list[int], str]] = (),
                            echo_prompts: Sequence[int] = (),
                            session_key: str | None = None,
                            retention: Sequence[RetentionBreakpoint] | None = None
                            ) -> web.StreamResponse:
    """Run and answer one admitted completion request (JSON or SSE per ``sampling.stream``).

    ``shape`` is a ``ChatCompletion`` or ``TextCompletion`` (ids, chunk and body builders);
    ``remember``: awaited with each choice's generated ids and text once all choices finished
    (not aborted), before the response ends, so the client's next turn finds them;
    ``lora_name``: the LoRA adapter to run with (None: the base model);
    ``batch``: several prompts as ``(token ids, body path)``, one engine request each
    (``radixkv.server.multi_prompt``), in place of ``prompt`` / ``prompt_param``: choice
    ``p * n + j`` is prompt ``p``'s ``j``-th, and a refused prompt's 400 names its path;
    ``echo_prompts``: indexes of prompts (into ``batch``, else 0) whose ids' text goes into
    ``shape.echoes[p]`` once the engine accepted them;
    ``session_key``: the request's session hint for the eviction policy (``prompt_cache_key``
    / ``user``), handed to every engine request it makes;
    ``retention``: the engine's retention breakpoints for every engine request it makes (None:
    ``sampling.retention``, i.e. ``prompt_cache_retention``). When there are any, the body
    (streamed: the ``include_usage`` chunk) carries the top-level extension
    ``"radixkv": {"num_retained_tokens", "cache_creation_tokens"}`` (``retention_report``).
    """
    engine = state.engine
    retain = tuple(sampling.retention if retention is None else retention)
    try:
        params = sampling.sampling_params(max_tokens)
    except ValueError as exc:  # SamplingParams names the field first ("top_k: ...")
        raise bad_request(str(exc), str(exc).split(":", 1)[0]) from exc
    runs = list(batch) or [(prompt, prompt_param)]
    try:
        gen = admit_prompts(engine, [ids for ids, _ in runs], params, request_id=shape.id,
                            param_names=[name for _, name in runs], cache_salt=cache_salt,
                            tenant=tenant.name if tenant is not None else None,
                            lora_name=lora_name, session_key=session_key, retention=retain)
    except PromptAdmissionError as err:
        cause, prompt_param = err.cause, err.prompt_param
        if isinstance(cause, QueueFullError):
            if len(runs) > 1:
                raise queue_full(f"{prompt_param}: {cause}") from cause
            raise queue_full(str(cause)) from cause
        if isinstance(cause, ValueError):
            raise engine_value_error(cause, prompt_param) from cause
        if isinstance(cause, EngineDeadError):
            raise engine_dead() from cause
        raise cause from None
    # Pairs the client's X-Request-Id (bound in the log context) with the engine's id, which
    # the engine thread's own lines (aborts, preemptions, faults) carry as request_id.
    log.info("request_admitted", completion_id=shape.id, num_prompts=len(runs))
    try:
        with tokenize_errors():  # decoded once the engine has checked the ids
            for p in echo_prompts:  # (echo: a /v1/completions field)
                assert isinstance(shape, TextCompletion)
                shape.echoes[p] = await engine.detokenize(runs[p][0], skip_special_tokens=False)
        first = await _first_output(gen)
        n = sampling.n * len(runs)
        if sampling.stream:
            return await _respond_stream(request, shape, gen, first, n, remember, bool(retain))
        return await _respond_json(request, shape, gen, first, n, remember, bool(retain))
    finally:
        gen.close()


async def _first_output(gen: RequestStream) -> RequestOutput:
    """Wait for the engine's first output (its admission errors were raised by ``generate``);
    a fault of the request's own in the engine (``finish_reason == "error"``) is a 500
    ``internal_error`` (before any stream started: a stream's later faults are in-band, see
    ``_respond_stream``).
    """
    try:
        out = await gen.__anext__()
    except EngineDeadError as exc:
        raise engine_dead() from exc
    except StopAsyncIteration:
        raise internal_error("the engine ended the request without output") from None
    if out.finish_reason == FAILED:
        raise internal_error(ENGINE_FAULT_MESSAGE)
    return out


def _usage(outputs: dict[int, RequestOutput]) -> dict:
    """Each prompt (and its cached tokens) once, summed over prompts (one engine request
    each); completion tokens summed over all choices."""
    per_request: dict[str, RequestOutput] = {}
    for o in outputs.values():
        per_request.setdefault(o.request_id, o)
    return usage(sum(o.num_prompt_tokens for o in per_request.values()),
                 sum(o.num_generated_tokens for o in outputs.values()),
                 sum(o.num_cached_tokens for o in per_request.values()))


def retention_report(outputs: dict[int, RequestOutput]) -> dict[str, int]:
    """The ``radixkv`` response extension of a request that asked for retention, from each
    choice's last output.

    Returns:
        ``{"num_retained_tokens", "cache_creation_tokens"}``: tokens of each prompt's sequence
        under a live retention once it finished (block-aligned; for ``n > 1`` the most of any
        of the prompt's choices), and prompt tokens this request newly retained (never those
        served from the cache, so ``cached_tokens + cache_creation_tokens <= prompt_tokens``),
        each summed over the request's prompts (one engine request each).
    """
    retained: dict[str, int] = {}
    created: dict[str, int] = {}
    for o in outputs.values():
        retained[o.request_id] = max(retained.get(o.request_id, 0), o.num_retained_tokens)
        created[o.request_id] = max(created.get(o.request_id, 0),
                                    sum(o.cache_creation_tokens_by_ttl.values()))
    return {"num_retained_tokens": sum(retained.values()),
            "cache_creation_tokens": sum(created.values())}


def _usage_event(shape: ResponseShape, last: dict[int, RequestOutput], report: bool) -> bytes:
    """The ``include_usage`` chunk, with the ``radixkv`` extension when ``report``."""
    event = shape.usage_chunk(_usage(last))
    if not report:
        return event
    payload = orjson.loads(event[len(b"data: "):])  # one event: b"data: {json}\n\n"
    return sse_event({**payload, "radixkv": retention_report(last)})


def _finish_outcome(last: dict[int, RequestOutput]) -> str:
    reasons = {o.finish_reason for o in last.values()}
    return "abort" if "abort" in reasons else "length" if "length" in reasons else "stop"


async def _respond_json(request: web.Request, shape: ResponseShape, gen: RequestStream,
                        first: RequestOutput, n: int, remember: Remember | None,
                        report: bool = False) -> web.Response:
    texts: dict[int, list[str]] = {i: [] for i in range(n)}
    ids: dict[int, list[int]] = {i: [] for i in range(n)}
    last: dict[int, RequestOutput] = {}
    out: RequestOutput | None = first
    while out is not None:
        texts[out.index].append(out.new_text)
        ids[out.index] += out.new_token_ids
        last[out.index] = out
        try:
            out = await gen.__anext__()
        except StopAsyncIteration:
            out = None
        except EngineDeadError as exc:
            raise engine_dead() from exc
    if any(o.finish_reason == FAILED for o in last.values()):
        raise internal_error(ENGINE_FAULT_MESSAGE)
    if len(last) < n or any(o.finish_reason == "abort" for o in last.values()):
        raise APIError(503, "the request was aborted by the server", type=SERVER_ERROR,
                       code="aborted")
    request[OUTCOME] = _finish_outcome(last)
    choices = [("".join(texts[i]), last[i].finish_reason) for i in range(n)]
    if remember is not None:
        await remember(ids, {i: text for i, (text, _) in enumerate(choices)})
    extra = {"token_ids": ids} if getattr(shape, "return_token_ids", False) else {}
    body = shape.response(choices, _usage(last), **extra)
    if report:
        body["radixkv"] = retention_report(last)
    return json_response(body)


async def _respond_stream(request: web.Request, shape: ResponseShape, gen: RequestStream,
                          first: RequestOutput, n: int, remember: Remember | None,
                          report: bool = False) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    last: dict[int, RequestOutput] = {}
    texts: dict[int, list[str]] = {i: [] for i in range(n)}
    ids: dict[int, list[int]] = {i: [] for i in range(n)}
    wants_ids = getattr(shape, "return_token_ids", False)  # vLLM's per-chunk token_ids
    try:
        # Inside the try: a client that went away during prefill makes the headers' write
        # raise ConnectionResetError, which is the client leaving, not a server fault.
        await resp.prepare(request)
        for index in range(n):
            head = shape.role_chunk(index)
            if head:
                await resp.write(head)
        out: RequestOutput | None = first
        while out is not None:
            if out.finish_reason == "abort":
                request[OUTCOME] = "abort"
                await resp.write(shape.error_event("the request was aborted by the server",
                                                   SERVER_ERROR, "aborted"))
                break
            if out.finish_reason == FAILED:  # the engine logged and counted it
                request[OUTCOME] = "error"
                await resp.write(shape.error_event(ENGINE_FAULT_MESSAGE, SERVER_ERROR,
                                                   INTERNAL_ERROR))
                break
            last[out.index] = out
            texts[out.index].append(out.new_text)
            ids[out.index] += out.new_token_ids
            if out.new_text or (wants_ids and out.new_token_ids):
                extra = {"token_ids": out.new_token_ids} if wants_ids else {}
                await resp.write(shape.content_chunk(out.new_text, out.index, **extra))
            if out.finished:
                await resp.write(shape.finish_chunk(out.finish_reason, out.index))
            try:
                out = await gen.__anext__()
            except StopAsyncIteration:
                out = None
        else:
            request[OUTCOME] = _finish_outcome(last)
            if remember is not None and len(last) == n:
                await remember(ids, {i: "".join(t) for i, t in texts.items()})
            if shape.include_usage:
                await resp.write(_usage_event(shape, last, report))
        await resp.write(SSE_DONE)
        await resp.write_eof()
    except ConnectionResetError:
        # The client went away mid-stream; the caller's finally closes (aborts) the request.
        request[OUTCOME] = "abort"
        log.info("client_disconnected", request_id=shape.id)
    except Exception as exc:
        # Headers are sent: report in-band (error event, then [DONE]), then end the stream.
        request[OUTCOME] = "error"
        if isinstance(exc, EngineDeadError):
            log.warning("engine_dead_mid_stream", request_id=shape.id)
            err = engine_dead()
        else:  # logged with its traceback and counted as a server fault
            err = server_fault(request, "stream_failed", completion_id=shape.id)
        try:
            await resp.write(shape.error_event(err.message, err.type, err.code))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except (ConnectionResetError, RuntimeError):  # the transport is gone already
            pass
    return resp

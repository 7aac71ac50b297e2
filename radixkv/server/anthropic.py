"""The Anthropic Messages API: ``POST /v1/messages`` (JSON or SSE) and ``/v1/messages/count_tokens``.

A request is validated and translated to its OpenAI chat equivalent
(``radixkv.server.anthropic_protocol``), rendered by the chat route's own code
(``radixkv.server.prompts.chat_prompt``: the same template, tool rendering, forced tool-call
start and spliced ids of the model's earlier replies), so it runs exactly the token ids the
equivalent ``/v1/chat/completions`` request runs and shares its cache. Replies are read for
tool calls by the same parser (``radixkv.server.tool_calls``) and remembered by the same
``OutputMemory``, so a ``tool_use`` the model produced, sent back on the next turn, extends the
prompt token for token.

Retention: each ``cache_control`` breakpoint becomes ``RetentionBreakpoint(n, ttl)``, ``n`` the
tokens the request cut right after the breakpoint's block renders to in common with the prompt
(``breakpoint_prefixes``; a cut the template refuses, e.g. Llama 3.x's tools without a user
turn, is rendered with an empty user turn appended, and a breakpoint neither renders is left
out: retention never fails a request). Usage, from the engine's output:
``cache_read_input_tokens`` = tokens served from the cache, ``cache_creation_input_tokens`` =
prompt tokens this request newly retained (per TTL in ``cache_creation``),
``input_tokens`` = the rest; the three add up to the prompt's tokens.

Responses (Anthropic's shapes): a ``message`` object ``{id, type, role, model, content,
stop_reason, stop_sequence, usage}``; streamed, the events ``message_start``, ``ping``, per
content block ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (``stop_reason``,
``stop_sequence``, cumulative ``usage``) and ``message_stop``. ``stop_reason``: ``tool_use``
when the reply holds a tool call, ``max_tokens`` when the output cap cut it, ``stop_sequence``
when a stop sequence ended it (``stop_sequence`` says which), ``end_turn`` otherwise. Errors
are Anthropic's (``radixkv.server.errors.anthropic_error``), in-band ``error`` events once a
stream has started.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from aiohttp import web

from radixkv.cache.retention import RetentionBreakpoint
from radixkv.engine.faults import FAILED
from radixkv.engine.tokenize_pool import CONTEXT_KEY, pool_key
from radixkv.errors import EngineDeadError, QueueFullError
from radixkv.server import adapters
from radixkv.server.anthropic_protocol import (
    Breakpoint,
    MessagesRequest,
    parse_count_tokens_request,
    parse_messages_request,
    truncated_chat,
)
from radixkv.server.auth import Tenant, cache_salt_for
from radixkv.server.errors import (
    SERVER_ERROR,
    APIError,
    anthropic_error,
    bad_request,
    internal_error,
    json_response,
    queue_full,
    server_fault,
)
from radixkv.server.generation import (
    ENGINE_FAULT_MESSAGE,
    OUTCOME,
    engine_dead,
    engine_value_error,
    remember_outputs,
)
from radixkv.server.prompts import ChatPrompt, chat_prompt
from radixkv.server.tokenization import tokenize_errors
from radixkv.server.tool_calls import ToolCallOptions, ToolCallStream, parse_reply

if TYPE_CHECKING:
    from radixkv.engine.async_engine import AsyncEngine, RequestOutput, RequestStream
    from radixkv.server.generation import ServerState

log = structlog.get_logger(__name__)

__all__ = ["AnthropicMessage", "breakpoint_prefixes", "count_tokens", "create_message",
           "message_usage"]


def new_message_id() -> str:
    """``msg_<24 hex digits>``."""
    return f"msg_{uuid.uuid4().hex[:24]}"


def new_tool_use_id() -> str:
    """``toolu_<24 hex digits>``."""
    return f"toolu_{uuid.uuid4().hex[:24]}"


def message_usage(out: RequestOutput) -> dict[str, Any]:
    """Anthropic's ``usage`` of a request from its (last) engine output.

    ``cache_read_input_tokens`` = ``num_cached_tokens``; ``cache_creation_input_tokens`` = the
    prompt tokens newly retained at the request's breakpoints (all TTL classes; split in
    ``cache_creation`` by 5m / 1h); ``input_tokens`` = the prompt's other tokens, so
    ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens`` is the prompt's
    length in tokens; ``output_tokens`` = tokens generated.
    """
    by_ttl: dict[str, int] = getattr(out, "cache_creation_tokens_by_ttl", None) or {}
    created = sum(by_ttl.values())
    return {"input_tokens": out.num_prompt_tokens - out.num_cached_tokens - created,
            "cache_creation_input_tokens": created,
            "cache_read_input_tokens": out.num_cached_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": by_ttl.get("5m", 0),
                               "ephemeral_1h_input_tokens": by_ttl.get("1h", 0)},
            "output_tokens": out.num_generated_tokens}


def sse(event: str, payload: dict[str, Any]) -> bytes:
    """One Anthropic server-sent event: ``event: <type>`` and its JSON ``data``."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:  # parse_call only returns JSON arguments; kept as text otherwise
        return arguments


@dataclass
class AnthropicMessage:
    """One ``message`` response or stream: its id, content blocks and events.

    Attributes:
        model: The model id echoed in the body.
        tools: How the reply is read for tool calls (None: plain text).
        id: ``msg_<hex>``; also the engine request id.
    """

    model: str
    tools: ToolCallOptions | None = None
    id: str = field(default_factory=new_message_id)
    _stream: ToolCallStream | None = field(default=None, repr=False)
    _num_blocks: int = 0
    _open_text: bool = False
    called: bool = False

    def body(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None,
             usage: dict) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage}

    def content(self, text: str) -> list[dict]:
        """The content blocks of a whole reply (generated ``text``, forced prefix not
        included): its text (if any), then one ``tool_use`` block per call."""
        if self.tools is None:
            return [{"type": "text", "text": text}] if text else []
        reply = parse_reply(self.tools.prefix + text, self.tools.parallel)
        if not reply.calls:
            return [{"type": "text", "text": reply.content}] if reply.content else []
        self.called = True
        blocks = [{"type": "text", "text": reply.content}] if reply.content else []
        return blocks + [{"type": "tool_use", "id": new_tool_use_id(), "name": c.name,
                          "input": _tool_input(c.arguments)} for c in reply.calls]

    # ---------------------------------------------------------------- stream events
    def start_events(self, usage: dict) -> bytes:
        """``message_start`` (empty content, the prompt's usage) and a ``ping``."""
        message = self.body([], None, None, {**usage, "output_tokens": 0})
        return (sse("message_start", {"type": "message_start", "message": message})
                + sse("ping", {"type": "ping"}))

    def _close_text(self) -> bytes:
        if not self._open_text:
            return b""
        self._open_text = False
        self._num_blocks += 1
        return sse("content_block_stop", {"type": "content_block_stop",
                                          "index": self._num_blocks - 1})

    def _text_events(self, text: str) -> bytes:
        if not text:
            return b""
        head = b""
        if not self._open_text:
            self._open_text = True
            head = sse("content_block_start", {"type": "content_block_start",
                                               "index": self._num_blocks,
                                               "content_block": {"type": "text", "text": ""}})
        return head + sse("content_block_delta", {"type": "content_block_delta",
                                                  "index": self._num_blocks,
                                                  "delta": {"type": "text_delta", "text": text}})

    def _call_events(self, name: str, arguments: str) -> bytes:
        self.called = True
        out = self._close_text()
        index = self._num_blocks
        self._num_blocks += 1
        return out + b"".join((
            sse("content_block_start", {"type": "content_block_start", "index": index,
                                        "content_block": {"type": "tool_use",
                                                          "id": new_tool_use_id(), "name": name,
                                                          "input": {}}}),
            sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                        "delta": {"type": "input_json_delta",
                                                  "partial_json": arguments}}),
            sse("content_block_stop", {"type": "content_block_stop", "index": index})))

    def _parsed(self, events: list) -> bytes:
        out = []
        for kind, value in events:
            if kind == "content":
                out.append(self._text_events(value))
            else:
                _, call = value
                out.append(self._call_events(call.name, call.arguments))
        return b"".join(out)

    def content_events(self, text: str) -> bytes:
        """The events for a piece of generated text (b"" while it is held back)."""
        if self.tools is None:
            return self._text_events(text)
        if self._stream is None:
            self._stream = ToolCallStream(parallel=self.tools.parallel)
            self._stream.feed(self.tools.prefix)  # a forced prefix alone decides nothing
        return self._parsed(self._stream.feed(text))

    def finish_events(self) -> bytes:
        """Held text flushed and the open block closed."""
        out = self._parsed(self._stream.finish()) if self._stream is not None else b""
        return out + self._close_text()

    @staticmethod
    def end_events(stop_reason: str | None, stop_sequence: str | None, usage: dict) -> bytes:
        """``message_delta`` (stop reason, cumulative usage) and ``message_stop``."""
        delta_usage = {k: v for k, v in usage.items() if k != "cache_creation"}
        return (sse("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop_reason,
                                                "stop_sequence": stop_sequence},
                                      "usage": delta_usage})
                + sse("message_stop", {"type": "message_stop"}))

    @staticmethod
    def error_event(err: APIError) -> bytes:
        """An error after the stream started (status already sent)."""
        _, body = anthropic_error(err)
        return sse("error", body)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


#: Appended to a cut the template refuses to render on its own (Llama 3.1-3.3 put the tools in
#: the first user turn and raise when there is none): its tokens differ from the prompt's from
#: the user turn's content on, so the common prefix still ends at the breakpoint's block.
PLACEHOLDER_TURN: dict[str, Any] = {"role": "user", "content": ""}


def _cut(req: MessagesRequest, bp: Breakpoint) -> tuple[list[dict], list[dict] | None] | None:
    try:
        return truncated_chat(req, bp)
    except APIError as exc:  # not seen for a valid body; the breakpoint is left out
        log.warning("breakpoint_not_placed", path=bp.path, error=exc.message)
        return None


def _render_cut(tok: Any, cut: tuple[list[dict], list[dict] | None] | None,
                known_outputs: Any) -> tuple[list[int] | None, bool]:
    """``(ids, placeholder used)`` of a cut rendered without a generation prompt: as it is,
    else with ``PLACEHOLDER_TURN`` appended; ids None when the template refuses both."""
    if cut is None:
        return None, False
    messages, tools = cut
    for placeholder, chat in ((False, messages), (True, [*messages, PLACEHOLDER_TURN])):
        try:
            return tok.apply_chat_template(chat, tools, add_generation_prompt=False,
                                           known_outputs=known_outputs), placeholder
        except (ValueError, RecursionError):  # the template refused this chat
            continue
    return None, False


async def breakpoint_prefixes(engine: AsyncEngine, req: MessagesRequest, prompt_ids: list[int],
                              known_outputs: Any) -> list[int]:
    """Per breakpoint of ``req``, the prompt tokens up to the end of its block: the common
    prefix of ``prompt_ids`` with the request cut after that block
    (``anthropic_protocol.truncated_chat``), rendered without a generation prompt on the
    tokenizer pool, with the same remembered replies (``known_outputs``).

    A cut the template refuses (an exception while rendering: Llama 3.x's template raises for
    tools without a user turn after the system turn, which a tool or system breakpoint's cut
    is) is rendered again with ``PLACEHOLDER_TURN`` appended; a breakpoint whose cut renders
    neither way gets 0 tokens (left out: nothing retained for it). Retention never fails a
    valid request.

    Returns:
        One token count per breakpoint, in ``req.breakpoints`` order (0: none).

    Raises:
        APIError: 503 ``queue_full`` (the tokenizer pool is full).
    """
    if not req.breakpoints:
        return []
    cuts = [_cut(req, bp) for bp in req.breakpoints]

    def render(tok: Any) -> list[tuple[list[int] | None, bool]]:
        return [_render_cut(tok, cut, known_outputs) for cut in cuts]

    with tokenize_errors():
        rendered = await engine.tokenize_pool.run(render, key=pool_key(CONTEXT_KEY))
    out = []
    for bp, (ids, placeholder) in zip(req.breakpoints, rendered):
        if ids is None:
            log.info("breakpoint_left_out", path=bp.path,
                     reason="the chat template refused its cut")
        elif placeholder:
            log.debug("breakpoint_cut_with_placeholder_turn", path=bp.path)
        out.append(_lcp(prompt_ids, ids) if ids is not None else 0)
    return out


async def _prompt(state: ServerState, req: MessagesRequest, salt: str | None) -> ChatPrompt:
    return await chat_prompt(state, req.chat, {}, salt)


async def count_tokens(request: web.Request, state: ServerState, tenant: Tenant | None,
                       body: dict[str, Any]) -> web.Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, N the prompt tokens the
    same ``/v1/messages`` request would run (forced tool-call start included)."""
    engine = state.engine
    req = parse_count_tokens_request(body, adapters.model_names(engine))
    salt = cache_salt_for(tenant, req.chat.cache_salt)
    prompt = await _prompt(state, req, salt)
    return json_response({"input_tokens": len(prompt.ids)})


async def create_message(request: web.Request, state: ServerState, tenant: Tenant | None,
                         body: dict[str, Any]) -> web.StreamResponse:
    """``POST /v1/messages`` for an admitted request (``radixkv.server.app``)."""
    engine = state.engine
    req = parse_messages_request(body, adapters.model_names(engine))
    lora = adapters.selected_lora(body, engine)
    salt = cache_salt_for(tenant, req.chat.cache_salt)
    prompt = await _prompt(state, req, salt)
    prefixes = await breakpoint_prefixes(engine, req, prompt.ids, state.outputs.lookup_in(salt))
    retention = tuple(RetentionBreakpoint(n, bp.ttl)
                      for n, bp in zip(prefixes, req.breakpoints) if n >= 1)
    adapters.require_lora(engine, lora)  # may have been unloaded while tokenizing
    shape = AnthropicMessage(model=lora or engine.model_name, tools=prompt.tools)
    try:
        params = req.chat.sampling_params(prompt.max_tokens)
    except ValueError as exc:  # SamplingParams names the field first ("top_k: ...")
        raise bad_request(str(exc), str(exc).split(":", 1)[0]) from exc
    try:
        gen = engine.generate(prompt.ids, params, cache_salt=salt, request_id=shape.id,
                              tenant=tenant.name if tenant is not None else None,
                              lora_name=lora, session_key=req.chat.session_key,
                              retention=retention)
    except QueueFullError as exc:
        raise queue_full(str(exc)) from exc
    except EngineDeadError as exc:
        raise engine_dead() from exc
    except ValueError as exc:
        raise engine_value_error(exc, "messages") from exc
    log.info("request_admitted", completion_id=shape.id, num_prompts=1,
             num_breakpoints=len(retention))
    run = _Run(request, state, shape, req, prompt, salt, gen)
    try:
        first = await run.first()
        if req.chat.stream:
            return await run.stream(first)
        return await run.json(first)
    finally:
        gen.close()


@dataclass
class _Run:
    """One admitted message request's engine stream and what it produced so far."""

    request: web.Request
    state: ServerState
    shape: AnthropicMessage
    req: MessagesRequest
    prompt: ChatPrompt
    salt: str | None
    gen: RequestStream
    ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    async def first(self) -> RequestOutput:
        try:
            out = await self.gen.__anext__()
        except EngineDeadError as exc:
            raise engine_dead() from exc
        except StopAsyncIteration:
            raise internal_error("the engine ended the request without output") from None
        if out.finish_reason == FAILED:
            raise internal_error(ENGINE_FAULT_MESSAGE)
        return out

    async def _next(self) -> RequestOutput | None:
        try:
            return await self.gen.__anext__()
        except StopAsyncIteration:
            return None

    def _add(self, out: RequestOutput) -> None:
        self.ids += out.new_token_ids
        self.texts.append(out.new_text)

    async def _stop(self, last: RequestOutput) -> tuple[str, str | None]:
        """``(stop_reason, stop_sequence)`` of the finished reply."""
        if self.shape.called:
            return "tool_use", None
        if last.finish_reason == "length":
            return "max_tokens", None
        stops = self.req.stop_sequences
        eos = self.state.engine.tokenizer.eos_token_ids
        if not stops or (self.ids and self.ids[-1] in eos):
            return "end_turn", None
        # A stop sequence ended it: the text sent is cut right before it.
        with tokenize_errors():
            full = await self.state.engine.detokenize(self.ids)
        rest = full[len("".join(self.texts)):]
        found = [(rest.find(s), k) for k, s in enumerate(stops) if s in rest]
        if not found:
            return "end_turn", None
        return "stop_sequence", stops[min(found)[1]]

    async def _remember(self) -> None:
        remember = remember_outputs(self.state, self.salt, self.prompt.tools, self.prompt.forced)
        await remember({0: self.ids}, {0: "".join(self.texts)})

    async def json(self, first: RequestOutput) -> web.Response:
        out: RequestOutput | None = first
        last = first
        while out is not None:
            self._add(out)
            last = out
            try:
                out = await self._next()
            except EngineDeadError as exc:
                raise engine_dead() from exc
        if last.finish_reason == FAILED:
            raise internal_error(ENGINE_FAULT_MESSAGE)
        if not last.finished or last.finish_reason == "abort":
            raise APIError(503, "the request was aborted by the server", type=SERVER_ERROR,
                           code="aborted")
        self.request[OUTCOME] = "length" if last.finish_reason == "length" else "stop"
        text = "".join(self.texts)
        content = self.shape.content(text)
        stop_reason, stop_sequence = await self._stop(last)
        await self._remember()
        return json_response(self.shape.body(content, stop_reason, stop_sequence,
                                             message_usage(last)))

    async def stream(self, first: RequestOutput) -> web.StreamResponse:
        request, shape = self.request, self.shape
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        try:
            await resp.prepare(request)  # raises ConnectionResetError for a client gone
            await resp.write(shape.start_events(message_usage(first)))
            out: RequestOutput | None = first
            last = first
            while out is not None:
                if out.finish_reason == "abort":
                    request[OUTCOME] = "abort"
                    await resp.write(shape.error_event(APIError(
                        503, "the request was aborted by the server", type=SERVER_ERROR,
                        code="aborted")))
                    break
                if out.finish_reason == FAILED:  # the engine logged and counted it
                    request[OUTCOME] = "error"
                    await resp.write(shape.error_event(internal_error(ENGINE_FAULT_MESSAGE)))
                    break
                self._add(out)
                last = out
                if out.new_text:
                    await resp.write(shape.content_events(out.new_text))
                out = await self._next()
            else:
                request[OUTCOME] = "length" if last.finish_reason == "length" else "stop"
                await resp.write(shape.finish_events())
                stop_reason, stop_sequence = await self._stop(last)
                await self._remember()
                await resp.write(shape.end_events(stop_reason, stop_sequence,
                                                  message_usage(last)))
            await resp.write_eof()
        except ConnectionResetError:
            request[OUTCOME] = "abort"
            log.info("client_disconnected", request_id=shape.id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            request[OUTCOME] = "error"
            if isinstance(exc, EngineDeadError):
                log.warning("engine_dead_mid_stream", request_id=shape.id)
                err = engine_dead()
            else:  # logged with its traceback and counted as a server fault
                err = server_fault(request, "stream_failed", completion_id=shape.id)
            try:
                await resp.write(shape.error_event(err))
                await resp.write_eof()
            except (ConnectionResetError, RuntimeError):  # the transport is gone already
                pass
        return resp


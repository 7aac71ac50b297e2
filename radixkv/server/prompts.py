"""The prompt ids a completion request runs, computed once for generation and for ``/render``.

``chat_prompt`` and ``completion_prompts`` are the only code that turns a validated request
into the token ids the engine runs: the chat and completions handlers call them before
generating, the render endpoints call them and answer with the ids. So a router that asks
``/render`` for a request's ids gets exactly what the replica would run for it: the same chat
template, tool rendering and ``chat_template_kwargs``, the model's earlier replies spliced in
by their generated ids (``radixkv.server.output_memory``), a forced tool call's start
(``tool_choice`` required / named), text-append reuse for ``/v1/completions``
(``radixkv.server.prefix_memory``), all under the request's cache salt (the tenant's, narrowed
by the client's ``cache_salt``). Rendering runs on the engine's tokenizer pool only, never the
engine.

Routes (vLLM 0.33's shapes; vllm-router's ``cache_aware`` / ``kv_aware`` call them on every
request, docs/routers-and-kv-events.md §2.5):

    POST /v1/chat/completions/render  a chat body → ``{"token_ids": [...]}``
    POST /v1/completions/render       a completions body → ``[{"token_ids": [...]}, ...]``,
                                      one entry per prompt (token-id prompts as sent)

Both take every field their generation endpoint takes (the same parameter policy and model
selection) and refuse a bad body with the same 4xx, context-length checks included.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from radixkv.config import check_token_ids
from radixkv.server import adapters, param_policy
from radixkv.server.auth import REQUEST_TENANT, cache_salt_for
from radixkv.server.completions import (
    DEFAULT_MAX_TOKENS,
    CompletionRequest,
    PromptInput,
    parse_completion_request,
)
from radixkv.server.errors import bad_request, json_response
from radixkv.server.generation import resolve_max_tokens
from radixkv.server.prefix_memory import tokenize_with_memory
from radixkv.server.protocol import ChatRequest, parse_chat_request
from radixkv.server.tokenization import check_texts_fit, tokenize_chat, tokenize_errors, tokenize_text
from radixkv.server.tool_calls import ToolCallOptions, options_for

if TYPE_CHECKING:
    from radixkv.server.generation import ServerState

__all__ = ["ChatPrompt", "CompletionPrompts", "chat_prompt", "completion_prompts", "render_routes"]


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat request sends to the engine.

    Attributes:
        ids: The whole prompt: the templated chat, then ``forced``.
        forced: The ids of a forced tool call's start (empty unless ``tool_choice`` is
            ``required`` or names a function); the reply's text begins with it.
        tools: How replies are read for tool calls, or None for plain text.
        max_tokens: The resolved output cap in tokens.
    """

    ids: list[int]
    forced: list[int]
    tools: ToolCallOptions | None
    max_tokens: int


async def chat_prompt(state: ServerState, req: ChatRequest, body: dict[str, Any],
                      salt: str | None) -> ChatPrompt:
    """The prompt ids of a validated chat request under cache salt ``salt``.

    Raises:
        APIError: 400 ``messages`` (template, context length), 400 naming ``max_tokens`` /
            ``max_completion_tokens`` when prompt + cap exceed the context, 503 ``queue_full``.
    """
    engine = state.engine
    # The model's own earlier replies keep their generated ids (radixkv.server.output_memory).
    # Refused from a size bound before tokenizing when it cannot fit (radixkv.server.tokenization).
    prompt = await tokenize_chat(engine, req.messages, req.tools, state.outputs.lookup_in(salt),
                                 template_kwargs=req.chat_template_kwargs)
    # Replies are read for tool calls; a forced call's start ends the prompt (tool_calls.py).
    tools = options_for(req, engine.tokenizer.chat_template)
    forced = await tokenize_text(engine, tools.prefix, fit=False) if tools and tools.prefix else []
    param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    max_tokens = resolve_max_tokens(req.max_tokens, None, param, len(prompt) + len(forced), engine,
                                    "messages")
    return ChatPrompt(prompt + forced, forced, tools, max_tokens)


@dataclass(frozen=True)
class CompletionPrompts:
    """What a completions request sends to the engine: one id list per prompt.

    Attributes:
        prompts: The request's prompts (text or ids, with their body paths).
        ids: Each prompt's token ids, in order.
        max_tokens: The resolved output cap (the smallest any prompt allows).
    """

    prompts: tuple[PromptInput, ...]
    ids: list[list[int]]
    max_tokens: int


async def completion_prompts(state: ServerState, req: CompletionRequest,
                             salt: str | None) -> CompletionPrompts:
    """The prompt ids of a validated completions request under cache salt ``salt``: token-id
    prompts as sent, text prompts extending a remembered prompt + reply as its ids followed
    by the rest encoded (``radixkv.server.prefix_memory``), other texts encoded plainly.

    Raises:
        APIError: 400 naming the prompt for an empty one or an id outside the vocabulary,
            400 ``context_length_exceeded`` naming the prompt or ``max_tokens``, 503
            ``queue_full``.
    """
    engine = state.engine
    prompts = req.prompts or (PromptInput(req.prompt_text, req.prompt_ids, req.prompt_param),)
    check_texts_fit(engine, prompts)  # a text that cannot fit is refused before tokenizing
    ids: list[list[int]] = []
    with tokenize_errors():  # a full tokenizer queue: 503
        for p in prompts:
            if p.ids is not None:
                ids.append(p.ids)
            else:
                assert p.text is not None  # a PromptInput has ids or text
                ids.append(await tokenize_with_memory(
                    engine, state.prefixes, (salt, req.add_special_tokens), p.text,
                    add_special_tokens=req.add_special_tokens))
    for p, prompt in zip(prompts, ids):  # here, not only in the engine: render must refuse too
        try:
            check_token_ids(p.param, prompt, engine.vocab_size)
        except ValueError as exc:
            raise bad_request(str(exc), str(exc).partition(":")[0]) from None
    max_tokens = min(resolve_max_tokens(req.max_tokens, DEFAULT_MAX_TOKENS, "max_tokens",
                                        len(prompt), engine, p.param)
                     for p, prompt in zip(prompts, ids))
    return CompletionPrompts(prompts, ids, max_tokens)


def render_routes(state_of: Callable[[web.Request], ServerState],
                  read_json: Callable[[web.Request], Awaitable[dict[str, Any]]]
                  ) -> list[web.RouteDef]:
    """The two render routes, given the app's state and body reader (``radixkv.server.app``)."""

    async def render_chat(request: web.Request) -> web.Response:
        state = state_of(request)
        body = await read_json(request)
        with param_policy.unrecorded():  # the forwarded request itself counts them
            req = parse_chat_request(body, adapters.model_names(state.engine))
        salt = cache_salt_for(request.get(REQUEST_TENANT), req.cache_salt)
        prompt = await chat_prompt(state, req, body, salt)
        return json_response({"token_ids": prompt.ids})

    async def render_completions(request: web.Request) -> web.Response:
        state = state_of(request)
        body = await read_json(request)
        with param_policy.unrecorded():
            req = parse_completion_request(body, adapters.model_names(state.engine))
        salt = cache_salt_for(request.get(REQUEST_TENANT), req.cache_salt)
        prompts = await completion_prompts(state, req, salt)
        return json_response([{"token_ids": ids} for ids in prompts.ids])

    return [web.post("/v1/chat/completions/render", render_chat),
            web.post("/v1/completions/render", render_completions)]

"""The server's tokenizer calls: the cheap context bound first, then the engine's fair pool.

A prompt that cannot fit the model's context is refused before it is tokenized: its size in
bytes divided by the tokenizer's longest token (``ChatTokenizer.min_tokens``) is a lower bound
on its tokens, and a bound at or past ``max_model_len`` is a 400 ``context_length_exceeded``
with no tokenizer call at all. What passes queues on the engine's ``TokenizePool`` as its
tenant (``TOKENIZE_KEY``, set per request by ``tenant_queue_middleware``); a full queue is a
503 ``queue_full`` with ``Retry-After``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from aiohttp import web

from radixkv.engine.tokenize_pool import TOKENIZE_KEY
from radixkv.errors import TokenizeQueueFullError
from radixkv.server.auth import REQUEST_TENANT
from radixkv.server.errors import bad_request, queue_full

if TYPE_CHECKING:
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.server.completions import PromptInput


def check_fits(engine: AsyncEngine, min_tokens: int, param: str) -> None:
    """400 ``context_length_exceeded`` naming ``param`` when a prompt's lower bound of
    ``min_tokens`` tokens cannot fit the context."""
    limit = engine.max_model_len
    if min_tokens >= limit:
        verb = "has" if param.startswith("prompt") else "have"
        raise bad_request(f"This model's maximum context length is {limit} tokens; the {param} "
                          f"{verb} at least {min_tokens} tokens", param, "context_length_exceeded")


def check_texts_fit(engine: AsyncEngine, prompts: Iterable[PromptInput]) -> None:
    """``check_fits`` for each text prompt of a completion request (objects with ``text`` and
    ``param``; token-id prompts are checked by length later)."""
    for p in prompts:
        if isinstance(p.text, str):
            check_fits(engine, engine.tokenizer.min_tokens([p.text]), p.param)


@contextmanager
def tokenize_errors() -> Iterator[None]:
    """Map a full tokenizer queue to the 503 ``queue_full`` (with ``Retry-After``)."""
    try:
        yield
    except TokenizeQueueFullError as exc:
        raise queue_full(str(exc)) from exc


async def tokenize_chat(engine: AsyncEngine, messages: list[dict], tools: list | None,
                        known_outputs: Any = None, *, fit: bool = True,
                        template_kwargs: dict | None = None) -> list[int]:
    """Template and tokenize a chat; with ``fit``, refuse one that cannot fit the context
    first (param ``messages``).

    Raises:
        APIError: 400 (context, template), 503 ``queue_full``.
    """
    if fit:
        check_fits(engine, engine.tokenizer.min_chat_tokens(messages, tools), "messages")
    try:
        with tokenize_errors():
            return await engine.tokenize_chat(messages, tools, known_outputs=known_outputs,
                                              template_kwargs=template_kwargs)
    except ValueError as exc:  # the chat template rejected these messages
        raise bad_request(f"could not apply the chat template: {exc}", "messages") from exc
    except RecursionError:
        raise bad_request("could not apply the chat template: the input is nested too deeply",
                          "messages") from None


async def tokenize_text(engine: AsyncEngine, text: str, param: str = "prompt", *,
                        fit: bool = True, add_special_tokens: bool = False) -> list[int]:
    """Tokenize a text prompt (behind the tokenizer's BOS with ``add_special_tokens``); with
    ``fit``, refuse one that cannot fit the context first.

    Raises:
        APIError: 400 ``context_length_exceeded`` naming ``param``, 503 ``queue_full``.
    """
    if fit:
        check_fits(engine, engine.tokenizer.min_tokens([text]), param)
    with tokenize_errors():
        return await engine.tokenize_text(text, add_special_tokens=add_special_tokens)


@web.middleware
async def tenant_queue_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Queue every tokenizer call of this request as its tenant (after ``auth_middleware``).

    The handler runs in this task, so the context variable reaches every call it makes."""
    tenant = request.get(REQUEST_TENANT)
    token = TOKENIZE_KEY.set(tenant.name if tenant is not None else None)
    try:
        return await handler(request)
    finally:
        TOKENIZE_KEY.reset(token)

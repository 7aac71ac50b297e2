"""Several prompts in one ``/v1/completions`` request: one engine request per prompt, their
outputs merged into one stream.

vLLM and OpenAI accept ``"prompt": ["a", "b"]`` (or lists of token-id lists) and answer one
choice set per prompt: choice ``index = prompt_index * n + j`` for the prompt's ``j``-th
choice, which is OpenAI's order. Each prompt is its own engine request (its own prefix-cache
lookup, its own ``cached_tokens``), so ``usage`` sums prompt, completion and cached tokens
over the prompts (``radixkv.server.generation._usage`` groups outputs by engine request id).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from radixkv.engine.request_stream import ENDS_REQUEST

if TYPE_CHECKING:
    from radixkv.cache.retention import RetentionBreakpoint
    from radixkv.engine.async_engine import AsyncEngine, RequestOutput, RequestStream
    from radixkv.engine.sampling import SamplingParams

__all__ = ["MergedStream", "PromptAdmissionError", "admit_prompts"]


class PromptAdmissionError(Exception):
    """Admitting prompt ``prompt_param`` failed with ``cause`` (QueueFullError, ValueError,
    EngineDeadError); the prompts admitted before it are already closed."""

    def __init__(self, cause: BaseException, prompt_param: str) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.prompt_param = prompt_param


class MergedStream:
    """The outputs of one engine request per prompt as one stream (``RequestStream``'s
    interface: ``__anext__``, ``close``, ``finished``).

    Each output comes out with ``index = prompt_index * n + choice`` (``request_id`` stays the
    prompt's engine request id). Iteration ends when every prompt's stream ended, or right
    after the first output that ends its request early (``finish_reason`` ``"abort"`` or
    ``"error"``, as a single stream does): the whole request has failed then. ``close`` closes
    (aborts) every prompt's request.

    Args:
        streams: one open stream per prompt, in prompt order.
        n: choices per prompt.
    """

    def __init__(self, streams: Sequence[RequestStream], n: int) -> None:
        self._streams = list(streams)
        self._n = n
        self._pending: dict[asyncio.Future, int] = {}  # next-output task -> prompt index
        self._live = set(range(len(self._streams)))
        self._aborted = False

    def __aiter__(self) -> MergedStream:
        return self

    @property
    def finished(self) -> bool:
        return self._aborted or not self._live

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            for p in self._live - set(self._pending.values()):
                task = asyncio.ensure_future(self._streams[p].__anext__())
                self._pending[task] = p
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            # Several may be done at once: take the lowest prompt first, keep the rest pending.
            task = min(done, key=self._pending.__getitem__)
            p = self._pending.pop(task)
            try:
                out = task.result()
            except StopAsyncIteration:
                self._live.discard(p)
                continue
            if out.finish_reason in ENDS_REQUEST:
                self._aborted = True
            return dataclasses.replace(out, index=p * self._n + out.index)
        self.close()
        raise StopAsyncIteration

    def close(self) -> None:
        """Abort every unfinished prompt request; idempotent."""
        for task in self._pending:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: an unread failure of a closed prompt is moot
            task.cancel()
        self._pending.clear()
        for stream in self._streams:
            stream.close()

    async def aclose(self) -> None:
        self.close()


def admit_prompts(engine: AsyncEngine, prompts: Sequence[Sequence[int]], params: SamplingParams,
                  *, request_id: str, param_names: Sequence[str], cache_salt: str | None,
                  tenant: str | None, lora_name: str | None,
                  session_key: str | None = None,
                  retention: tuple[RetentionBreakpoint, ...] = ()) -> Any:
    """Submit one engine request per prompt; one prompt returns its own ``RequestStream``
    (request id ``request_id``), several a ``MergedStream`` (ids ``{request_id}-{p}``).
    ``retention`` (the engine's retention breakpoints, ``prompt_cache_retention``) applies to
    each prompt's request alike.

    Several prompts pass the engine's admission bound together (``check_capacity`` for all
    their choices), so a list that an idle engine accepts is never refused half-way.

    Raises:
        PromptAdmissionError: the engine refused prompt ``p`` (``param_names[p]``; ``prompt``
            when the list as a whole is over the bound); the requests of prompts ``0..p-1``
            are closed (aborted) before this is raised.

    Known limit (docs/retention.md): a prompt retention the engine applied to prompt
    ``0..p-1`` before its abort (its prompt was cached in between) is not undone: the
    request's outputs, which name it, are never read, and a refreshed retention is not this
    request's to release. The route checks every prompt's ids and context first, so the
    engine refuses a later prompt only when it has stopped (or a pool-size bound).
    """
    if len(prompts) == 1:
        try:
            return engine.generate(prompts[0], params, cache_salt=cache_salt,
                                   request_id=request_id, tenant=tenant, lora_name=lora_name,
                                   session_key=session_key, retention=retention)
        except Exception as exc:
            raise PromptAdmissionError(exc, param_names[0]) from exc
    try:  # the bound applies to the request as a whole, as to one request with n choices
        engine.check_capacity(params.n * len(prompts))
    except Exception as exc:
        raise PromptAdmissionError(exc, "prompt") from exc
    streams: list[RequestStream] = []
    try:
        for p, ids in enumerate(prompts):
            streams.append(engine.generate(ids, params, cache_salt=cache_salt,
                                           request_id=f"{request_id}-{p}", tenant=tenant,
                                           lora_name=lora_name, capacity_checked=True,
                                           session_key=session_key, retention=retention))
    except Exception as exc:
        for stream in streams:
            stream.close()
        raise PromptAdmissionError(exc, param_names[len(streams)]) from exc
    return MergedStream(streams, params.n)

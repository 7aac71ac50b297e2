"""Chat and text completion response bodies (one JSON, or SSE chunks) in OpenAI's shapes.

Streaming sends ``data: <chunk JSON>\\n\\n`` events: a first chunk with ``delta.role``, content
deltas, a last chunk with ``finish_reason``, then (with ``stream_options.include_usage``) a
chunk with empty ``choices`` and the ``usage``, then ``data: [DONE]\\n\\n``. When usage is
requested every other chunk carries ``"usage": null``, as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from radixkv.server.tool_calls import ToolCallOptions, ToolCallStream, new_call_id, parse_reply

SSE_DONE = b"data: [DONE]\n\n"


def usage(num_prompt_tokens: int, num_generated_tokens: int, num_cached_tokens: int) -> dict:
    """The ``usage`` object; ``prompt_tokens_details.cached_tokens`` is always present."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_generated_tokens,
        "total_tokens": num_prompt_tokens + num_generated_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON payload."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass
class ChatCompletion:
    """Identity of one chat completion, shared by its response or all its chunks.

    With ``tools`` set, each choice's text is read for tool calls
    (:mod:`radixkv.server.tool_calls`): the body's ``message.tool_calls`` and, streamed,
    ``delta.tool_calls`` chunks; a streamed choice keeps its parser between chunks, so
    ``content_chunk`` may return b"" (text held back until decided) or several events.

    Attributes:
        model: The served model id echoed in every body.
        include_usage: Streaming: add ``"usage": null`` to chunks and a final usage chunk.
        tools: How replies are read for tool calls; None: plain text.
        id: ``chatcmpl-<uuid4 hex>``; also the engine request id.
        created: Unix time in whole seconds.
    """

    model: str
    include_usage: bool = False
    tools: ToolCallOptions | None = None
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    _streams: dict[int, ToolCallStream] = field(default_factory=dict, repr=False)

    def message(self, text: str) -> tuple[dict, bool]:
        """``(message, has tool calls)`` for one choice's generated text."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, False
        reply = parse_reply(self.tools.prefix + text, self.tools.parallel)
        if not reply.calls:
            return {"role": "assistant", "content": reply.content}, False
        return {"role": "assistant", "content": reply.content,
                "tool_calls": [c.openai(new_call_id()) for c in reply.calls]}, True

    def response(self, choices: list[tuple[str, str | None]], usage_: dict) -> dict:
        """The non-streaming ``chat.completion`` body; ``choices[i] = (text, finish_reason)``;
        a choice with tool calls finishes with ``"tool_calls"``."""
        out = []
        for i, (text, reason) in enumerate(choices):
            message, called = self.message(text)
            out.append({"index": i, "message": message, "logprobs": None,
                        "finish_reason": "tool_calls" if called else reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": out, "usage": usage_}

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage_
        return body

    def _delta(self, index: int, delta: dict, finish_reason: str | None = None) -> bytes:
        return sse_event(self._chunk([{"index": index, "delta": delta, "logprobs": None,
                                       "finish_reason": finish_reason}]))

    def _stream(self, index: int) -> ToolCallStream:
        stream = self._streams.get(index)
        if stream is None:
            assert self.tools is not None
            stream = self._streams[index] = ToolCallStream(parallel=self.tools.parallel)
            stream.feed(self.tools.prefix)  # a forced prefix alone decides nothing
        return stream

    def _events(self, index: int, events: list) -> bytes:
        out = []
        for kind, value in events:
            if kind == "content":
                out.append(self._delta(index, {"content": value}))
            else:
                k, call = value
                out.append(self._delta(index, {"tool_calls": [{"index": k,
                                                               **call.openai(new_call_id())}]}))
        return b"".join(out)

    def role_chunk(self, index: int = 0) -> bytes:
        """First event of a choice: the assistant role with empty content."""
        return self._delta(index, {"role": "assistant", "content": ""})

    def content_chunk(self, text: str, index: int = 0) -> bytes:
        """The events for ``text`` (b"" while it is held back)."""
        if self.tools is None:
            return self._delta(index, {"content": text})
        return self._events(index, self._stream(index).feed(text))

    def finish_chunk(self, finish_reason: str | None, index: int = 0) -> bytes:
        """Held text flushed, then the finish chunk (``"tool_calls"`` when calls were sent)."""
        if self.tools is None:
            return self._delta(index, {}, finish_reason)
        stream = self._stream(index)
        head = self._events(index, stream.finish())
        return head + self._delta(index, {}, "tool_calls" if stream.calls else finish_reason)

    def usage_chunk(self, usage_: dict) -> bytes:
        """The extra ``include_usage`` chunk: no choices, the whole request's usage."""
        return sse_event(self._chunk([], usage_))

    @staticmethod
    def error_event(message: str, type_: str, code: str | None = None) -> bytes:
        """An error after the stream started (status already sent): OpenAI error shape."""
        return sse_event({"error": {"message": message, "type": type_, "param": None,
                                    "code": code}})


@dataclass
class TextCompletion:
    """Identity of one ``/v1/completions`` response or its chunks (``object: text_completion``).

    Choice ``i`` belongs to prompt ``i // n`` (one choice set per prompt, OpenAI's order).

    Attributes:
        model: The served model id echoed in every body.
        include_usage: Streaming: add ``"usage": null`` to chunks and a final usage chunk.
        n: Choices per prompt.
        echoes: Prompt index → text put in front of each of its choices (``echo: true``).
        return_token_ids: vLLM's field: every choice carries ``prompt_token_ids`` (its
            prompt's ids) and ``token_ids`` (the generated ids; in a stream each chunk's new
            ids, and ``prompt_token_ids`` on a choice's first chunk only).
        prompt_token_ids: The ids of each prompt, as sent to the engine.
        id: ``cmpl-<uuid4 hex>``; also the engine request id.
        created: Unix time in whole seconds.
    """

    model: str
    include_usage: bool = False
    n: int = 1
    echoes: dict[int, str] = field(default_factory=dict)
    return_token_ids: bool = False
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    _started: set[int] = field(default_factory=set, repr=False)  # choices with a chunk sent

    def _choice(self, index: int, text: str, finish_reason: str | None,
                token_ids: list[int] | None) -> dict:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["prompt_token_ids"] = self.prompt_token_ids[index // self.n]
            choice["token_ids"] = list(token_ids or ())
        return choice

    def response(self, choices: list[tuple[str, str | None]], usage_: dict,
                 token_ids: dict[int, list[int]] | None = None) -> dict:
        """The non-streaming body; ``choices[i] = (generated text, finish_reason)``,
        ``token_ids[i]``: choice ``i``'s generated ids (with ``return_token_ids``)."""
        ids = token_ids or {}
        return {
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model,
            "choices": [self._choice(i, self.echoes.get(i // self.n, "") + text, reason,
                                     ids.get(i)) for i, (text, reason) in enumerate(choices)],
            "usage": usage_,
        }

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage_
        return body

    def _text(self, text: str, index: int, finish_reason: str | None = None,
              token_ids: list[int] | None = None) -> bytes:
        choice = self._choice(index, text, finish_reason, token_ids)
        if self.return_token_ids:
            if index in self._started:  # vLLM sends the prompt's ids on the first chunk only
                choice["prompt_token_ids"] = None
            self._started.add(index)
        return sse_event(self._chunk([choice]))

    def role_chunk(self, index: int = 0) -> bytes:
        """First event of a choice: its prompt's echoed text, if any (b"" otherwise)."""
        echo = self.echoes.get(index // self.n, "")
        return self._text(echo, index) if echo else b""

    def content_chunk(self, text: str, index: int = 0, token_ids: list[int] | None = None
                      ) -> bytes:
        return self._text(text, index, token_ids=token_ids)

    def finish_chunk(self, finish_reason: str | None, index: int = 0) -> bytes:
        return self._text("", index, finish_reason)

    def usage_chunk(self, usage_: dict) -> bytes:
        return sse_event(self._chunk([], usage_))

    error_event = staticmethod(ChatCompletion.error_event)

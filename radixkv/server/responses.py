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

    Attributes:
        model: The served model id echoed in every body.
        include_usage: Streaming: add ``"usage": null`` to chunks and a final usage chunk.
        id: ``chatcmpl-<uuid4 hex>``; also the engine request id.
        created: Unix time in whole seconds.
    """

    model: str
    include_usage: bool = False
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, choices: list[tuple[str, str | None]], usage_: dict) -> dict:
        """The non-streaming ``chat.completion`` body; ``choices[i] = (text, finish_reason)``."""
        return {
            "id": self.id, "object": "chat.completion", "created": self.created,
            "model": self.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": reason}
                        for i, (text, reason) in enumerate(choices)],
            "usage": usage_,
        }

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage_
        return body

    def role_chunk(self, index: int = 0) -> bytes:
        """First event of a choice: the assistant role with empty content."""
        return sse_event(self._chunk([{"index": index,
                                       "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]))

    def content_chunk(self, text: str, index: int = 0) -> bytes:
        return sse_event(self._chunk([{"index": index, "delta": {"content": text},
                                       "logprobs": None, "finish_reason": None}]))

    def finish_chunk(self, finish_reason: str | None, index: int = 0) -> bytes:
        return sse_event(self._chunk([{"index": index, "delta": {}, "logprobs": None,
                                       "finish_reason": finish_reason}]))

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

    Attributes:
        model: The served model id echoed in every body.
        include_usage: Streaming: add ``"usage": null`` to chunks and a final usage chunk.
        echo: Text to put in front of every choice (the prompt, with ``echo: true``) or "".
        id: ``cmpl-<uuid4 hex>``; also the engine request id.
        created: Unix time in whole seconds.
    """

    model: str
    include_usage: bool = False
    echo: str = ""
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, choices: list[tuple[str, str | None]], usage_: dict) -> dict:
        """The non-streaming body; ``choices[i] = (generated text, finish_reason)``."""
        return {
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model,
            "choices": [{"index": i, "text": self.echo + text, "logprobs": None,
                         "finish_reason": reason} for i, (text, reason) in enumerate(choices)],
            "usage": usage_,
        }

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage_
        return body

    def _text(self, text: str, index: int, finish_reason: str | None = None) -> bytes:
        return sse_event(self._chunk([{"index": index, "text": text, "logprobs": None,
                                       "finish_reason": finish_reason}]))

    def role_chunk(self, index: int = 0) -> bytes:
        """First event of a choice: the echoed prompt, if any (b"" otherwise)."""
        return self._text(self.echo, index) if self.echo else b""

    def content_chunk(self, text: str, index: int = 0) -> bytes:
        return self._text(text, index)

    def finish_chunk(self, finish_reason: str | None, index: int = 0) -> bytes:
        return self._text("", index, finish_reason)

    def usage_chunk(self, usage_: dict) -> bytes:
        return sse_event(self._chunk([], usage_))

    error_event = staticmethod(ChatCompletion.error_event)

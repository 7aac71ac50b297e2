"""What every ``bench serve`` target is sent and how its replies are counted, client side.

- ``flatten_request``: a transcript request as plain-text system / user / assistant messages
  (no ``tools``, no ``tool_calls``, no ``tool`` role), so that every OpenAI-compatible server
  renders the same text with the same chat template. Tool schemas and assistant tool calls are
  rendered by radixkv's own fallback (``radixkv.model.tool_render.render_tools_fallback``:
  schemas into the system turn, calls as ``<tool_call>{...}</tool_call>`` lines); a tool result
  becomes a user message ``<tool_response>\\n{content}\\n</tool_response>`` (the Hermes / Qwen
  convention the fallback follows). A server that sees a ``tool`` role or ``tool_calls`` may
  rewrite them (llama.cpp's template polyfills turn tool results into JSON user messages), so
  they never reach it.
- ``load_client_tokenizer``: the served model's tokenizer and chat template (a Hugging Face
  folder, a GGUF file, or the embedded SmolLM2 one), without loading weights.
- ``read_usage``: prompt / completion / cached tokens of one streamed chunk, from
  ``usage.prompt_tokens_details.cached_tokens`` or llama.cpp's ``timings.cache_n``.
- ``sse_events``: the JSON events of a server-sent-events body, as they arrive.
"""

# No ``from __future__ import annotations``: loaded by path (see bench/serve.py).
import json
import os
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any

from radixkv.model.tool_render import render_tools_fallback

TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def _text(content: Any) -> str:
    """A message content as one string (None -> "", text parts joined by newlines)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def flatten_request(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` with its messages flattened to plain text (see the module docstring).

    Args:
        request: A normalised transcript request (``radixkv.tools.transcripts``):
            ``{"session_id", "turn", "messages", "tools"?}``.

    Returns:
        A new request with the same keys but ``tools`` and with ``messages`` a list of
        ``{"role": "system" | "user" | "assistant", "content": str}``. The input is not
        modified.
    """
    messages = [dict(m, content=_text(m.get("content"))) for m in request["messages"]]
    rendered = render_tools_fallback(messages, request.get("tools"))
    flat = []
    for message in rendered:
        role, content = message["role"], message["content"]
        if role == "tool":
            role, content = "user", f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"
        flat.append({"role": role, "content": content})
    out = {k: v for k, v in request.items() if k not in ("messages", "tools")}
    out["messages"] = flat
    return out


def load_client_tokenizer(spec: str | None) -> tuple[Any, str]:
    """The chat tokenizer of the served model, loaded without its weights.

    Args:
        spec: None for the embedded SmolLM2-135M-Instruct tokenizer (converted once and cached
            by ``radixkv.model.loader``); a Hugging Face model folder (its tokenizer files);
            a ``*.gguf`` file or a shipped model's name (``gemma3-270m``): the tokenizer, chat
            template and EOS ids ``radixkv serve`` converts from it (``gguf_tokenizer_dir``).

    Returns:
        ``(ChatTokenizer, description)``; the description names what was loaded. The
        tokenizer's ``max_model_len`` is 0: the context length comes from the servers.

    Raises:
        ValueError: ``spec`` does not exist or is neither a folder nor a ``.gguf`` file.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the files carry everything
    from transformers import AutoTokenizer  # deferred: heavy import

    from radixkv.model.hf_loader import generation_eos_ids
    from radixkv.model.loader import embedded_tokenizer_dir, gguf_tokenizer_dir
    from radixkv.model.shipped import shipped_model_name
    from radixkv.model.tokenizer import ChatTokenizer

    extra_eos: list[int] = []
    if spec is None:
        hf = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
        name = "embedded SmolLM2-135M-Instruct"
    else:
        if not spec.strip():
            raise ValueError("--tokenizer: empty; give a model folder, a .gguf file or a shipped "
                             "model name")
        path = Path(spec).expanduser()
        if path.is_dir():
            try:
                hf = AutoTokenizer.from_pretrained(str(path))
            except (OSError, ValueError) as exc:  # no tokenizer files, or ones it cannot read
                raise ValueError(f"--tokenizer: the folder {path} holds no tokenizer transformers "
                                 f"can load (tokenizer.json / tokenizer_config.json; "
                                 f"{type(exc).__name__})") from exc
            extra_eos = generation_eos_ids(path)
        elif (path.is_file() and path.suffix == ".gguf") or (not path.exists()
                                                              and shipped_model_name(spec) is not None):
            try:
                directory = gguf_tokenizer_dir(spec)
            except ValueError as exc:  # a shipped model whose package is missing
                raise ValueError(f"--tokenizer: {exc}") from exc
            hf = AutoTokenizer.from_pretrained(str(directory))
            extra_eos = generation_eos_ids(directory.parent)
        else:
            raise ValueError(f"--tokenizer: {path} is neither a model folder, a .gguf file nor "
                             "a shipped model name")
        name = str(path)
    return ChatTokenizer(hf, max_model_len=0, extra_eos_token_ids=extra_eos), name


def client_tokens(tokenizer: Any, requests: list[dict[str, Any]]) -> list[list[int]]:
    """Token ids of each (flattened) request's prompt: its chat template with the assistant
    header appended, as a server renders a chat completion.

    Raises:
        ValueError: the template cannot render a request (the message names it).
    """
    return [tokenizer.apply_chat_template(r["messages"]) for r in requests]


def read_usage(chunk: dict[str, Any]) -> dict[str, int | None] | None:
    """Token counts a streamed chunk (or a whole response) reports, or None if it has none.

    ``cached_tokens`` is ``usage.prompt_tokens_details.cached_tokens`` (OpenAI, vLLM with
    ``--enable-prompt-tokens-details``, radixkv), else llama.cpp ``llama-server``'s
    ``timings.cache_n`` (prompt tokens it reused from its slot's cache), else None: the server
    did not say, which is not the same as 0. ``prompt_tokens`` falls back to
    ``timings.cache_n + timings.prompt_n`` and ``completion_tokens`` to
    ``timings.predicted_n`` when ``usage`` lacks them.

    Returns:
        ``{"prompt_tokens", "completion_tokens", "cached_tokens"}`` (each int or None), or None
        when the chunk has neither ``usage`` nor ``timings``.
    """
    usage = chunk.get("usage") or {}
    timings = chunk.get("timings") or {}
    if not usage and not timings:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = timings.get("cache_n")
    prompt = usage.get("prompt_tokens")
    if prompt is None and timings.get("prompt_n") is not None:
        prompt = timings["prompt_n"] + (timings.get("cache_n") or 0)
    completion = usage.get("completion_tokens", timings.get("predicted_n"))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}


RETENTION_MODES = ("anthropic-5m", "anthropic-1h", "openai-24h")
"""``--retention`` values: ``anthropic-5m`` / ``anthropic-1h`` send every request through
``POST /v1/messages``, the retained sessions' with ``cache_control`` (that TTL) on the last
content block; ``openai-24h`` sends chat completions, the retained sessions' with
``prompt_cache_retention: "24h"``."""


def anthropic_messages(messages: list[dict[str, Any]],
                       ttl: str | None = None) -> dict[str, Any]:
    """A flattened request's messages (``flatten_request``) as Anthropic Messages API fields.

    The leading ``system`` messages become ``system`` text blocks (one per message); every other
    message becomes ``{"role", "content": [{"type": "text", "text": ...}]}`` in order (roles
    are not merged: a server renders the same messages as the chat request). With ``ttl``
    (``"5m"`` / ``"1h"``) the last content block carries ``cache_control: {"type": "ephemeral",
    "ttl": ttl}``: the whole prompt is a breakpoint.

    Returns:
        ``{"system": [...]?, "messages": [...]}`` (no ``system`` key without system messages).

    Raises:
        ValueError: a ``system`` message after the first non-system one (the Messages API has
            no such turn), or no message besides the system ones.
    """
    system: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    for message in messages:
        role, text = message["role"], _text(message.get("content"))
        if role == "system":
            if out:
                raise ValueError("--retention anthropic-*: a system message after the first "
                                 "turn cannot be sent through /v1/messages")
            system.append({"type": "text", "text": text})
        else:
            out.append({"role": role, "content": [{"type": "text", "text": text}]})
    if not out:
        raise ValueError("--retention anthropic-*: a request with only system messages cannot "
                         "be sent through /v1/messages")
    if ttl is not None:
        last = out[-1]["content"][-1]
        last["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    fields: dict[str, Any] = {"messages": out}
    if system:
        fields["system"] = system
    return fields


def read_anthropic_usage(event: dict[str, Any]) -> dict[str, int | None] | None:
    """Token counts of one Messages API stream event (``message_start``'s ``message.usage``,
    ``message_delta``'s ``usage``) or of a whole response, or None when it has no usage.

    ``prompt_tokens`` = ``input_tokens`` + ``cache_read_input_tokens`` +
    ``cache_creation_input_tokens`` (Anthropic's usage identity), ``cached_tokens`` =
    ``cache_read_input_tokens``, ``cache_creation_tokens`` = ``cache_creation_input_tokens``,
    ``completion_tokens`` = ``output_tokens``; each None when the event lacks it (a
    ``message_delta`` may carry only ``output_tokens``).
    """
    usage = event.get("usage")
    if usage is None and isinstance(event.get("message"), dict):
        usage = event["message"].get("usage")
    if not isinstance(usage, dict):
        return None
    parts = [usage.get(k) for k in ("input_tokens", "cache_read_input_tokens",
                                    "cache_creation_input_tokens")]
    prompt = sum(p for p in parts if p is not None) if parts[0] is not None else None
    return {"prompt_tokens": prompt, "completion_tokens": usage.get("output_tokens"),
            "cached_tokens": usage.get("cache_read_input_tokens"),
            "cache_creation_tokens": usage.get("cache_creation_input_tokens")}


async def sse_events(lines: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON object of each ``data:`` line of a server-sent-events body (an aiohttp
    ``resp.content``), in order, ending at ``data: [DONE]`` (OpenAI) or at the body's end
    (Anthropic sends no ``[DONE]``); ``event:`` lines, comments and blank lines are skipped.

    Raises:
        json.JSONDecodeError: a ``data:`` line that is not JSON.
    """
    async for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)

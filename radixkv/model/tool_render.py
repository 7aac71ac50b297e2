"""Deterministic tool rendering for chat templates that ignore ``tools`` and ``tool_calls``.

SmolLM2's plain ChatML template drops both, which would silently change what the model sees.
For such templates radixkv rewrites the messages before rendering (DESIGN.md §5):

- ``tools``: the JSON schemas go into the system turn (appended to the first system message,
  or a new system message at the start), between ``<tools>`` and ``</tools>``, one per line,
  followed by one line saying how to call them;
- assistant ``tool_calls``: appended to the turn's text as
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` lines;
- ``tool`` results: kept as ``tool`` turns (ChatML renders any role).

The rendering depends only on the request (JSON with sorted keys, no spaces), so turn k+1 of
an agent session renders as an extension of turn k and its prefix stays cacheable. The format
follows the Hermes / Qwen function-calling convention, which many chat models were tuned on.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_HEADER = ("You may call one or more functions to assist with the user query. "
                "The available functions are listed as JSON schemas within <tools></tools>:")
TOOLS_FOOTER = ("To call a function, reply with one line per call: "
                '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>')


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def template_handles_tools(template: str | None) -> bool:
    """True when the Jinja template references both ``tools`` and ``tool_calls``."""
    return bool(template) and "tools" in template and "tool_calls" in template


def _call_text(call: dict) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:  # OpenAI sends arguments as a JSON string; keep it verbatim if it is not JSON
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return "<tool_call>" + _dumps({"name": function.get("name"), "arguments": arguments}) + "</tool_call>"


def fallback_texts(messages: list[dict], tools: list[dict] | None) -> list[str]:
    """The texts ``render_tools_fallback`` adds to a chat (each tool's schema line and each
    assistant tool call's line), for a size bound before rendering; malformed entries are
    skipped (the rendering reports them)."""
    texts = [_dumps(t) for t in tools or ()]
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            texts += [_call_text(c) for c in calls if isinstance(c, dict)]
    return texts


def render_tools_fallback(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Rewrite ``messages`` so that a tool-unaware template shows tools and calls as text.

    Args:
        messages: OpenAI-style messages whose ``content`` is already a string.
        tools: OpenAI tool schemas (``{"type": "function", "function": {...}}``), or None.

    Returns:
        New message dicts without ``tool_calls`` keys (the input is not modified).
    """
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            lines = [message.get("content") or ""] if message.get("content") else []
            lines += [_call_text(c) for c in calls]
            message["content"] = "\n".join(lines)
        out.append(message)
    if tools:
        block = "\n".join([TOOLS_HEADER, "<tools>", *(_dumps(t) for t in tools), "</tools>",
                           TOOLS_FOOTER])
        if out and out[0].get("role") == "system":
            first = out[0]
            first["content"] = (first["content"] + "\n\n" + block) if first["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out

"""Deterministic tool rendering for chat templates that ignore ``tools`` and ``tool_calls``.

SmolLM2's plain ChatML template drops both, which would silently change what the model sees.
For such templates radixkv rewrites the messages before rendering (docs/design.md §5):

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

import orjson

TOOLS_HEADER = ("You may call one or more functions to assist with the user query. "
                "The available functions are listed as JSON schemas within <tools></tools>:")
TOOLS_FOOTER = ("To call a function, reply with one line per call: "
                '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>')


_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def template_handles_tools(template: str | None) -> bool:
    """True when the Jinja template references both ``tools`` and ``tool_calls``."""
    return template is not None and "tools" in template and "tool_calls" in template


def _call_text(call: dict) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:  # OpenAI sends arguments as a JSON string; keep it verbatim if it is not JSON
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return _CALL_OPEN + _dumps({"name": function.get("name"), "arguments": arguments}) + _CALL_CLOSE


def fallback_num_bytes(messages: list[dict], tools: list[dict] | None) -> int:
    """UTF-8 bytes that ``render_tools_fallback`` adds to a chat at least (each tool's schema
    line and each assistant tool call's line), for a size bound before rendering.

    Measured with orjson (compact, like ``_dumps``; ~30x faster, so the bound costs the event
    loop milliseconds for a schema near the body limit); where the two spell a number
    differently orjson's is the shorter, so this stays a lower bound. Entries orjson cannot
    write count 0 (the rendering reports real errors).
    """
    size = 0
    for tool in tools or ():
        size += _json_num_bytes(tool)
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = orjson.loads(arguments)
                except orjson.JSONDecodeError:
                    pass
            size += len(_CALL_OPEN) + len(_CALL_CLOSE) + _json_num_bytes(
                {"name": function.get("name"), "arguments": arguments})
    return size


def _json_num_bytes(value: Any) -> int:
    try:
        return len(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):
        return 0


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

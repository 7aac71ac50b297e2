"""Validation of OpenAI chat requests (and ``/tokenize`` bodies).

Everything here is pure (no engine, no I/O) so that the whole catalogue of bad input can be
checked cheaply. A request that asks for something we do not implement and that would change
what the caller gets (logit_bias, logprobs, penalties, JSON mode, forced tool calls,
unknown keys) is refused with a 400 naming the parameter rather than silently ignored.
Shared decoding and sampling fields live in ``radixkv.server.params``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixkv.server.errors import bad_request
from radixkv.server.params import (  # some re-exported (see __all__)
    JSON_CONTENT_TYPES,
    MAX_CHOICES,
    MAX_SALT_CHARS,
    Sampling,
    check_model,
    json_depth,
    opt_bool,
    parse_json_object,
    parse_sampling,
    refuse_unimplemented_sampling,
    refuse_unknown_keys,
)

__all__ = ["CHAT_KEYS", "JSON_CONTENT_TYPES", "MAX_CHOICES", "ChatRequest", "TokenizeRequest",
           "check_model", "parse_chat_request", "parse_json_object", "parse_tokenize_request",
           "validate_messages", "validate_tools"]

# Accepted top-level keys; anything else is refused (param = the key).
CHAT_KEYS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stream", "stream_options", "n", "cache_salt", "user", "tools", "tool_choice",
    "parallel_tool_calls", "ignore_eos", "logprobs", "top_logprobs", "logit_bias",
    "presence_penalty", "frequency_penalty", "response_format",
})
TOKENIZE_KEYS = frozenset({"model", "messages", "prompt", "tools", "add_generation_prompt",
                           "add_special_tokens", "cache_salt"})

# Keys a message may carry, per role. Assistant messages echoed back by OpenAI clients carry
# refusal / annotations / audio / function_call; they do not reach the template.
_MESSAGE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "refusal", "annotations", "audio",
                  "function_call"},
    "tool": {"role", "content", "tool_call_id", "name"},
}
MAX_MESSAGES = 8192      # far more than fit any context; refused before templating
MAX_CONTENT_PARTS = 1024
MAX_TOOLS = 128          # OpenAI's limit
MAX_TOOL_SCHEMA_DEPTH = 32


def _content_text(content: Any, param: str, *, nullable: bool) -> str:
    """Message content as text: a string, or text parts joined by newlines."""
    if content is None:
        if nullable:
            return ""
        raise bad_request(f"'{param}' is required for this role", param)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or a list of content parts", param)
    if len(content) > MAX_CONTENT_PARTS:
        raise bad_request(f"'{param}' has {len(content)} parts; at most {MAX_CONTENT_PARTS}", param)
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"'{p}' must be an object with a 'type'", p)
        if part["type"] != "text":
            raise bad_request(f"'{p}': content part type {part['type']!r} is not supported "
                              "(text only)", f"{p}.type")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"'{p}.text' must be a string", f"{p}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"'{param}' must be a list", param)
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"'{p}' must be {{id, type: 'function', function: {{name, "
                              "arguments}}}", p)
        if call.get("type", "function") != "function":
            raise bad_request(f"'{p}.type' must be 'function'", f"{p}.type")
        if not isinstance(call.get("id"), str):
            raise bad_request(f"'{p}.id' must be a string", f"{p}.id")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            raise bad_request(f"'{p}.function.arguments' must be a JSON string",
                              f"{p}.function.arguments")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check ``messages`` and reduce each to what the chat template needs.

    Returns:
        Messages ``{"role", "content": str}`` plus ``tool_calls`` (assistant) or
        ``tool_call_id`` / ``name`` (tool); ``developer`` becomes ``system``.

    Raises:
        APIError: 400 naming the offending ``messages[i]...`` path.
    """
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"'messages' has {len(messages)} messages; at most {MAX_MESSAGES}",
                          "messages")
    out = []
    for i, msg in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"'{p}' must be an object", p)
        role = msg.get("role")
        if not isinstance(role, str) or role not in _MESSAGE_KEYS:
            raise bad_request(f"'{p}.role' must be one of {sorted(_MESSAGE_KEYS)}, got {role!r}",
                              f"{p}.role")
        for key in msg:
            if key not in _MESSAGE_KEYS[role]:
                raise bad_request(f"'{p}.{key}' is not supported on a {role} message", f"{p}.{key}")
        if msg.get("name") is not None and not isinstance(msg["name"], str):
            raise bad_request(f"'{p}.name' must be a string", f"{p}.name")
        if "content" not in msg and role != "assistant":
            raise bad_request(f"'{p}.content' is required for a {role} message", f"{p}.content")
        clean: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            # content null renders as empty text for every role (DESIGN.md §5).
            "content": _content_text(msg.get("content"), f"{p}.content", nullable=True),
        }
        if role == "assistant":
            if msg.get("function_call") is not None or msg.get("audio") is not None:
                key = "function_call" if msg.get("function_call") is not None else "audio"
                raise bad_request(f"'{p}.{key}' is not supported", f"{p}.{key}")
            if msg.get("tool_calls"):
                clean["tool_calls"] = _tool_calls(msg["tool_calls"], f"{p}.tool_calls")
        elif role == "tool":
            if not isinstance(msg.get("tool_call_id"), str):
                raise bad_request(f"'{p}.tool_call_id' must be a string", f"{p}.tool_call_id")
            clean["tool_call_id"] = msg["tool_call_id"]
            if msg.get("name") is not None:
                clean["name"] = msg["name"]
        out.append(clean)
    return out


def validate_tools(tools: Any) -> list[dict] | None:
    """Check ``tools`` (OpenAI function tools); None or [] means no tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' has {len(tools)} tools; at most {MAX_TOOLS}", "tools")
    for j, tool in enumerate(tools):
        p = f"tools[{j}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"'{p}' must be {{type: 'function', function: {{name, ...}}}}", p)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"'{p}.function.name' must be a non-empty string",
                              f"{p}.function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"'{p}.function.parameters' must be an object",
                              f"{p}.function.parameters")
        if json_depth(tool, MAX_TOOL_SCHEMA_DEPTH) > MAX_TOOL_SCHEMA_DEPTH:
            raise bad_request(f"'{p}' is nested deeper than {MAX_TOOL_SCHEMA_DEPTH} levels", p)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"'{p}.function.description' must be a string",
                              f"{p}.function.description")
    return tools or None


@dataclass(frozen=True)
class ChatRequest(Sampling):
    """A validated chat-completion request: the shared ``Sampling`` fields plus these.

    Attributes:
        messages: Template-ready messages (see ``validate_messages``).
        tools: Function tools passed to the chat template, or None.
    """

    messages: list[dict[str, Any]]
    tools: list[dict] | None


def _refuse_unimplemented(body: dict) -> None:
    """400 for options that would change the result and that we do not implement."""
    if opt_bool(body, "logprobs"):
        raise bad_request("'logprobs' is not supported: radixkv does not compute log "
                          "probabilities", "logprobs")
    if body.get("top_logprobs") is not None:
        raise bad_request("'top_logprobs' is not supported: radixkv does not compute log "
                          "probabilities", "top_logprobs")
    refuse_unimplemented_sampling(body)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("'response_format' supports only {\"type\": \"text\"}",
                          "response_format")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        # "required" / a named function would force a tool call, which we do not constrain.
        raise bad_request("'tool_choice' supports only 'auto' and 'none'", "tool_choice")
    opt_bool(body, "parallel_tool_calls")


def parse_chat_request(body: dict[str, Any], served_model: str) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body.

    Raises:
        APIError: 400 naming the parameter for any invalid or unsupported field; 404 for an
            unknown model.
    """
    refuse_unknown_keys(body, CHAT_KEYS)
    check_model(body, served_model)
    messages = validate_messages(body.get("messages"))
    tools = validate_tools(body.get("tools"))
    _refuse_unimplemented(body)
    return ChatRequest(messages=messages, tools=tools, **parse_sampling(body).fields())


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated ``/tokenize`` body: exactly one of ``messages`` / ``prompt``."""

    messages: list[dict[str, Any]] | None
    tools: list[dict] | None
    prompt: str | None
    cache_salt: str | None = None  # the salt whose remembered replies a chat is rendered with


def parse_tokenize_request(body: dict[str, Any], served_model: str) -> TokenizeRequest:
    """Validate a ``/tokenize`` body (vLLM's shape).

    ``{"model", "messages", "tools"?}`` renders the chat template exactly as a chat request
    would (generation prompt included); ``{"model", "prompt": str}`` encodes raw text without
    special tokens.

    Raises:
        APIError: 400 naming the parameter; 404 for an unknown model.
    """
    for key in body:
        if key not in TOKENIZE_KEYS:
            raise bad_request(f"unknown parameter '{key}'", key)
    check_model(body, served_model)
    if body.get("add_generation_prompt", True) is not True:
        # The chat path always adds the generation prompt; counting anything else would differ.
        raise bad_request("'add_generation_prompt' must be true", "add_generation_prompt")
    if body.get("add_special_tokens", False) is not False:
        raise bad_request("'add_special_tokens' must be false (prompts are encoded as is)",
                          "add_special_tokens")
    has_messages, has_prompt = "messages" in body, "prompt" in body
    if has_messages == has_prompt:
        raise bad_request("send exactly one of 'messages' and 'prompt'",
                          "prompt" if has_prompt else "messages")
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise bad_request("'prompt' must be a string", "prompt")
        if body.get("tools") is not None:
            raise bad_request("'tools' needs 'messages'", "tools")
        return TokenizeRequest(messages=None, tools=None, prompt=body["prompt"])
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_SALT_CHARS):
        raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} "
                          "characters", "cache_salt")
    return TokenizeRequest(messages=validate_messages(body["messages"]),
                           tools=validate_tools(body.get("tools")), prompt=None, cache_salt=salt)

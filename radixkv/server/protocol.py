"""Validation of OpenAI chat requests (and ``/tokenize`` bodies).

No engine, no I/O, so that the whole catalogue of bad input can be checked cheaply. Which
fields are honoured, ignored or refused is the parameter policy (``radixkv.server.param_table``):
a request asking for something we do not implement that would change what the caller gets
(logit_bias, logprobs, penalties, JSON mode, ...) is refused with a 400 naming the field; the
only side effect is counting ignored fields once the request is valid. Shared decoding and
sampling fields live in ``radixkv.server.params``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixkv.server import param_policy
from radixkv.server.errors import bad_request
from radixkv.server.param_policy import PolicyCheck, check_field
from radixkv.server.param_table import (
    CHAT_PARAMS,
    MESSAGE_IGNORED,
    RESERVED_TEMPLATE_KWARGS,
    TOKENIZE_PARAMS,
)
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
)

__all__ = ["JSON_CONTENT_TYPES", "MAX_CHOICES", "ChatRequest", "TokenizeRequest",
           "check_model", "parse_chat_request", "parse_json_object", "parse_tokenize_request",
           "validate_messages", "validate_tools"]

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


def validate_messages(messages: Any, found: PolicyCheck | None = None) -> list[dict[str, Any]]:
    """Check ``messages`` and reduce each to what the chat template needs.

    Ignored message keys (``id``, an assistant's ``reasoning_content``; ``MESSAGE_IGNORED``)
    are type-checked, dropped and noted in ``found``.

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
            extra = MESSAGE_IGNORED.get(key)
            if extra is not None and role in extra[1]:
                check_field(extra[0], msg[key], f"{p}.{key}", found or PolicyCheck())
            elif key not in _MESSAGE_KEYS[role]:
                raise bad_request(f"'{p}.{key}' is not supported on a {role} message", f"{p}.{key}")
        if msg.get("name") is not None and not isinstance(msg["name"], str):
            raise bad_request(f"'{p}.name' must be a string", f"{p}.name")
        if "content" not in msg and role != "assistant":
            raise bad_request(f"'{p}.content' is required for a {role} message", f"{p}.content")
        clean: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            # content null renders as empty text for every role (docs/design.md §5).
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
        tool_choice: ``"auto"``, ``"none"``, ``"required"`` (some tool must be called) or
            ``"function"`` (the tool named ``tool_choice_function`` must be called).
        tool_choice_function: The forced tool's name, one of ``tools``; else None.
        parallel_tool_calls: False = at most the first parsed tool call is returned.
        chat_template_kwargs: Extra variables for the chat template (string keys, JSON values;
            names the templating machinery itself uses are refused), or None.
    """

    messages: list[dict[str, Any]]
    tools: list[dict] | None
    tool_choice: str = "auto"  # "auto" | "none" | "required" | "function"
    tool_choice_function: str | None = None  # the forced tool's name when tool_choice="function"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (validated)


MAX_TEMPLATE_KWARGS_DEPTH = 32


def parse_tool_choice(body: dict, tools: list[dict] | None) -> tuple[str, str | None]:
    """``(tool_choice, forced function name or None)``; null means "auto".

    Raises:
        APIError: 400 ``tool_choice`` for a bad value or "required"/a named function without
            tools; 400 ``tool_choice.function.name`` for a name that is not one of ``tools``.
    """
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    if choice == "required":
        if not tools:
            raise bad_request("'tool_choice' 'required' needs 'tools'", "tool_choice")
        return "required", None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type") != "function" \
            or not isinstance(fn.get("name"), str):
        raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if not tools:
        raise bad_request("'tool_choice' names a function but 'tools' is empty", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if fn["name"] not in names:
        raise bad_request(f"'tool_choice.function.name' {fn['name']!r} is not one of the "
                          f"request's tools {names}", "tool_choice.function.name")
    return "function", fn["name"]


def parse_template_kwargs(body: dict) -> dict[str, Any] | None:
    """``chat_template_kwargs``: an object of extra template variables, or None (null / {}).

    Raises:
        APIError: 400 ``chat_template_kwargs`` if not an object or nested too deeply;
            400 ``chat_template_kwargs.<name>`` for a name the template machinery binds itself.
    """
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for name in kwargs:
        if name in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"'chat_template_kwargs.{name}' is set by the server and cannot be "
                              "overridden", f"chat_template_kwargs.{name}")
    if json_depth(kwargs, MAX_TEMPLATE_KWARGS_DEPTH) > MAX_TEMPLATE_KWARGS_DEPTH:
        raise bad_request(f"'chat_template_kwargs' is nested deeper than "
                          f"{MAX_TEMPLATE_KWARGS_DEPTH} levels", "chat_template_kwargs")
    return kwargs or None


def parse_chat_request(body: dict[str, Any], served_model: str | tuple[str, ...]) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body (fields per ``param_table.CHAT_PARAMS``).

    Raises:
        APIError: 400 naming the parameter for any invalid or unsupported field; 404 for an
            unknown model.
    """
    check_model(body, served_model)
    found = param_policy.check(body, CHAT_PARAMS)
    messages = validate_messages(body.get("messages"), found)
    tools = validate_tools(body.get("tools"))
    choice, function = parse_tool_choice(body, tools)
    parallel = opt_bool(body, "parallel_tool_calls")
    req = ChatRequest(messages=messages, tools=tools, tool_choice=choice,
                      tool_choice_function=function,
                      parallel_tool_calls=True if parallel is None else parallel,
                      chat_template_kwargs=parse_template_kwargs(body),
                      **parse_sampling(body, found).fields())
    found.record()
    return req


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated ``/tokenize`` body: exactly one of ``messages`` / ``prompt``."""

    messages: list[dict[str, Any]] | None
    tools: list[dict] | None
    prompt: str | None
    cache_salt: str | None = None  # the salt whose remembered replies a chat is rendered with
    chat_template_kwargs: dict[str, Any] | None = None  # as for ChatRequest (messages only)
    add_special_tokens: bool = True  # a prompt behind the tokenizer's BOS, as /v1/completions


def parse_tokenize_request(body: dict[str, Any], served_model: str | tuple[str, ...]) -> TokenizeRequest:
    """Validate a ``/tokenize`` body (vLLM's shape).

    ``{"model", "messages", "tools"?}`` renders the chat template exactly as a chat request
    would (generation prompt included); ``{"model", "prompt": str}`` encodes the text as
    ``/v1/completions`` does (behind the tokenizer's BOS unless ``add_special_tokens`` is
    false).

    Raises:
        APIError: 400 naming the parameter; 404 for an unknown model.
    """
    check_model(body, served_model)
    found = param_policy.check(body, TOKENIZE_PARAMS)
    has_messages, has_prompt = "messages" in body, "prompt" in body
    if has_messages == has_prompt:
        raise bad_request("send exactly one of 'messages' and 'prompt'",
                          "prompt" if has_prompt else "messages")
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise bad_request("'prompt' must be a string", "prompt")
        for key in ("tools", "chat_template_kwargs"):
            if body.get(key) is not None:
                raise bad_request(f"'{key}' needs 'messages'", key)
        found.record()
        return TokenizeRequest(messages=None, tools=None, prompt=body["prompt"],
                               add_special_tokens=opt_bool(body, "add_special_tokens") is not False)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_SALT_CHARS):
        raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} "
                          "characters", "cache_salt")
    if body.get("add_special_tokens"):
        raise bad_request("'add_special_tokens' needs 'prompt': the chat template places the "
                          "special tokens of 'messages'", "add_special_tokens")
    req = TokenizeRequest(messages=validate_messages(body["messages"], found),
                          tools=validate_tools(body.get("tools")), prompt=None, cache_salt=salt,
                          chat_template_kwargs=parse_template_kwargs(body))
    found.record()
    return req

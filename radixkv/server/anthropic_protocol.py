"""Validation of Anthropic Messages API bodies and their translation to OpenAI chat requests.

No engine, no I/O. ``POST /v1/messages`` and ``/v1/messages/count_tokens`` bodies are checked
against the parameter policy (``param_table.MESSAGES_PARAMS`` / ``COUNT_TOKENS_PARAMS``) and
Anthropic's own shapes, every refusal a 400 whose message names the field the way Anthropic
does (``messages.2.content.0.cache_control.ttl``). A valid body becomes the *equivalent OpenAI
chat request* (``ChatRequest``), which the chat route's own rendering turns into token ids
(``radixkv.server.prompts.chat_prompt``), so an agent that switches APIs keeps its cache:

- ``system`` (a string, or text blocks) → a first ``system`` message (blocks as text parts,
  which render joined by newlines, as OpenAI content parts do);
- a user message's text blocks → a ``user`` message (consecutive ones together), each
  ``tool_result`` block → a ``tool`` message (``tool_call_id`` = ``tool_use_id``), in order;
- an assistant message's text blocks → its content, its ``tool_use`` blocks → ``tool_calls``
  (``arguments`` = the ``input`` as JSON); ``thinking`` / ``redacted_thinking`` blocks are
  dropped (earlier reasoning, as an OpenAI assistant's ``reasoning_content``);
- ``tools`` → function tools (``input_schema`` as ``parameters``); ``tool_choice`` ``auto`` /
  ``any`` / ``tool`` / ``none`` → ``auto`` / ``required`` / a named function / ``none``,
  ``disable_parallel_tool_use`` → ``parallel_tool_calls: false``;
- ``stop_sequences`` → ``stop``, ``metadata.user_id`` → the session hint (``prompt_cache_key``).

``cache_control`` (``{"type": "ephemeral", "ttl": "5m" | "1h"}``) on a tool, a system block,
a message's content block, a text block inside a ``tool_result``'s content, or an ignored
``thinking`` block (or at the top level: the last block of the last message) is a breakpoint
(``Breakpoint``): the request cut right after that block (``truncated_chat``) renders to a
prefix of the prompt, whose length in tokens the handler retains for the TTL. Every marker
counts towards the limit of 4 and the 1h-before-5m order, each under its own path
(``messages.1.content.0.content.2.cache_control``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from radixkv.server import param_policy
from radixkv.server.errors import bad_request
from radixkv.server.param_policy import PolicyCheck, check_field
from radixkv.server.param_table import (
    COUNT_TOKENS_PARAMS,
    MESSAGES_BLOCK_FIELDS,
    MESSAGES_IGNORED_BLOCKS,
    MESSAGES_PARAMS,
    MESSAGES_REFUSED_BLOCKS,
    TTL_VALUES,
)
from radixkv.server.params import (
    MAX_SALT_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    check_model,
    json_depth,
    opt_bool,
    opt_int,
    opt_number,
    parse_sampling,
)
from radixkv.server.protocol import (
    MAX_MESSAGES,
    MAX_TOOL_SCHEMA_DEPTH,
    MAX_TOOLS,
    ChatRequest,
    validate_messages,
    validate_tools,
)

__all__ = ["MAX_BREAKPOINTS", "Breakpoint", "MessagesRequest", "parse_count_tokens_request",
           "parse_messages_request", "truncated_chat"]

MAX_BREAKPOINTS = 4   # Anthropic's limit of cache_control breakpoints per request
MAX_BLOCKS = 1024     # content blocks in one message (OpenAI's content-part bound)
MAX_USER_ID_CHARS = 256
DEFAULT_TTL = "5m"

# Keys each supported block type may carry (besides MESSAGES_BLOCK_FIELDS' policy entries).
_BLOCK_KEYS = {
    "text": {"type", "text", "cache_control"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "cache_control"},
}
_ROLE_BLOCKS = {"user": {"text", "tool_result"}, "assistant": {"text", "tool_use"}}
_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control"}


@dataclass(frozen=True)
class Breakpoint:
    """One ``cache_control`` breakpoint: where the request is cut to find its prefix.

    Attributes:
        path: The breakpoint's ``cache_control`` field (``tools.0.cache_control``,
            ``system.1.cache_control``, ``messages.3.content.0.cache_control``, or
            ``cache_control`` for the top level).
        ttl: ``"5m"`` or ``"1h"``.
        num_tools: Tools kept: ``k + 1`` for a breakpoint on tool ``k``; -1: all of them.
        num_system_blocks: System blocks kept (None: the whole system prompt, also for a tool
            breakpoint: the system text renders before the tools).
        num_messages: Messages kept whole before the cut one (0 for a tool or system
            breakpoint, whose cut keeps no message).
        num_blocks: Blocks kept of message ``num_messages`` (None: no part of it).
        num_inner_blocks: For a marker inside a ``tool_result``'s content: the text blocks
            kept of that content (the tool_result is the last kept block); None otherwise.
    """

    path: str
    ttl: str
    num_tools: int
    num_system_blocks: int | None
    num_messages: int
    num_blocks: int | None
    num_inner_blocks: int | None = None


@dataclass(frozen=True)
class MessagesRequest:
    """A validated Anthropic body and its OpenAI equivalent.

    Attributes:
        chat: The equivalent OpenAI chat request (messages reduced by ``validate_messages``,
            function tools, tool choice, sampling): it renders to the prompt ids.
        system: The ``system`` field as given: a string, a list of block texts, or None.
        messages: ``(role, blocks)`` per message; a block is a dict of the validated fields
            (``type`` plus ``text`` / ``id``, ``name``, ``input`` / ``tool_use_id``,
            ``content`` as a string or list of texts); ignored block types are left out.
        tools: The function tools (OpenAI shape), in order, or None.
        breakpoints: The ``cache_control`` breakpoints, in Anthropic's order (tools, system,
            messages, then the top-level one), at most ``MAX_BREAKPOINTS``.
        stop_sequences: The stop sequences, in order.
    """

    chat: ChatRequest
    system: str | list[str] | None
    messages: list[tuple[str, list[dict[str, Any]]]]
    tools: list[dict] | None
    breakpoints: tuple[Breakpoint, ...]
    stop_sequences: tuple[str, ...]


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def _cache_control(value: Any, path: str) -> str | None:
    """The TTL of a ``cache_control`` value (None when absent or null).

    Raises:
        APIError: 400 naming ``path`` (not an object, an unknown key) or ``path.type`` /
            ``path.ttl`` (a type other than ``ephemeral``, a TTL other than 5m / 1h).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"'{path}' must be an object {{\"type\": \"ephemeral\", \"ttl\": "
                          f"\"5m\" | \"1h\"}}, got {_type_name(value)}", path)
    for key in value:
        if key not in ("type", "ttl"):
            raise bad_request(f"'{path}.{key}': unknown field (cache_control takes type and "
                              "ttl)", f"{path}.{key}")
    if value.get("type") != "ephemeral":
        raise bad_request(f"'{path}.type' must be 'ephemeral', got {value.get('type')!r}",
                          f"{path}.type")
    ttl = value.get("ttl")
    if ttl is None:
        return DEFAULT_TTL
    if ttl not in TTL_VALUES:
        raise bad_request(f"'{path}.ttl' must be '5m' or '1h', got {ttl!r}", f"{path}.ttl")
    return ttl


def _text(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{path}' must be a string, got {_type_name(value)}", path)
    return value


def _check_keys(block: dict, allowed: set[str], extra: dict, path: str, kind: str,
                found: PolicyCheck) -> None:
    for key, value in block.items():
        if key in allowed or value is None:  # null is neutral for every field
            continue
        entry = extra.get(key)
        if entry is None:
            raise bad_request(f"'{path}.{key}': unknown field for a {kind} block", f"{path}.{key}")
        check_field(entry, value, f"{path}.{key}", found)


class _Collector:
    """Breakpoints in the order they are found, the count and TTL-order rules enforced."""

    def __init__(self) -> None:
        self.found: list[Breakpoint] = []

    def add(self, ttl: str | None, path: str, **where: Any) -> None:
        if ttl is None:
            return
        if len(self.found) == MAX_BREAKPOINTS:
            raise bad_request(f"'{path}': at most {MAX_BREAKPOINTS} cache_control breakpoints "
                              f"are allowed per request; this is the {MAX_BREAKPOINTS + 1}th",
                              path)
        if ttl == "1h" and any(b.ttl == "5m" for b in self.found):
            raise bad_request(f"'{path}.ttl': a 1h breakpoint cannot follow a 5m one (longer "
                              "TTLs come first: tools, then system, then messages)",
                              f"{path}.ttl")
        self.found.append(Breakpoint(path=path, ttl=ttl, **where))


def _text_block(block: Any, path: str, found: PolicyCheck) -> tuple[str, str | None]:
    """``(text, ttl)`` of a text block (system, or inside a tool_result)."""
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind in MESSAGES_REFUSED_BLOCKS:
            raise bad_request(f"'{path}.type': content block type {kind!r} is not supported: "
                              f"{MESSAGES_REFUSED_BLOCKS[kind]}", f"{path}.type")
        raise bad_request(f"'{path}' must be a text block {{\"type\": \"text\", \"text\": ...}}",
                          path)
    _check_keys(block, _BLOCK_KEYS["text"], MESSAGES_BLOCK_FIELDS["text"], path, "text", found)
    return (_text(block.get("text"), f"{path}.text"),
            _cache_control(block.get("cache_control"), f"{path}.cache_control"))


def _system(body: dict, tools: int, found: PolicyCheck, bps: _Collector) -> str | list[str] | None:
    system = body.get("system")
    if system is None or isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise bad_request("'system' must be a string or a list of text blocks", "system")
    if len(system) > MAX_BLOCKS:
        raise bad_request(f"'system' has {len(system)} blocks; at most {MAX_BLOCKS}", "system")
    texts = []
    for j, block in enumerate(system):
        text, ttl = _text_block(block, f"system.{j}", found)
        texts.append(text)
        bps.add(ttl, f"system.{j}.cache_control", num_tools=tools, num_system_blocks=j + 1,
                num_messages=0, num_blocks=None)
    return texts


def _tools(body: dict, bps: _Collector) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' has {len(tools)} tools; at most {MAX_TOOLS}", "tools")
    out: list[dict] = []
    names: set[str] = set()
    for k, tool in enumerate(tools):
        p = f"tools.{k}"
        if not isinstance(tool, dict):
            raise bad_request(f"'{p}' must be an object {{name, description?, input_schema}}", p)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_request(f"'{p}.type': tool type {kind!r} is not supported: server tools "
                              "are not implemented (client tools only: 'custom' or no type)",
                              f"{p}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'{p}.name' must be a non-empty string", f"{p}.name")
        if name in names:
            raise bad_request(f"'{p}.name': tool names must be unique; {name!r} is repeated",
                              f"{p}.name")
        names.add(name)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"'{p}.input_schema' must be an object (a JSON schema)",
                              f"{p}.input_schema")
        if json_depth(schema, MAX_TOOL_SCHEMA_DEPTH) > MAX_TOOL_SCHEMA_DEPTH:
            raise bad_request(f"'{p}.input_schema' is nested deeper than "
                              f"{MAX_TOOL_SCHEMA_DEPTH} levels", f"{p}.input_schema")
        function: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            function["description"] = _text(tool["description"], f"{p}.description")
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
        bps.add(_cache_control(tool.get("cache_control"), f"{p}.cache_control"),
                f"{p}.cache_control", num_tools=k + 1, num_system_blocks=None, num_messages=0,
                num_blocks=None)
    return out or None


def _tool_choice(body: dict, tools: list[dict] | None) -> tuple[str, str | None, bool]:
    """``(OpenAI tool_choice, forced function name, parallel_tool_calls)``."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", None, True
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                          "{\"type\": \"tool\", \"name\": ...}", "tool_choice")
    kind = choice["type"]
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if kind == "none":
        allowed = {"type"}
    for key in choice:
        if key not in allowed:
            raise bad_request(f"'tool_choice.{key}': unknown field for tool_choice type "
                              f"{kind!r}", f"tool_choice.{key}")
    disable = opt_bool(choice, "disable_parallel_tool_use")
    parallel = not disable
    if kind in ("auto", "none"):
        return kind, None, parallel
    if not tools:
        raise bad_request(f"'tool_choice' of type {kind!r} needs 'tools'", "tool_choice")
    if kind == "any":
        return "required", None, parallel
    name = choice.get("name")
    names = [t["function"]["name"] for t in tools]
    if not isinstance(name, str) or name not in names:
        raise bad_request(f"'tool_choice.name' {name!r} is not one of the request's tools "
                          f"{names}", "tool_choice.name")
    return "function", name, parallel


def _tool_result_content(value: Any, path: str, found: PolicyCheck
                         ) -> tuple[Any, list[tuple[int, str]]]:
    """``(content as a string or list of texts, [(index, ttl)] of its text blocks' markers)``."""
    if value is None:
        return "", []
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        raise bad_request(f"'{path}' must be a string or a list of text blocks", path)
    if len(value) > MAX_BLOCKS:
        raise bad_request(f"'{path}' has {len(value)} blocks; at most {MAX_BLOCKS}", path)
    texts: list[str] = []
    markers: list[tuple[int, str]] = []
    for j, block in enumerate(value):
        text, block_ttl = _text_block(block, f"{path}.{j}", found)
        texts.append(text)
        if block_ttl is not None:
            markers.append((j, block_ttl))
    return texts, markers


def _block(block: Any, role: str, path: str, found: PolicyCheck
           ) -> tuple[dict | None, str | None, list[tuple[int, str]]]:
    """``(validated block or None for an ignored one, its TTL, [(index, ttl)] of the markers
    inside a tool_result's content)``."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"'{path}' must be an object with a 'type'", path)
    kind = block["type"]
    if kind in MESSAGES_REFUSED_BLOCKS:
        raise bad_request(f"'{path}.type': content block type {kind!r} is not supported: "
                          f"{MESSAGES_REFUSED_BLOCKS[kind]}", f"{path}.type")
    if kind in MESSAGES_IGNORED_BLOCKS and role == "assistant":
        found.ignored.append(f"messages[].content[{kind}]")
        # Dropped from the prompt, but its marker is checked and counted like any other.
        return None, _cache_control(block.get("cache_control"), f"{path}.cache_control"), []
    if kind not in _ROLE_BLOCKS[role]:
        allowed = " and ".join(sorted(_ROLE_BLOCKS[role]))
        raise bad_request(f"'{path}.type': a {role} message takes {allowed} blocks, got "
                          f"{kind!r}", f"{path}.type")
    _check_keys(block, _BLOCK_KEYS[kind], MESSAGES_BLOCK_FIELDS.get(kind, {}), path, kind, found)
    ttl = _cache_control(block.get("cache_control"), f"{path}.cache_control")
    if kind == "text":
        return {"type": "text", "text": _text(block.get("text"), f"{path}.text")}, ttl, []
    if kind == "tool_use":
        call_id = _text(block.get("id"), f"{path}.id")
        name = block.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'{path}.name' must be a non-empty string", f"{path}.name")
        if not isinstance(block.get("input"), dict):
            raise bad_request(f"'{path}.input' must be an object", f"{path}.input")
        return ({"type": "tool_use", "id": call_id, "name": name, "input": block["input"]},
                ttl, [])
    content, markers = _tool_result_content(block.get("content"), f"{path}.content", found)
    return {"type": "tool_result", "tool_use_id": _text(block.get("tool_use_id"),
                                                        f"{path}.tool_use_id"),
            "content": content}, ttl, markers


def _messages(body: dict, found: PolicyCheck, bps: _Collector
              ) -> list[tuple[str, list[dict[str, Any]]]]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages': field required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"'messages' has {len(messages)} messages; at most {MAX_MESSAGES}",
                          "messages")
    out: list[tuple[str, list[dict[str, Any]]]] = []
    for i, msg in enumerate(messages):
        p = f"messages.{i}"
        if not isinstance(msg, dict):
            raise bad_request(f"'{p}' must be an object {{role, content}}", p)
        role = msg.get("role")
        if role not in ("user", "assistant"):
            hint = " (use the top-level 'system' field)" if role == "system" else ""
            raise bad_request(f"'{p}.role' must be 'user' or 'assistant', got {role!r}{hint}",
                              f"{p}.role")
        for key in msg:
            if key not in ("role", "content"):
                raise bad_request(f"'{p}.{key}': unknown field for a message", f"{p}.{key}")
        content = msg.get("content")
        if isinstance(content, str):
            out.append((role, [{"type": "text", "text": content, "plain": True}]))
            continue
        if not isinstance(content, list):
            raise bad_request(f"'{p}.content' must be a string or a list of content blocks",
                              f"{p}.content")
        if len(content) > MAX_BLOCKS:
            raise bad_request(f"'{p}.content' has {len(content)} blocks; at most {MAX_BLOCKS}",
                              f"{p}.content")
        blocks: list[dict[str, Any]] = []
        for j, raw in enumerate(content):
            block, ttl, markers = _block(raw, role, f"{p}.content.{j}", found)
            if block is not None:
                blocks.append(block)
            # Prompt order: the markers inside a tool_result's content, then its own.
            for k, inner_ttl in markers:
                bps.add(inner_ttl, f"{p}.content.{j}.content.{k}.cache_control", num_tools=-1,
                        num_system_blocks=None, num_messages=i, num_blocks=len(blocks),
                        num_inner_blocks=k + 1)
            bps.add(ttl, f"{p}.content.{j}.cache_control", num_tools=-1,
                    num_system_blocks=None, num_messages=i, num_blocks=len(blocks))
        out.append((role, blocks))
    if out[-1][0] == "assistant":
        raise bad_request(f"'messages.{len(out) - 1}': a final assistant message (prefill) is "
                          "not supported: continuing a message is not implemented; end with a "
                          "user message", f"messages.{len(out) - 1}")
    return out


def _openai_messages(system: str | list[str] | None,
                     messages: list[tuple[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """The OpenAI message list of a (possibly truncated) Anthropic conversation."""
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": system if isinstance(system, str)
                    else [{"type": "text", "text": t} for t in system]})
    for role, blocks in messages:
        if role == "assistant":
            texts = [b["text"] for b in blocks if b["type"] == "text"]
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"],
                                   "arguments": orjson.dumps(b["input"]).decode()}}
                     for b in blocks if b["type"] == "tool_use"]
            message: dict[str, Any] = {"role": "assistant"}
            if len(blocks) == 1 and blocks[0].get("plain"):
                message["content"] = texts[0]
            else:
                message["content"] = [{"type": "text", "text": t} for t in texts] or None
            if calls:
                message["tool_calls"] = calls
            out.append(message)
            continue
        if len(blocks) == 1 and blocks[0].get("plain"):
            out.append({"role": "user", "content": blocks[0]["text"]})
            continue
        pending: list[dict[str, str]] = []
        for b in blocks:
            if b["type"] == "text":
                pending.append({"type": "text", "text": b["text"]})
                continue
            if pending:
                out.append({"role": "user", "content": pending})
                pending = []
            content = b["content"]
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": content if isinstance(content, str)
                        else [{"type": "text", "text": t} for t in content]})
        if pending or not blocks:
            out.append({"role": "user", "content": pending})
    return out


def truncated_chat(req: MessagesRequest, bp: Breakpoint) -> tuple[list[dict], list[dict] | None]:
    """``(messages, tools)`` of the chat cut right after ``bp``'s block, for rendering without
    a generation prompt: its tokens' common prefix with the prompt is the breakpoint's prefix.

    A tool breakpoint keeps the system prompt and the tools up to it (the fallback tool
    rendering puts them after the system text); a system breakpoint keeps every tool (they
    follow the last system block) and the system blocks up to it; a message breakpoint keeps
    everything before its block; a marker inside a tool_result's content keeps that
    tool_result with its content's text blocks up to the marked one.

    Raises:
        APIError: 400 when the cut chat is not a valid chat request (not seen for a cut of a
            valid body; the handler treats it as a breakpoint it cannot place).
    """
    tools = req.tools
    if bp.num_tools >= 0 and tools is not None:
        tools = tools[:bp.num_tools]
    system = req.system
    if bp.num_system_blocks is not None and isinstance(system, list):
        system = system[:bp.num_system_blocks]
    messages = req.messages[:bp.num_messages]
    if bp.num_blocks is not None:
        role, blocks = req.messages[bp.num_messages]
        kept = blocks[:bp.num_blocks]
        if bp.num_inner_blocks is not None:  # a marker inside the last kept tool_result
            last = kept[-1]
            kept = [*kept[:-1], {**last, "content": last["content"][:bp.num_inner_blocks]}]
        messages = [*messages, (role, kept)]
    cut = _openai_messages(system, messages)
    if not cut:  # a tool breakpoint without a system prompt: the tools make the system turn
        return [{"role": "system", "content": ""}], tools
    return validate_messages(cut), tools


def _sampling_body(body: dict, *, stream: bool) -> dict[str, Any]:
    """The OpenAI sampling fields equivalent to the Anthropic ones (validated here first, so
    that ``parse_sampling`` cannot refuse them under their OpenAI names)."""
    max_tokens = opt_int(body, "max_tokens", 1)
    if max_tokens is None:
        raise bad_request("'max_tokens': field required", "max_tokens")
    out: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream}
    temperature = opt_number(body, "temperature", 0.0, 1.0)
    if temperature is not None:
        out["temperature"] = temperature
    top_p = opt_number(body, "top_p", 0.0, 1.0, lo_open=True)
    if top_p is not None:
        out["top_p"] = top_p
    top_k = opt_int(body, "top_k", 0)
    if top_k is not None:
        out["top_k"] = top_k
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad_request("'stop_sequences' must be a list of non-empty strings",
                              "stop_sequences")
        if len(stop) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise bad_request(f"'stop_sequences' allows at most {MAX_STOP_SEQUENCES} sequences "
                              f"of at most {MAX_STOP_CHARS} characters", "stop_sequences")
        if stop:
            out["stop"] = list(stop)
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad_request("'metadata' must be an object {\"user_id\": ...}", "metadata")
        for key in metadata:
            if key != "user_id":
                raise bad_request(f"'metadata.{key}': unknown field (metadata takes user_id)",
                                  f"metadata.{key}")
        user_id = metadata.get("user_id")
        if user_id is not None and (not isinstance(user_id, str)
                                    or len(user_id) > MAX_USER_ID_CHARS):
            raise bad_request(f"'metadata.user_id' must be a string of at most "
                              f"{MAX_USER_ID_CHARS} characters", "metadata.user_id")
        if user_id:
            out["prompt_cache_key"] = user_id
    return out


def _cache_salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_SALT_CHARS):
        raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} "
                          "characters", "cache_salt")
    return salt


def _parse(body: dict[str, Any], served_model: str | tuple[str, ...], table: dict,
           *, count_only: bool) -> MessagesRequest:
    check_model(body, served_model)
    found = param_policy.check(body, table)
    bps = _Collector()
    tools = _tools(body, bps)
    num_tools = len(tools or ())
    system = _system(body, num_tools, found, bps)
    messages = _messages(body, found, bps)
    last = len(messages) - 1
    bps.add(_cache_control(body.get("cache_control"), "cache_control"), "cache_control",
            num_tools=-1, num_system_blocks=None, num_messages=last,
            num_blocks=len(messages[last][1]))
    choice, function, parallel = _tool_choice(body, tools)
    if count_only:
        sampling = parse_sampling({"max_tokens": 1, "cache_salt": _cache_salt(body)})
    else:
        stream = opt_bool(body, "stream")
        sampling = parse_sampling({**_sampling_body(body, stream=bool(stream)),
                                   "cache_salt": _cache_salt(body)})
    chat = ChatRequest(messages=validate_messages(_openai_messages(system, messages)),
                       tools=validate_tools(tools), tool_choice=choice,
                       tool_choice_function=function, parallel_tool_calls=parallel,
                       chat_template_kwargs=None,
                       **{**sampling.fields(), **({"max_tokens": None} if count_only else {})})
    found.record()
    return MessagesRequest(chat=chat, system=system, messages=messages, tools=tools,
                           breakpoints=tuple(bps.found), stop_sequences=chat.stop)


def parse_messages_request(body: dict[str, Any], served_model: str | tuple[str, ...]
                           ) -> MessagesRequest:
    """Validate a ``POST /v1/messages`` body (fields per ``param_table.MESSAGES_PARAMS``).

    Raises:
        APIError: 400 naming the field (Anthropic's dotted path) for any invalid or
            unsupported field, more than ``MAX_BREAKPOINTS`` breakpoints, a 1h breakpoint after
            a 5m one, or a final assistant message; 404 for an unknown model.
    """
    return _parse(body, served_model, MESSAGES_PARAMS, count_only=False)


def parse_count_tokens_request(body: dict[str, Any], served_model: str | tuple[str, ...]
                               ) -> MessagesRequest:
    """Validate a ``POST /v1/messages/count_tokens`` body (``param_table.COUNT_TOKENS_PARAMS``:
    the messages fields without the sampling ones; ``chat.max_tokens`` is None).

    Raises:
        APIError: as ``parse_messages_request``.
    """
    return _parse(body, served_model, COUNT_TOKENS_PARAMS, count_only=True)

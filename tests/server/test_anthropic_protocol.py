"""Anthropic bodies without a server: the translation to OpenAI chat requests, breakpoint
positions, the parameter policy of the messages tables, Anthropic's error shape, and the
key file's ``max_retained_tokens``."""

from __future__ import annotations

import pytest

from radixkv.server.anthropic_protocol import (
    Breakpoint,
    parse_count_tokens_request,
    parse_messages_request,
    truncated_chat,
)
from radixkv.server.auth import Tenant, parse_api_keys
from radixkv.server.errors import APIError, anthropic_error, is_anthropic_path
from radixkv.server.param_policy import IGNORED, NEUTRAL, SUPPORTED, same_json
from radixkv.server.param_table import COUNT_TOKENS_PARAMS, MESSAGES_PARAMS

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]


def parse(**body):
    return parse_messages_request({"max_tokens": 8, **body}, MODEL)


def refused(body: dict, parser=parse_messages_request) -> APIError:
    with pytest.raises(APIError) as info:
        parser(body, MODEL)
    assert info.value.status == 400
    return info.value


def test_translation_to_the_equivalent_openai_chat():
    req = parse(
        system=[{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}],
        tools=[{"name": "get", "description": "d", "input_schema": {"type": "object"}}],
        tool_choice={"type": "tool", "name": "get", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=7,
        metadata={"user_id": "u-1"}, stream=True,
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "t1", "name": "get", "input": {"a": [1, "é"]}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "r1", "is_error": True},
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "r2"}, {"type": "text", "text": "r3"}]},
                {"type": "text", "text": "more"}, {"type": "text", "text": "and more"}]}])
    chat = req.chat
    assert chat.messages == [
        {"role": "system", "content": "S1\nS2"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "tool_calls": [{
            "id": "t1", "type": "function",
            "function": {"name": "get", "arguments": '{"a":[1,"é"]}'}}]},
        {"role": "tool", "content": "r1", "tool_call_id": "t1"},
        {"role": "tool", "content": "r2\nr3", "tool_call_id": "t1"},
        {"role": "user", "content": "more\nand more"}]
    assert chat.tools == [{"type": "function", "function": {
        "name": "get", "description": "d", "parameters": {"type": "object"}}}]
    assert (chat.tool_choice, chat.tool_choice_function, chat.parallel_tool_calls) == (
        "function", "get", False)
    assert (chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.max_tokens) == (
        ("END",), 0.5, 0.9, 7, 8)
    assert (chat.session_key, chat.stream, chat.n, chat.seed, chat.include_usage) == (
        "u-1", True, 1, None, False)
    assert req.breakpoints == ()


@pytest.mark.parametrize("choice,expected", [
    (None, ("auto", None, True)), ({"type": "auto"}, ("auto", None, True)),
    ({"type": "any"}, ("required", None, True)), ({"type": "none"}, ("none", None, True)),
    ({"type": "auto", "disable_parallel_tool_use": True}, ("auto", None, False)),
])
def test_tool_choice_maps_to_openai(choice, expected):
    req = parse(messages=HI, tools=[{"name": "get", "input_schema": {"type": "object"}}],
                **({"tool_choice": choice} if choice else {}))
    assert (req.chat.tool_choice, req.chat.tool_choice_function,
            req.chat.parallel_tool_calls) == expected


def test_string_and_empty_contents():
    req = parse(system="", messages=[{"role": "user", "content": []},
                                     {"role": "assistant", "content": []},
                                     {"role": "user", "content": "x"}])
    assert req.chat.messages == [{"role": "system", "content": ""},
                                 {"role": "user", "content": ""},
                                 {"role": "assistant", "content": ""},
                                 {"role": "user", "content": "x"}]


def test_breakpoints_in_anthropic_order_and_their_cuts():
    cc1, cc5 = {"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral"}
    req = parse(
        tools=[{"name": "a", "input_schema": {"type": "object"}, "cache_control": cc1},
               {"name": "b", "input_schema": {"type": "object"}}],
        system=[{"type": "text", "text": "S1", "cache_control": cc1},
                {"type": "text", "text": "S2"}],
        messages=[{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "r"},
                  {"role": "user", "content": [{"type": "text", "text": "u1", "cache_control": cc5},
                                               {"type": "text", "text": "u2"}]}],
        cache_control=cc5)
    assert req.breakpoints == (
        Breakpoint("tools.0.cache_control", "1h", 1, None, 0, None),
        Breakpoint("system.0.cache_control", "1h", 2, 1, 0, None),
        Breakpoint("messages.2.content.0.cache_control", "5m", -1, None, 2, 1),
        Breakpoint("cache_control", "5m", -1, None, 2, 2))
    tools_cut = truncated_chat(req, req.breakpoints[0])
    assert tools_cut == ([{"role": "system", "content": "S1\nS2"}], [req.tools[0]])
    assert truncated_chat(req, req.breakpoints[1]) == ([{"role": "system", "content": "S1"}],
                                                       req.tools)
    assert truncated_chat(req, req.breakpoints[2]) == ([
        {"role": "system", "content": "S1\nS2"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "r"}, {"role": "user", "content": "u1"}], req.tools)
    assert truncated_chat(req, req.breakpoints[3])[0] == req.chat.messages


def test_tool_breakpoint_without_a_system_prompt_keeps_an_empty_system_turn():
    req = parse(tools=[{"name": "a", "input_schema": {"type": "object"},
                        "cache_control": {"type": "ephemeral"}}], messages=HI)
    assert truncated_chat(req, req.breakpoints[0]) == (
        [{"role": "system", "content": ""}], req.tools)


CC5, CC1 = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}
CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get",
                                          "input": {}}]}


def with_result(*texts: dict, own: dict | None = None, thinking: dict | None = None) -> dict:
    """A body whose message 2 holds one tool_result with ``texts`` as its content blocks
    (and ``own`` as its cache_control); ``thinking`` is added to the assistant message 1."""
    call = CALL if thinking is None else {
        "role": "assistant", "content": [{"type": "thinking", "thinking": "hm",
                                          "signature": "s", **thinking}, *CALL["content"]]}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": list(texts),
              **({"cache_control": own} if own is not None else {})}
    return {"max_tokens": 8, "messages": [{"role": "user", "content": "q"}, call,
                                          {"role": "user", "content": [result]}]}


def text(t: str, cc: dict | None = None) -> dict:
    return {"type": "text", "text": t, **({"cache_control": cc} if cc is not None else {})}


def test_every_marker_inside_a_tool_result_counts_under_its_own_path():
    err = refused(with_result(*(text(f"r{k}", CC5) for k in range(6))))
    assert (err.param, err.message) == (
        "messages.2.content.0.content.4.cache_control",
        "'messages.2.content.0.content.4.cache_control': at most 4 cache_control breakpoints "
        "are allowed per request; this is the 5th")
    # Four inside and the tool_result's own: five.
    err = refused(with_result(*(text(f"r{k}", CC5) for k in range(4)), own=CC5))
    assert err.param == "messages.2.content.0.cache_control"


def test_the_ttl_order_is_checked_inside_a_tool_result():
    err = refused(with_result(text("r0", CC5), text("r1", CC1)))
    assert (err.param, err.message) == (
        "messages.2.content.0.content.1.cache_control.ttl",
        "'messages.2.content.0.content.1.cache_control.ttl': a 1h breakpoint cannot follow a "
        "5m one (longer TTLs come first: tools, then system, then messages)")
    # The content comes before the end of its tool_result: a 1h on the block after a 5m inside.
    err = refused(with_result(text("r0", CC5), own=CC1))
    assert err.param == "messages.2.content.0.cache_control.ttl"
    err = refused(with_result(text("r0", {"type": "ephemeral", "ttl": "2h"})))
    assert (err.param, err.message) == (
        "messages.2.content.0.content.0.cache_control.ttl",
        "'messages.2.content.0.content.0.cache_control.ttl' must be '5m' or '1h', got '2h'")


def test_markers_inside_a_tool_result_cut_its_content():
    req = parse_messages_request(
        with_result(text("r0"), text("r1", CC1), text("r2", CC5), own=CC5), MODEL)
    assert req.breakpoints == (
        Breakpoint("messages.2.content.0.content.1.cache_control", "1h", -1, None, 2, 1, 2),
        Breakpoint("messages.2.content.0.content.2.cache_control", "5m", -1, None, 2, 1, 3),
        Breakpoint("messages.2.content.0.cache_control", "5m", -1, None, 2, 1))
    head = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "t1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]}]
    cuts = [truncated_chat(req, bp)[0] for bp in req.breakpoints]
    assert cuts == [
        [*head, {"role": "tool", "content": "r0\nr1", "tool_call_id": "t1"}],
        [*head, {"role": "tool", "content": "r0\nr1\nr2", "tool_call_id": "t1"}],
        req.chat.messages]


def test_a_marker_on_an_ignored_thinking_block_is_checked_and_counted():
    err = refused(with_result(text("r"), thinking={"cache_control": {"type": "ephemeral",
                                                                      "ttl": "2h"}}))
    assert (err.param, err.message) == (
        "messages.1.content.0.cache_control.ttl",
        "'messages.1.content.0.cache_control.ttl' must be '5m' or '1h', got '2h'")
    err = refused(with_result(text("r"), thinking={"cache_control": "yes"}))
    assert err.param == "messages.1.content.0.cache_control"
    err = refused(with_result(*(text(f"r{k}", CC5) for k in range(4)),
                              thinking={"cache_control": CC5}))
    assert err.param == "messages.2.content.0.content.3.cache_control"  # the 5th
    req = parse_messages_request(with_result(text("r"), thinking={"cache_control": CC1}), MODEL)
    # The thinking block renders to nothing: its cut keeps an empty assistant turn.
    assert req.breakpoints == (
        Breakpoint("messages.1.content.0.cache_control", "1h", -1, None, 1, 0),)
    assert truncated_chat(req, req.breakpoints[0]) == (
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}], None)


def test_count_tokens_takes_the_prompt_fields_only():
    req = parse_count_tokens_request({"messages": HI, "system": "s"}, MODEL)
    assert req.chat.max_tokens is None and req.chat.messages[0] == {"role": "system",
                                                                    "content": "s"}
    assert set(COUNT_TOKENS_PARAMS) < set(MESSAGES_PARAMS)
    assert "max_tokens" not in COUNT_TOKENS_PARAMS and "stream" not in COUNT_TOKENS_PARAMS


@pytest.mark.parametrize("body,param,message", [
    ({"messages": HI, "max_tokens": 0}, "max_tokens", "'max_tokens' must be >= 1, got 0"),
    ({"messages": HI, "max_tokens": 1, "top_k": -1}, "top_k", "'top_k' must be >= 0, got -1"),
    ({"messages": HI, "max_tokens": 1, "stop_sequences": "END"}, "stop_sequences",
     "'stop_sequences' must be a list of non-empty strings"),
    ({"messages": HI, "max_tokens": 1, "metadata": {"user_id": "u", "x": 1}}, "metadata.x",
     "'metadata.x': unknown field (metadata takes user_id)"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}],
      "max_tokens": 1}, "messages.0.content.0.extra",
     "'messages.0.content.0.extra': unknown field for a text block"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a",
                                                 "citations": [{"x": 1}]}]}], "max_tokens": 1},
     "messages.0.content.0.citations",
     "'messages.0.content.0.citations' is not supported: citations are not implemented (only "
     "[] or null is accepted)"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x",
                                                 "input": {}}]}], "max_tokens": 1},
     "messages.0.content.0.type",
     "'messages.0.content.0.type': a user message takes text and tool_result blocks, got "
     "'tool_use'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "x", "input": "{}"}]},
        {"role": "user", "content": "b"}], "max_tokens": 1}, "messages.1.content.0.input",
     "'messages.1.content.0.input' must be an object"),
    ({"messages": HI, "max_tokens": 1, "tools": [{"name": "web_search",
                                                  "type": "web_search_20250305"}]},
     "tools.0.type", "'tools.0.type': tool type 'web_search_20250305' is not supported: server "
                     "tools are not implemented (client tools only: 'custom' or no type)"),
    ({"messages": HI, "max_tokens": 1, "tools": [
        {"name": "a", "input_schema": {}}, {"name": "a", "input_schema": {}}]}, "tools.1.name",
     "'tools.1.name': tool names must be unique; 'a' is repeated"),
    ({"messages": HI, "max_tokens": 1, "tools": [{"name": "a", "input_schema": {}}],
      "tool_choice": {"type": "tool", "name": "b"}}, "tool_choice.name",
     "'tool_choice.name' 'b' is not one of the request's tools ['a']"),
    ({"messages": HI, "max_tokens": 1, "cache_control": {"type": "ephemeral", "x": 1}},
     "cache_control.x", "'cache_control.x': unknown field (cache_control takes type and ttl)"),
    ({"messages": HI, "max_tokens": 1, "mcp_servers": [{"url": "x"}]}, "mcp_servers",
     "'mcp_servers' is not supported: MCP connectors are not implemented (only [] or null is "
     "accepted)"),
    ({"messages": HI, "max_tokens": 1, "service_tier": 3}, "service_tier",
     "'service_tier' must be string, got 3"),
])
def test_bad_fields_are_named(body, param, message):
    err = refused(body)
    assert (err.param, err.message) == (param, message)


def test_messages_table_is_well_formed_and_classifies_what_clients_send():
    for name, p in MESSAGES_PARAMS.items():
        assert p.name == name and p.policy in (SUPPORTED, IGNORED, NEUTRAL)
        if p.policy == NEUTRAL:
            assert p.neutral[0] is None and p.schema["enum"] == list(p.neutral) and p.why
    policies = {n: p.policy for n, p in MESSAGES_PARAMS.items()}
    for name in ("model", "messages", "system", "max_tokens", "tools", "tool_choice",
                 "stop_sequences", "temperature", "top_p", "top_k", "stream", "metadata",
                 "cache_control"):
        assert policies[name] == SUPPORTED, name
    for name in ("thinking", "mcp_servers", "output_config", "context_management"):
        assert policies[name] == NEUTRAL, name
    for name in ("service_tier", "inference_geo", "container"):
        assert policies[name] == IGNORED, name


@pytest.mark.parametrize("name", [n for n, p in MESSAGES_PARAMS.items() if p.policy == NEUTRAL])
def test_neutral_fields_accept_their_neutral_values_only(name):
    param = MESSAGES_PARAMS[name]
    for value in param.neutral:
        parse(messages=HI, **{name: value})
    for value in (1, "x", {"type": "enabled"}, [1]):
        if not any(same_json(value, n) for n in param.neutral):
            assert refused({"max_tokens": 1, "messages": HI, name: value}).param == name


def test_anthropic_error_shape_and_statuses():
    assert is_anthropic_path("/v1/messages") and is_anthropic_path("/v1/messages/count_tokens")
    assert not is_anthropic_path("/v1/messagesx") and not is_anthropic_path("/v1/chat/completions")
    cases = [(400, "invalid_request_error"), (401, "authentication_error"),
             (403, "permission_error"), (404, "not_found_error"), (413, "request_too_large"),
             (415, "invalid_request_error"), (429, "rate_limit_error"), (500, "api_error")]
    for status, type_ in cases:
        assert anthropic_error(APIError(status, "m"), "rid") == (status, {
            "type": "error", "error": {"type": type_, "message": "m"}, "request_id": "rid"})
    assert anthropic_error(APIError(503, "queue full", code="queue_full")) == (
        529, {"type": "error", "error": {"type": "overloaded_error", "message": "queue full"}})


def test_key_file_max_retained_tokens():
    keys = parse_api_keys({"k" * 8: {"tenant": "a", "max_retained_tokens": 4096},
                           "j" * 8: {"tenant": "b", "admin": True}})
    assert keys == {"k" * 8: Tenant("a", False, 4096), "j" * 8: Tenant("b", True, None)}
    for bad in (-1, 1.5, "10", True):
        with pytest.raises(ValueError, match="entry 1 of api keys: 'max_retained_tokens' must "
                                             "be a non-negative integer"):
            parse_api_keys({"k" * 8: {"tenant": "a", "max_retained_tokens": bad}})

"""Tool-call parsing: whole replies, the incremental parser, the chat chunks built on it."""

from __future__ import annotations

import re

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.server.responses import ChatCompletion
from radixkv.server.tool_calls import (
    ParsedCall,
    ToolCallOptions,
    ToolCallStream,
    forced_prefix,
    memory_key,
    options_for,
    parse_call,
    parse_reply,
)

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')


def test_one_call_alone_has_null_content():
    assert parse_reply(CALL) == parse_reply("\n" + CALL + " \n") == parse_reply(CALL, False)
    reply = parse_reply(CALL)
    assert (reply.content, reply.calls, reply.dropped) == (None, [WEATHER], 0)


def test_text_around_and_between_blocks_stays_content_verbatim():
    qwen = ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\nDone.')
    reply = parse_reply(qwen)
    assert reply.content == "Let me look.\n\n\nDone."
    assert reply.calls == [ParsedCall("a", '{"x": 1}'), ParsedCall("b", "{}")]


def test_malformed_blocks_stay_text():
    for body in ['{"name": "x", ', '{"arguments": {}}', '{"name": 3}', '{"name": ""}',
                 '["get_weather"]', '"get_weather"', '{"name": "x", "arguments": NaN}', ""]:
        text = f"ok <tool_call>{body}</tool_call>"
        assert parse_reply(text) == parse_reply(text, False)
        assert (parse_reply(text).content, parse_reply(text).calls) == (text, []), body
    # A malformed block next to a good one: the bad one is content, verbatim.
    bad = '<tool_call>{"name": }</tool_call>'
    reply = parse_reply(bad + CALL)
    assert (reply.content, reply.calls) == (bad, [WEATHER])


def test_an_unclosed_block_stays_text():
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_'
    assert (parse_reply(cut).content, parse_reply(cut).calls) == (cut, [])
    # A complete call followed by a cut one (max_tokens): the call, the rest as content.
    reply = parse_reply(CALL + "\n" + cut)
    assert (reply.content, reply.calls) == ("\n" + cut, [WEATHER])


def test_arguments_become_a_json_string():
    assert parse_call('{"name": "f"}') == ParsedCall("f", "{}")
    assert parse_call('{"name": "f", "arguments": {"city": "Zürich"}}') == ParsedCall(
        "f", '{"city": "Zürich"}')
    # A string that holds JSON is already what OpenAI sends; any other value is encoded.
    assert parse_call('{"name": "f", "arguments": "{\\"a\\": [1]}"}') == ParsedCall(
        "f", '{"a": [1]}')
    assert parse_call('{"name": "f", "arguments": "Paris"}') == ParsedCall("f", '"Paris"')
    assert parse_call('{"name": "f", "arguments": [1, 2]}') == ParsedCall("f", "[1, 2]")
    assert parse_call("[" * 100_000) is None  # too deep for json: not a call, no crash


def test_parallel_false_keeps_the_first_call_only():
    second = CALL.replace("Paris", "Lyon")
    reply = parse_reply(CALL + "\n" + second, parallel=False)
    assert (reply.content, reply.calls, reply.dropped) == (None, [WEATHER], 1)
    assert len(parse_reply(CALL + "\n" + second).calls) == 2


def test_no_call_keeps_the_text_as_is():
    for text in ["", "  \n", "plain", "a <tool_ b", "<tool_call>"]:
        assert (parse_reply(text).content, parse_reply(text).calls) == (text, [])


def test_stream_holds_back_a_possible_tag_and_releases_it_when_decided():
    s = ToolCallStream()
    assert s.feed("Hi <tool") == [("content", "Hi ")]
    assert s.feed("_") == []
    assert s.feed("x> y") == [("content", "<tool_x> y")]
    assert s.feed("<tool_call>{\"name\": \"get_weather\", ") == []
    assert s.feed('"arguments": {"city": "Paris"}}</tool_call') == []
    assert s.feed(">\nok") == [("call", (0, WEATHER)), ("content", "\nok")]
    assert s.finish() == []


def test_stream_flushes_an_open_block_and_whitespace_at_the_end():
    s = ToolCallStream()
    assert s.feed("\n\n") == []  # leading whitespace: content only if something else follows
    assert s.feed("<tool_call>{\"name\"") == []
    assert s.finish() == [("content", '\n\n<tool_call>{"name"')]
    s = ToolCallStream()
    assert s.feed(" \n") == [] and s.finish() == [("content", " \n")]  # no call: kept
    s = ToolCallStream()
    assert s.feed(" \n" + CALL + "\n") == [("call", (0, WEATHER))]
    assert s.finish() == []  # a call and whitespace only: content null


def test_a_long_block_streamed_in_small_pieces():
    args = {"text": "x<tool_call>y</tool_" * 5_000}
    text = '<tool_call>{"name": "f", "arguments": ' + orjson.dumps(args).decode() + "}</tool_call>ok"
    s = ToolCallStream()
    events = [e for i in range(0, len(text), 3) for e in s.feed(text[i:i + 3])] + s.finish()
    assert events == [("call", (0, ParsedCall("f", orjson.dumps(args).decode().replace(
        '":"', '": "')))), ("content", "ok")]


PIECES = ["Sure", " ", "\n", CALL, CALL.replace("Paris", "Lyon"), "<tool_call>{bad}</tool_call>",
          "<tool_call>", "</tool_call>", "<", "tool", "_call", ">", '{"name": "f"}', "é"]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=8), cuts=st.lists(
    st.integers(min_value=0, max_value=400), max_size=12), parallel=st.booleans())
def test_streaming_in_any_pieces_equals_the_whole_parse(parts, cuts, parallel):
    text = "".join(parts)
    whole = parse_reply(text, parallel)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    s = ToolCallStream(parallel=parallel)
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += s.feed(text[a:b])
    events += s.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "call"]
    assert [c for _, c in calls] == whole.calls
    assert [k for k, _ in calls] == list(range(len(calls)))
    if whole.calls:
        assert content == (whole.content or "")
    else:
        assert content == text == whole.content


def test_forced_prefix_follows_each_format():
    assert forced_prefix("required", None, False) == "<tool_call>"
    assert forced_prefix("required", None, True) == "<tool_call>\n"
    assert forced_prefix("function", "get_weather", False) == (
        '<tool_call>{"name": "get_weather", "arguments": ')
    assert forced_prefix("function", "f", True) == '<tool_call>\n{"name": "f", "arguments": '
    assert forced_prefix("auto", None, False) == forced_prefix("none", None, False) == ""


class Req:
    def __init__(self, tools=(1,), tool_choice="auto", tool_choice_function=None,
                 parallel_tool_calls=True):
        self.tools, self.tool_choice = list(tools), tool_choice
        self.tool_choice_function = tool_choice_function
        self.parallel_tool_calls = parallel_tool_calls


def test_options_for_a_request():
    chatml = "{% for m in messages %}{{ m.content }}{% endfor %}"
    hermes = chatml + "{{ tools }}{{ m.tool_calls }}"
    assert options_for(Req(tools=()), chatml) is None
    assert options_for(Req(tool_choice="none"), chatml) is None
    assert options_for(Req(), chatml) == ToolCallOptions(parallel=True, prefix="")
    assert options_for(Req(tool_choice="function", tool_choice_function="f",
                           parallel_tool_calls=False), hermes) == ToolCallOptions(
        parallel=False, prefix='<tool_call>\n{"name": "f", "arguments": ', hermes_template=True)


def test_memory_key_is_the_fallback_rendering_of_the_returned_message():
    text = "Checking.\n" + CALL + "\nOne moment."
    assert memory_key(text, None) == text
    assert memory_key("no calls", ToolCallOptions()) == "no calls"
    assert memory_key(text, ToolCallOptions()) == (
        'Checking.\n\nOne moment.\n<tool_call>{"arguments":{"city":"Paris"},'
        '"name":"get_weather"}</tool_call>')
    assert memory_key(CALL, ToolCallOptions()) == (
        '<tool_call>{"arguments":{"city":"Paris"},"name":"get_weather"}</tool_call>')
    assert memory_key(text, ToolCallOptions(hermes_template=True)) is None
    assert memory_key(CALL + CALL, ToolCallOptions(parallel=False)) is None


def chunks(raw: bytes) -> list[dict]:
    return [orjson.loads(e[len(b"data: "):]) for e in raw.split(b"\n\n") if e]


def test_chat_completion_body_with_tool_calls():
    shape = ChatCompletion(model="m", tools=ToolCallOptions(prefix="<tool_call>"))
    body = shape.response([(CALL[len("<tool_call>"):] + "\nok", "length"), ("no call", "stop")],
                          {})
    first, second = body["choices"]
    call = first["message"]["tool_calls"][0]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert first == {"index": 0, "logprobs": None, "finish_reason": "tool_calls",
                     "message": {"role": "assistant", "content": "\nok", "tool_calls": [
                         {"id": call["id"], "type": "function", "function": {
                             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}
    assert second["message"] == {"role": "assistant", "content": "<tool_call>no call"}
    assert second["finish_reason"] == "stop"
    plain = ChatCompletion(model="m").response([(CALL, "stop")], {})
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": CALL}


def test_chat_completion_chunks_with_tool_calls():
    shape = ChatCompletion(model="m", tools=ToolCallOptions(prefix='<tool_call>{"name": '))
    assert shape.content_chunk('"f", "arguments": {}}</tool_', 1) == b""
    out = chunks(shape.content_chunk("call>Hi <tool", 1))
    call_id = out[0]["choices"][0]["delta"]["tool_calls"][0]["id"]
    assert [c["choices"] for c in out] == [
        [{"index": 1, "logprobs": None, "finish_reason": None, "delta": {"tool_calls": [
            {"index": 0, "id": call_id, "type": "function",
             "function": {"name": "f", "arguments": "{}"}}]}}],
        [{"index": 1, "logprobs": None, "finish_reason": None, "delta": {"content": "Hi "}}]]
    out = chunks(shape.finish_chunk("stop", 1))
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in out] == [
        ({"content": "<tool"}, None), ({}, "tool_calls")]
    # Another choice of the same completion has its own parser; no call: the reason as is.
    assert chunks(shape.content_chunk("x", 0)) == []
    out = chunks(shape.finish_chunk("length", 0))
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in out] == [
        ({"content": '<tool_call>{"name": x'}, None), ({}, "length")]

"""Pure request validation (no engine): every refusal names its parameter."""

from __future__ import annotations

import pytest

from radixkv.server.errors import APIError
from radixkv.server.protocol import (
    parse_chat_request,
    parse_json_object,
    parse_tokenize_request,
    validate_messages,
)

MODEL = "tiny"
MSG = [{"role": "user", "content": "hi"}]


def refused(body, status=400):
    with pytest.raises(APIError) as info:
        parse_chat_request(body, MODEL)
    assert info.value.status == status
    return info.value


def test_minimal_request_defaults():
    req = parse_chat_request({"messages": MSG}, MODEL)
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stop) == (
        None, 1.0, 1.0, 0, None, ())
    assert (req.stream, req.include_usage, req.cache_salt, req.tools) == (False, False, None, None)


def test_full_request_is_accepted():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    req = parse_chat_request({
        "model": MODEL, "messages": [
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "out", "tool_call_id": "c1", "name": "f"}],
        "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 3,
        "stop": "x", "stream": True, "stream_options": {"include_usage": True}, "n": 1,
        "cache_salt": "s", "user": "u", "tools": tools, "tool_choice": "auto", "logprobs": False,
        "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0,
        "response_format": {"type": "text"}, "parallel_tool_calls": True}, MODEL)
    assert req.messages[0] == {"role": "system", "content": "sys"}
    assert req.messages[1] == {"role": "user", "content": "a\nb"}
    assert req.messages[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert req.messages[3] == {"role": "tool", "content": "out", "tool_call_id": "c1", "name": "f"}
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stop) == (
        7, 0.0, 0.5, 0, 3, ("x",))
    assert (req.stream, req.include_usage, req.cache_salt, req.tools) == (True, True, "s", tools)
    params = req.sampling_params(7)
    assert (params.max_tokens, params.temperature, params.top_k, params.stop) == (7, 0.0, 0, ("x",))


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a"}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": MSG, "max_tokens": "5"}, "max_tokens"),
    ({"messages": MSG, "max_tokens": True}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "temperature": 2.5}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "top_k": -2}, "top_k"),
    ({"messages": MSG, "seed": 1.5}, "seed"),
    ({"messages": MSG, "stop": 3}, "stop"),
    ({"messages": MSG, "stop": [""]}, "stop"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSG, "stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    ({"messages": MSG, "n": 65}, "n"),
    ({"messages": MSG, "logit_bias": {"5": 10}}, "logit_bias"),
    ({"messages": MSG, "logprobs": True}, "logprobs"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": MSG, "frequency_penalty": -1}, "frequency_penalty"),
    ({"messages": MSG, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": MSG, "cache_salt": 5}, "cache_salt"),
    ({"messages": MSG, "model": 5}, "model"),
    ({"messages": MSG, "best_of": 2}, "best_of"),
])
def test_bad_requests_name_the_parameter(body, param):
    err = refused(body)
    assert (err.type, err.param) == ("invalid_request_error", param)
    assert err.to_dict() == {"error": {"message": err.message, "type": "invalid_request_error",
                                       "param": param, "code": None}}


def test_unknown_model_is_404():
    err = refused({"messages": MSG, "model": "gpt-4"}, status=404)
    assert (err.param, err.code) == ("model", "model_not_found")


@pytest.mark.parametrize("raw,ctype,fragment", [
    (b"{", "application/json", "not valid JSON"),
    (b"[1]", "application/json", "JSON object"),
    (b"{}", "text/plain", "Content-Type"),
])
def test_body_decoding(raw, ctype, fragment):
    with pytest.raises(APIError, match=fragment) as info:
        parse_json_object(raw, ctype)
    assert info.value.status == 400
    assert parse_json_object(b'{"a": 1}', "application/json") == {"a": 1}


def test_tokenize_request_shapes():
    req = parse_tokenize_request({"model": MODEL, "messages": MSG}, MODEL)
    assert (req.messages, req.prompt) == ([{"role": "user", "content": "hi"}], None)
    req = parse_tokenize_request({"prompt": "abc"}, MODEL)
    assert (req.messages, req.prompt) == (None, "abc")
    for body, param in [({}, "messages"), ({"prompt": "a", "messages": MSG}, "prompt"),
                        ({"prompt": 3}, "prompt"),
                        ({"prompt": "a", "return_token_strs": True}, "return_token_strs"),
                        ({"prompt": "a", "chat_template_kwargs": {"x": 1}},
                         "chat_template_kwargs"),
                        ({"messages": MSG, "add_generation_prompt": False},
                         "add_generation_prompt")]:
        with pytest.raises(APIError) as info:
            parse_tokenize_request(body, MODEL)
        assert (info.value.status, info.value.param) == (400, param)


def test_validate_messages_keeps_only_template_keys():
    out = validate_messages([{"role": "user", "content": "a", "name": "bob"},
                             {"role": "assistant", "content": "b", "annotations": []}])
    assert out == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


async def test_unexpected_exception_is_500_in_the_error_shape(aiohttp_client):
    from aiohttp import web

    from radixkv.server.errors import error_middleware

    async def broken(request):
        raise RuntimeError("boom")

    async def rejected(request):
        raise APIError(400, "bad", param="x")

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/broken", broken)
    app.router.add_get("/rejected", rejected)
    client = await aiohttp_client(app)
    resp = await client.get("/broken")
    assert resp.status == 500
    assert await resp.json() == {"error": {"message": "internal server error",
                                           "type": "server_error", "param": None,
                                           "code": "internal_error"}}
    resp = await client.get("/rejected")
    assert resp.status == 400
    assert await resp.json() == {"error": {"message": "bad", "type": "invalid_request_error",
                                           "param": "x", "code": None}}


def test_null_content_renders_as_empty_text_for_every_role():
    body = {"messages": [{"role": "system", "content": None}, {"role": "user", "content": None},
                         {"role": "assistant", "content": None}]}
    req = parse_chat_request(body, MODEL)
    assert [m["content"] for m in req.messages] == ["", "", ""]
    assert refused({"messages": [{"role": "user"}]}).param == "messages[0].content"


def test_n_is_passed_to_sampling():
    req = parse_chat_request({"messages": MSG, "n": 3, "seed": 9}, MODEL)
    params = req.sampling_params(5)
    assert (params.n, params.seed, params.max_tokens) == (3, 9, 5)


@pytest.mark.parametrize(("body", "message"), [
    # A JSON integer past 64 bits reaches the parser as a float (orjson); the client sent an
    # integer, so the error says its range, not "must be an integer".
    ({"messages": MSG, "seed": 18446744073709551616.0},
     "'seed' must be an integer in [-9223372036854775808, 18446744073709551615], got one of "
     "about 1.84e+19"),
    ({"messages": MSG, "max_tokens": 1e23}, "'max_tokens' must be an integer >= 1, got one of about 1e+23"),
    ({"messages": MSG, "seed": 1.5}, "'seed' must be an integer, got 1.5"),
])
def test_integers_past_64_bits_are_refused_by_range(body, message):
    assert refused(body).message.startswith(message)

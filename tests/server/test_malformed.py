"""The catalogue of malformed requests: each gets its documented 4xx in OpenAI's error shape,
never a 5xx, and /health stays 200 throughout (one tiny-model server for the module)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

from tests.server.conftest import MAX_BODY_BYTES
from tests.server.helpers import HI, get, wait_idle

CHAT, TEXT, TOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize"
JSON = "application/json"


@dataclass(frozen=True)
class Case:
    name: str
    body: Any                    # bytes are sent raw; anything else as JSON
    status: int
    param: str | None = None
    code: str | None = None
    path: str = CHAT
    content_type: str | None = JSON
    method: str = "POST"


def user(content: Any) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
OVERSIZE = orjson.dumps(user("x" * MAX_BODY_BYTES))

CASES = [
    # --- the body itself
    Case("non-json", b"hello there", 400),
    Case("truncated-json", b'{"messages": [', 400),
    Case("wrong-content-type", orjson.dumps(user("hi")), 400, content_type="text/plain"),
    Case("form-content-type", b"messages=hi", 400,
         content_type="application/x-www-form-urlencoded"),
    Case("empty-body", b"", 400),
    Case("whitespace-body", b"  \n ", 400),
    Case("json-array", b"[1, 2]", 400),
    Case("json-string", b'"messages"', 400),
    Case("json-null", b"null", 400),
    Case("nan-literal", b'{"messages": [], "temperature": NaN}', 400),
    Case("oversize-body", OVERSIZE, 413, code="request_too_large"),
    Case("raw-nul-byte", b'{"messages": [{"role": "user", "content": "a\x00b"}]}', 400),
    Case("escaped-nul", orjson.dumps(user("a\x00b")), 400, "messages[0].content"),
    Case("nul-in-key", b'{"messages": [], "a\\u0000": 1}', 400),
    Case("lone-surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    Case("invalid-utf8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    Case("deep-nesting", nested(5000), 400),
    Case("deep-nesting-in-object", b'{"messages": ' + nested(2000) + b"}", 400),
    # --- messages
    Case("missing-messages", {"max_tokens": 3}, 400, "messages"),
    Case("null-messages", {"messages": None}, 400, "messages"),
    Case("empty-messages", {"messages": []}, 400, "messages"),
    Case("messages-object", {"messages": {"role": "user", "content": "x"}}, 400, "messages"),
    Case("message-not-object", {"messages": ["hi"]}, 400, "messages[0]"),
    Case("missing-role", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    Case("unknown-role", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
         "messages[0].role"),
    Case("role-wrong-type", {"messages": [{"role": 1, "content": "x"}]}, 400, "messages[0].role"),
    Case("missing-content", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    Case("content-number", user(5), 400, "messages[0].content"),
    Case("content-object", user({"text": "x"}), 400, "messages[0].content"),
    Case("image-part", user([{"type": "image_url", "image_url": {"url": "x"}}]), 400,
         "messages[0].content[0].type"),
    Case("part-without-text", user([{"type": "text"}]), 400, "messages[0].content[0].text"),
    Case("unknown-message-key", {"messages": [{"role": "user", "content": "x", "foo": 1}]},
         400, "messages[0].foo"),
    Case("tool-without-id", {"messages": [{"role": "tool", "content": "x"}]}, 400,
         "messages[0].tool_call_id"),
    Case("bad-tool-call", {"messages": [{"role": "assistant", "tool_calls": [{"id": "a"}]}]},
         400, "messages[0].tool_calls[0]"),
    Case("name-wrong-type", {"messages": [{"role": "user", "content": "x", "name": 3}]}, 400,
         "messages[0].name"),
    Case("huge-message-count", {"messages": [{"role": "user", "content": "x"}] * 10000}, 400,
         "messages"),
    Case("overlong-prompt", user(" ".join(f"word{i}" for i in range(3000))), 400, "messages",
         "context_length_exceeded"),
    # --- sampling fields
    Case("max-tokens-zero", {**user("x"), "max_tokens": 0}, 400, "max_tokens"),
    Case("max-tokens-negative", {**user("x"), "max_tokens": -5}, 400, "max_tokens"),
    Case("max-tokens-string", {**user("x"), "max_tokens": "5"}, 400, "max_tokens"),
    Case("max-tokens-float", {**user("x"), "max_tokens": 5.5}, 400, "max_tokens"),
    Case("max-tokens-bool", {**user("x"), "max_tokens": True}, 400, "max_tokens"),
    Case("max-tokens-over-context", {**user("x"), "max_tokens": 10 ** 12}, 400, "max_tokens",
         "context_length_exceeded"),
    Case("max-tokens-disagree", {**user("x"), "max_tokens": 3, "max_completion_tokens": 4},
         400, "max_completion_tokens"),
    Case("n-zero", {**user("x"), "n": 0}, 400, "n"),
    Case("n-huge", {**user("x"), "n": 1000}, 400, "n"),
    Case("temperature-negative", {**user("x"), "temperature": -1}, 400, "temperature"),
    Case("temperature-too-high", {**user("x"), "temperature": 5}, 400, "temperature"),
    Case("temperature-string", {**user("x"), "temperature": "hot"}, 400, "temperature"),
    Case("top-p-zero", {**user("x"), "top_p": 0}, 400, "top_p"),
    Case("top-p-above-one", {**user("x"), "top_p": 1.5}, 400, "top_p"),
    Case("top-k-negative", {**user("x"), "top_k": -5}, 400, "top_k"),
    Case("seed-string", {**user("x"), "seed": "abc"}, 400, "seed"),
    Case("stop-number", {**user("x"), "stop": 7}, 400, "stop"),
    Case("stop-empty-string", {**user("x"), "stop": [""]}, 400, "stop"),
    Case("too-many-stops", {**user("x"), "stop": [f"s{i}" for i in range(100)]}, 400, "stop"),
    Case("stream-string", {**user("x"), "stream": "yes"}, 400, "stream"),
    Case("stream-options-without-stream", {**user("x"), "stream_options": {}}, 400,
         "stream_options"),
    Case("stream-options-unknown", {**user("x"), "stream": True, "stream_options": {"x": 1}},
         400, "stream_options.x"),
    Case("unknown-model", {**user("x"), "model": "gpt-4o"}, 404, "model", "model_not_found"),
    Case("model-wrong-type", {**user("x"), "model": 3}, 400, "model"),
    Case("salt-number", {**user("x"), "cache_salt": 5}, 400, "cache_salt"),
    Case("salt-empty", {**user("x"), "cache_salt": ""}, 400, "cache_salt"),
    Case("salt-too-long", {**user("x"), "cache_salt": "s" * 5000}, 400, "cache_salt"),
    Case("router-field-non-neutral", {**user("x"), "no_stop_trim": True}, 400, "no_stop_trim"),
    Case("ignored-field-wrong-type", {**user("x"), "store": "yes"}, 400, "store"),
    Case("logit-bias", {**user("x"), "logit_bias": {"42": 5}}, 400, "logit_bias"),
    Case("logprobs", {**user("x"), "logprobs": True}, 400, "logprobs"),
    Case("presence-penalty", {**user("x"), "presence_penalty": 1}, 400, "presence_penalty"),
    Case("json-mode", {**user("x"), "response_format": {"type": "json_object"}}, 400,
         "response_format"),
    Case("tool-choice-required-no-tools", {**user("x"), "tool_choice": "required"},
         400, "tool_choice"),
    Case("tool-choice-unknown-function", {**user("x"), "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, 400, "tool_choice.function.name"),
    Case("tools-not-list", {**user("x"), "tools": TOOL}, 400, "tools"),
    Case("too-many-tools", {**user("x"), "tools": [TOOL] * 200}, 400, "tools"),
    Case("deep-tool-schema", {**user("x"), "tools": [
        {"type": "function", "function": {"name": "f", "parameters": deep_schema(40)}}]},
         400, "tools[0]"),
    # --- other routes
    Case("completion-prompt-object", {"prompt": {"text": "x"}}, 400, "prompt", path=TEXT),
    Case("completion-batch-too-large", {"prompt": ["a"] * 65}, 400, "prompt", path=TEXT),
    Case("completion-negative-token", {"prompt": [1, -1]}, 400, "prompt[1]", path=TEXT),
    Case("completion-token-out-of-vocab", {"prompt": [1 << 40]}, 400, "prompt[0]", path=TEXT),
    Case("completion-echo-logprobs", {"prompt": "x", "echo": True, "logprobs": 1}, 400,
         "logprobs", path=TEXT),
    Case("tokenize-both", {"prompt": "x", "messages": HI}, 400, "prompt", path=TOKENIZE),
    Case("get-on-post-route", None, 405, code="method_not_allowed", method="GET"),
    Case("unknown-route", {}, 404, code="not_found", path="/v1/nothing"),
]


def test_catalogue_is_large_and_named_uniquely():
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_malformed_request(server, case: Case):
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    data = case.body if isinstance(case.body, bytes) else (
        None if case.body is None else orjson.dumps(case.body))
    async with aiohttp.ClientSession() as http:
        async with http.request(case.method, server.url + case.path, data=data,
                                headers=headers) as resp:
            status, raw = resp.status, await resp.read()
    err = orjson.loads(raw)
    assert status == case.status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "invalid_request_error"
    assert isinstance(err["error"]["message"], str) and err["error"]["message"]
    assert err["error"]["param"] == case.param
    if case.code is not None:
        assert err["error"]["code"] == case.code
    assert await get(server.url, "/health") == (200, {"status": "ok"})


async def test_server_still_serves_after_the_catalogue(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + CHAT, json={"messages": HI, "max_tokens": 1}) as resp:
            assert resp.status == 200
            body = await resp.json()
    assert body["usage"]["completion_tokens"] == 1
    stats = await wait_idle(server.url)
    assert stats["pool"]["in_use_blocks"] == 0  # no refused body left a block held


C21_CHAT = [("logit_bias", {"50": 100}), ("presence_penalty", 0.5), ("frequency_penalty", 1.0),
            ("logprobs", True), ("top_logprobs", 3), ("response_format", {"type": "json_object"}),
            ("no_stop_trim", True), ("min_p", 0.1), ("repetition_penalty", 1.2),
            ("guided_json", {"type": "object"}), ("best_of", 2), ("functions", []),
            ("structured_outputs", {"json": {"type": "object"}})]
C21_TEXT = [("logit_bias", {"50": 100}), ("logprobs", 2), ("suffix", "end"), ("best_of", 3),
            ("presence_penalty", -1.0), ("min_tokens", 5)]


@pytest.mark.parametrize("path,key,value",
                         [(CHAT, k, v) for k, v in C21_CHAT] + [(TEXT, k, v) for k, v in C21_TEXT],
                         ids=[f"chat-{k}" for k, _ in C21_CHAT] + [f"text-{k}" for k, _ in C21_TEXT])
async def test_c21_unimplemented_parameters_are_refused_not_ignored(server, path, key, value):
    base = {"messages": HI} if path == CHAT else {"prompt": "Hello"}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + path, json={**base, "max_tokens": 1, key: value}) as resp:
            status, err = resp.status, await resp.json()
    assert status == 400 and err["error"]["param"] == key
    assert key in err["error"]["message"]

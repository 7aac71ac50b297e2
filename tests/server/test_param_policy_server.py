"""The parameter policy over HTTP: the fields today's SDKs, agent frameworks
and routers add are accepted and change nothing; non-neutral values get a 400 naming them;
unknown names are accepted; /openapi.json lists exactly the policy table's fields; /metrics
counts the ignored ones; the official ``openai`` client's newest request shapes work."""

from __future__ import annotations

import re

import openai
import orjson
import pytest

from radixkv.server.param_table import CHAT_PARAMS, COMPLETION_PARAMS, TOKENIZE_PARAMS
from tests.server.helpers import get, post, post_json, sse_events

CHAT, TEXT, TOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize"
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]
# What vllm-router, LiteLLM, the OpenAI Agents SDK and today's SDKs send.
CLIENT_FIELDS = {
    "no_stop_trim": False, "store": True, "metadata": {"trace": "t-1"}, "service_tier": "auto",
    "prompt_cache_key": "conv-42", "safety_identifier": "user-hash", "modalities": ["text"],
    "verbosity": None, "reasoning_effort": "low", "audio": None, "top_logprobs": 0,
    "chat_template_kwargs": {"enable_thinking": False},
}
# docs/routers-and-kv-events.md §1: fields each router injects into forwarded bodies.
VLLM_ROUTER_CHAT = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": True,
                    "continue_final_message": False, "skip_special_tokens": True,
                    "separate_reasoning": True, "stream_reasoning": True,
                    "return_hidden_states": False, "include_reasoning": True}
SGLANG_ROUTER_CHAT = {k: v for k, v in VLLM_ROUTER_CHAT.items() if k != "include_reasoning"}
ROUTER_COMPLETIONS = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": True,
                      "skip_special_tokens": True, "return_hidden_states": False}


def with_extras(messages: list[dict]) -> list[dict]:
    """The same conversation as agent SDKs send it: message ids, the reply's reasoning."""
    out = [{**m, "id": f"msg_{i}"} for i, m in enumerate(messages)]
    out[2]["reasoning_content"] = "The user wants a colour."
    return out


async def post_json_stream(server, body: dict) -> tuple[int, str]:
    """POST a streaming chat; (status, the streamed content joined)."""
    status, raw, _ = await post(server.url, CHAT, body)
    if status != 200:
        return status, raw.decode()
    chunks = [orjson.loads(e) for e in sse_events(raw)]
    return status, "".join(c["choices"][0]["delta"].get("content") or ""
                           for c in chunks if c["choices"])


async def chat(server, body: dict) -> dict:
    status, resp = await post_json(server.url, CHAT, body)
    assert status == 200, resp
    return resp


def same_completion(a: dict, b: dict) -> None:
    assert [c["message"] for c in a["choices"]] == [c["message"] for c in b["choices"]]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 8


async def ignored_counts(server) -> dict[str, float]:
    status, text = await get(server.url, "/metrics")
    assert status == 200
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^radixkv_ignored_parameters_total\{param="([^"]*)"\} (\S+)$', text, re.M)}


async def test_client_added_fields_change_nothing(server):
    plain = await chat(server, {"messages": CONVERSATION, **GREEDY})
    before = await ignored_counts(server)
    full = await chat(server, {"messages": with_extras(CONVERSATION), **GREEDY, **CLIENT_FIELDS,
                               "frobnicate_unknown": {"x": 1}})
    same_completion(full, plain)
    after = await ignored_counts(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    # prompt_cache_key is supported (the eviction policy's session hint): not counted.
    assert delta == {"no_stop_trim": 1, "store": 1, "metadata": 1, "service_tier": 1,
                     "safety_identifier": 1, "modalities": 1,
                     "reasoning_effort": 1, "top_logprobs": 1, "messages[].id": 4,
                     "messages[].reasoning_content": 1, "(unknown)": 1}
    # Streaming with stream_options.include_obfuscation gives the same text.
    status, raw = await post_json_stream(server, {
        "messages": with_extras(CONVERSATION), **GREEDY, **CLIENT_FIELDS, "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": True}})
    assert status == 200 and raw == plain["choices"][0]["message"]["content"]


@pytest.mark.parametrize("extras", [VLLM_ROUTER_CHAT, SGLANG_ROUTER_CHAT],
                         ids=["vllm-router", "sglang-router"])
async def test_router_injected_chat_fields_change_nothing(server, extras):
    plain = await chat(server, {"messages": CONVERSATION, **GREEDY})
    body = {"messages": CONVERSATION, **GREEDY, **extras}
    if extras is SGLANG_ROUTER_CHAT:  # sglang-router renames max_tokens
        body["max_completion_tokens"] = body.pop("max_tokens")
    same_completion(await chat(server, body), plain)


async def test_router_injected_completion_fields_change_nothing(server):
    base = {"prompt": "Once upon a time", **GREEDY}
    status, plain = await post_json(server.url, TEXT, base)
    status2, routed = await post_json(server.url, TEXT, {**base, **ROUTER_COMPLETIONS,
                                                         "cache_salt": None, "user": "u"})
    assert status == status2 == 200, routed
    assert routed["choices"][0]["text"] == plain["choices"][0]["text"]
    assert routed["usage"] == plain["usage"] | {"prompt_tokens_details":
                                                routed["usage"]["prompt_tokens_details"]}


async def test_router_tokenize_fallback(server):
    status, plain = await post_json(server.url, TOKENIZE, {"messages": CONVERSATION})
    status2, routed = await post_json(server.url, TOKENIZE, {
        "model": server.engine.model_name, "continue_final_message": False,
        "messages": CONVERSATION})
    assert status == status2 == 200, routed
    assert routed["tokens"] == plain["tokens"] and routed["count"] == len(routed["tokens"]) > 0
    assert routed["max_model_len"] >= routed["count"]


@pytest.mark.parametrize("path,field,value", [
    (CHAT, "no_stop_trim", True), (CHAT, "min_p", 0.5), (CHAT, "logprobs", True),
    (CHAT, "top_logprobs", 2), (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "verbosity", "high"), (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "continue_final_message", True), (CHAT, "skip_special_tokens", False),
    (CHAT, "return_hidden_states", True), (CHAT, "structured_outputs", {"regex": "a+"}),
    (CHAT, "repetition_penalty", 1.3), (CHAT, "stop_token_ids", [2]),
    (TEXT, "no_stop_trim", True), (TEXT, "echo", "yes"), (TEXT, "min_tokens", 2),
    (TOKENIZE, "continue_final_message", True),
])
async def test_non_neutral_values_are_refused_by_name(server, path, field, value):
    base = {"prompt": "Hello"} if path == TEXT else {"messages": CONVERSATION}
    status, err = await post_json(server.url, path, {**base, "max_tokens": 1, field: value}
                                  if path != TOKENIZE else {**base, field: value})
    assert status == 400, err
    assert err["error"]["param"] == field and field in err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", [CHAT, TEXT, TOKENIZE])
async def test_unknown_names_are_accepted(server, path):
    base = {"prompt": "Hello"} if path == TEXT else {"messages": CONVERSATION}
    if path != TOKENIZE:
        base["max_tokens"] = 1
    status, body = await post_json(server.url, path, {**base, "vendor_extension": {"a": [1]},
                                                      "another_unknown": None})
    assert status == 200, body


@pytest.mark.parametrize("path,schema,table", [
    ("/v1/chat/completions", "ChatCompletionRequest", CHAT_PARAMS),
    ("/v1/completions", "CompletionRequest", COMPLETION_PARAMS),
    ("/tokenize", "TokenizeRequest", TOKENIZE_PARAMS),
])
async def test_openapi_lists_exactly_the_policy_table(server, path, schema, table):
    status, doc = await get(server.url, "/openapi.json")
    assert status == 200
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": f"#/components/schemas/{schema}"}
    props = doc["components"]["schemas"][schema]["properties"]
    assert set(props) == set(table)
    for name, param in table.items():
        assert props[name] == param.schema, name
    assert len(table) > {"ChatCompletionRequest": 90, "CompletionRequest": 65,
                         "TokenizeRequest": 10}[schema]


def test_official_client_newest_request_shapes(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = server.engine.model_name
    plain = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    newest = dict(store=False, metadata={"session": "s1"}, service_tier="auto",
                  reasoning_effort="minimal", prompt_cache_key="k1",
                  prompt_cache_retention="24h", safety_identifier="sid", modalities=["text"],
                  verbosity=None, audio=None, logprobs=False, top_logprobs=0, user="u1",
                  parallel_tool_calls=True, frequency_penalty=0, presence_penalty=0,
                  logit_bias={}, response_format={"type": "text"}, n=1, seed=7)
    resp = client.chat.completions.create(model=model, messages=with_extras(CONVERSATION),
                                          max_completion_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}, **newest)
    assert resp.choices[0].message.content == plain.choices[0].message.content
    assert resp.usage.completion_tokens == plain.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=model, messages=with_extras(CONVERSATION), max_completion_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True, "include_obfuscation": False},
        extra_body={"ignore_eos": True}, **newest)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=1,
                                       logprobs=True)
    assert info.value.body["param"] == "logprobs"

"""Tool calls over HTTP: parsed replies, streamed ``delta.tool_calls``, forced calls, and the
token-exact round trip of a reply with calls.

The tiny random model never writes a tool call, so a test hook scripts what it samples: the
engine's ``sample_each`` is wrapped to return given token ids for requests with a chosen
``seed`` (every other request samples as usual). The round-trip tests then check exact ids:
the next turn's prompt (via ``/tokenize``) must extend the first prompt + the generated ids,
and ``cached_tokens`` must reach the cap (all full blocks of prompt + fed reply).
"""

from __future__ import annotations

import uuid

import openai
import orjson
import pytest

from radixkv.engine import llm_engine
from tests.factories import make_async_engine
from tests.server.conftest import BLOCK_SIZE, run_server_in_thread
from tests.server.helpers import lcp, post, post_json, sse_events

IM_END = 2  # SmolLM2's <|im_end|>: EOS, and what the template writes after a turn
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
REPLY = "Let me check.\n" + CALL + "\nOne moment."
ASK = "What's the weather in Paris? Use the tool."


@pytest.fixture
def script(monkeypatch) -> dict[int, list[int]]:
    """``script[seed] = ids``: a request with that seed samples these ids, in order."""
    scripts: dict[int, list[int]] = {}
    real = llm_engine.sample_each

    def scripted(logits, params, generators):
        out = real(logits, params, generators)
        for i, p in enumerate(params):
            if scripts.get(p.seed):
                out[i] = scripts[p.seed].pop(0)
        return out

    monkeypatch.setattr(llm_engine, "sample_each", scripted)
    return scripts


def first_turn() -> list[dict]:
    return [{"role": "system", "content": f"{uuid.uuid4().hex} You help with the weather."},
            {"role": "user", "content": ASK}]


async def tokenize(url: str, messages: list[dict], salt: str) -> list[int]:
    status, out = await post_json(url, "/tokenize", {"messages": messages, "tools": TOOLS,
                                                     "cache_salt": salt})
    assert status == 200, out
    return out["tokens"]


async def chat(url: str, messages: list[dict], salt: str, **extra) -> dict:
    status, body = await post_json(url, "/v1/chat/completions", {
        "messages": messages, "tools": TOOLS, "temperature": 0, "cache_salt": salt, **extra})
    assert status == 200, body
    return body


async def stream_chat(url: str, messages: list[dict], salt: str, **extra) -> list[dict]:
    status, raw, _ = await post(url, "/v1/chat/completions", {
        "messages": messages, "tools": TOOLS, "temperature": 0, "cache_salt": salt,
        "stream": True, "stream_options": {"include_usage": True}, **extra})
    assert status == 200, raw
    return [orjson.loads(e) for e in sse_events(raw)]


async def check_round_trip(server, salt: str, first: list[dict], message: dict,
                           fed: list[int]) -> None:
    """Send ``message`` back with a tool result: the prompt extends ``fed`` (first prompt +
    fed generated ids) exactly and caches all its full blocks."""
    second = first + [{k: v for k, v in message.items() if v is not None},
                      {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                       "content": '{"temperature_c": 18}'}]
    p2 = await tokenize(server.url, second, salt)
    assert p2[:len(fed)] == fed
    body = await chat(server.url, second, salt, max_tokens=1)
    assert body["usage"]["prompt_tokens"] == len(p2)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        len(fed) // BLOCK_SIZE * BLOCK_SIZE)
    # Plain rendering writes the call as compact sorted JSON: the hit would end in the reply.
    naive = server.engine.tokenizer.apply_chat_template(second, TOOLS)
    assert lcp(naive, fed) < len(fed)


async def test_reply_with_a_call_becomes_tool_calls_and_round_trips_token_exact(server, script):
    tok = server.engine.tokenizer
    salt, first = uuid.uuid4().hex, first_turn()
    gen = tok.encode(REPLY) + [IM_END]
    script[101] = list(gen)
    p1 = await tokenize(server.url, first, salt)
    body = await chat(server.url, first, salt, seed=101, max_tokens=64)
    (choice,) = body["choices"]
    message = choice["message"]
    call = message["tool_calls"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert message == {"role": "assistant", "content": "Let me check.\n\nOne moment.",
                       "tool_calls": [{"id": call["id"], "type": "function", "function": {
                           "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert call["id"].startswith("call_")
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (
        len(p1), len(gen))
    await check_round_trip(server, salt, first, message, p1 + gen[:-1])


async def test_streamed_tool_calls_and_round_trip(server, script):
    tok = server.engine.tokenizer
    salt, first = uuid.uuid4().hex, first_turn()
    gen = tok.encode(REPLY) + [IM_END]
    script[102] = list(gen)
    p1 = await tokenize(server.url, first, salt)
    chunks = await stream_chat(server.url, first, salt, seed=102, max_tokens=64)
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
              for c in chunks if c["choices"]]
    assert deltas[0] == ({"role": "assistant", "content": ""}, None)
    assert deltas[-1] == ({}, "tool_calls")
    kinds = ["call" if "tool_calls" in d else "text" for d, _ in deltas[1:-1]]
    at = kinds.index("call")
    assert kinds.count("call") == 1 and set(kinds) == {"call", "text"}
    before = "".join(d["content"] for d, _ in deltas[1:1 + at])
    after = "".join(d["content"] for d, _ in deltas[2 + at:-1])
    assert (before, after) == ("Let me check.\n", "\nOne moment.")
    (call,) = deltas[1 + at][0]["tool_calls"]
    assert call == {"index": 0, "id": call["id"], "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert chunks[-1]["usage"]["completion_tokens"] == len(gen)
    message = {"role": "assistant", "content": before + after,
               "tool_calls": [{k: v for k, v in call.items() if k != "index"}]}
    await check_round_trip(server, salt, first, message, p1 + gen[:-1])


async def test_cut_by_max_tokens_after_a_complete_call_finishes_with_tool_calls(server, script):
    tok = server.engine.tokenizer
    salt, first = uuid.uuid4().hex, first_turn()
    gen = tok.encode(REPLY)[:-2]  # " moment" "." never generated: finish_reason "length"
    assert tok.decode(gen).endswith("\nOne")
    script[103] = list(gen)
    p1 = await tokenize(server.url, first, salt)
    body = await chat(server.url, first, salt, seed=103, max_tokens=len(gen))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check.\n\nOne"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    await check_round_trip(server, salt, first, choice["message"], p1 + gen[:-1])


@pytest.mark.parametrize(("tool_choice", "prefix", "rest"), [
    ({"type": "function", "function": {"name": "get_weather"}},
     '<tool_call>{"name": "get_weather", "arguments": ', '{"city": "Paris"}}</tool_call>'),
    ("required", "<tool_call>", CALL[len("<tool_call>"):]),
])
async def test_forced_call_starts_the_reply_and_round_trips(server, script, tool_choice, prefix,
                                                            rest):
    tok = server.engine.tokenizer
    salt, first = uuid.uuid4().hex, first_turn()
    forced = tok.encode(prefix)
    gen = tok.encode(rest) + [IM_END]
    script[104] = list(gen)
    p1 = await tokenize(server.url, first, salt)
    body = await chat(server.url, first, salt, seed=104, max_tokens=64, tool_choice=tool_choice)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]] == [("get_weather", '{"city": "Paris"}')]
    # The forced start is prompt to the engine, and reply text to the parser and the memory.
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (
        len(p1) + len(forced), len(gen))
    await check_round_trip(server, salt, first, choice["message"], p1 + forced + gen[:-1])


async def test_forced_call_that_goes_wrong_comes_back_as_text(server, script):
    tok = server.engine.tokenizer
    salt, first = uuid.uuid4().hex, first_turn()
    script[105] = tok.encode("Paris}") + [IM_END]
    chunks = await stream_chat(server.url, first, salt, seed=105, max_tokens=16,
                               tool_choice="required")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "<tool_call>Paris}"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks if c["choices"])


@pytest.mark.parametrize("extra", [{"tool_choice": "none"}, {"tools": None}])
async def test_without_tool_parsing_blocks_stay_text(server, script, extra):
    tok = server.engine.tokenizer
    gen = tok.encode(REPLY) + [IM_END]
    script[106] = list(gen)
    body = await chat(server.url, first_turn(), uuid.uuid4().hex, seed=106, max_tokens=64,
                      **extra)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_malformed_call_stays_text_and_parallel_false_keeps_the_first(server, script):
    tok = server.engine.tokenizer
    bad = 'Hm <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    script[107] = tok.encode(bad) + [IM_END]
    body = await chat(server.url, first_turn(), uuid.uuid4().hex, seed=107, max_tokens=64)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": bad}
    assert body["choices"][0]["finish_reason"] == "stop"
    two = CALL + "\n" + CALL.replace("Paris", "Lyon")
    for parallel, cities in [(False, ["Paris"]), (True, ["Paris", "Lyon"])]:
        script[108] = tok.encode(two) + [IM_END]
        body = await chat(server.url, first_turn(), uuid.uuid4().hex, seed=108, max_tokens=64,
                          parallel_tool_calls=parallel)
        calls = body["choices"][0]["message"]["tool_calls"]
        assert [orjson.loads(c["function"]["arguments"])["city"] for c in calls] == cities
        assert len({c["id"] for c in calls}) == len(cities)


def test_official_openai_client_reads_tool_calls(server, script):
    tok = server.engine.tokenizer
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=server.engine.model_name, messages=first_turn(), tools=TOOLS,
                  temperature=0, seed=109, max_tokens=64)
    script[109] = tok.encode(REPLY) + [IM_END]
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n\nOne moment."
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == (
        "function", "get_weather", '{"city": "Paris"}')
    script[109] = tok.encode(REPLY) + [IM_END]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:  # OpenAI's accumulation: by index, strings appended
            acc = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            acc["id"] += d.id or ""
            acc["name"] += d.function.name or ""
            acc["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (content, finish) == ("Let me check.\n\nOne moment.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", '{"city": "Paris"}')]
    assert calls[0]["id"].startswith("call_")
    # The SDK's own stream accumulator builds the same message.
    script[109] = tok.encode(REPLY) + [IM_END]
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert (choice.finish_reason, choice.message.content) == (
        "tool_calls", "Let me check.\n\nOne moment.")
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]


@pytest.fixture(scope="module")
def smollm2_server(smollm2):
    engine = make_async_engine(smollm2, block_size=BLOCK_SIZE, num_blocks=64)
    yield from run_server_in_thread(engine)


@pytest.mark.smollm2
async def test_smollm2_weather_tool_call_and_follow_up_hits_the_cap(smollm2_server):
    server = smollm2_server
    tok = server.engine.tokenizer
    ask = [{"role": "user", "content": ASK}]
    # SmolLM2 writes a complete call (naming the city, not the tool), then
    # text until max_tokens. That used to be content with finish_reason "length".
    salt = uuid.uuid4().hex
    chunks = await stream_chat(server.url, ask, salt, max_tokens=32)
    calls = [d["tool_calls"][0] for c in chunks if c["choices"]
             for d in [c["choices"][0]["delta"]] if "tool_calls" in d]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("Paris", '{"city": "Paris"}')]
    assert text == "\n\nThe function is called"
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 32
    message = {"role": "assistant", "content": text,
               "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]}
    await smollm2_follow_up(server, salt, ask, message, usage)
    # Naming the function forces the call's start: the right tool, then the model's arguments.
    salt = uuid.uuid4().hex
    body = await chat(server.url, ask, salt, max_tokens=32,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]] == [
        ("get_weather", '{"city": {"type": "string"}}')]
    assert choice["message"]["content"] == "\n\nThe weather in Paris is Paris."
    p1 = await tokenize(server.url, ask, salt)
    forced = tok.encode('<tool_call>{"name": "get_weather", "arguments": ')
    assert body["usage"]["prompt_tokens"] == len(p1) + len(forced)
    await smollm2_follow_up(server, salt, ask, choice["message"], body["usage"])


async def smollm2_follow_up(server, salt: str, first: list[dict], message: dict,
                            usage: dict) -> None:
    """The tool result turn: cached tokens = every full block of prompt + fed reply."""
    second = first + [{k: v for k, v in message.items() if v is not None},
                      {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                       "content": '{"temperature_c": 18, "sky": "clear"}'}]
    body = await chat(server.url, second, salt, max_tokens=1)
    fed = usage["prompt_tokens"] + usage["completion_tokens"] - 1  # the last token is not fed
    assert body["usage"]["prompt_tokens"] > fed
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == fed // BLOCK_SIZE * BLOCK_SIZE

"""The Anthropic Messages API against a real server (tiny model), through the official SDK.

The tiny random model never writes a tool call, so a test hook scripts what it samples: the
engine's ``sample_each`` is wrapped to return given token ids for requests with a chosen
``top_k`` (Anthropic has no ``seed``; with ``temperature: 0`` top_k changes nothing else). The
engine's ``generate`` is wrapped to record every request's prompt ids and its ``step`` to
record the sampled ids, so the tests check exact token ids and exact cache counts:
a request renders to the ids of the equivalent OpenAI chat request, a ``tool_use`` the model
wrote comes back token for token, and each agent turn reads all full blocks of the previous
turn's prompt + fed reply from the cache (``min(match, N - 1) // B * B``).
"""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.engine import llm_engine
from radixkv.model.loader import LoadedModel
from tests.factories import make_async_engine
from tests.server.conftest import BLOCK_SIZE, NUM_BLOCKS, RunningServer, run_server_in_thread
from tests.server.helpers import capped, get, post, post_json

IM_END = 2  # SmolLM2's <|im_end|>: EOS, and what the template writes after a turn
LOOKUP = {"name": "lookup", "description": "Look a word up in the dictionary",
          "input_schema": {"type": "object", "properties": {"word": {"type": "string"}},
                           "required": ["word"]}}
LOOKUP_OPENAI = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the dictionary",
    "parameters": LOOKUP["input_schema"]}}
SYSTEM = "You are a careful lexicographer. Answer briefly. " * 4


@pytest.fixture(scope="module")
def recorded(tiny_model: LoadedModel) -> Iterator[tuple[RunningServer, dict, dict, dict]]:
    """``(server, prompts, generated, script)``: prompt ids and sampled ids per engine request
    id, and ``script[top_k] = ids`` that a request with that top_k samples, in order."""
    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    prompts: dict[str, list[int]] = {}
    generated: dict[str, list[int]] = defaultdict(list)
    script: dict[int, list[int]] = {}
    generate = engine.generate

    def recording_generate(prompt_token_ids, params, **kwargs):
        stream = generate(prompt_token_ids, params, **kwargs)
        prompts[kwargs.get("request_id") or ""] = list(prompt_token_ids)
        return stream

    engine.generate = recording_generate  # type: ignore[method-assign]
    real = llm_engine.sample_each

    def scripted(logits, params, generators):
        out = real(logits, params, generators)
        for i, p in enumerate(params):
            if script.get(p.top_k):
                out[i] = script[p.top_k].pop(0)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "sample_each", scripted)
        for server in run_server_in_thread(engine):
            llm = server.engine._engine

            def recording_step(step=llm.step):
                outputs = step()
                for out in outputs:
                    generated[out.request_id] += out.new_token_ids
                return outputs

            llm.step = recording_step
            yield server, prompts, generated, script


@pytest.fixture(scope="module")
def server(recorded) -> RunningServer:
    return recorded[0]


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


EXTRA_BODY = ("temperature", "top_p", "top_k", "cache_salt", "cache_control")


def sdk_args(**kwargs: Any) -> dict[str, Any]:
    """``kwargs`` for the SDK: the sampling fields (which the newest SDK no longer takes as
    arguments; older ones send them as such), the top-level ``cache_control`` (which older
    SDKs lack) and radixkv's ``cache_salt`` go in ``extra_body``."""
    extra = {k: kwargs.pop(k) for k in EXTRA_BODY if k in kwargs}
    extra.update(kwargs.pop("extra_body", {}))
    return {**kwargs, **({"extra_body": extra} if extra else {})}


def create(client: anthropic.Anthropic, **kwargs: Any) -> Any:
    return client.messages.create(**sdk_args(**kwargs))


def stream(client: anthropic.Anthropic, **kwargs: Any) -> Any:
    return client.messages.stream(**sdk_args(**kwargs))


def usage_identity(usage: Any, num_prompt_tokens: int) -> None:
    assert (usage.input_tokens + usage.cache_read_input_tokens
            + usage.cache_creation_input_tokens) == num_prompt_tokens
    assert usage.cache_creation.ephemeral_5m_input_tokens \
        + usage.cache_creation.ephemeral_1h_input_tokens == usage.cache_creation_input_tokens
    assert min(usage.input_tokens, usage.cache_read_input_tokens,
               usage.cache_creation_input_tokens) >= 0


def events_of(raw: bytes) -> list[tuple[str, dict]]:
    """``(event name, data)`` of each SSE event; the name always equals ``data.type``."""
    out = []
    for chunk in raw.decode().split("\n\n"):
        if not chunk:
            continue
        head, data = chunk.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), chunk
        payload = orjson.loads(data[len("data: "):])
        assert payload["type"] == head[len("event: "):]
        out.append((payload["type"], payload))
    return out


def collapse(names: list[str]) -> list[str]:
    """Runs of content_block_delta collapsed to one."""
    out: list[str] = []
    for name in names:
        if not (out and name == out[-1] == "content_block_delta"):
            out.append(name)
    return out


# ------------------------------------------------------------------ same ids as OpenAI chat

CONVERSATION = [
    {"role": "user", "content": "Define the word 'harbor'."},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look it up."},
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"word": "harbor"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a sheltered port"},
        {"type": "text", "text": "Now use it in a sentence."}]},
]
OPENAI_CONVERSATION = [
    {"role": "system", "content": [{"type": "text", "text": SYSTEM},
                                   {"type": "text", "text": "Be kind."}]},
    {"role": "user", "content": "Define the word 'harbor'."},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look it up."}],
     "tool_calls": [{"id": "toolu_1", "type": "function",
                     "function": {"name": "lookup", "arguments": '{"word": "harbor"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "a sheltered port"},
    {"role": "user", "content": [{"type": "text", "text": "Now use it in a sentence."}]},
]
SYSTEM_BLOCKS = [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Be kind."}]


async def test_create_runs_the_ids_of_the_equivalent_openai_chat(recorded, client):
    server, prompts, generated, _ = recorded
    salt = uuid.uuid4().hex
    status, render = await post_json(server.url, "/v1/chat/completions/render", {
        "messages": OPENAI_CONVERSATION, "tools": [LOOKUP_OPENAI], "cache_salt": salt})
    assert status == 200, render
    ids = render["token_ids"]
    msg = create(client, model=server.engine.model_name, max_tokens=4, temperature=0,
                                 system=SYSTEM_BLOCKS, tools=[LOOKUP], messages=CONVERSATION,
                                 extra_body={"cache_salt": salt})
    assert prompts[msg.id] == ids
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == server.engine.model_name
    assert msg.usage.output_tokens == len(generated[msg.id])
    usage_identity(msg.usage, len(ids))
    assert (msg.usage.cache_read_input_tokens, msg.usage.cache_creation_input_tokens) == (0, 0)
    # The same reply as the OpenAI route (greedy), and the same prompt ids there too.
    status, chat = await post_json(server.url, "/v1/chat/completions", {
        "messages": OPENAI_CONVERSATION, "tools": [LOOKUP_OPENAI], "cache_salt": salt,
        "max_tokens": 4, "temperature": 0})
    assert status == 200, chat
    assert prompts[chat["id"]] == ids
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == chat["choices"][0]["message"]["content"]
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat["choices"][0]["finish_reason"]]
    # The second request reads the first one's whole blocks.
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == capped(
        len(ids) + len(generated[msg.id]) - 1, len(ids), BLOCK_SIZE)
    count = client.messages.count_tokens(model=server.engine.model_name, system=SYSTEM_BLOCKS,
                                         tools=[LOOKUP], messages=CONVERSATION,
                                         extra_body={"cache_salt": salt})
    assert count.input_tokens == len(ids)


async def test_count_tokens_includes_a_forced_tool_call_start(recorded, client):
    server, prompts, _, _ = recorded
    salt = uuid.uuid4().hex
    status, render = await post_json(server.url, "/v1/chat/completions/render", {
        "messages": OPENAI_CONVERSATION, "tools": [LOOKUP_OPENAI], "cache_salt": salt,
        "tool_choice": {"type": "function", "function": {"name": "lookup"}}})
    assert status == 200
    ids = render["token_ids"]
    forced = server.engine.tokenizer.encode('<tool_call>{"name": "lookup", "arguments": ')
    assert ids[-len(forced):] == forced
    count = client.messages.count_tokens(
        model=server.engine.model_name, system=SYSTEM_BLOCKS, tools=[LOOKUP],
        messages=CONVERSATION, tool_choice={"type": "tool", "name": "lookup"},
        extra_body={"cache_salt": salt})
    assert count.input_tokens == len(ids)
    msg = create(client, 
        model=server.engine.model_name, max_tokens=1, temperature=0, system=SYSTEM_BLOCKS,
        tools=[LOOKUP], messages=CONVERSATION, tool_choice={"type": "tool", "name": "lookup"},
        extra_body={"cache_salt": salt})
    assert prompts[msg.id] == ids


# ------------------------------------------------------------------ streaming

async def test_stream_event_sequence_and_same_reply_as_create(recorded, client):
    server, prompts, generated, _ = recorded
    body = {"model": server.engine.model_name, "max_tokens": 6, "temperature": 0,
            "system": SYSTEM, "messages": [{"role": "user", "content": "Say hello."}]}
    plain = create(client, **body, extra_body={"cache_salt": uuid.uuid4().hex})
    status, raw, headers = await post(server.url, "/v1/messages", {
        **body, "stream": True, "cache_salt": uuid.uuid4().hex},
        headers={"anthropic-version": "2023-06-01"})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = events_of(raw)
    names = [name for name, _ in events]
    assert collapse(names) == ["message_start", "ping", "content_block_start",
                               "content_block_delta", "content_block_stop", "message_delta",
                               "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    num_prompt = len(prompts[start["id"]])
    assert start["usage"]["input_tokens"] == num_prompt
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == plain.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": plain.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == plain.usage.output_tokens == len(
        generated[start["id"]])
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] \
        + delta["usage"]["cache_creation_input_tokens"] == num_prompt
    # The SDK's stream helper reads the same events.
    with stream(client, **body, extra_body={"cache_salt": uuid.uuid4().hex}) as events_in:
        text = "".join(events_in.text_stream)
        final = events_in.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (plain.stop_reason,
                                                              plain.usage.output_tokens)
    usage_identity(final.usage, num_prompt)


async def test_streamed_tool_use_and_stop_reason(recorded, client):
    server, prompts, _, script = recorded
    tok = server.engine.tokenizer
    call = '<tool_call>{"name": "lookup", "arguments": {"word": "quay"}}</tool_call>'
    script[901] = tok.encode("Checking.\n" + call) + [IM_END]
    status, raw, _ = await post(server.url, "/v1/messages", {
        "max_tokens": 64, "temperature": 0, "top_k": 901, "stream": True, "tools": [LOOKUP],
        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} Define 'quay'."}]})
    assert status == 200
    events = events_of(raw)
    assert collapse([n for n, _ in events]) == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    text = "".join(d["delta"]["text"] for n, d in events
                   if n == "content_block_delta" and d["index"] == 0)
    assert text == "Checking.\n"
    starts = [d for n, d in events if n == "content_block_start"]
    tool = starts[1]["content_block"]
    assert starts[1]["index"] == 1 and tool["id"].startswith("toolu_")
    assert tool == {"type": "tool_use", "id": tool["id"], "name": "lookup", "input": {}}
    json_deltas = [d["delta"] for n, d in events
                   if n == "content_block_delta" and d["index"] == 1]
    assert json_deltas == [{"type": "input_json_delta", "partial_json": '{"word": "quay"}'}]
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


async def test_stop_sequence_and_max_tokens_stop_reasons(recorded, client):
    server, _, _, script = recorded
    tok = server.engine.tokenizer
    script[902] = tok.encode("alpha beta STOP gamma delta") + [IM_END]
    msg = create(client, 
        model=server.engine.model_name, max_tokens=32, temperature=0, top_k=902,
        stop_sequences=["NEVER", "STOP"],
        messages=[{"role": "user", "content": f"{uuid.uuid4().hex} go"}])
    assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence) == (
        "alpha beta ", "stop_sequence", "STOP")
    script[903] = tok.encode("alpha beta") + [IM_END]
    msg = create(client, 
        model=server.engine.model_name, max_tokens=32, temperature=0, top_k=903,
        stop_sequences=["STOP"], messages=[{"role": "user", "content": f"{uuid.uuid4().hex}"}])
    assert (msg.content[0].text, msg.stop_reason, msg.stop_sequence) == (
        "alpha beta", "end_turn", None)
    script[904] = tok.encode("one two three four five six")
    msg = create(client, 
        model=server.engine.model_name, max_tokens=3, temperature=0, top_k=904,
        messages=[{"role": "user", "content": f"{uuid.uuid4().hex}"}])
    assert (msg.stop_reason, msg.usage.output_tokens) == ("max_tokens", 3)


async def test_a_stream_aborted_by_the_server_ends_with_an_overloaded_error_event(recorded):
    """Headers are sent: the abort is an in-band ``error`` event (529's type), and the stream
    ends there (no message_delta / message_stop)."""
    server, _, _, script = recorded
    script[905] = server.engine.tokenizer.encode(" word" * 1900)
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/messages", json={
                "max_tokens": 1900, "temperature": 0, "top_k": 905, "stream": True,
                "messages": [{"role": "user", "content": uuid.uuid4().hex}]}) as resp:
            assert resp.status == 200
            first = await resp.content.readuntil(b"\n\n")
            assert first.startswith(b"event: message_start\n")
            server.loop.call_soon_threadsafe(server.engine.abort_all)
            raw = first + await resp.read()
    script.pop(905, None)
    events = events_of(raw)
    assert events[-1] == ("error", {"type": "error", "error": {
        "type": "overloaded_error", "message": "the request was aborted by the server"}})
    assert "message_delta" not in [n for n, _ in events]


# ------------------------------------------------------------------ the agent loop

def test_five_turn_tool_agent_reads_every_previous_turn_from_the_cache(recorded, client):
    """Each turn the model (scripted) calls ``lookup``; the agent sends the reply back as the
    SDK returned it, with the tool's result. Turn k + 1's prompt extends turn k's prompt + fed
    reply token for token, and reads all of its full blocks from the cache. The system prompt
    carries a 1h breakpoint, the request a top-level (last block) 5m one: the first turn
    creates the system turn's blocks under 1h and the rest of its prompt's blocks under 5m,
    each later turn the blocks past what it read under 5m."""
    server, prompts, generated, script = recorded
    tok = server.engine.tokenizer
    model = server.engine.model_name
    system_text = f"{uuid.uuid4().hex} {SYSTEM}"
    system = [{"type": "text", "text": system_text,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    # Where the breakpoints end: the system turn (with the tools), and the last message (the
    # prompt without its generation prompt).
    system_end = len(tok.apply_chat_template([{"role": "system", "content": system_text}],
                                             [LOOKUP_OPENAI], add_generation_prompt=False))
    probe = [{"role": "user", "content": "x"}]
    gen_prompt = len(tok.apply_chat_template(probe)) - len(
        tok.apply_chat_template(probe, add_generation_prompt=False))
    assert gen_prompt > 0

    def blocks(n: int) -> int:
        return n // BLOCK_SIZE * BLOCK_SIZE

    messages: list[dict] = [{"role": "user", "content": "Look up five harbor words."}]
    previous: list[int] | None = None
    for turn in range(5):
        word = ["quay", "pier", "wharf", "dock", "jetty"][turn]
        call = '<tool_call>{"name": "lookup", "arguments": {"word": "%s"}}</tool_call>' % word
        reply_ids = tok.encode(f"Turn {turn}: checking.\n" + call) + [IM_END]
        script[1000 + turn] = list(reply_ids)
        msg = create(client, model=model, max_tokens=64, temperature=0,
                                     top_k=1000 + turn, system=system, tools=[LOOKUP],
                                     messages=messages, metadata={"user_id": "agent-1"},
                                     cache_control={"type": "ephemeral"})
        prompt = prompts[msg.id]
        assert generated[msg.id] == reply_ids
        assert msg.stop_reason == "tool_use"
        assert [b.type for b in msg.content] == ["text", "tool_use"]
        assert msg.content[0].text == f"Turn {turn}: checking.\n"
        assert (msg.content[1].name, msg.content[1].input) == ("lookup", {"word": word})
        usage_identity(msg.usage, len(prompt))
        read = msg.usage.cache_read_input_tokens
        if previous is None:
            assert read == 0
            assert (msg.usage.cache_creation.ephemeral_1h_input_tokens,
                    msg.usage.cache_creation.ephemeral_5m_input_tokens) == (
                blocks(system_end), blocks(len(prompt) - gen_prompt) - blocks(system_end))
        else:
            assert prompt[:len(previous)] == previous  # the tool_use came back token for token
            assert read == capped(len(previous), len(prompt), BLOCK_SIZE)
            assert (msg.usage.cache_creation.ephemeral_1h_input_tokens,
                    msg.usage.cache_creation.ephemeral_5m_input_tokens) == (
                0, blocks(len(prompt) - gen_prompt) - read)
        previous = prompt + reply_ids[:-1]  # the engine caches all but the last sampled id
        messages = [*messages, {"role": "assistant", "content": msg.content},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": msg.content[1].id,
                         "content": f"{word}: a place where ships dock"}]}]


# ------------------------------------------------------------------ usage identity (property)

_WORDS = st.sampled_from(["harbor", "quay", "ship", "the", "sea", "is", "calm", "x"])
_TEXT = st.lists(_WORDS, min_size=1, max_size=12).map(" ".join)
_CC = st.one_of(st.none(), st.sampled_from([{"type": "ephemeral"},
                                            {"type": "ephemeral", "ttl": "5m"},
                                            {"type": "ephemeral", "ttl": "1h"}]))


@st.composite
def message_requests(draw) -> dict:
    """A random valid messages body: system (none, text, blocks), 0-2 tools, 1-3 exchanges,
    random cache_control placements (at most 4, 1h ones first)."""
    body: dict[str, Any] = {"max_tokens": draw(st.integers(1, 3)), "temperature": 0}
    kind = draw(st.sampled_from(["none", "text", "blocks"]))
    if kind == "text":
        body["system"] = draw(_TEXT)
    elif kind == "blocks":
        body["system"] = [{"type": "text", "text": draw(_TEXT), "cache_control": draw(_CC)}
                          for _ in range(draw(st.integers(1, 2)))]
    tools = [{"name": f"t{i}", "input_schema": {"type": "object"}, "cache_control": draw(_CC)}
             for i in range(draw(st.integers(0, 2)))]
    if tools:
        body["tools"] = tools
    messages = []
    for i in range(draw(st.integers(1, 3))):
        blocks = [{"type": "text", "text": draw(_TEXT), "cache_control": draw(_CC)}
                  for _ in range(draw(st.integers(1, 2)))]
        messages.append({"role": "user", "content": blocks})
        if i < 2 and draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(_TEXT)})
    if messages[-1]["role"] == "assistant":
        messages.pop()
    body["messages"] = messages
    # At most 4 breakpoints, 1h before 5m: drop the surplus, then order TTLs by position.
    holders = [b for b in (body.get("system") if isinstance(body.get("system"), list) else [])]
    holders = tools + holders + [b for m in messages if isinstance(m["content"], list)
                                 for b in m["content"]]
    marked = [h for h in holders if h.get("cache_control")]
    for h in marked[4:]:
        h["cache_control"] = None
    marked = marked[:4]
    ttls = sorted((h["cache_control"].get("ttl", "5m") for h in marked), key=lambda t: t != "1h")
    for h, ttl in zip(marked, ttls):
        h["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    for h in holders:
        if h.get("cache_control") is None:
            h.pop("cache_control", None)
    return body


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.data_too_large])
@given(body=message_requests())
def test_usage_identity_over_random_requests(recorded, client, body):
    server, prompts, generated, _ = recorded
    msg = create(client, model=server.engine.model_name, **body)
    prompt = prompts[msg.id]
    usage_identity(msg.usage, len(prompt))
    assert msg.usage.cache_read_input_tokens <= (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert msg.usage.cache_read_input_tokens % BLOCK_SIZE == 0
    assert msg.usage.output_tokens == len(generated[msg.id])
    count = client.messages.count_tokens(
        model=server.engine.model_name,
        **{k: v for k, v in body.items() if k not in ("max_tokens", "temperature")})
    assert count.input_tokens == len(prompt)


# ------------------------------------------------------------------ bad input

def _error(message: str, type_: str = "invalid_request_error") -> dict:
    return {"type": "error", "error": {"type": type_, "message": message}}


HI = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def _cc(ttl: str | None = None, type_: str = "ephemeral") -> dict:
    return {"type": type_, **({"ttl": ttl} if ttl else {})}


BAD = [
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": _cc("2h")}]}]},
     "'messages.0.content.0.cache_control.ttl' must be '5m' or '1h', got '2h'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": _cc(type_="persistent")}]}]},
     "'messages.0.content.0.cache_control.type' must be 'ephemeral', got 'persistent'"),
    ({"system": [{"type": "text", "text": f"s{i}", "cache_control": _cc()} for i in range(3)],
      "messages": [{"role": "user", "content": [
          {"type": "text", "text": "a", "cache_control": _cc()},
          {"type": "text", "text": "b", "cache_control": _cc()}]}]},
     "'messages.0.content.1.cache_control': at most 4 cache_control breakpoints are allowed "
     "per request; this is the 5th"),
    ({"system": [{"type": "text", "text": "s", "cache_control": _cc("5m")}],
      "messages": [{"role": "user", "content": [
          {"type": "text", "text": "a", "cache_control": _cc("1h")}]}]},
     "'messages.0.content.0.cache_control.ttl': a 1h breakpoint cannot follow a 5m one "
     "(longer TTLs come first: tools, then system, then messages)"),
    ({"messages": HI, "cache_control": {"type": "ephemeral", "ttl": "24h"}},
     "'cache_control.ttl' must be '5m' or '1h', got '24h'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "'messages.0.content.0.type': content block type 'image' is not supported: images are "
     "not supported (text only)"),
    ({"messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "'thinking' is not supported: extended thinking is not implemented (only "
     "{\"type\":\"disabled\"} or null is accepted)"),
    ({"messages": [{"role": "system", "content": "x"}]},
     "'messages.0.role' must be 'user' or 'assistant', got 'system' (use the top-level "
     "'system' field)"),
    ({"messages": HI, "tool_choice": {"type": "any"}}, "'tool_choice' of type 'any' needs 'tools'"),
    ({"messages": HI, "temperature": 1.5}, "'temperature' must be in [0.0, 1.0], got 1.5"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]},
     "'messages.1': a final assistant message (prefill) is not supported: continuing a message "
     "is not implemented; end with a user message"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[m[:40] for _, m in BAD])
async def test_bad_input_is_a_400_naming_the_field_and_retains_nothing(server, extra, message):
    before = await retained(server)
    status, body = await post_json(server.url, "/v1/messages", {"max_tokens": 4, **extra})
    assert status == 400, body
    assert {k: v for k, v in body.items() if k != "request_id"} == _error(message)
    assert len(body["request_id"]) == 32
    assert await retained(server) == before


async def retained(server) -> list[tuple[str, int]]:
    status, listing = await get(server.url, "/v1/cache/retentions")
    assert status == 200, listing
    return sorted((r["id"], r["num_tokens"]) for r in listing["data"])


async def test_malformed_bodies_and_missing_fields(server):
    status, raw, _ = await post(server.url, "/v1/messages", data=b"{not json",
                                headers={"Content-Type": "application/json"})
    body = orjson.loads(raw)
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("request body is not valid JSON")
    status, body = await post_json(server.url, "/v1/messages", {"messages": HI})
    assert (status, body["error"]["message"]) == (400, "'max_tokens': field required")
    status, body = await post_json(server.url, "/v1/messages/count_tokens", {"max_tokens": 1})
    assert (status, body["error"]["message"]) == (400, "'messages': field required")
    status, body = await post_json(server.url, "/v1/messages",
                                   {"max_tokens": 1, "messages": HI, "model": "claude-x"})
    assert status == 404 and body["error"]["type"] == "not_found_error"
    assert "'claude-x' does not exist" in body["error"]["message"]
    status, body = await post_json(server.url, "/v1/messages/nope", {})
    assert (status, body["error"]["type"]) == (404, "not_found_error")


def test_sdk_raises_its_own_error_types(server, client):
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, model=server.engine.model_name, max_tokens=1,
                               messages=[{"role": "user", "content": [
                                   {"type": "text", "text": "hi",
                                    "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}])
    assert info.value.status_code == 400
    assert info.value.body["error"]["message"] == (
        "'messages.0.content.0.cache_control.ttl' must be '5m' or '1h', got '2h'")
    with pytest.raises(anthropic.NotFoundError):
        create(client, model="claude-sonnet-4-5", max_tokens=1,
                               messages=[{"role": "user", "content": "hi"}])


async def test_openapi_documents_the_messages_tables(server):
    from radixkv.server.param_table import COUNT_TOKENS_PARAMS, MESSAGES_PARAMS

    status, doc = await get(server.url, "/openapi.json")
    assert status == 200
    for schema, table in (("AnthropicMessagesRequest", MESSAGES_PARAMS),
                          ("AnthropicCountTokensRequest", COUNT_TOKENS_PARAMS)):
        props = doc["components"]["schemas"][schema]["properties"]
        assert set(props) == set(table)
        assert all(props[name] == p.schema for name, p in table.items())
    assert set(doc["paths"]["/v1/messages"]["post"]["responses"]) == {
        "200", "400", "401", "404", "413", "429", "500", "529"}


# ------------------------------------------------------------------ never a 5xx

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(
        ["", "text", "tool_use", "tool_result", "user", "assistant", "ephemeral", "5m", "1h",
         "auto", "any", "tool", "image"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "text", "role", "content", "name", "input", "id",
                         "tool_use_id", "cache_control", "ttl", "input_schema"]),
        inner, max_size=4),
    max_leaves=12)
_FIELDS = ["messages", "system", "tools", "tool_choice", "cache_control", "stop_sequences",
           "metadata", "temperature", "top_k", "thinking", "stream"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.data_too_large])
@given(fields=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=4),
       route=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_random_bodies_get_200_or_an_anthropic_4xx(server, fields, route):
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **fields}
    req = urllib.request.Request(server.url + route, data=orjson.dumps(body), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - 127.0.0.1 only
            status, raw, content_type = resp.status, resp.read(), resp.headers["Content-Type"]
    except urllib.error.HTTPError as err:
        status, raw, content_type = err.code, err.read(), err.headers["Content-Type"]
    assert status in (200, 400), (status, raw, body)
    if status == 400:
        out = orjson.loads(raw)
        assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
        assert isinstance(out["error"]["message"], str) and out["error"]["message"]
    else:
        assert content_type.startswith(
            "text/event-stream" if route == "/v1/messages" and fields.get("stream") is True
            else "application/json")

"""Anthropic breakpoints on a chat template that cannot render every cut on its own.

Llama 3.1–3.3's template puts the tools in the first user message and raises ("Cannot put
tools in the first user message when there's no first user message!") when there is none —
which is exactly the chat a tool or system breakpoint is cut to ([system] + tools). The server
here runs the tiny model with a template modelled on that tools branch (SmolLM2's special
tokens; ``<|endoftext|>`` closes the tools section, so the tokens up to the end of the tools
are known exactly: the prompt up to that token). A valid request with such breakpoints gets
200 and retains exactly the block-aligned prefix up to the end of the tools; a breakpoint that
cannot be rendered at all retains nothing, never fails the request.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from transformers import AutoTokenizer

from radixkv.model.loader import LoadedModel, embedded_tokenizer_dir
from radixkv.model.tokenizer import ChatTokenizer
from radixkv.server.anthropic import breakpoint_prefixes
from radixkv.server.anthropic_protocol import parse_messages_request
from tests.factories import make_async_engine
from tests.server.conftest import BLOCK_SIZE, NUM_BLOCKS, RunningServer, run_server_in_thread
from tests.server.helpers import get, post_json

B = BLOCK_SIZE
# Modelled on the tools branch of Llama 3.1's chat template (custom tools in the first user
# message), with SmolLM2's special tokens for Llama's headers.
LLAMA_LIKE_TEMPLATE = """
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|im_start|>system\\n" + system_message + "<|im_end|>\\n" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content'] | trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- "<|im_start|>user\\nGiven the following functions, please respond with a JSON for a function call.\\n" }}
    {%- for t in tools %}
        {{- t | tojson }}
        {{- "\\n" }}
    {%- endfor %}
    {{- "<|endoftext|>" + first_user_message + "<|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'assistant' and message.tool_calls %}
        {{- "<|im_start|>assistant\\n" }}
        {%- for call in message.tool_calls %}{{- call.function | tojson }}{%- endfor %}
        {{- "<|im_end|>\\n" }}
    {%- elif message['role'] == 'tool' %}
        {{- "<|im_start|>ipython\\n" + message['content'] + "<|im_end|>\\n" }}
    {%- else %}
        {{- "<|im_start|>" + message['role'] + "\\n" + message['content'] | trim + "<|im_end|>\\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}{%- endif %}
"""
LOOKUP: dict[str, Any] = {"name": "lookup", "description": "Look a word up in the dictionary",
          "input_schema": {"type": "object", "properties": {"word": {"type": "string"}},
                           "required": ["word"]}}
CC1 = {"type": "ephemeral", "ttl": "1h"}
CC5 = {"type": "ephemeral"}


def llama_like_tokenizer(like: ChatTokenizer) -> ChatTokenizer:
    hf = AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
    hf.chat_template = LLAMA_LIKE_TEMPLATE
    return ChatTokenizer(hf, max_model_len=like.max_model_len,
                         extra_eos_token_ids=like.eos_token_ids)


@pytest.fixture(scope="module")
def tok(tiny_model: LoadedModel) -> ChatTokenizer:
    return llama_like_tokenizer(tiny_model.tokenizer)


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel, tok: ChatTokenizer) -> Iterator[RunningServer]:
    model = dataclasses.replace(tiny_model, tokenizer=tok)
    yield from run_server_in_thread(make_async_engine(model, block_size=B,
                                                      num_blocks=NUM_BLOCKS))


@pytest.fixture
async def no_retentions(server) -> None:
    """The test starts with no retention (released through the operator route)."""
    async with aiohttp.ClientSession() as session:
        async with session.delete(f"{server.url}/v1/cache/retentions") as resp:
            assert resp.status == 200


def lookup_openai() -> dict:
    return {"type": "function", "function": {"name": LOOKUP["name"],
                                             "description": LOOKUP["description"],
                                             "parameters": LOOKUP["input_schema"]}}


def end_of_tools(ids: list[int], tok: ChatTokenizer) -> int:
    """Tokens of ``ids`` up to the end of the tools section (its closing ``<|endoftext|>``)."""
    sep = tok.hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert ids.count(sep) == 1
    return ids.index(sep) + 1


async def message(server: RunningServer, **body: Any) -> tuple[int, dict]:
    return await post_json(server.url, "/v1/messages",
                           {"max_tokens": 1, "temperature": 0.0, **body})


async def retentions(server: RunningServer) -> list[tuple[int, str]]:
    status, body = await get(server.url, "/v1/cache/retentions")
    assert status == 200
    return sorted((r["num_tokens"], r["ttl"]) for r in body["data"])


_FRESH = itertools.count()


def unique(text: str) -> str:
    # A fresh prefix (nothing cached before) that tokenizes the same on every run: a random
    # suffix made the token counts, and so which block a breakpoint lands in, vary by run. The
    # marker goes first so the text parts from every earlier one inside the template's first
    # block.
    return f"[session {next(_FRESH):04d}] {text}"


def test_the_template_refuses_tools_without_a_user_turn(tok):
    with pytest.raises(ValueError, match="Cannot put tools in the first user message"):
        tok.apply_chat_template([{"role": "system", "content": "S"}], [lookup_openai()],
                                add_generation_prompt=False)


@pytest.mark.parametrize("where", ["tool", "system_block", "tool_without_system"])
async def test_a_tool_or_system_breakpoint_retains_up_to_the_end_of_the_tools(
        server, tok, no_retentions, where):
    system = unique("You are a careful lexicographer. Answer briefly.")
    question = "Define the word 'retain'."
    body: dict[str, Any] = {"messages": [{"role": "user", "content": question}],
                            "tools": [{**LOOKUP, **({"cache_control": CC1}
                                                    if where != "system_block" else {})}]}
    chat = [{"role": "user", "content": question}]
    if where == "system_block":
        body["system"] = [{"type": "text", "text": system, "cache_control": CC1}]
    elif where == "tool":
        body["system"] = system
    if where != "tool_without_system":
        chat.insert(0, {"role": "system", "content": system})
    else:  # a fresh prefix still: the tool's description is the unique part
        body["tools"][0]["description"] = unique(LOOKUP["description"])
    tools = [{"type": "function", "function": {
        "name": "lookup", "description": body["tools"][0]["description"],
        "parameters": LOOKUP["input_schema"]}}]
    prompt = tok.apply_chat_template(chat, tools)
    n = end_of_tools(prompt, tok)
    assert n > 2 * B

    status, reply = await message(server, **body)
    assert status == 200, reply
    assert reply["usage"] == {
        "input_tokens": len(prompt) - n // B * B,
        "cache_creation_input_tokens": n // B * B,
        "cache_read_input_tokens": 0,
        "cache_creation": {"ephemeral_5m_input_tokens": 0,
                           "ephemeral_1h_input_tokens": n // B * B},
        "output_tokens": 1}
    assert await retentions(server) == [(n // B * B, "1h")]


async def test_tool_and_message_breakpoints_together(server, tok, no_retentions):
    """The tool breakpoint needs the fallback, the message one renders as it is."""
    system = unique("You are a careful lexicographer.")
    # Long enough (> one block of the message turn) that the message breakpoint always ends in a
    # later block than the tools' one.
    question = ("Define the word 'pin', give its origin, and list three common phrases that use "
                "it, each with a short example sentence.")
    status, reply = await message(
        server, system=system, tools=[{**LOOKUP, "cache_control": CC1}],
        messages=[{"role": "user", "content": [{"type": "text", "text": question,
                                                "cache_control": CC5}]}])
    assert status == 200, reply
    chat = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    prompt = tok.apply_chat_template(chat, [lookup_openai()])
    n_tools = end_of_tools(prompt, tok)
    n_message = len(tok.apply_chat_template(chat, [lookup_openai()], add_generation_prompt=False))
    assert n_tools // B < n_message // B and n_message < len(prompt)
    created_1h, created_5m = n_tools // B * B, n_message // B * B - n_tools // B * B
    assert reply["usage"]["cache_creation"] == {"ephemeral_5m_input_tokens": created_5m,
                                                "ephemeral_1h_input_tokens": created_1h}
    assert reply["usage"]["input_tokens"] == len(prompt) - created_1h - created_5m
    assert await retentions(server) == sorted([(created_1h, "1h"), (n_message // B * B, "5m")])
    # The next turn reads what the first retained (and its own full blocks) from the cache.
    status, again = await message(
        server, system=system, tools=[{**LOOKUP, "cache_control": CC1}],
        messages=[{"role": "user", "content": [{"type": "text", "text": question,
                                                "cache_control": CC5}]}])
    assert status == 200
    assert again["usage"]["cache_read_input_tokens"] == (len(prompt) - 1) // B * B
    assert again["usage"]["cache_creation_input_tokens"] == 0


class _Pool:
    def __init__(self, tok: Any) -> None:
        self.tok = tok

    async def run(self, fn: Any, key: Any = None) -> Any:
        return fn(self.tok)


class _Refusing:
    """A tokenizer whose template refuses every chat rendered without a generation prompt."""

    calls = 0

    def apply_chat_template(self, messages: list, tools: Any, add_generation_prompt: bool,
                            known_outputs: Any = None) -> list[int]:
        type(self).calls += 1
        raise ValueError("messages: chat template failed: TemplateError: no")


async def test_a_breakpoint_no_rendering_can_place_retains_nothing():
    req = parse_messages_request({"max_tokens": 1, "system": "S",
                                  "tools": [{**LOOKUP, "cache_control": CC1}],
                                  "messages": [{"role": "user", "content": "q"}]}, "tiny")
    engine = type("E", (), {"tokenize_pool": _Pool(_Refusing())})()
    assert await breakpoint_prefixes(engine, req, [5, 6, 7], None) == [0]
    assert _Refusing.calls == 2  # the cut, then the cut with the placeholder user turn

"""The render endpoints, ``/tokenize`` with the fields routers send, ``model: "unknown"`` and the
gRPC probe routers make.

``/v1/chat/completions/render`` and ``/v1/completions/render`` must answer exactly the ids the
engine runs for the same body. The engine's ``generate`` is wrapped (a test hook on our own
code) to record the prompt ids of every request it admits, and each render is compared with
them: a plain chat (also with ``/tokenize`` and ``usage.prompt_tokens``), a forced tool call
(its ``<tool_call>`` start ends the prompt), a salted second turn whose earlier reply keeps its
generated ids, and a text-append completion (also with ``prompt_token_ids``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, InvalidURLError

from radixkv.model.loader import LoadedModel
from radixkv.server.auth import parse_api_keys
from radixkv.server.param_policy import IGNORED_COUNTS, UNKNOWN_LABEL
from radixkv.server.params import UNKNOWN_MODEL
from radixkv.server.probes import is_http2_preface_error
from tests.factories import make_async_engine
from tests.lora_files import write_adapter
from tests.server.conftest import BLOCK_SIZE, NUM_BLOCKS, RunningServer, run_server_in_thread
from tests.server.helpers import get, post_json

SYSTEM = "You are a careful assistant. Answer briefly. " * 4
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
# What vllm-router adds to every forwarded chat body (docs/routers-and-kv-events.md §1).
ROUTER_CHAT_DEFAULTS = {"stream": False, "logprobs": False, "no_stop_trim": False,
                        "ignore_eos": False, "continue_final_message": False,
                        "skip_special_tokens": True, "separate_reasoning": True,
                        "stream_reasoning": True, "return_hidden_states": False,
                        "include_reasoning": True}
P1 = "Once upon a time, in a land far far"
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest.fixture(scope="module")
def render_server(tiny_model: LoadedModel) -> Iterator[tuple[RunningServer, list[list[int]]]]:
    """A server whose engine records the prompt ids of every request it admits."""
    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    ran: list[list[int]] = []
    generate = engine.generate

    def recording_generate(prompt_token_ids, *args, **kwargs):
        ran.append(list(prompt_token_ids))
        return generate(prompt_token_ids, *args, **kwargs)

    engine.generate = recording_generate  # type: ignore[method-assign]
    for server in run_server_in_thread(engine):
        yield server, ran


async def ok(url: str, path: str, body: dict[str, Any]) -> Any:
    status, out = await post_json(url, path, body)
    assert status == 200, out
    return out


async def render_chat(url: str, body: dict[str, Any]) -> list[int]:
    out = await ok(url, "/v1/chat/completions/render", body)
    assert list(out) == ["token_ids"]
    return out["token_ids"]


async def run_chat(server: RunningServer, ran: list[list[int]], body: dict[str, Any]
                   ) -> tuple[dict, list[int]]:
    """The chat response and the prompt ids the engine ran for it."""
    before = len(ran)
    out = await ok(server.url, "/v1/chat/completions", body)
    assert len(ran) == before + 1
    assert out["usage"]["prompt_tokens"] == len(ran[-1])
    return out, ran[-1]


def chat_body(messages: list[dict], **extra: Any) -> dict[str, Any]:
    return {"messages": messages, "temperature": 0, "max_tokens": 8, **extra}


async def test_chat_render_is_what_the_engine_runs(render_server):
    server, ran = render_server
    body = chat_body([{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": "Name three colours."}],
                     model=server.engine.model_name, **ROUTER_CHAT_DEFAULTS)
    rendered = await render_chat(server.url, body)
    _, run = await run_chat(server, ran, body)
    assert rendered == run
    tokenized = await ok(server.url, "/tokenize", {"model": server.engine.model_name,
                                                   "continue_final_message": False,
                                                   "messages": body["messages"]})
    assert tokenized == {"tokens": rendered, "count": len(rendered),
                         "max_model_len": server.engine.max_model_len}
    assert rendered == server.engine.tokenizer.apply_chat_template(body["messages"])


async def test_render_does_not_count_ignored_parameters(render_server):
    """A router renders every forwarded request on every replica: only the request itself
    counts its ignored fields (``radixkv_ignored_parameters_total``)."""
    server, ran = render_server
    body = chat_body([{"role": "user", "content": "count me once"}],
                     model=server.engine.model_name, no_stop_trim=False, bogus_router_field=1)
    before = IGNORED_COUNTS.snapshot()
    await render_chat(server.url, body)
    await ok(server.url, "/v1/completions/render", {"model": server.engine.model_name,
                                                    "prompt": "x", "no_stop_trim": False})
    assert IGNORED_COUNTS.snapshot() == before
    await run_chat(server, ran, body)
    after = IGNORED_COUNTS.snapshot()
    assert after["no_stop_trim"] - before.get("no_stop_trim", 0) == 1
    assert after[UNKNOWN_LABEL] - before.get(UNKNOWN_LABEL, 0) == 1


async def test_forced_tool_call_start_ends_the_rendered_prompt(render_server):
    server, ran = render_server
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = (await ok(server.url, "/tokenize", {"messages": messages, "tools": TOOLS}))["tokens"]
    forced = server.engine.tokenizer.encode("<tool_call>")
    for choice, tail in (("auto", []), ("required", forced)):
        body = chat_body(messages, tools=TOOLS, tool_choice=choice)
        rendered = await render_chat(server.url, body)
        _, run = await run_chat(server, ran, body)
        assert rendered == run == plain + tail
    assert forced  # "required" really appended ids


async def test_salted_second_turn_renders_the_remembered_reply(render_server):
    server, ran = render_server
    salt = "render-salt"
    first = [{"role": "user", "content": "Tell me a story about a fox."}]
    reply, _ = await run_chat(server, ran, chat_body(first, cache_salt=salt))
    second = first + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And then?"}]
    body = chat_body(second, cache_salt=salt)
    rendered = await render_chat(server.url, body)
    unsalted = await render_chat(server.url, chat_body(second))
    tokenized = (await ok(server.url, "/tokenize", {"messages": second,
                                                    "cache_salt": salt}))["tokens"]
    out, run = await run_chat(server, ran, body)
    assert rendered == run == tokenized
    # The splice is real: under another salt the reply is re-tokenized, to other ids.
    assert unsalted == server.engine.tokenizer.apply_chat_template(second) != rendered
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_text_append_completion_renders_the_remembered_ids(render_server):
    server, ran = render_server
    salt = "render-text"
    first = await ok(server.url, "/v1/completions", {"prompt": P1, "max_tokens": 24,
                                                     "temperature": 0, "cache_salt": salt})
    text = P1 + first["choices"][0]["text"] + " And then?"
    body = {"prompt": [text, [5, 6, 7]], "max_tokens": 2, "temperature": 0, "cache_salt": salt,
            "return_token_ids": True, "echo": False, "no_stop_trim": False,
            "skip_special_tokens": True, "return_hidden_states": False}
    rendered = await ok(server.url, "/v1/completions/render", body)
    assert rendered == [{"token_ids": rendered[0]["token_ids"]}, {"token_ids": [5, 6, 7]}]
    before = len(ran)
    out = await ok(server.url, "/v1/completions", body)
    assert ran[before:] == [r["token_ids"] for r in rendered]
    assert [c["prompt_token_ids"] for c in out["choices"]] == [r["token_ids"] for r in rendered]
    assert out["usage"]["prompt_tokens"] == len(rendered[0]["token_ids"]) + 3
    plain = server.engine.tokenizer.encode(text)
    assert rendered[0]["token_ids"] != plain  # the remembered ids, not a re-tokenization
    other = await ok(server.url, "/v1/completions/render", {**body, "cache_salt": "other"})
    assert other[0]["token_ids"] == plain


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 1 << 20}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1 << 20}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": [1, 999999]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": [1, -1]}, 400, "prompt[1]"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 50000]]}, 400, "prompt[1][1]"),
])
async def test_render_refuses_what_generation_refuses(render_server, path, body, status, param):
    server, _ = render_server
    rendered = await post_json(server.url, path + "/render", body)
    generated = await post_json(server.url, path, body)
    assert rendered == generated
    assert rendered[0] == status and rendered[1]["error"]["param"] == param


async def test_tokenize_takes_what_routers_and_vllm_send(render_server):
    server, _ = render_server
    model = server.engine.model_name
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    expected = server.engine.tokenizer.apply_chat_template(messages, TOOLS)
    for extra in ({"continue_final_message": False},
                  {"add_generation_prompt": True, "add_special_tokens": False,
                   "return_token_strs": False, "chat_template_kwargs": {},
                   "mm_processor_kwargs": {}}):
        out = await ok(server.url, "/tokenize", {"model": model, "messages": messages,
                                                 "tools": TOOLS, **extra})
        assert out["tokens"] == expected
    out = await ok(server.url, "/tokenize", {"model": model, "prompt": P1,
                                             "add_special_tokens": False})
    assert out["tokens"] == server.engine.tokenizer.encode(P1)
    status, err = await post_json(server.url, "/tokenize", {"messages": messages,
                                                            "continue_final_message": True})
    assert status == 400 and err["error"]["param"] == "continue_final_message"


async def test_unknown_model_means_the_served_one_until_an_adapter_loads(render_server,
                                                                         tiny_model, tmp_path):
    server, _ = render_server
    url, name = server.url, server.engine.model_name
    hi = [{"role": "user", "content": "hi"}]
    calls = [("/v1/chat/completions", {"messages": hi, "max_tokens": 1}),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
             ("/v1/chat/completions/render", {"messages": hi}),
             ("/v1/completions/render", {"prompt": "hi"}),
             ("/tokenize", {"prompt": "hi"}),
             ("/detokenize", {"tokens": [5, 6]})]
    for path, body in calls:
        status, out = await post_json(url, path, {**body, "model": UNKNOWN_MODEL})
        assert status == 200, (path, out)
        if isinstance(out, dict) and "id" in out:  # a completion: the base model answered
            assert out["model"] == name
        else:
            assert out == (await post_json(url, path, {**body, "model": name}))[1]
    adapter = write_adapter(tmp_path / "A", tiny_model.shape, seed=1)
    assert (await post_json(url, "/v1/load_lora_adapter",
                            {"lora_name": "A", "lora_path": str(adapter)}))[0] == 200
    try:
        for path, body in calls:
            status, out = await post_json(url, path, {**body, "model": UNKNOWN_MODEL})
            assert status == 404, (path, out)
            assert out["error"]["param"] == "model" and out["error"]["code"] == "model_not_found"
    finally:
        assert (await post_json(url, "/v1/unload_lora_adapter", {"lora_name": "A"}))[0] == 200


T1_KEY, T2_KEY = "key-render-t1", "key-render-t2"


@pytest.fixture(scope="module")
def keyed_server(tiny_model: LoadedModel) -> Iterator[RunningServer]:
    keys = parse_api_keys({T1_KEY: {"tenant": "t1", "admin": False},
                           T2_KEY: {"tenant": "t2", "admin": False}})
    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    yield from run_server_in_thread(engine, api_keys=keys)


async def test_render_uses_the_tenants_scope(keyed_server):
    """A tenant's second turn renders with its remembered reply; another tenant's render of
    the same body is the plain template (no reply crosses tenants); no key is a 401."""
    url = keyed_server.url
    first = [{"role": "user", "content": "Tell me a story about a fox."}]
    status, reply = await post_json(url, "/v1/chat/completions", chat_body(first), T1_KEY)
    assert status == 200, reply
    second = first + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And then?"}]
    body = chat_body(second)
    mine = await post_json(url, "/v1/chat/completions/render", body, T1_KEY)
    theirs = await post_json(url, "/v1/chat/completions/render", body, T2_KEY)
    tokenized = await post_json(url, "/tokenize", {"messages": second}, T1_KEY)
    plain = keyed_server.engine.tokenizer.apply_chat_template(second)
    assert mine[0] == theirs[0] == tokenized[0] == 200
    assert mine[1]["token_ids"] == tokenized[1]["tokens"] != plain
    assert theirs[1]["token_ids"] == plain
    status, out = await post_json(url, "/v1/completions/render", {"prompt": "hi"})
    assert status == 401, out


def _send_preface(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(HTTP2_PREFACE)
        chunks = []
        while chunk := sock.recv(4096):  # aiohttp closes the connection after its 400
            chunks.append(chunk)
    return b"".join(chunks)


async def test_grpc_probe_is_answered_without_a_traceback(render_server, caplog):
    server, _ = render_server
    caplog.set_level(logging.DEBUG)
    reply = await asyncio.to_thread(_send_preface, server.port)
    assert reply.startswith(b"HTTP/1.0 400 Bad Request\r\n") or \
        reply.startswith(b"HTTP/1.1 400 Bad Request\r\n"), reply[:100]
    assert (await get(server.url, "/health")) == (200, {"status": "ok"})
    server_records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert server_records == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize(("exc", "expected"), [
    (BadHttpMessage("Pause on PRI/Upgrade:\n\n  b''\n    ^"), True),  # llhttp (C parser)
    (InvalidURLError("*"), True),  # the pure-Python parser: a '*' target on PRI
    (InvalidURLError("/x y"), False),
    (BadHttpMessage("Invalid header value char"), False),
    (BadHttpMethod("GARBAGE"), False),
    (ValueError("PRI/Upgrade"), False),
    (None, False),
])
def test_only_the_http2_preface_is_quieted(exc, expected):
    assert is_http2_preface_error(exc) is expected

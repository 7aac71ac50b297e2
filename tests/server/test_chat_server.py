"""The HTTP server end to end: real engine (tiny random-init model), real sockets."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import aiohttp
import openai
import orjson
import pytest

from tests.server.conftest import BLOCK_SIZE, MAX_BODY_BYTES

HI = [{"role": "user", "content": "Hello there"}]


async def post(url: str, path: str, body=None, *, data=None, headers=None):
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body, data=data, headers=headers) as resp:
            return resp.status, await resp.read()


async def get(url: str, path: str):
    async with aiohttp.ClientSession() as http:
        async with http.get(url + path) as resp:
            return resp.status, orjson.loads(await resp.read())


async def chat(url: str, **body):
    status, raw = await post(url, "/v1/chat/completions", {"messages": HI, **body})
    return status, orjson.loads(raw)


async def tokenize(url: str, messages) -> list[int]:
    status, raw = await post(url, "/tokenize", {"messages": messages})
    assert status == 200
    return orjson.loads(raw)["tokens"]


def sse_events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert all(e.startswith(b"data: ") for e in events[:-1])
    return [e[len(b"data: "):] for e in events[:-2]]


async def test_models_health_stats(server):
    engine = server.engine
    assert await get(server.url, "/health") == (200, {"status": "ok"})
    status, models = await get(server.url, "/v1/models")
    assert status == 200 and models["object"] == "list" and len(models["data"]) == 1
    entry = models["data"][0]
    assert (entry["id"], entry["object"], entry["owned_by"], entry["max_model_len"]) == (
        engine.model_name, "model", "radixkv", 2048)
    assert isinstance(entry["created"], int)
    status, stats = await get(server.url, "/stats")
    assert status == 200
    assert stats["pool"]["block_size_tokens"] == BLOCK_SIZE
    assert stats["pool"]["total_blocks"] == 512
    assert stats["prefix_caching"] is True


async def test_tokenize_matches_the_chat_template(server):
    engine = server.engine
    status, raw = await post(server.url, "/tokenize", {"model": engine.model_name, "messages": HI})
    body = orjson.loads(raw)
    expected = engine.tokenizer.apply_chat_template(HI)
    assert status == 200
    assert body == {"tokens": expected, "count": len(expected), "max_model_len": 2048}
    status, raw = await post(server.url, "/tokenize", {"prompt": "Hello there"})
    expected = engine.tokenizer.encode("Hello there")
    # SmolLM2's tokenizer adds no BOS: add_special_tokens (default true) changes nothing.
    assert engine.tokenizer.prompt_prefix_ids == ()
    assert (status, orjson.loads(raw)) == (
        200, {"tokens": expected, "count": len(expected), "max_model_len": 2048})
    for flag in (True, False):
        status, raw = await post(server.url, "/tokenize", {"prompt": "Hello there", "add_special_tokens": flag})
        assert (status, orjson.loads(raw)["tokens"]) == (200, expected)
    # With messages the chat template places the special tokens: true is refused, naming it.
    status, raw = await post(server.url, "/tokenize", {"messages": HI, "add_special_tokens": True})
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "add_special_tokens"
    status, raw = await post(server.url, "/v1/completions",
                             {"prompt": "Hello there", "max_tokens": 1, "add_special_tokens": "yes"})
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "add_special_tokens"


async def test_non_stream_chat_shape_and_usage(server):
    n_prompt = len(await tokenize(server.url, HI))
    status, body = await chat(server.url, max_tokens=5, temperature=0, ignore_eos=True,
                              model=server.engine.model_name)
    assert status == 200
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "chat.completion" and isinstance(body["created"], int)
    assert body["model"] == server.engine.model_name and "system_fingerprint" not in body
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    usage = body["usage"]
    assert usage["prompt_tokens"] == n_prompt and usage["completion_tokens"] == 5
    assert usage["total_tokens"] == n_prompt + 5
    assert usage["prompt_tokens_details"]["cached_tokens"] in (0, (n_prompt - 1) // 16 * 16)


async def test_stream_chat_events_match_non_stream(server):
    # A unique system prompt first: nothing earlier shares a whole block with this prompt.
    messages = [{"role": "system", "content": uuid.uuid4().hex},
                {"role": "user", "content": "Stream me something"}]
    n_prompt = len(await tokenize(server.url, messages))
    req = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, raw = await post(server.url, "/v1/chat/completions",
                             {**req, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = [orjson.loads(e) for e in sse_events(raw)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 6,
                                   "total_tokens": n_prompt + 6,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    # The same prompt again, not streamed: greedy text is identical, and now mostly cached.
    status, body = await chat(server.url, **req)
    assert status == 200 and body["choices"][0]["message"]["content"] == streamed
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (n_prompt - 1) // 16 * 16
    # Without include_usage there is no usage field and no usage chunk.
    status, raw = await post(server.url, "/v1/chat/completions", {**req, "stream": True})
    chunks = [orjson.loads(e) for e in sse_events(raw)]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"]


def test_official_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": f"{uuid.uuid4().hex} You are terse."},
                {"role": "user", "content": "Say hi"}]
    resp = client.chat.completions.create(model=server.engine.model_name, messages=messages,
                                          max_tokens=4, temperature=0, seed=1)
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    assert 1 <= resp.usage.completion_tokens <= 4
    stream = client.chat.completions.create(model=server.engine.model_name, messages=messages,
                                            max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
    n = resp.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    many = client.chat.completions.create(model=server.engine.model_name, messages=messages,
                                          n=3, max_tokens=4, temperature=1.0, seed=5)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage.prompt_tokens == n  # the prompt once, not n times
    assert many.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert 3 <= many.usage.completion_tokens <= 12  # summed over the 3 choices
    for c in many.choices:  # choice i equals an n=1 request with seed 5 + i
        one = client.chat.completions.create(model=server.engine.model_name, messages=messages,
                                             max_tokens=4, temperature=1.0, seed=5 + c.index)
        assert one.choices[0].message.content == c.message.content
    streamed = list(client.chat.completions.create(
        model=server.engine.model_name, messages=messages, n=3, max_tokens=4, temperature=1.0,
        seed=5, stream=True, stream_options={"include_usage": True}))
    for c in many.choices:
        text = "".join(ch.choices[0].delta.content or "" for ch in streamed
                       if ch.choices and ch.choices[0].index == c.index)
        assert text == c.message.content
    finishes = [ch.choices[0].index for ch in streamed if ch.choices and ch.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert streamed[-1].usage.completion_tokens == many.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.engine.model_name, messages=messages, n=65)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert info.value.body["code"] == "model_not_found"


async def test_shared_system_prompt_second_request_hits_the_cap(server):
    words = " ".join(f"rule{i}" for i in range(150))
    system = {"role": "system", "content": f"Policy {uuid.uuid4().hex}: {words}."}
    first = [system, {"role": "user", "content": "Can I change my flight?"}]
    second = [system, {"role": "user", "content": "What is the baggage allowance?"}]
    t1, t2 = await tokenize(server.url, first), await tokenize(server.url, second)
    assert 280 <= len(t1) <= 700
    lcp = next(i for i, (a, b) in enumerate(zip(t1, t2)) if a != b)
    expected = min(lcp, len(t2) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert expected >= 256
    _, before = await get(server.url, "/stats")
    status, r1 = await chat(server.url, messages=first, max_tokens=2, temperature=0)
    assert status == 200 and r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, r2 = await chat(server.url, messages=second, max_tokens=2, temperature=0)
    assert status == 200 and r2["usage"]["prompt_tokens"] == len(t2)
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
    _, after = await get(server.url, "/stats")
    assert after["cached_prompt_tokens_total"] - before["cached_prompt_tokens_total"] == expected
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == len(t1) + len(t2)
    assert after["requests_with_hit_total"] - before["requests_with_hit_total"] == 1


async def test_cache_salt_isolates_the_prefix_cache(server):
    messages = [{"role": "system", "content": f"{uuid.uuid4().hex} " + "shared " * 60},
                {"role": "user", "content": "hello"}]
    n = len(await tokenize(server.url, messages))
    cap = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    cached = []
    for salt in ("tenant-a", "tenant-b", "tenant-a", None):
        extra = {"cache_salt": salt} if salt else {}
        status, body = await chat(server.url, messages=messages, max_tokens=1, **extra)
        assert status == 200
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 0, cap, 0]


LONG = " ".join(f"word{i}" for i in range(3000))
BAD_INPUT = [
    # (id, raw body or JSON object, content type, status, param)
    ("malformed-json", b'{"messages": [', "application/json", 400, None),
    ("not-an-object", b"[1, 2]", "application/json", 400, None),
    ("wrong-content-type", b'{"messages": []}', "text/plain", 400, None),
    ("missing-messages", {"max_tokens": 3}, None, 400, "messages"),
    ("empty-messages", {"messages": []}, None, 400, "messages"),
    ("messages-wrong-type", {"messages": {"role": "user"}}, None, 400, "messages"),
    ("content-wrong-type", {"messages": [{"role": "user", "content": 5}]}, None, 400,
     "messages[0].content"),
    ("max-tokens-wrong-type", {"messages": HI, "max_tokens": "3"}, None, 400, "max_tokens"),
    ("temperature-out-of-range", {"messages": HI, "temperature": 3}, None, 400, "temperature"),
    ("unknown-role", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages[0].role"),
    ("n-too-large", {"messages": HI, "n": 65}, None, 400, "n"),
    ("n-zero", {"messages": HI, "n": 0}, None, 400, "n"),
    ("logit-bias", {"messages": HI, "logit_bias": {"42": 5}}, None, 400, "logit_bias"),
    ("non-neutral-known-key", {"messages": HI, "min_p": 0.2}, None, 400, "min_p"),
    ("over-long-prompt", {"messages": [{"role": "user", "content": LONG}]}, None, 400,
     "messages"),
    ("prompt-plus-max-tokens", {"messages": HI, "max_tokens": 2040}, None, 400, "max_tokens"),
    ("unknown-model", {"messages": HI, "model": "gpt-4o"}, None, 404, "model"),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
async def test_bad_input_is_refused_and_server_keeps_serving(server, case):
    _, body, ctype, status, param = case
    if isinstance(body, bytes):
        got, raw = await post(server.url, "/v1/chat/completions", data=body,
                              headers={"Content-Type": ctype})
    else:
        got, raw = await post(server.url, "/v1/chat/completions", body)
    err = orjson.loads(raw)
    assert got == status
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == param
    if case[0] in ("over-long-prompt", "prompt-plus-max-tokens"):
        assert "maximum context length is 2048 tokens" in err["error"]["message"]
        assert err["error"]["code"] == "context_length_exceeded"
    ok, good = await chat(server.url, max_tokens=1)
    assert ok == 200 and good["usage"]["completion_tokens"] == 1


async def test_oversize_body_is_413(server):
    body = orjson.dumps({"messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]})
    status, raw = await post(server.url, "/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"})
    assert status == 413 and orjson.loads(raw)["error"]["type"] == "invalid_request_error"

    async def chunked():  # no Content-Length: aiohttp's own limit must answer the same way
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)]

    status, raw = await post(server.url, "/v1/chat/completions", data=chunked(),
                             headers={"Content-Type": "application/json"})
    assert status == 413 and orjson.loads(raw)["error"]["code"] == "request_too_large"
    ok, _ = await chat(server.url, max_tokens=1)
    assert ok == 200


async def test_unknown_route_and_method_use_the_error_shape(server):
    status, body = await get(server.url, "/v1/nothing")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    status, body = await get(server.url, "/v1/chat/completions")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"


async def _wait_idle(url: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        _, stats = await get(url, "/stats")
        if stats["pool"]["in_use_blocks"] == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


LONG_RUN = {"messages": HI, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}


async def test_client_disconnect_during_stream_aborts_the_request(server):
    _, before = await get(server.url, "/stats")
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.url + "/v1/chat/completions", json={**LONG_RUN, "stream": True})
        assert resp.status == 200
        seen = b""
        while b'"content":"' not in seen.split(b"\n\n", 1)[-1]:  # past the role chunk
            seen += await resp.content.readany()
        resp.close()  # drop the connection mid-stream
    after = await _wait_idle(server.url)
    assert after["pool"]["in_use_blocks"] == 0
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 1900


async def test_client_disconnect_while_waiting_aborts_the_request(server):
    _, before = await get(server.url, "/stats")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as http:
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(server.url + "/v1/chat/completions", json=LONG_RUN) as resp:
                await resp.read()
    after = await _wait_idle(server.url)
    assert after["pool"]["in_use_blocks"] == 0
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 1900


async def test_unhealthy_engine_answers_503(tiny_model, aiohttp_client):
    from radixkv.server.app import create_app
    from tests.factories import make_async_engine
    from tests.server.conftest import BLOCK_SIZE

    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=64)  # never started: not healthy
    client = await aiohttp_client(create_app(engine))
    resp = await client.get("/health")
    assert (resp.status, await resp.json()) == (503, {"status": "unhealthy"})
    resp = await client.post("/v1/chat/completions", json={"messages": HI})
    body = await resp.json()
    assert resp.status == 503 and body["error"]["type"] == "server_error"

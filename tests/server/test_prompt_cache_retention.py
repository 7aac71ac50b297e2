"""OpenAI's ``prompt_cache_retention`` on chat and text completions.

``"in_memory"`` (or none) retains nothing, as before; ``"24h"`` retains the prompt and the
reply (the whole sequence, block-aligned, at finish) for 24 hours and the response carries the
``radixkv`` extension; any other value is a 400 naming the field, with nothing retained.

One server for the module: tiny model, B = 4, 128 blocks (512 tokens; retentions may pin half),
no API keys. Every test starts with no retention (``DELETE /v1/cache/retentions``).
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Iterator

import aiohttp
import openai
import orjson
import pytest

from tests.factories import make_async_engine
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import cached_tokens, complete, get, post_json

B = 4
NUM_BLOCKS = 128
DAY_S = 86400.0
_fresh = itertools.count(100)


def fresh_prompt(length: int) -> list[int]:
    """Token ids no other test used (a distinct first token)."""
    base = next(_fresh) * 97
    return [base + i for i in range(length)]


def retained_tokens(num_prompt_tokens: int, num_generated_tokens: int) -> int:
    """A whole sequence's retained tokens: its full blocks of computed K/V (the last generated
    token is never fed through the model, so it has none)."""
    return (num_prompt_tokens + num_generated_tokens - 1) // B * B


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[RunningServer]:
    yield from run_server_in_thread(make_async_engine(tiny_model, block_size=B,
                                                      num_blocks=NUM_BLOCKS))


async def delete(url: str, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.delete(url + path) as resp:
            return resp.status, orjson.loads(await resp.read())


async def retentions(url: str) -> list[dict]:
    status, body = await get(url, "/v1/cache/retentions")
    assert status == 200, body
    return body["data"]


@pytest.fixture(autouse=True)
def no_retentions(server) -> None:
    async def clear() -> None:
        status, _ = await delete(server.url, "/v1/cache/retentions")
        assert status == 200
        assert await retentions(server.url) == []

    asyncio.run(clear())


async def test_24h_retains_prompt_and_reply_completions(server):
    url, p = server.url, fresh_prompt(10)
    status, body = await complete(url, p, max_tokens=3, ignore_eos=True, temperature=0,
                                  prompt_cache_retention="24h")
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 10 and body["usage"]["completion_tokens"] == 3
    assert cached_tokens(body) == 0
    # 10 + 3 tokens, K/V for 12: three blocks; the prompt's two full blocks are new.
    assert body["radixkv"] == {"num_retained_tokens": 12, "cache_creation_tokens": 8}
    # The prompt was retained once cached (8 tokens), the whole sequence at finish (12).
    listed = await retentions(url)
    assert sorted((r["num_tokens"], r["ttl"], r["tenant"], r["object"]) for r in listed) == [
        (8, "24h", None, "cache.retention"), (12, "24h", None, "cache.retention")]
    for ret in listed:
        assert re.fullmatch(r"ret_[0-9a-f]{24}", ret["id"]), ret
        assert DAY_S - 60 < ret["expires_in_s"] <= DAY_S
    # The next turn (prompt + reply + more) reads the retained blocks.
    status, reply = await complete(url, p, max_tokens=3, ignore_eos=True, temperature=0,
                                   return_token_ids=True)
    turn = p + reply["choices"][0]["token_ids"] + fresh_prompt(5)
    status, body = await complete(url, turn, prompt_cache_retention="in_memory")
    assert status == 200, body
    assert cached_tokens(body) == 12
    assert "radixkv" not in body


async def test_in_memory_or_absent_retains_nothing(server):
    url = server.url
    for extra in ({}, {"prompt_cache_retention": "in_memory"}, {"prompt_cache_retention": None}):
        status, body = await complete(url, fresh_prompt(10), max_tokens=2, ignore_eos=True,
                                      **extra)
        assert status == 200, body
        assert "radixkv" not in body
        status, body = await post_json(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"in memory {len(extra)}"}],
            "max_tokens": 2, **extra})
        assert status == 200, body
        assert "radixkv" not in body
    assert await retentions(url) == []


@pytest.mark.parametrize("value", ["1h", "24H", "in-memory", "", "forever", 24, True,
                                   {"ttl": "24h"}, ["24h"]])
async def test_other_values_are_refused_naming_the_field(server, value):
    url = server.url
    _, before = await get(url, "/stats")
    for path, body in (("/v1/completions", {"prompt": fresh_prompt(10), "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})):
        status, err = await post_json(url, path, {**body, "prompt_cache_retention": value})
        assert status == 400, (path, err)
        assert err["error"]["type"] == "invalid_request_error"
        assert err["error"]["param"] == "prompt_cache_retention"
        assert "prompt_cache_retention" in err["error"]["message"]
        if isinstance(value, str):
            assert err["error"] == {
                "message": f"'prompt_cache_retention' must be 'in_memory' or '24h', got {value!r}",
                "type": "invalid_request_error", "param": "prompt_cache_retention", "code": None}
    _, after = await get(url, "/stats")
    assert after["requests_total"] == before["requests_total"]  # nothing reached the engine
    assert await retentions(url) == []


async def test_several_prompts_each_retain(server):
    url, a, b = server.url, fresh_prompt(10), fresh_prompt(6)
    status, body = await complete(url, [a, b], max_tokens=2, ignore_eos=True,
                                  prompt_cache_retention="24h")
    assert status == 200, body
    # a: 12 tokens, K/V for 11 → 8; b: 8 tokens, K/V for 7 → 4. New prompt blocks: 8 + 4.
    assert body["radixkv"] == {"num_retained_tokens": retained_tokens(10, 2) + retained_tokens(6, 2),
                               "cache_creation_tokens": 12}
    assert sorted(r["num_tokens"] for r in await retentions(url)) == [4, 8]


def test_official_sdk_chat_json_and_stream(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Retain this conversation for a day, please."}]
    resp = client.chat.completions.create(model=server.engine.model_name, messages=messages,
                                          max_tokens=4, temperature=0,
                                          prompt_cache_retention="24h",
                                          extra_body={"ignore_eos": True})
    n = resp.usage.prompt_tokens
    assert resp.usage.completion_tokens == 4
    # The chat template's default system turn may be cached already; the rest is retained.
    hit = resp.usage.prompt_tokens_details.cached_tokens
    assert hit < n // B * B
    assert resp.model_extra["radixkv"] == {"num_retained_tokens": retained_tokens(n, 4),
                                           "cache_creation_tokens": n // B * B - hit}
    # Streamed: the include_usage chunk carries the extension; the same prompt is now cached.
    chunks = list(client.chat.completions.create(
        model=server.engine.model_name, messages=messages, max_tokens=4, temperature=0,
        prompt_cache_retention="24h", stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == n
    assert last.usage.prompt_tokens_details.cached_tokens == (n - 1) // B * B
    assert last.model_extra["radixkv"] == {"num_retained_tokens": retained_tokens(n, 4),
                                           "cache_creation_tokens": 0}
    assert all("radixkv" not in (c.model_extra or {}) for c in chunks[:-1])
    # Without retention the body is OpenAI's alone.
    plain = client.chat.completions.create(model=server.engine.model_name, messages=messages,
                                           max_tokens=1, prompt_cache_retention="in_memory")
    assert "radixkv" not in (plain.model_extra or {})
    # The legacy completions client has no such argument: it goes in extra_body.
    text = client.completions.create(model=server.engine.model_name, prompt=fresh_prompt(9),
                                     max_tokens=2, extra_body={"prompt_cache_retention": "24h",
                                                               "ignore_eos": True})
    assert text.usage.prompt_tokens_details.cached_tokens == 0
    assert text.model_extra["radixkv"] == {"num_retained_tokens": retained_tokens(9, 2),
                                           "cache_creation_tokens": 8}
    # A refused value raises the SDK's BadRequestError carrying the field.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=server.engine.model_name, messages=messages,
                                       max_tokens=1, extra_body={"prompt_cache_retention": "1h"})
    assert refused.value.status_code == 400 and refused.value.param == "prompt_cache_retention"


async def test_retained_sequence_survives_pressure_that_evicts_the_rest(server):
    url, kept, dropped = server.url, fresh_prompt(10), fresh_prompt(10)
    status, body = await complete(url, kept, max_tokens=1, prompt_cache_retention="24h")
    assert body["radixkv"]["num_retained_tokens"] == 8, body
    status, body = await complete(url, dropped, max_tokens=1)
    assert status == 200 and "radixkv" not in body
    for _ in range(12):  # 12 x 60 tokens: more than the pool's 512
        status, body = await complete(url, fresh_prompt(60), max_tokens=1)
        assert status == 200, body
    status, body = await complete(url, dropped + [5], max_tokens=1)
    assert cached_tokens(body) == 0  # evicted (LRU)
    status, body = await complete(url, kept + [5], max_tokens=1)
    assert cached_tokens(body) == 8  # retained


async def test_n_choices_retain_the_prompt_and_the_first_choice(server):
    url, p = server.url, fresh_prompt(10)
    status, body = await complete(url, p, max_tokens=3, ignore_eos=True, n=2, seed=7,
                                  temperature=1.0, return_token_ids=True,
                                  prompt_cache_retention="24h")
    assert status == 200, body
    replies = [c["token_ids"] for c in body["choices"]]
    assert replies[0][:2] != replies[1][:2], replies  # seeds 7 and 8 sample apart
    # The prompt once (8 new tokens), then choice 0's 13 tokens (K/V for 12) at its finish:
    # the engine retains one reply per request, the first choice's.
    assert body["radixkv"] == {"num_retained_tokens": 12, "cache_creation_tokens": 8}
    assert sorted(r["num_tokens"] for r in await retentions(url)) == [8, 12]
    status, out = await complete(url, p + replies[0] + [1, 2], prompt_cache_retention="in_memory")
    assert cached_tokens(out) == 12
    assert [r["num_refreshes"] for r in await retentions(url) if r["num_tokens"] == 12] == [1]

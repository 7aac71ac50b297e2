"""``/v1/completions`` text-append multi-turn reuse through the reply memory.

A completions client keeps its conversation as one growing text: prompt ``p1``, reply ``t1``,
then ``p1 + t1 + new``. The engine cached ``p1``'s ids + the fed reply ids (every sampled
token but the last), so the next prompt hits ``floor(min(match, N - 1) / B) * B`` tokens where
``match`` is its common prefix with those ids. Re-tokenizing the whole text merges across the
``p1``/``t1`` boundary (``"far"`` + ``"ymour"``), so plain tokenization only matches ``p1``'s
first block; the prefix memory keeps the generated ids and the whole of ``p1 + t1`` hits.

Block size 8 and a 10-token prompt with a 24-token reply: the case plain re-tokenizing misses
(8 of 32 tokens hit).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import orjson
import pytest

from radixkv.model.loader import LoadedModel
from radixkv.server.auth import parse_api_keys
from tests.factories import make_async_engine
from tests.server import helpers
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import lcp, post, post_json, sse_events

B = 8
P1 = "Once upon a time, in a land far far"  # 10 tokens; its greedy reply starts "ymour"
NEW = " And then?"


@pytest.fixture(scope="module")
def b8_server(tiny_model: LoadedModel) -> Iterator[RunningServer]:
    yield from run_server_in_thread(make_async_engine(tiny_model, block_size=B, num_blocks=512))


def capped(match: int, num_prompt: int) -> int:
    return helpers.capped(match, num_prompt, B)


async def tokenize(url: str, text: str) -> list[int]:
    status, body = await post_json(url, "/tokenize", {"prompt": text})
    assert status == 200, body
    return body["tokens"]


async def complete(url: str, prompt, salt: str | None, **extra) -> dict:
    body = {"prompt": prompt, "temperature": 0, "return_token_ids": True, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    status, out = await post_json(url, "/v1/completions", body)
    assert status == 200, out
    return out


async def first_turn(url: str, salt: str | None) -> tuple[list[int], list[int], str]:
    """(p1 ids, generated ids, reply text) of the conversation's first turn."""
    body = await complete(url, P1, salt, max_tokens=24, ignore_eos=True)
    (choice,) = body["choices"]
    assert body["usage"]["prompt_tokens"] == 10 and body["usage"]["completion_tokens"] == 24
    assert choice["prompt_token_ids"] == await tokenize(url, P1)
    assert len(choice["token_ids"]) == 24
    return choice["prompt_token_ids"], choice["token_ids"], choice["text"]


async def test_text_append_across_a_merged_token_caches_at_the_cap(b8_server):
    url = b8_server.url
    salt = uuid.uuid4().hex
    p1, gen, t1 = await first_turn(url, salt)
    assert t1.startswith("ymour")  # merges with "far" when the whole text is re-tokenized
    fed = p1 + gen[:-1]  # 33 ids whose K/V the engine computed and cached
    second = P1 + t1 + NEW
    naive = await tokenize(url, second)
    assert lcp(naive, fed) == 9 and capped(lcp(naive, fed), len(naive)) == 8  # the bug: 8 of 32
    body = await complete(url, second, salt, max_tokens=1)
    ids = body["choices"][0]["prompt_token_ids"]
    assert ids == p1 + gen + await tokenize(url, NEW)
    assert body["usage"]["prompt_tokens"] == len(ids) == 37
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32 == capped(33, 37)
    # The model saw exactly the text the client sent.
    status, text = await post_json(url, "/detokenize", {"tokens": ids})
    assert status == 200 and text == {"prompt": second}


async def test_three_turns_chain_and_each_hits_at_the_cap(b8_server):
    url = b8_server.url
    salt = uuid.uuid4().hex
    p1, gen1, t1 = await first_turn(url, salt)
    second = P1 + t1 + NEW
    body2 = await complete(url, second, salt, max_tokens=16, ignore_eos=True)
    ids2, gen2 = body2["choices"][0]["prompt_token_ids"], body2["choices"][0]["token_ids"]
    assert ids2 == p1 + gen1 + await tokenize(url, NEW) and len(ids2) == 37
    assert len(gen2) == 16
    third = second + body2["choices"][0]["text"] + " Go on."
    body3 = await complete(url, third, salt, max_tokens=1)
    ids3 = body3["choices"][0]["prompt_token_ids"]
    assert ids3[:53] == ids2 + gen2
    fed = ids2 + gen2[:-1]  # 52
    assert lcp(ids3, fed) == 52
    assert body3["usage"]["prompt_tokens_details"]["cached_tokens"] == 48 == \
        capped(52, len(ids3))


async def test_another_salt_does_not_see_the_memory(b8_server):
    url = b8_server.url
    salt, other = uuid.uuid4().hex, uuid.uuid4().hex
    p1, gen, t1 = await first_turn(url, salt)
    second = P1 + t1 + NEW
    # Same text under another scope (another salt, and no salt): plain tokenization, no hit.
    for scope in (other, None):
        body = await complete(url, second, scope, max_tokens=1)
        assert body["choices"][0]["prompt_token_ids"] == await tokenize(url, second)
    body = await complete(url, second, other, max_tokens=1)  # the earlier request cached it
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        (len(body["choices"][0]["prompt_token_ids"]) - 1) // B * B
    # The owner's scope still finds it.
    body = await complete(url, second, salt, max_tokens=1)
    assert body["choices"][0]["prompt_token_ids"][:34] == p1 + gen
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_streamed_echoed_reply_is_remembered_too(b8_server):
    url = b8_server.url
    salt = uuid.uuid4().hex
    status, raw, _ = await post(url, "/v1/completions", {
        "prompt": P1, "max_tokens": 24, "ignore_eos": True, "temperature": 0, "echo": True,
        "cache_salt": salt, "stream": True, "return_token_ids": True})
    assert status == 200
    chunks = [orjson.loads(e)["choices"][0] for e in sse_events(raw)]
    p1 = await tokenize(url, P1)
    # vLLM's placement: the prompt's ids on a choice's first chunk only, new ids on each.
    assert chunks[0]["text"] == P1 and chunks[0]["prompt_token_ids"] == p1
    assert chunks[0]["token_ids"] == []
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    gen = [t for c in chunks for t in c["token_ids"]]
    assert len(gen) == 24 and chunks[-1]["finish_reason"] == "length"
    echoed = "".join(c["text"] for c in chunks)  # the client holds p1 + t1 already
    body = await complete(url, echoed + NEW, salt, max_tokens=1)
    assert body["choices"][0]["prompt_token_ids"] == p1 + gen + await tokenize(url, NEW)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_token_id_prompts_are_not_remembered(b8_server):
    url = b8_server.url
    salt = uuid.uuid4().hex
    p1 = await tokenize(url, P1)
    body = await complete(url, p1, salt, max_tokens=24, ignore_eos=True)
    t1 = body["choices"][0]["text"]
    second = P1 + t1 + NEW
    body = await complete(url, second, salt, max_tokens=1)
    assert body["choices"][0]["prompt_token_ids"] == await tokenize(url, second)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 8


T1_KEY, T2_KEY = "key-tenant-one", "key-tenant-two"


@pytest.fixture(scope="module")
def keyed_server(tiny_model: LoadedModel) -> Iterator[RunningServer]:
    keys = parse_api_keys({T1_KEY: {"tenant": "t1", "admin": False},
                           T2_KEY: {"tenant": "t2", "admin": False}})
    engine = make_async_engine(tiny_model, block_size=B, num_blocks=512)
    yield from run_server_in_thread(engine, api_keys=keys)


async def test_tenants_never_see_each_others_memory(keyed_server):
    url = keyed_server.url

    async def run(key: str, prompt: str, **extra) -> dict:
        status, body = await post_json(url, "/v1/completions", {
            "prompt": prompt, "temperature": 0, "return_token_ids": True, **extra}, key)
        assert status == 200, body
        return body

    first = await run(T1_KEY, P1, max_tokens=24, ignore_eos=True)
    p1, gen = first["choices"][0]["prompt_token_ids"], first["choices"][0]["token_ids"]
    second = P1 + first["choices"][0]["text"] + NEW
    status, plain = await post_json(url, "/tokenize", {"prompt": second}, T2_KEY)
    assert status == 200
    # Tenant t2, with no salt or a salt that spells t1's scope: plain tokenization, no hit.
    for extra in ({}, {"cache_salt": "tenant:t1"}):
        body = await run(T2_KEY, second, max_tokens=1, **extra)
        assert body["choices"][0]["prompt_token_ids"] == plain["tokens"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    body = await run(T1_KEY, second, max_tokens=1)
    assert body["choices"][0]["prompt_token_ids"][:34] == p1 + gen
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

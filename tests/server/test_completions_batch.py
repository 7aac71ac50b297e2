"""``/v1/completions`` with a list of prompts, ``return_token_ids`` (vLLM's shape) and
``POST /detokenize``.

A list of prompts answers one choice set per prompt, choice ``index = prompt * n + j``; each
prompt is its own engine request, so ``usage`` sums prompt, completion and cached tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator

import aiohttp
import openai
import orjson
import pytest

from radixkv.engine.async_engine import AsyncEngine
from radixkv.model.loader import LoadedModel
from tests.factories import engine_config, make_async_engine
from tests.server.conftest import BLOCK_SIZE, RunningServer, run_server_in_thread
from tests.server.helpers import post, post_json, sse_events, wait_idle

TEXT = "The quick brown fox jumps over the lazy dog, and then the dog chases the fox away."
IDS = [5000 + i for i in range(40)]


async def tokenize(url: str, text: str) -> list[int]:
    status, body = await post_json(url, "/tokenize", {"prompt": text})
    assert status == 200, body
    return body["tokens"]


async def completion(url: str, **body) -> dict:
    status, out = await post_json(url, "/v1/completions", {"temperature": 0, "ignore_eos": True,
                                                           **body})
    assert status == 200, out
    return out


async def test_one_choice_set_per_prompt_in_openai_order(server):
    url, salt = server.url, uuid.uuid4().hex
    text_ids = await tokenize(url, TEXT)
    singles = [await completion(url, prompt=p, max_tokens=4, cache_salt=uuid.uuid4().hex)
               for p in (TEXT, IDS)]
    body = await completion(url, prompt=[TEXT, IDS], n=2, max_tokens=4, cache_salt=salt)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    expected = [singles[0]["choices"][0]["text"]] * 2 + [singles[1]["choices"][0]["text"]] * 2
    assert [c["text"] for c in body["choices"]] == expected
    assert all(set(c) == {"index", "text", "logprobs", "finish_reason"} for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": len(text_ids) + 40, "completion_tokens": 16,
                             "total_tokens": len(text_ids) + 56,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    again = await completion(url, prompt=[TEXT, IDS], n=2, max_tokens=4, cache_salt=salt)
    cached = (len(text_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE + 32  # summed over the prompts
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert [c["text"] for c in again["choices"]] == expected


async def test_streamed_prompts_interleave_with_their_indexes(server):
    url = server.url
    req = {"prompt": [TEXT, IDS], "n": 2, "max_tokens": 5, "temperature": 0,
           "ignore_eos": True, "cache_salt": uuid.uuid4().hex}
    body = await completion(url, **req)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, raw, _ = await post(url, "/v1/completions", {
        **req, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = [orjson.loads(e) for e in sse_events(raw)]
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert dict(texts) == {c["index"]: c["text"] for c in body["choices"]}
    assert dict(finishes) == {i: ["length"] for i in range(4)}
    cached = (len(await tokenize(url, TEXT)) - 1) // BLOCK_SIZE * BLOCK_SIZE + 32
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {**body["usage"],
                                   "prompt_tokens_details": {"cached_tokens": cached}}


async def test_echo_is_per_prompt(server):
    url = server.url
    status, decoded = await post_json(url, "/detokenize", {"tokens": IDS})
    assert status == 200
    plain = await completion(url, prompt=[TEXT, IDS], max_tokens=3)
    echoed = await completion(url, prompt=[TEXT, IDS], max_tokens=3, echo=True)
    assert [c["text"] for c in echoed["choices"]] == [
        TEXT + plain["choices"][0]["text"], decoded["prompt"] + plain["choices"][1]["text"]]


async def test_a_refused_later_prompt_is_named_and_the_admitted_ones_are_closed(server):
    url = server.url
    for prompt, param, fragment in [
        (["Hello", [1, 2, 49152]], "prompt[1][2]", "prompt[1][2]: must be an int in [0, 49151]"),
        ([IDS, IDS, [7] * 2049], "prompt[2]", "the prompt[2] has 2049 tokens"),
    ]:
        status, err = await post_json(url, "/v1/completions", {"prompt": prompt})
        assert status == 400, err
        assert err["error"]["param"] == param
        if fragment:
            assert fragment in err["error"]["message"]
    assert server.engine.num_requests_in_flight == 0
    assert (await wait_idle(url))["pool"]["in_use_blocks"] == 0


@pytest.fixture(scope="module")
def one_seat_server(tiny_model: LoadedModel) -> Iterator[RunningServer]:
    """One running sequence, no queue: a second prompt never fits beside the first."""
    yield from run_server_in_thread(make_async_engine(tiny_model, block_size=BLOCK_SIZE,
                                                      num_blocks=64, max_num_seqs=1,
                                                      max_queue=0))


async def test_a_prompt_list_passes_the_admission_bound_as_one_request(one_seat_server):
    """Like one request with n choices: accepted whole on an idle engine, refused whole (503,
    nothing admitted) when it does not fit beside what is in flight — never half-way."""
    url = one_seat_server.url
    body = await completion(url, prompt=["a", "b", "c"], max_tokens=2)  # idle: 3 > 1 seat, ok
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions",
                             json={"prompt": "busy", "max_tokens": 200, "ignore_eos": True,
                                   "stream": True}) as busy:
            await busy.content.readline()  # admitted and generating
            status, raw, headers = await post(url, "/v1/completions",
                                              {"prompt": ["a", "b"], "max_tokens": 2})
    err = orjson.loads(raw)
    assert status == 503 and headers["Retry-After"] == "1"
    assert err["error"]["code"] == "queue_full"
    assert err["error"]["message"].startswith("prompt: the engine is at capacity")
    assert (await wait_idle(url))["pool"]["in_use_blocks"] == 0
    assert one_seat_server.engine.num_requests_in_flight == 0


async def test_return_token_ids_in_json_and_stream(server):
    url = server.url
    text_ids = await tokenize(url, TEXT)
    req = {"prompt": [TEXT, IDS], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
           "return_token_ids": True}
    body = await completion(url, **req)
    assert [c["prompt_token_ids"] for c in body["choices"]] == [text_ids, IDS]
    for choice in body["choices"]:
        assert len(choice["token_ids"]) == 6
        status, text = await post_json(url, "/detokenize", {"tokens": choice["token_ids"]})
        assert text == {"prompt": choice["text"]}
    status, raw, _ = await post(url, "/v1/completions", {**req, "stream": True})
    seen: dict[int, list] = defaultdict(list)
    for event in sse_events(raw):
        (choice,) = orjson.loads(event)["choices"]
        seen[choice["index"]].append(choice)
    for index, chunks in seen.items():
        assert chunks[0]["prompt_token_ids"] == body["choices"][index]["prompt_token_ids"]
        assert all(c["prompt_token_ids"] is None for c in chunks[1:])
        assert [t for c in chunks for t in c["token_ids"]] == body["choices"][index]["token_ids"]
        assert chunks[-1] == {"index": index, "text": "", "logprobs": None,
                              "finish_reason": "length", "prompt_token_ids": None,
                              "token_ids": []}


async def test_detokenize(server):
    url = server.url
    ids = await tokenize(url, TEXT)
    status, body = await post_json(url, "/detokenize", {"model": server.engine.model_name,
                                                        "tokens": ids})
    assert (status, body) == (200, {"prompt": TEXT})
    status, body = await post_json(url, "/detokenize", {"tokens": [1, 2]})  # special: kept
    assert (status, body) == (200, {"prompt": "<|im_start|><|im_end|>"})
    status, body = await post_json(url, "/detokenize", {"tokens": []})
    assert (status, body) == (200, {"prompt": ""})
    for request, code, param, fragment in [
        ({"tokens": [1, 49152]}, 400, "tokens[1]", "'tokens[1]' = 49152 is outside the "
                                                   "vocabulary [0, 49151]"),
        ({"tokens": [-1]}, 400, "tokens[0]", "outside the vocabulary"),
        ({"tokens": [True]}, 400, "tokens[0]", "must be a token id"),
        ({"tokens": [1, "2"]}, 400, "tokens[1]", "must be a token id"),
        ({"tokens": "12"}, 400, "tokens", "must be a list"),
        ({}, 400, "tokens", "'tokens' is required"),
        ({"tokens": [1], "prompt": "x"}, 400, "prompt", "unknown parameter"),
        ({"tokens": [1], "model": "other"}, 404, "model", "does not exist"),
    ]:
        status, err = await post_json(url, "/detokenize", request)
        assert status == code, err
        assert err["error"]["param"] == param and fragment in err["error"]["message"]


def test_official_client_sends_a_list_of_prompts(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    resp = client.completions.create(model=server.engine.model_name, prompt=["Hi", "Bye"],
                                     max_tokens=3, temperature=0, n=2,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == 12
    assert [len(c.model_extra["token_ids"]) for c in resp.choices] == [3, 3, 3, 3]
    assert resp.choices[0].model_extra["prompt_token_ids"] == server.engine.tokenizer.encode("Hi")


async def test_a_client_gone_mid_stream_aborts_every_prompt(server):
    url = server.url
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json={
                "prompt": [IDS, TEXT], "n": 2, "max_tokens": 1000, "ignore_eos": True,
                "stream": True}) as resp:
            assert resp.status == 200
            first = await resp.content.readline()
            assert first.startswith(b"data: {")
            assert server.engine.num_requests_in_flight == 2
    deadline = time.monotonic() + 30
    while server.engine.num_requests_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert server.engine.num_requests_in_flight == 0
    assert (await wait_idle(url))["pool"]["in_use_blocks"] == 0


@pytest.fixture(scope="module")
def one_slot_tokenizer_server(tiny_model: LoadedModel) -> Iterator[RunningServer]:
    engine = AsyncEngine(engine_config(block_size=BLOCK_SIZE, num_blocks=64), tiny_model,
                         check_integrity_when_idle=True, tokenizer_workers=1,
                         max_tokenize_queue=1)
    yield from run_server_in_thread(engine)


async def test_detokenize_with_a_full_tokenizer_queue_is_503(one_slot_tokenizer_server):
    url, pool = one_slot_tokenizer_server.url, one_slot_tokenizer_server.engine._tokenize_pool
    pool.hold()  # the worker starts nothing: the first job waits in the one queue slot
    try:
        waiting = asyncio.ensure_future(post_json(url, "/detokenize", {"tokens": IDS}))
        deadline = time.monotonic() + 30
        while pool.queued < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        status, raw, headers = await post(url, "/detokenize", {"tokens": IDS})
        assert status == 503 and headers["Retry-After"] == "1"
        assert orjson.loads(raw)["error"]["code"] == "queue_full"
    finally:
        pool.release()
    status, body = await waiting
    assert status == 200 and body == {"prompt": one_slot_tokenizer_server.engine.tokenizer.decode(
        IDS, skip_special_tokens=False)}

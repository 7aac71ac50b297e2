"""Token-exact multi-turn reuse: the model's own reply, sent back verbatim, hits the cache.

The engine caches the prompt followed by the fed generated ids (every sampled token except
the last one, whose K/V is never computed). When the next turn re-sends the reply, the server
must tokenize it as those ids, so the new prompt's match is the whole of (previous prompt +
fed reply) and ``cached_tokens = floor(min(match, N - 1) / B) * B``. Plain re-tokenization of
the text gives other ids (the tiny random model's replies are non-canonical BPE almost
everywhere), which these tests check too, so they fail if the splice stops working.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Iterator

import pytest

from radixkv.model.loader import LoadedModel
from tests.factories import make_async_engine
from tests.server import helpers
from tests.server.conftest import BLOCK_SIZE, NUM_BLOCKS, RunningServer, run_server_in_thread
from tests.server.helpers import lcp, post_json, sse_events

SYSTEM = "You are a careful assistant. Answer briefly and precisely. " * 6


def capped(match: int, num_prompt: int, block_size: int = BLOCK_SIZE) -> int:
    return helpers.capped(match, num_prompt, block_size)


def capture_generated(server: RunningServer) -> dict[str, list[int]]:
    """Record every sampled token id per request id, from the engine thread's step outputs."""
    generated: dict[str, list[int]] = defaultdict(list)
    llm = server.engine._engine
    step = llm.step

    def recording_step():
        outputs = step()
        for out in outputs:
            generated[out.request_id] += out.new_token_ids
        return outputs

    llm.step = recording_step
    return generated


@pytest.fixture(scope="module")
def reuse_server(tiny_model: LoadedModel) -> Iterator[tuple[RunningServer, dict]]:
    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    for server in run_server_in_thread(engine):
        yield server, capture_generated(server)


async def tokenize(url: str, messages: list[dict], salt: str | None) -> list[int]:
    body = {"messages": messages, **({"cache_salt": salt} if salt else {})}
    status, out = await post_json(url, "/tokenize", body)
    assert status == 200, out
    return out["tokens"]


async def chat(url: str, messages: list[dict], salt: str, **extra) -> dict:
    status, body = await post_json(url, "/v1/chat/completions", {
        "messages": messages, "temperature": 0, "cache_salt": salt, **extra})
    assert status == 200, body
    return body


async def stream_chat(url: str, messages: list[dict], salt: str, **extra) -> tuple[str, str, dict]:
    """(request id, concatenated text, usage) of a streamed chat completion."""
    from tests.server.helpers import post
    status, raw, _ = await post(url, "/v1/chat/completions", {
        "messages": messages, "temperature": 0, "cache_salt": salt, "stream": True,
        "stream_options": {"include_usage": True}, **extra})
    assert status == 200
    import orjson
    chunks = [orjson.loads(e) for e in sse_events(raw) if e != b"[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return chunks[0]["id"], text, chunks[-1]["usage"]


async def check_reply_hits(server: RunningServer, generated: dict, salt: str,
                           first: list[dict], reply_id: str, reply: str) -> tuple[int, int]:
    """Send the reply back with a new user message; assert the exact cached count.

    Returns (cached tokens, what plain re-tokenization would have allowed)."""
    url = server.url
    p1 = await tokenize(url, first, salt)
    gen = generated[reply_id]
    fed = p1 + gen[:-1]  # the last sampled token is never fed, so its K/V does not exist
    second = first + [{"role": "assistant", "content": reply},
                      {"role": "user", "content": "Thanks. And now?"}]
    p2 = await tokenize(url, second, salt)
    body = await chat(url, second, salt, max_tokens=1)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(p2)
    match = lcp(p2, fed)
    assert match == len(fed)  # the whole previous prompt and the whole fed reply
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == capped(match, len(p2))
    naive = server.engine.tokenizer.apply_chat_template(second)
    return cached, capped(lcp(naive, fed), len(naive))


async def test_reply_sent_back_verbatim_is_cached_whole(reuse_server):
    server, generated = reuse_server
    salt = uuid.uuid4().hex
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say something."}]
    body = await chat(server.url, first, salt, max_tokens=40, ignore_eos=True)
    reply = body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 40
    cached, naive = await check_reply_hits(server, generated, salt, first, body["id"], reply)
    p1 = body["usage"]["prompt_tokens"]
    assert cached == (p1 + 39) // BLOCK_SIZE * BLOCK_SIZE
    assert naive < cached  # plain re-tokenization loses part of the reply


async def test_streamed_reply_cut_by_a_stop_string_is_cached_up_to_the_cut(reuse_server):
    server, generated = reuse_server
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a list."}]
    # Same prompt and greedy sampling under a fresh salt: the same tokens, to pick a stop
    # string that cuts the reply inside it.
    _, full, _ = await stream_chat(server.url, first, uuid.uuid4().hex, max_tokens=48,
                                   ignore_eos=True)
    # A stop string inside the first long word that occurs once: it cuts a token in two.
    word = next(w for w in full.split() if len(w) >= 6 and full.count(w[2:5]) == 1)
    stop = word[2:5]
    salt = uuid.uuid4().hex
    reply_id, reply, usage = await stream_chat(server.url, first, salt, max_tokens=48,
                                               ignore_eos=True, stop=[stop])
    assert reply == full[:full.index(stop)]
    # The cache holds the ids sampled up to the stop (past the cut); the reply's ids keep
    # every sampled token whose text lies before the cut, so the hit runs up to there.
    url = server.url
    p1 = await tokenize(url, first, salt)
    second = first + [{"role": "assistant", "content": reply},
                      {"role": "user", "content": "Thanks. And now?"}]
    p2 = await tokenize(url, second, salt)
    gen = generated[reply_id]
    kept = lcp(p2[len(p1):], gen)
    decode = server.engine.tokenizer.decode
    assert reply.startswith(decode(gen[:kept], skip_special_tokens=False))
    assert not reply.startswith(decode(gen[:kept + 1], skip_special_tokens=False))
    body = await chat(url, second, salt, max_tokens=1)
    match = lcp(p2, p1 + gen[:-1])
    assert match == len(p1) + kept
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == capped(match, len(p2))


async def test_remembered_replies_do_not_cross_cache_salts(reuse_server):
    server, _ = reuse_server
    salt = uuid.uuid4().hex
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say something."}]
    body = await chat(server.url, first, salt, max_tokens=24, ignore_eos=True)
    reply = body["choices"][0]["message"]["content"]
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
    plain = server.engine.tokenizer.apply_chat_template(second)
    spliced, other, unsalted = await asyncio.gather(
        tokenize(server.url, second, salt), tokenize(server.url, second, uuid.uuid4().hex),
        tokenize(server.url, second, None))
    assert spliced != plain  # the splice is in effect under the reply's own salt ...
    assert other == plain and unsalted == plain  # ... and invisible under any other


@pytest.fixture(scope="module")
def smollm2_server(smollm2: LoadedModel) -> Iterator[tuple[RunningServer, dict]]:
    engine = make_async_engine(smollm2, block_size=BLOCK_SIZE, num_blocks=64)
    for server in run_server_in_thread(engine):
        yield server, capture_generated(server)


@pytest.mark.smollm2
async def test_smollm2_non_canonical_reply_is_cached_whole(smollm2_server):
    # SmolLM2 answers this with " sa" + "ra" + "ce", which re-tokenizes as " sar" + "ace":
    # plain re-tokenization of the reply would end the hit 2 tokens into it.
    server, generated = smollm2_server
    salt = uuid.uuid4().hex
    first = [{"role": "user", "content": "Translate 'good morning' to French and German."}]
    body = await chat(server.url, first, salt, max_tokens=48)
    reply = body["choices"][0]["message"]["content"]
    assert reply.startswith("Je ne sarace pas")
    assert body["choices"][0]["finish_reason"] == "stop"
    p1, gen = body["usage"]["prompt_tokens"], generated[body["id"]]
    assert (p1, len(gen), gen[-1]) == (41, 24, 2)  # 23 content tokens, then <|im_end|>
    cached, naive = await check_reply_hits(server, generated, salt, first, body["id"], reply)
    # fed = 41 prompt + 23 reply tokens (the sampled <|im_end|> is never fed) = 64 = 4 blocks.
    assert (cached, naive) == (64, 32)

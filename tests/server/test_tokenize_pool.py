"""No head-of-line blocking before the engine: the tokenizer pool, without timing.

The tokenizer pool is fair across tenants (round-robin, FIFO within one), bounded (503
``queue_full``), gives each worker its own tokenizer, and exports its queue time; a prompt that
cannot fit the context is refused from its size alone, with no tokenizer call. The workers are
held and released job by job through the pool's test hook (``hold`` / ``allow``), so every order
below is forced, not raced.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.tokenize_pool import TokenizePool, default_workers
from radixkv.errors import TokenizeQueueFullError
from radixkv.model.tokenizer import ChatTokenizer
from radixkv.server.auth import parse_api_keys
from tests.factories import engine_config
from tests.server.conftest import MAX_BODY_BYTES, RunningServer, run_server_in_thread
from tests.server.helpers import bearer, get, post

KEY_A, KEY_B, ADMIN = "key-tenant-a", "key-tenant-b", "key-the-admin"
KEYS = {KEY_A: {"tenant": "ta"}, KEY_B: {"tenant": "tb"}, ADMIN: {"tenant": "ops", "admin": True}}
SMOLLM2_LONGEST_TOKEN_BYTES = 81  # SmolLM2's tokenizer (the tiny model's): measured once


def make_engine(tiny_model, **pool: int) -> AsyncEngine:
    return AsyncEngine(engine_config(block_size=16, num_blocks=512), tiny_model,
                       check_integrity_when_idle=True, **pool)


async def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def chat(content: str) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}


async def post_chat(url: str, content: str, key: str | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=chat(content),
                             headers=bearer(key)) as resp:
            return resp.status, orjson.loads(await resp.read()), dict(resp.headers)


def jobs_run(pool: TokenizePool) -> int:
    return pool.queue_seconds.cumulative()[0][-1][1]


# ---------------------------------------------------------------------------- the pool alone
async def test_jobs_are_taken_round_robin_across_keys_fifo_within_one(tiny_model):
    pool = TokenizePool(tiny_model.tokenizer, workers=1)
    pool.hold()
    order: list[str] = []
    jobs = [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("b", "b2"), (None, "n1")]
    tasks = []
    for i, (key, name) in enumerate(jobs):
        tasks.append(asyncio.ensure_future(pool.run(lambda tok, n=name: order.append(n) or n,
                                                    key=key)))
        await wait_for(lambda i=i: pool.queued == i + 1)
    for done in range(1, len(jobs) + 1):
        pool.allow(1)
        await wait_for(lambda done=done: len(order) == done)
    assert order == ["a1", "b1", "n1", "a2", "b2", "a3"]
    assert await asyncio.gather(*tasks) == [name for _, name in jobs]
    assert jobs_run(pool) == 6 and pool.queued == 0
    pool.shutdown(wait=True)


async def test_full_queue_raises_and_a_cancelled_job_leaves_it(tiny_model):
    pool = TokenizePool(tiny_model.tokenizer, workers=1, max_queue=2)
    pool.hold()
    first = asyncio.ensure_future(pool.run(lambda tok: 1, key="a"))
    second = asyncio.ensure_future(pool.run(lambda tok: 2, key="b"))
    await wait_for(lambda: pool.queued == 2)
    with pytest.raises(TokenizeQueueFullError) as exc:
        await pool.run(lambda tok: 3, key="c")
    assert str(exc.value) == ("the tokenizer queue is full: 2 requests are waiting for 1 "
                              "tokenizer worker(s)")
    second.cancel()
    await wait_for(lambda: pool.queued == 1)
    third = asyncio.ensure_future(pool.run(lambda tok: 3, key="c"))
    pool.release()
    assert (await first, await third) == (1, 3)
    assert second.cancelled() and jobs_run(pool) == 2
    pool.shutdown(wait=True)


async def test_workers_run_in_parallel_each_on_its_own_tokenizer(tiny_model):
    pool = TokenizePool(tiny_model.tokenizer, workers=2)
    both_running = threading.Barrier(2, timeout=30)  # passes only if two jobs run at once
    seen: list[ChatTokenizer] = []

    def job(tok: ChatTokenizer) -> list[int]:
        seen.append(tok)
        both_running.wait()
        return tok.encode("Hello there")

    results = await asyncio.gather(pool.run(job, key="a"), pool.run(job, key="b"))
    expected = tiny_model.tokenizer.encode("Hello there")
    assert results == [expected, expected]
    assert len({id(t) for t in seen}) == 2 and tiny_model.tokenizer not in seen
    assert len({id(t.hf_tokenizer) for t in [*seen, tiny_model.tokenizer]}) == 3
    pool.shutdown(wait=True)


async def test_one_key_never_holds_every_worker(tiny_model):
    pool = TokenizePool(tiny_model.tokenizer, workers=2)
    assert pool.max_running_per_key == 1
    gate = threading.Event()
    started: list[str] = []

    def long_job(name: str):
        def job(tok: ChatTokenizer) -> str:
            started.append(name)
            assert gate.wait(30)
            return name
        return job

    a1 = asyncio.ensure_future(pool.run(long_job("a1"), key="a"))
    a2 = asyncio.ensure_future(pool.run(long_job("a2"), key="a"))
    await wait_for(lambda: started == ["a1"] and pool.queued == 1)
    # The second worker is free but left to other keys: b1 runs while a1 still does.
    b1 = await asyncio.wait_for(pool.run(lambda tok: started.append("b1") or "b1", key="b"), 30)
    assert (b1, started, a1.done(), pool.queued) == ("b1", ["a1", "b1"], False, 1)
    gate.set()
    assert await asyncio.gather(a1, a2) == ["a1", "a2"]
    assert started == ["a1", "b1", "a2"]
    # The single tenant of a server without keys (None) has nobody to leave a worker for.
    gate.clear()
    both = [asyncio.ensure_future(pool.run(long_job(f"n{i}"), key=None)) for i in (1, 2)]
    await wait_for(lambda: sorted(started[3:]) == ["n1", "n2"])  # both run at once
    gate.set()
    assert await asyncio.gather(*both) == ["n1", "n2"]
    pool.shutdown(wait=True)


def test_pool_size_and_bound_are_validated(tiny_model):
    assert 1 <= default_workers() <= 8
    for bad in ({"workers": 0}, {"max_queue": 0}, {"workers": True}):
        with pytest.raises(ValueError):
            TokenizePool(tiny_model.tokenizer, **bad)


# ---------------------------------------------------------------------------- the size bound
def test_longest_token_and_the_bound(tiny_model):
    tok = tiny_model.tokenizer
    assert tok.longest_token_bytes == SMOLLM2_LONGEST_TOKEN_BYTES
    assert tok.min_tokens(["x" * 810]) == 10
    assert tok.min_tokens(["  " + "é" * 81 + "\n"]) == 2  # bytes, stripped: 162 // 81
    messages = [{"role": "system", "content": "s" * 81},
                {"role": "user", "content": [{"type": "text", "text": "u" * 81}]},
                {"role": "assistant", "content": "a" * 8100},  # templates may trim these
                {"role": "tool", "content": "t" * 81}, "not a message"]
    assert tok.min_chat_tokens(messages) == 3
    assert tok.min_chat_tokens("not a list") == 0
    # SmolLM2's template gets tools and tool calls as text (render_tools_fallback): they count,
    # as that rendering writes them (compact JSON, so the bound stays below the real count).
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 8100}}
    with_calls = [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c", "type": "function",
                       "function": {"name": "f", "arguments": '{"q": "%s"}' % ("q" * 8100)}}]}]
    assert tok.min_chat_tokens(with_calls[:1], [tool]) == 100  # 8160 + 2 bytes: the schema line, "hi"
    assert tok.min_chat_tokens(with_calls) == 100  # 8156 + 2 bytes: <tool_call>...</tool_call>, "hi"
    assert tok.min_chat_tokens(with_calls, [tool]) == 201  # 8160 + 8156 + 2 ("hi") bytes
    for chat, tools in ((with_calls[:1], [tool]), (with_calls, None), (with_calls, [tool])):
        assert tok.min_chat_tokens(chat, tools) <= len(tok.apply_chat_template(chat, tools))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=400)
       | st.builds(lambda c, n: c * n, st.sampled_from([" ", "\n", "a", "=", "-", "é", "😀"]),
                   st.integers(0, 2000)))
def test_the_bound_never_exceeds_the_real_token_count(tiny_model, text):
    tok = tiny_model.tokenizer
    assert tok.min_tokens([text]) <= len(tok.encode(text))


# ---------------------------------------------------------------------------- through the server
@pytest.fixture
def counted_tokenizer_calls(monkeypatch) -> list[str]:
    """Every ChatTokenizer templating or encoding call, wherever it runs (test hook)."""
    calls: list[str] = []
    for name in ("apply_chat_template", "_render", "encode"):
        real = getattr(ChatTokenizer, name)

        def counting(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(ChatTokenizer, name, counting)
    return calls


@pytest.fixture(scope="module")
def fair_server(tiny_model) -> Iterator[RunningServer]:
    """Tenants ta and tb, one tokenizer worker, at most 4 jobs waiting."""
    engine = make_engine(tiny_model, tokenizer_workers=1, max_tokenize_queue=4)
    yield from run_server_in_thread(engine, api_keys=parse_api_keys(KEYS))


async def test_another_tenants_short_request_is_tokenized_and_admitted_first(
        fair_server, counted_tokenizer_calls):
    engine, url = fair_server.engine, fair_server.url
    pool = engine.tokenize_pool
    admitted: list[tuple[str, str]] = []
    generate = engine.generate

    def recording_generate(prompt, params, **kwargs):  # test hook: the admission order
        text = engine.tokenizer.decode(prompt)
        admitted.append((kwargs["tenant"], next(w for w in ("a1", "a2", "a3", "b1")
                                                if f"user\n{w}" in text)))
        return generate(prompt, params, **kwargs)

    engine.generate = recording_generate
    pool.hold()
    try:
        tasks = []
        for i, (content, key) in enumerate([("a1", KEY_A), ("a2", KEY_A), ("a3", KEY_A),
                                            ("b1", KEY_B)]):
            tasks.append(asyncio.ensure_future(post_chat(url, content, key)))
            await wait_for(lambda i=i: pool.queued == i + 1)
        for n in range(1, 5):
            pool.allow(1)
            await wait_for(lambda n=n: len(admitted) == n)
        results = await asyncio.gather(*tasks)
    finally:
        pool.release()
        del engine.generate
    assert [status for status, _, _ in results] == [200] * 4
    assert admitted == [("ta", "a1"), ("tb", "b1"), ("ta", "a2"), ("ta", "a3")]
    assert counted_tokenizer_calls == ["apply_chat_template"] * 4


async def test_a_full_tokenizer_queue_is_503_with_retry_after(fair_server):
    engine, url = fair_server.engine, fair_server.url
    pool = engine.tokenize_pool
    _, before = await get(url, "/metrics", ADMIN)
    pool.hold()
    try:
        waiting = [asyncio.ensure_future(post_chat(url, f"w{i}", KEY_A)) for i in range(4)]
        await wait_for(lambda: pool.queued == 4)
        status, body, headers = await post_chat(url, "one too many", KEY_B)
        tok_status, tok_raw, tok_headers = await post(url, "/tokenize", {"prompt": "hi"},
                                                      headers=bearer(KEY_B))
    finally:
        pool.release()
    full = {"error": {"message": "the tokenizer queue is full: 4 requests are waiting for 1 "
                                 "tokenizer worker(s)",
                      "type": "server_error", "param": None, "code": "queue_full"}}
    assert (status, body, headers["Retry-After"]) == (503, full, "1")
    assert (tok_status, orjson.loads(tok_raw), tok_headers["Retry-After"]) == (503, full, "1")
    assert [r[0] for r in await asyncio.gather(*waiting)] == [200] * 4
    _, after = await get(url, "/metrics", ADMIN)

    def value(text: str, name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        return float(line.split()[1])

    assert value(after, "radixkv_tokenize_queue_seconds_count") \
        - value(before, "radixkv_tokenize_queue_seconds_count") == 4
    assert value(after, 'radixkv_requests_total{outcome="overloaded"}') \
        - value(before, 'radixkv_requests_total{outcome="overloaded"}') == 1
    assert 'radixkv_tokenize_queue_seconds_bucket{le="+Inf"}' in after


async def test_a_body_just_under_the_limit_that_cannot_fit_gets_400_untokenized(
        fair_server, counted_tokenizer_calls):
    engine, url = fair_server.engine, fair_server.url
    ran = jobs_run(engine.tokenize_pool)
    content = "x" * (MAX_BODY_BYTES - 100)
    body = orjson.dumps(chat(content))
    assert MAX_BODY_BYTES - 100 < len(body) <= MAX_BODY_BYTES
    headers = {**bearer(KEY_A), "Content-Type": "application/json"}
    status, raw, _ = await post(url, "/v1/chat/completions", data=body, headers=headers)
    at_least = len(content) // SMOLLM2_LONGEST_TOKEN_BYTES
    assert (status, orjson.loads(raw)) == (400, {"error": {
        "message": f"This model's maximum context length is 2048 tokens; the messages have at "
                   f"least {at_least} tokens",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}})
    text = orjson.dumps({"prompt": content, "max_tokens": 1})
    status, raw, _ = await post(url, "/v1/completions", data=text, headers=headers)
    assert (status, orjson.loads(raw)["error"]) == (400, {
        "message": f"This model's maximum context length is 2048 tokens; the prompt has at "
                   f"least {at_least} tokens",
        "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"})
    assert counted_tokenizer_calls == [] and jobs_run(engine.tokenize_pool) == ran
    # Under the bound it is tokenized as ever (the count above could have been seen).
    status, _, _ = await post_chat(url, "x" * 4000, KEY_A)
    assert status == 200 and counted_tokenizer_calls == ["apply_chat_template"]

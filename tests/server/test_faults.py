"""Fault isolation through the HTTP server, and the per-choice seed at the top of its range.

A fault of one request's own — in the engine thread (detokenizing, adding it, a failed forward)
or in the server's per-request code (output memory, templating, writing a stream) — ends that
request with an OpenAI-shaped 500 ``internal_error`` (in a stream: an error event, then
``data: [DONE]``); a concurrent request completes normally, ``/health`` stays 200, a later
request succeeds, the pool goes back to idle, and ``/stats`` and ``/metrics`` count it once
(``requests_*``) or per choice (``sequences_*``). Faults are injected by monkeypatching our own
code (test hooks) on the tiny model.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.server.generation import ENGINE_FAULT_MESSAGE
from radixkv.server.output_memory import OutputMemory
from radixkv.server.responses import ChatCompletion
from tests.factories import make_async_engine
from tests.server.conftest import BLOCK_SIZE, NUM_BLOCKS, RunningServer, run_server_in_thread
from tests.server.helpers import get, post, post_json, sse_events, wait_idle

FAULT_STOP = "<<FAULT>>"  # a stop string that marks the request the detokenizer hook breaks
ENGINE_FAULT = {"error": {"message": ENGINE_FAULT_MESSAGE, "type": "server_error", "param": None,
                          "code": "internal_error"}}
SERVER_FAULT = {"error": {"message": "internal server error", "type": "server_error",
                          "param": None, "code": "internal_error"}}
COUNTERS = ("requests_total", "sequences_total", "requests_failed_total", "sequences_failed_total",
            "requests_aborted_total", "sequences_aborted_total", "server_errors_total")
METRICS = {  # /stats key -> /metrics sample
    "requests_total": "radixkv_admitted_requests_total",
    "sequences_total": "radixkv_admitted_sequences_total",
    "requests_failed_total": "radixkv_failed_requests_total",
    "sequences_failed_total": "radixkv_failed_sequences_total",
    "requests_aborted_total": "radixkv_aborted_requests_total",
    "sequences_aborted_total": "radixkv_aborted_sequences_total",
    "server_errors_total": "radixkv_server_error_requests_total",
}


def chat(text: str, **body) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, **body}


async def snapshot(url: str) -> dict[str, float]:
    """The counters of /stats, the same from /metrics (``metrics:`` prefix), and the outcomes."""
    _, stats = await get(url, "/stats")
    _, text = await get(url, "/metrics")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    out: dict[str, float] = {key: stats[key] for key in COUNTERS}
    out.update({f"metrics:{key}": samples[(name, ())] for key, name in METRICS.items()})
    out["outcome_error"] = samples[("radixkv_requests_total", (("outcome", "error"),))]
    out["outcome_abort"] = samples[("radixkv_requests_total", (("outcome", "abort"),))]
    return out


def delta(before: dict, after: dict) -> dict:
    """Counters that moved, /stats and /metrics both (they must agree)."""
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    for key in COUNTERS:
        assert moved.get(key, 0) == moved.get(f"metrics:{key}", 0), key
        moved.pop(f"metrics:{key}", None)
    return moved


async def assert_healthy_and_idle(srv: RunningServer) -> None:
    """/health 200, the pool back to idle with the integrity check passing, a later request OK."""
    stats = await wait_idle(srv.url)
    pool = stats["pool"]
    assert pool["in_use_blocks"] == 0
    assert pool["free_blocks"] + pool["cached_evictable_blocks"] == pool["total_blocks"]
    # The engine runs check_integrity() whenever it idles (factories.make_async_engine): a
    # failure would stop it, and /health would say so.
    await asyncio.sleep(0.6)
    assert await get(srv.url, "/health") == (200, {"status": "ok"})
    status, body = await post_json(srv.url, "/v1/chat/completions", chat("later"))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


async def stream(http: aiohttp.ClientSession, url: str, body: dict) -> list[dict]:
    async with http.post(url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        return [orjson.loads(e) for e in sse_events(await resp.read())]


async def first_content(resp: aiohttp.ClientResponse) -> bytes:
    """Read a stream until a content delta (past the role chunk) arrived; what was read."""
    seen = b""
    while b'"content":"' not in seen.split(b"\n\n", 1)[-1]:
        chunk = await asyncio.wait_for(resp.content.readany(), 30)
        assert chunk, seen  # the stream ended first
        seen += chunk
    return seen


@pytest.fixture
def detokenizer_fault(monkeypatch) -> None:
    """Requests with the stop string ``FAULT_STOP`` raise when a choice has 3 tokens."""
    real_add = IncrementalDetokenizer.add

    def faulty(self, output_ids, *, final=False):
        if FAULT_STOP in self._stop and len(output_ids) == 3:
            raise ValueError("injected detokenizer fault")
        return real_add(self, output_ids, final=final)

    monkeypatch.setattr(IncrementalDetokenizer, "add", faulty)


async def test_a_seed_at_the_top_of_the_range_works_for_every_choice(server):
    url = server.url
    messages = [{"role": "user", "content": "Pick a number"}]
    status, body = await post_json(url, "/v1/chat/completions", {
        "messages": messages, "n": 2, "temperature": 1, "seed": 18446744073709551615,
        "max_tokens": 5})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert await get(url, "/health") == (200, {"status": "ok"})
    texts = []
    for seed in (18446744073709551615, 0, -1):
        status, single = await post_json(url, "/v1/chat/completions", {
            "messages": messages, "temperature": 1, "seed": seed, "max_tokens": 5})
        assert status == 200
        texts.append(single["choices"][0]["message"]["content"])
    # Choice 1 is seed (2**64 - 1 + 1) mod 2**64 = 0; -1 is 2**64 - 1.
    assert [c["message"]["content"] for c in body["choices"]] == texts[:2]
    assert texts[2] == texts[0]


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_engine_fault_ends_only_its_request(server, detokenizer_fault, streamed):
    url = server.url
    healthy = chat(f"healthy streamed={streamed}", max_tokens=8)
    status, alone = await post_json(url, "/v1/chat/completions", healthy)
    assert status == 200
    faulty = chat(f"faulty streamed={streamed}", max_tokens=8, temperature=1, seed=3, n=2,
                  stop=[FAULT_STOP])
    again = {**healthy, "cache_salt": uuid.uuid4().hex}  # computed afresh, beside the fault
    before = await snapshot(url)
    async with aiohttp.ClientSession() as http:
        if streamed:
            with capture_logs() as logs:
                events, (status, body) = await asyncio.gather(
                    stream(http, url, faulty), post_json(url, "/v1/chat/completions", again))
            assert events[-1] == ENGINE_FAULT  # then data: [DONE] (sse_events checks it)
            assert not any(c["choices"][0].get("finish_reason") for c in events[:-1])
            # Logged once by the engine thread, with the request's id.
            assert [e["request_id"] for e in logs if e["event"] == "request_failed"] == [
                events[0]["id"]]
        else:
            (fault_status, fault_body), (status, body) = await asyncio.gather(
                post_json(url, "/v1/chat/completions", faulty),
                post_json(url, "/v1/chat/completions", again))
            assert (fault_status, fault_body) == (500, ENGINE_FAULT)
    assert status == 200 and body["choices"] == alone["choices"]
    await assert_healthy_and_idle(server)
    moved = delta(before, await snapshot(url))
    # 2 requests admitted (faulty n=2, healthy) + the later one: 3 requests, 4 sequences.
    assert moved == {"requests_total": 3, "sequences_total": 4, "requests_failed_total": 1,
                     "sequences_failed_total": 2, "outcome_error": 1}


async def test_a_fault_adding_the_request_ends_only_it(server, monkeypatch):
    url = server.url
    engine = server.engine._engine
    real_add = engine.add_request

    def faulty(req):
        if req.params.stop == (FAULT_STOP,):
            raise RuntimeError("injected add_request fault")
        return real_add(req)

    monkeypatch.setattr(engine, "add_request", faulty)
    before = await snapshot(url)
    status, body = await post_json(url, "/v1/chat/completions",
                                   chat("never added", n=3, temperature=1, stop=[FAULT_STOP]))
    assert (status, body) == (500, ENGINE_FAULT)
    await assert_healthy_and_idle(server)
    moved = delta(before, await snapshot(url))
    # Never admitted: not in requests_total; its 3 choices failed; the later request counts.
    assert moved == {"requests_total": 1, "sequences_total": 1, "requests_failed_total": 1,
                     "sequences_failed_total": 3, "outcome_error": 1}


async def test_a_forward_fault_mid_stream_ends_that_steps_requests(server, monkeypatch):
    url = server.url
    runner = server.engine._engine.runner
    real_forward = runner.forward
    armed = threading.Event()  # set on the test's loop, read in the engine thread
    fired = []

    def faulty(batch):
        if armed.is_set() and not fired:
            fired.append(1)
            raise RuntimeError("injected forward fault")
        return real_forward(batch)

    monkeypatch.setattr(runner, "forward", faulty)
    before = await snapshot(url)
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions",
                             json=chat("forward fault", max_tokens=400, stream=True)) as resp:
            assert resp.status == 200
            seen = await first_content(resp)
            armed.set()
            events = [orjson.loads(e) for e in sse_events(seen + await resp.read())]
    assert events[-1] == ENGINE_FAULT and fired == [1]
    await assert_healthy_and_idle(server)
    moved = delta(before, await snapshot(url))
    assert moved == {"requests_total": 2, "sequences_total": 2, "requests_failed_total": 1,
                     "sequences_failed_total": 1, "outcome_error": 1}


async def test_a_server_fault_is_a_counted_500(server, monkeypatch):
    url = server.url

    def broken_lookup(self, scope):
        raise RuntimeError("injected output-memory fault")

    def broken_template(*args, **kwargs):
        raise RuntimeError("injected templating fault")

    before = await snapshot(url)
    with monkeypatch.context() as patch, capture_logs() as logs:
        patch.setattr(OutputMemory, "lookup_in", broken_lookup)
        status, raw, headers = await post(url, "/v1/chat/completions", chat("memory fault"),
                                          headers={"X-Request-Id": "fault-probe-1"})
        assert (status, orjson.loads(raw)) == (500, SERVER_FAULT)
    assert [(e["request_id"], e["path"]) for e in logs if e["event"] == "unhandled_server_error"
            ] == [("fault-probe-1", "/v1/chat/completions")]
    with monkeypatch.context() as patch:
        # On the class: the tokenizer pool's workers may each hold their own tokenizer.
        patch.setattr(type(server.engine.tokenizer), "apply_chat_template", broken_template)
        status, raw, _ = await post(url, "/tokenize", {"messages": [{"role": "user",
                                                                     "content": "hi"}]})
        assert (status, orjson.loads(raw)) == (500, SERVER_FAULT)
    await assert_healthy_and_idle(server)
    moved = delta(before, await snapshot(url))
    # Two server faults (one a completion request: outcome error); the later request counts.
    assert moved == {"server_errors_total": 2, "outcome_error": 1, "requests_total": 1,
                     "sequences_total": 1}


async def test_a_server_fault_mid_stream_ends_with_an_error_event_then_done(server, monkeypatch):
    url = server.url
    real_chunk = ChatCompletion.content_chunk
    calls = []

    def faulty(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected chunk fault")
        return real_chunk(self, *args, **kwargs)

    monkeypatch.setattr(ChatCompletion, "content_chunk", faulty)
    before = await snapshot(url)
    async with aiohttp.ClientSession() as http:
        events = await stream(http, url, chat("chunk fault", max_tokens=30))
    monkeypatch.undo()
    assert events[-1] == SERVER_FAULT and len(calls) == 2
    await assert_healthy_and_idle(server)
    moved = delta(before, await snapshot(url))
    # The stream's request was aborted by the handler ending it (its blocks freed).
    assert moved == {"server_errors_total": 1, "outcome_error": 1, "requests_total": 2,
                     "sequences_total": 2, "requests_aborted_total": 1,
                     "sequences_aborted_total": 1}


async def test_an_aborted_n3_stream_counts_one_request_and_three_sequences(server):
    url = server.url
    before = await snapshot(url)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(url + "/v1/chat/completions", json=chat(
            "abort me", max_tokens=1500, temperature=1, n=3, stream=True))
        assert resp.status == 200
        await first_content(resp)
        resp.close()
    await wait_idle(url)
    for _ in range(100):  # the handler's outcome is counted once its task ends
        moved = delta(before, await snapshot(url))
        if "outcome_abort" in moved:
            break
        await asyncio.sleep(0.05)
    assert moved == {"requests_total": 1, "sequences_total": 3, "requests_aborted_total": 1,
                     "sequences_aborted_total": 3, "outcome_abort": 1}


@pytest.fixture
def fragile(tiny_model) -> Iterator[RunningServer]:
    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    yield from run_server_in_thread(engine, expect_engine_error=True)


async def test_a_forward_fault_with_a_failed_integrity_check_kills_the_engine(fragile,
                                                                              monkeypatch):
    engine = fragile.engine._engine
    broken = []

    def broken_forward(batch):
        broken.append(1)
        raise RuntimeError("injected forward fault")

    real_check = engine.cache.check_integrity

    def check(**kwargs):
        if broken:
            raise AssertionError("injected integrity failure")
        return real_check(**kwargs)

    monkeypatch.setattr(engine.runner, "forward", broken_forward)
    monkeypatch.setattr(engine.cache, "check_integrity", check)
    status, body = await post_json(fragile.url, "/v1/chat/completions", chat("doomed"))
    assert status == 503 and body["error"]["code"] == "engine_dead"
    assert await get(fragile.url, "/health") == (503, {"status": "unhealthy"})
    status, body = await post_json(fragile.url, "/v1/chat/completions", chat("after"))
    assert status == 503 and body["error"]["type"] == "server_error"
    assert isinstance(fragile.engine.error, AssertionError)

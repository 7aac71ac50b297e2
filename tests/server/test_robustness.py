"""Disconnect storm, event-loop blocking by one long request, /metrics, latency_ms, /openapi.json, CLI flags."""

from __future__ import annotations

import asyncio
import gc
import random
import socket
import struct
import threading
import time
import uuid

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixkv.cli import build_parser, main
from radixkv.server.app import REGISTRY_KEY, create_app
from radixkv.server.metrics import render
from tests.server.helpers import HI, get, post_json, sse_events, wait_idle

SHARED = " ".join(f"rule{i}" for i in range(60))


def storm_messages(i: int) -> list[dict]:
    """Four groups sharing a system prompt; every eighth prompt is long (~1500 tokens)."""
    system = f"Group {i % 4}: {SHARED}"
    if i % 8 == 7:
        system += " " + " ".join(f"extra{j}" for j in range(300))
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]


STORM = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


async def test_disconnect_storm_frees_every_block_and_lock(server):
    url = server.url
    references = []
    for i in range(32):
        status, body = await post_json(url, "/v1/chat/completions",
                                       {"messages": storm_messages(i), **STORM})
        assert status == 200
        references.append(body["choices"][0]["message"]["content"])
    rng = random.Random(1234)
    dropped = dict(zip(rng.sample(range(32), 10),
                       ["before_headers", "mid_prefill", "mid_stream"] * 4))
    # Fresh cache namespace for this run, so prefills really happen concurrently.
    salt = uuid.uuid4().hex

    async def client(i: int, http: aiohttp.ClientSession) -> str | None:
        body = {"messages": storm_messages(i), **STORM, "stream": True, "cache_salt": salt}
        mode = dropped.get(i)
        if mode in ("before_headers", "mid_prefill"):
            task = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=body))
            await asyncio.sleep(rng.uniform(0.0, 0.03 if mode == "before_headers" else 0.15))
            task.cancel()
            try:
                resp = await task
                resp.close()  # headers came first after all: drop now
            except asyncio.CancelledError:
                pass
            return None
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            if mode == "mid_stream":
                for _ in range(rng.randint(1, 6)):
                    await resp.content.readline()
                resp.close()
                return None
            raw = await resp.read()
        chunks = [orjson.loads(e) for e in sse_events(raw)]
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)

    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(client(i, http) for i in range(32)))
    for i, text in enumerate(results):
        if i not in dropped:
            assert text == references[i], i
    stats = await wait_idle(url)
    assert stats["pool"]["in_use_blocks"] == 0
    cache = server.engine._engine.cache
    deadline = time.monotonic() + 30
    while server.engine.num_requests_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert server.engine.num_requests_in_flight == 0
    assert cache.tree.num_locked_blocks == 0 and cache.num_in_use_blocks == 0
    _, metrics = await get(url, "/metrics")
    assert "radixkv_in_flight_requests 0.0" in metrics


def _outcome_counts(metrics: str) -> dict[str, float]:
    return {s.labels["outcome"]: s.value
            for family in text_string_to_metric_families(metrics)
            if family.name == "radixkv_requests"
            for s in family.samples if s.name == "radixkv_requests_total"}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_reset_before_the_stream_headers_counts_abort_not_a_server_error(server, path):
    # A client that resets its connection while its request prefills: the handler either is
    # cancelled or finds the transport closing when it writes the stream's headers. Both are the
    # client going away (outcome "abort"), never a server error.
    url, n = server.url, 40
    host, port = url.removeprefix("http://").split(":")
    _, before = await get(url, "/metrics")
    for i in range(n):
        body = orjson.dumps({"model": server.engine.model_name, "max_tokens": 8, "stream": True,
                             "messages": [{"role": "user", "content": f"Reset {i} {uuid.uuid4()}"}]})
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        await asyncio.sleep(0.00025 * i)  # spread the resets over the prefill and first write
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        writer.transport.abort()
    deadline = time.monotonic() + 30
    while True:  # the outcome is counted when the handler ends
        _, after = await get(url, "/metrics")
        delta = {k: v - _outcome_counts(before).get(k, 0.0)
                 for k, v in _outcome_counts(after).items()}
        if sum(delta.values()) >= n or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert delta["abort"] == n and delta["error"] == 0, delta
    stats = await wait_idle(url)  # the engine thread releases the aborted requests' blocks
    assert stats["pool"]["in_use_blocks"] == 0


async def test_c20_tokenizing_and_hashing_stay_off_the_event_loop(server, monkeypatch):
    engine, loop = server.engine, server.loop

    async def ident() -> int:
        return threading.get_ident()

    loop_thread = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(ident(), loop))
    calls: list[str] = []

    def recorded(fn):
        def wrapper(*args, **kwargs):
            calls.append(threading.current_thread().name)
            assert threading.get_ident() != loop_thread
            return fn(*args, **kwargs)
        return wrapper

    for obj, name in [(engine.tokenizer, "apply_chat_template"), (engine.tokenizer, "encode"),
                      (engine._engine.cache, "begin"), (engine._engine.cache, "publish")]:
        monkeypatch.setattr(obj, name, recorded(getattr(obj, name)))
    stop = threading.Event()

    async def probe() -> float:  # runs on the server's loop: worst oversleep of 5 ms naps
        worst = 0.0
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            worst = max(worst, time.perf_counter() - t0 - 0.005)
        return worst

    # The probe measures what this test is about (work on the loop), not a full collection of
    # the whole test session's heap (~450k objects after torch, transformers and the earlier
    # tests: ~0.4 s on this machine, and it stops every thread): the heap so far is frozen.
    gc.collect()
    gc.freeze()
    try:
        lag = asyncio.run_coroutine_threadsafe(probe(), loop)
        huge = " ".join(f"token{i}" for i in range(90_000))  # ~700 KB: tokenized, then refused
        near_limit = " ".join(f"w{i}" for i in range(420))
        bodies = [{"messages": [{"role": "user", "content": huge}], "max_tokens": 1},
                  {"messages": [{"role": "user", "content": near_limit}], "max_tokens": 2}]
        bodies += [{"messages": [{"role": "user", "content": f"short {i}"}], "max_tokens": 4}
                   for i in range(62)]
        results = await asyncio.gather(*(post_json(server.url, "/v1/chat/completions", b)
                                         for b in bodies))
        stop.set()
        worst_lag = await asyncio.wrap_future(lag)
    finally:
        stop.set()
        gc.unfreeze()
    assert results[0][0] == 400 and results[0][1]["error"]["code"] == "context_length_exceeded"
    assert all(status == 200 for status, _ in results[1:])
    assert calls and all(name.startswith(("radixkv-tok", "radixkv-engine")) for name in calls)
    assert {"radixkv-engine"} <= {n.split("_")[0] for n in calls}
    assert worst_lag < 0.25, worst_lag


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    family = families[name]
    for s in family.samples:
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v
                                                        for k, v in labels.items()):
            return s.value
    raise KeyError((name, sample, labels))


async def test_metrics_exposition(server):
    url = server.url
    status, text = await get(url, "/metrics")
    assert status == 200
    before = _families(text)
    messages = [{"role": "system", "content": f"{uuid.uuid4().hex} " + "cached " * 80}, *HI]
    for _ in range(2):
        status, _ = await post_json(url, "/v1/chat/completions",
                                    {"messages": messages, "max_tokens": 3, "temperature": 0,
                                     "ignore_eos": True})
        assert status == 200
    await post_json(url, "/v1/chat/completions", {"messages": []})
    _, text = await get(url, "/metrics")
    after = _families(text)
    for name in ("radixkv_prefix_cache_queries_tokens", "radixkv_prefix_cache_hits_tokens",
                 "radixkv_saved_prefill_tokens", "radixkv_evicted_blocks",
                 "radixkv_generated_tokens", "radixkv_requests", "radixkv_kv_free_blocks",
                 "radixkv_kv_in_use_blocks", "radixkv_time_to_first_token_seconds",
                 "radixkv_inter_token_latency_seconds", "radixkv_prefix_cache_miss_tokens"):
        assert name in after, name
    assert all(name.startswith("radixkv_") for name in after)
    hits = "radixkv_prefix_cache_hits_tokens"
    assert _value(after, hits) - _value(before, hits) >= 80
    assert (_value(after, "radixkv_requests", outcome="length")
            - _value(before, "radixkv_requests", outcome="length")) == 2
    assert (_value(after, "radixkv_requests", outcome="rejected")
            - _value(before, "radixkv_requests", outcome="rejected")) == 1
    ttft = "radixkv_time_to_first_token_seconds"
    assert _value(after, ttft, ttft + "_count") - _value(before, ttft, ttft + "_count") == 2
    assert _value(after, ttft, ttft + "_bucket", le="+Inf") == _value(after, ttft, ttft + "_count")
    itl = "radixkv_inter_token_latency_seconds"
    assert _value(after, itl, itl + "_count") - _value(before, itl, itl + "_count") == 4
    assert _value(after, "radixkv_kv_total_blocks") == 512


async def test_latency_in_stats(server):
    await post_json(server.url, "/v1/chat/completions", {"messages": HI, "max_tokens": 3})
    _, stats = await get(server.url, "/stats")
    latency = stats["latency_ms"]
    assert set(latency) >= {"ttft_p50", "ttft_p99", "itl_p50"}
    assert 0 < latency["ttft_p50"] <= latency["ttft_p99"]
    assert latency["itl_p50"] > 0


async def test_openapi_documents_every_route(server):
    status, doc = await get(server.url, "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1")
    app = create_app(server.engine)
    routes = {(r.resource.canonical, r.method.lower()) for r in app.router.routes()
              if r.method != "HEAD"}
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert routes == documented
    for ops in doc["paths"].values():
        for op in ops.values():
            for response in op["responses"].values():
                ref = orjson.dumps(response)
                for name in {part.split(b'"')[0] for part in ref.split(b"#/components/schemas/")[1:]}:
                    assert name.decode() in doc["components"]["schemas"]


def test_two_apps_in_one_process_have_their_own_registries(server):
    first, second = create_app(server.engine), create_app(server.engine)
    assert first[REGISTRY_KEY] is not second[REGISTRY_KEY]
    for app in (first, second):
        body, content_type = render(app[REGISTRY_KEY])
        assert b"radixkv_kv_total_blocks 512.0" in body and content_type.startswith("text/plain")


def test_cli_flags():
    args = build_parser().parse_args([
        "serve", "--api-keys", "keys.json", "--max-queue", "0", "--max-concurrency-per-tenant",
        "4", "--shutdown-timeout", "2.5", "--max-body-bytes", "1000"])
    assert (args.api_keys, args.max_queue, args.max_concurrency_per_tenant,
            args.shutdown_timeout, args.max_body_bytes) == ("keys.json", 0, 4, 2.5, 1000)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.api_keys, defaults.max_queue, defaults.max_concurrency_per_tenant,
            defaults.shutdown_timeout, defaults.max_body_bytes) == (None, None, None, 30.0, 8 << 20)
    for bad in (["--max-queue", "-1"], ["--max-concurrency-per-tenant", "0"],
                ["--max-body-bytes", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])


def test_cli_refuses_an_eviction_policy_before_loading_anything(monkeypatch, capsys):
    import radixkv.engine.async_engine
    from radixkv.config import CacheConfig

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine (model, KV pool) was built before the policy check")

    monkeypatch.setattr(radixkv.engine.async_engine, "AsyncEngine", no_engine)
    usable = "usable: cost, fifo, gdsf, lfu, lru, predicted-reuse, predicted-reuse-prior, s3fifo"
    oracle = "'belady' is an offline oracle that needs the trace's future (bench eviction only)"
    for name, reason in (("nope", "unknown policy 'nope'"), ("belady", oracle)):
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--eviction-policy", name])
        assert exc.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"radixkv serve: error: argument --eviction-policy: {reason}; {usable}")
    assert build_parser().parse_args(["serve", "--eviction-policy", "s3fifo"]).eviction_policy \
        == "s3fifo"
    # The config refuses it too (API users), naming the field.
    for name, reason in (("nope", "unknown policy 'nope'"), ("belady", oracle)):
        with pytest.raises(ValueError) as exc:
            CacheConfig(eviction_policy=name)
        assert str(exc.value) == f"eviction_policy: {reason}; {usable}"


def test_cli_refuses_a_bad_key_file(tmp_path, capsys):
    path = tmp_path / "keys.json"
    path.write_text('{"short": {"tenant": "a"}}')
    assert main(["serve", "--api-keys", str(path)]) == 2
    assert "at least 8" in capsys.readouterr().err
    assert main(["serve", "--api-keys", str(tmp_path / "missing.json")]) == 2

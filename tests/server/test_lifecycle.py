"""Admission limits (503 queue full, 429 per tenant), graceful shutdown (drain, then abort),
/health once the engine is dead, and ``radixkv serve`` under a real SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from radixkv.server.auth import parse_api_keys
from tests.factories import make_async_engine
from tests.server.conftest import BLOCK_SIZE, NUM_BLOCKS, RunningServer, run_server_in_thread
from tests.server.helpers import HI, bearer, get, post, post_json, sse_events, wait_process_healthy

T1, T2, ADMIN = "key-tenant-one", "key-tenant-two", "key-the-admin"
KEYS = {T1: {"tenant": "t1"}, T2: {"tenant": "t2"}, ADMIN: {"tenant": "ops", "admin": True}}
LONG = {"messages": HI, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited(tiny_model) -> Iterator[RunningServer]:
    """Two sequences run at once, none may queue; one request in flight per tenant."""
    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                               max_num_seqs=2, max_queue=0)
    yield from run_server_in_thread(engine, api_keys=parse_api_keys(KEYS),
                                    max_concurrency_per_tenant=1)


async def open_stream(http: aiohttp.ClientSession, url: str, body: dict, key: str | None = None
                      ) -> aiohttp.ClientResponse:
    """Start a streaming chat and wait for its first content event."""
    resp = await http.post(url + "/v1/chat/completions", json={**body, "stream": True},
                           headers=bearer(key))
    assert resp.status == 200, await resp.text()
    seen = b""
    while b'"content":"' not in seen.split(b"\n\n", 1)[-1]:
        seen += await resp.content.readany()
    return resp


async def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_tenant_limit_429_and_queue_full_503(limited):
    url = limited.url
    async with aiohttp.ClientSession() as http:
        first = await open_stream(http, url, LONG, T1)
        status, raw, headers = await post(url, "/v1/chat/completions",
                                          {"messages": HI, "max_tokens": 1}, headers=bearer(T1))
        err = orjson.loads(raw)["error"]
        assert status == 429 and headers["Retry-After"] == "1"
        assert (err["type"], err["code"]) == ("requests", "rate_limit_exceeded")
        # Another tenant is not limited by t1's requests ...
        second = await open_stream(http, url, LONG, T2)
        # ... but the engine is now full (2 running, queue bound 0): 503 with Retry-After.
        status, raw, headers = await post(url, "/v1/completions",
                                          {"prompt": [1, 2, 3], "max_tokens": 1},
                                          headers=bearer(ADMIN))
        err = orjson.loads(raw)["error"]
        assert status == 503 and headers["Retry-After"] == "1"
        assert (err["type"], err["code"]) == ("server_error", "queue_full")
        first.close()
        second.close()
    await wait_for(lambda: limited.engine.num_requests_in_flight == 0)
    status, body = await post_json(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 1},
                                   T1)
    assert status == 200
    _, metrics = await get(url, "/metrics", ADMIN)
    assert 'radixkv_requests_total{outcome="overloaded"} 2.0' in metrics


async def test_shutdown_drains_in_flight_requests(tiny_model):
    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    gen = run_server_in_thread(engine, shutdown_timeout_s=60.0)
    srv = next(gen)
    try:
        async with aiohttp.ClientSession() as http:
            resp = await open_stream(http, srv.url, {**LONG, "max_tokens": 300})
            srv.stop()
            status, body = await get(srv.url, "/health")
            deadline = time.monotonic() + 10
            while status == 200 and time.monotonic() < deadline:
                status, body = await get(srv.url, "/health")
            assert (status, body) == (503, {"status": "draining"})
            status, raw, headers = await post(srv.url, "/v1/chat/completions",
                                              {"messages": HI, "max_tokens": 1})
            assert status == 503 and orjson.loads(raw)["error"]["code"] == "shutting_down"
            assert headers["Retry-After"] == "1"
            rest = await resp.content.read()  # the in-flight stream finishes normally
        events = [orjson.loads(e) for e in sse_events(rest)]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        await wait_for(lambda: srv.stopped)
    finally:
        next(gen, None)


async def test_shutdown_timeout_aborts_the_rest(tiny_model):
    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    gen = run_server_in_thread(engine, shutdown_timeout_s=0.3)
    srv = next(gen)
    try:
        async with aiohttp.ClientSession() as http:
            stream = await open_stream(http, srv.url, LONG)
            plain = asyncio.ensure_future(post(srv.url, "/v1/chat/completions", LONG))
            await wait_for(lambda: engine.num_requests_in_flight == 2)
            started = time.monotonic()
            srv.stop()
            rest = await stream.content.read()
            status, raw, _ = await plain
        assert time.monotonic() - started < 8
        assert status == 503 and orjson.loads(raw)["error"]["code"] == "aborted"
        events = [orjson.loads(e) for e in sse_events(rest)]
        assert events[-1] == {"error": {"message": "the request was aborted by the server",
                                        "type": "server_error", "param": None, "code": "aborted"}}
        await wait_for(lambda: srv.stopped)
        assert engine._engine.cache.num_in_use_blocks == 0
    finally:
        next(gen, None)


async def test_health_is_503_once_the_engine_is_dead(tiny_model):
    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    gen = run_server_in_thread(engine, expect_engine_error=True)
    srv = next(gen)
    try:
        assert await get(srv.url, "/health") == (200, {"status": "ok"})
        async with aiohttp.ClientSession() as http:
            stream = await open_stream(http, srv.url, LONG)

            def broken():
                raise RuntimeError("injected engine failure")

            engine._engine.step = broken
            rest = await stream.content.read()
        assert b'"code":"engine_dead"' in rest
        assert await get(srv.url, "/health") == (503, {"status": "unhealthy"})
        status, body = await post_json(srv.url, "/v1/chat/completions",
                                       {"messages": HI, "max_tokens": 1})
        assert status == 503 and body["error"]["type"] == "server_error"
        status, body = await post_json(srv.url, "/v1/chat/completions", {"messages": []})
        assert status == 400  # client mistakes are still 4xx
    finally:
        next(gen, None)
    assert isinstance(engine.error, RuntimeError)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_radixkv_serve_drains_on_sigterm(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    port = _free_port()
    cmd = [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(tiny_model_dir),
           "--device", "cpu", "--port", str(port), "--num-blocks", "256",
           "--api-keys", str(keys), "--max-queue", "4", "--max-concurrency-per-tenant", "2",
           "--shutdown-timeout", "60", "--max-body-bytes", "100000", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> bytes:
        await wait_process_healthy(proc, url)
        assert (await get(url, "/stats"))[0] == 401
        status, _, _ = await post(url, "/v1/chat/completions", data=b"x" * 200_000,
                                  headers={**bearer(T1), "Content-Type": "application/json"})
        assert status == 413
        async with aiohttp.ClientSession() as http:
            resp = await open_stream(http, url, {**LONG, "max_tokens": 200}, T1)
            proc.send_signal(signal.SIGTERM)
            return await resp.content.read()

    try:
        rest = asyncio.run(scenario())
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [orjson.loads(e) for e in sse_events(rest)]
    assert events[-1]["choices"][0]["finish_reason"] == "length"

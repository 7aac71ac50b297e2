"""What a KV-aware router asks of a replica (``radixkv.server.fleet``): discovery
(``GET /get_server_info``, ``GET /kv_event_sources``) and the admin cache reset
(``POST /reset_prefix_cache``, SGLang's alias ``POST /flush_cache``).

Two in-process tiny-model servers (B = 16): ``plain`` (no keys, no KV events) and ``keyed``
(``--api-keys`` with tenants a and b and an admin key, KV events on a free loopback port).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from radixkv.engine.kv_events import KVEventsConfig
from radixkv.server.auth import load_api_keys
from tests.factories import make_async_engine
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import HI, bearer, cached_tokens, capped, complete, get, post_json

B = 16
A_KEY, B_KEY, ADMIN_KEY = "key-tenant-a", "key-tenant-b", "key-fleet-admin"
KEYS = {A_KEY: {"tenant": "a", "admin": False}, B_KEY: {"tenant": "b", "admin": False},
        ADMIN_KEY: {"tenant": "ops", "admin": True}}
RESETS = ("/reset_prefix_cache", "/flush_cache")
_fresh = itertools.count(1)


def fresh_prompt(length: int) -> list[int]:
    """Token ids no other test of the module used (distinct first block)."""
    base = 100 + next(_fresh) * 50
    return [base + i for i in range(length)]


@pytest.fixture(scope="module")
def plain(tiny_model) -> Iterator[RunningServer]:
    yield from run_server_in_thread(make_async_engine(tiny_model, block_size=B, num_blocks=128))


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory) -> Iterator[RunningServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0")
    engine = make_async_engine(tiny_model, block_size=B, num_blocks=128, kv_events=events)
    yield from run_server_in_thread(engine, api_keys=load_api_keys(path))


async def tree_blocks(server: RunningServer) -> tuple[int, int]:
    """(blocks in the tree, of which no request holds any) from the admin /stats view."""
    _, stats = await get(server.url, "/stats", ADMIN_KEY)
    return stats["tree"]["cached_blocks"], stats["pool"]["cached_evictable_blocks"]


async def test_get_server_info(plain: RunningServer, keyed: RunningServer):
    for server, events in ((plain, False), (keyed, True)):
        status, info = await get(server.url, "/get_server_info")  # public: no key, even keyed
        assert status == 200
        assert info == {"model_id": server.engine.model_name,
                        "instance_id": server.engine.instance_id, "kv_block_size": B,
                        "max_model_len": server.engine.max_model_len,
                        "enable_kv_cache_events": events}
        assert len(info["instance_id"]) == 32 and int(info["instance_id"], 16) >= 0
    assert plain.engine.instance_id != keyed.engine.instance_id
    # Stable for the life of the process (a router takes a new one for a restart).
    assert (await get(plain.url, "/get_server_info"))[1]["instance_id"] == plain.engine.instance_id


async def test_kv_event_sources(plain: RunningServer, keyed: RunningServer):
    assert await get(plain.url, "/kv_event_sources") == (200, {})
    status, sources = await get(keyed.url, "/kv_event_sources")
    endpoint = keyed.engine.kv_events.advertised_endpoint
    assert status == 200
    assert sources == {"0": {"endpoint": endpoint, "replay_endpoint": None, "topic": "",
                             "hwm": 100_000, "buffer_steps": 10_000, "publisher": "zmq",
                             "encoding": "msgpack", "schema_version": 1,
                             "enable_kv_cache_events": True}}
    # The port as bound, not the 0 the config asked for.
    host, _, port = endpoint.rpartition(":")
    assert host == "tcp://127.0.0.1" and int(port) > 0


@pytest.mark.parametrize("path", RESETS)
async def test_resets_need_an_admin_key(keyed: RunningServer, path: str):
    async with aiohttp.ClientSession() as http:
        async with http.post(keyed.url + path) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
        for key in (A_KEY, B_KEY):
            async with http.post(keyed.url + path, headers=bearer(key)) as resp:
                assert resp.status == 403
                assert orjson.loads(await resp.read()) == {"error": {
                    "message": f"{path} needs an admin key", "type": "invalid_request_error",
                    "param": None, "code": "insufficient_permissions"}}
        async with http.post(keyed.url + path, headers=bearer(ADMIN_KEY)) as resp:
            assert resp.status == 200
            assert set(await resp.json()) == {"success", "num_evicted_blocks"}


@pytest.mark.parametrize("path", RESETS)
async def test_reset_evicts_every_cached_block(keyed: RunningServer, path: str):
    await post_json(keyed.url, path, None, ADMIN_KEY)  # start from an empty tree
    assert await tree_blocks(keyed) == (0, 0)
    prompts = {A_KEY: fresh_prompt(40), B_KEY: fresh_prompt(70)}
    for key, prompt in prompts.items():
        status, body = await complete(keyed.url, prompt, key)
        assert status == 200 and cached_tokens(body) == 0
        assert cached_tokens((await complete(keyed.url, prompt, key))[1]) == capped(
            len(prompt), len(prompt), B)
    # 40 tokens: 2 full blocks; 70 tokens: 4 (max_tokens 1: the sampled token has no K/V).
    assert await tree_blocks(keyed) == (6, 6)
    seq = keyed.engine.kv_events.next_seq
    assert await post_json(keyed.url, path, None, ADMIN_KEY) == (
        200, {"success": True, "num_evicted_blocks": 6})
    assert await tree_blocks(keyed) == (0, 0)
    for key, prompt in prompts.items():
        status, body = await complete(keyed.url, prompt, key)
        assert status == 200 and cached_tokens(body) == 0
    # Tenant blocks are never published; the reset itself is (one AllBlocksCleared batch).
    assert keyed.engine.kv_events.next_seq == seq + 1
    assert await post_json(keyed.url, path, None, ADMIN_KEY) == (
        200, {"success": True, "num_evicted_blocks": 6})
    assert await post_json(keyed.url, path, None, ADMIN_KEY) == (
        200, {"success": True, "num_evicted_blocks": 0})


async def test_reset_keeps_a_running_requests_blocks(plain: RunningServer):
    long = {"messages": HI, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    status, reference = await post_json(plain.url, "/v1/chat/completions", long)
    assert status == 200
    prompt_tokens = reference["usage"]["prompt_tokens"]
    await post_json(plain.url, "/reset_prefix_cache", None)  # no keys: anyone may reset
    assert await tree_blocks(plain) == (0, 0)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(plain.url + "/v1/chat/completions", json={**long, "stream": True})
        assert resp.status == 200
        raw = b""
        while raw.count(b'"content":"') < 2:  # decoding: the prompt's blocks are in the tree
            raw += await asyncio.wait_for(resp.content.readany(), 60)
        held, evictable = await tree_blocks(plain)
        assert held > 0 and evictable == 0  # all of them the running request's
        status, reset = await post_json(plain.url, "/flush_cache", None)
        assert (status, reset) == (200, {"success": True, "num_evicted_blocks": 0})
        assert (await tree_blocks(plain))[0] >= held  # nothing it holds was dropped
        raw += await asyncio.wait_for(resp.read(), 60)
    text, finish = "", None
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            choice = orjson.loads(event[len(b"data: "):])["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    # Served to the end, exactly as without the reset (greedy).
    assert (text, finish) == (reference["choices"][0]["message"]["content"], "length")
    # Its blocks stayed cached: the same chat again is served from them.
    status, again = await post_json(plain.url, "/v1/chat/completions", {**long, "max_tokens": 1})
    assert cached_tokens(again) == capped(prompt_tokens, prompt_tokens, B)
    # Now idle: the whole prompt plus the 300 generated tokens' full blocks are evictable.
    cached, evictable = await tree_blocks(plain)
    assert cached == evictable == (prompt_tokens + 299) // B
    assert await post_json(plain.url, "/reset_prefix_cache", None) == (
        200, {"success": True, "num_evicted_blocks": cached})


async def test_openapi_documents_the_fleet_routes(keyed: RunningServer):
    status, doc = await get(keyed.url, "/openapi.json")
    assert status == 200
    paths = doc["paths"]
    for path in ("/get_server_info", "/kv_event_sources"):
        assert list(paths[path]) == ["get"] and paths[path]["get"]["security"] == []
    info = paths["/get_server_info"]["get"]["responses"]["200"]["content"]["application/json"]
    assert info["schema"]["required"] == ["model_id", "instance_id", "kv_block_size"]
    for path in RESETS:
        assert list(paths[path]) == ["post"]
        assert sorted(paths[path]["post"]["responses"]) == ["200", "401", "403", "503"]

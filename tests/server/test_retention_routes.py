"""The operator routes: ``POST /v1/cache/retain`` (warm and retain without generating),
``GET /v1/cache/retentions``, ``DELETE /v1/cache/retentions[/{id}]``, and their isolation.

One server for the module: tiny model, B = 4, 128 blocks, three API keys (two tenants and an
admin). Every test starts with no retention (the admin releases all).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.engine.async_engine import AsyncEngine
from radixkv.server.auth import load_api_keys
from tests.factories import engine_config
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import bearer, cached_tokens, complete, get, post_json

B = 4
T1_KEY, T2_KEY, ADMIN_KEY = "key-tenant-one", "key-tenant-two", "key-the-admin"
KEYS = {T1_KEY: {"tenant": "t1", "admin": False}, T2_KEY: {"tenant": "t2", "admin": False},
        ADMIN_KEY: {"tenant": "ops", "admin": True}}
HOUR_S = 3600.0
T2_BUDGET_TOKENS = 12
_fresh = itertools.count(300)


def fresh_prompt(length: int) -> list[int]:
    """Token ids no other test used (a distinct first token)."""
    base = next(_fresh) * 89
    return [base + i for i in range(length)]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[RunningServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    config = engine_config(block_size=B, num_blocks=128)
    # t2 may retain 3 blocks (as `radixkv serve` takes max_retained_tokens from the key file).
    config = dataclasses.replace(config, cache=dataclasses.replace(
        config.cache, tenant_max_retained_tokens=(("t2", T2_BUDGET_TOKENS),)))
    engine = AsyncEngine(config, tiny_model, check_integrity_when_idle=True)
    yield from run_server_in_thread(engine, api_keys=load_api_keys(path))


async def delete(url: str, path: str, key: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.delete(url + path, headers=bearer(key)) as resp:
            return resp.status, orjson.loads(await resp.read())


async def listed(url: str, key: str, query: str = "") -> list[dict]:
    status, body = await get(url, "/v1/cache/retentions" + query, key)
    assert status == 200, body
    assert body["object"] == "list"
    return body["data"]


def health_status(url: str) -> int:
    return asyncio.run(get(url, "/health"))[0]


async def retain(url: str, key: str, **body: Any) -> tuple[int, Any]:
    return await post_json(url, "/v1/cache/retain", body, key)


@pytest.fixture(autouse=True)
def no_retentions(server) -> None:
    async def clear() -> None:
        status, _ = await delete(server.url, "/v1/cache/retentions", ADMIN_KEY)
        assert status == 200
        assert await listed(server.url, ADMIN_KEY) == []

    asyncio.run(clear())


async def test_retain_token_ids_then_hit_list_release(server):
    url, p = server.url, fresh_prompt(10)
    status, body = await retain(url, T1_KEY, prompt=p, ttl="1h")
    assert status == 200, body
    rid = body["id"]
    assert re.fullmatch(r"ret_[0-9a-f]{24}", rid), rid
    assert 0 <= HOUR_S - body.pop("expires_in_s") < 60
    assert body == {"id": rid, "object": "cache.retention", "ttl": "1h", "num_prompt_tokens": 10,
                    "num_cached_tokens": 0, "num_retained_tokens": 8, "cache_creation_tokens": 8}
    # The tenant's next request reads the warmed prefix; the other tenant's does not.
    status, body = await complete(url, p + [7, 8], T1_KEY)
    assert cached_tokens(body) == 8
    status, body = await complete(url, p + [7, 8], T2_KEY)
    assert cached_tokens(body) == 0
    # Listed for its tenant and the admin only; the hit refreshed it.
    [mine] = await listed(url, T1_KEY)
    assert {k: mine[k] for k in ("id", "object", "tenant", "ttl", "num_tokens", "num_refreshes")
            } == {"id": rid, "object": "cache.retention", "tenant": "t1", "ttl": "1h",
                  "num_tokens": 8, "num_refreshes": 1}
    assert await listed(url, T2_KEY) == []
    assert [r["id"] for r in await listed(url, ADMIN_KEY)] == [rid]
    assert [r["id"] for r in await listed(url, ADMIN_KEY, "?tenant=t1")] == [rid]
    assert await listed(url, ADMIN_KEY, "?tenant=t2") == []
    # Another tenant can neither name, nor release, nor refresh it.
    status, err = await get(url, "/v1/cache/retentions?tenant=t1", T2_KEY)
    assert (status, err["error"]["code"], err["error"]["param"]) == (
        403, "insufficient_permissions", "tenant")
    status, err = await delete(url, f"/v1/cache/retentions/{rid}", T2_KEY)
    assert status == 404
    assert err == {"error": {"message": f"No retention '{rid}'", "type": "invalid_request_error",
                             "param": "retention_id", "code": "retention_not_found"}}
    assert await delete(url, "/v1/cache/retentions", T2_KEY) == (
        200, {"object": "cache.retention.deleted", "deleted": True, "num_released": 0})
    [still] = await listed(url, T1_KEY)
    assert still["num_refreshes"] == 1
    # Its own tenant releases it; a second release is a 404.
    assert await delete(url, f"/v1/cache/retentions/{rid}", T1_KEY) == (
        200, {"id": rid, "object": "cache.retention.deleted", "deleted": True})
    assert await listed(url, T1_KEY) == []
    status, err = await delete(url, f"/v1/cache/retentions/{rid}", T1_KEY)
    assert (status, err["error"]["code"]) == (404, "retention_not_found")


async def test_the_retain_answer_names_its_retention_even_if_it_ended_before_the_listing(
        server, monkeypatch):
    """The id comes from the output (``RequestOutput.retention_ids``), not from the listing:
    a retention that ends between the warm request and the listing (released, expired or
    dropped under pressure; here the listing is made to miss it) is still named, with
    ``expires_in_s`` 0."""
    url, p = server.url, fresh_prompt(10)

    async def nothing_live(tenant, *, all_tenants=False):
        return []

    monkeypatch.setattr(server.engine, "list_retentions", nothing_live)
    status, body = await retain(url, T1_KEY, prompt=p, ttl="5m")
    monkeypatch.undo()
    assert status == 200, body
    rid = body["id"]
    assert re.fullmatch(r"ret_[0-9a-f]{24}", rid or ""), body
    assert body == {"id": rid, "object": "cache.retention", "ttl": "5m", "num_prompt_tokens": 10,
                    "num_cached_tokens": 0, "num_retained_tokens": 8, "cache_creation_tokens": 8,
                    "expires_in_s": 0.0}
    assert [(r["id"], r["num_tokens"]) for r in await listed(url, T1_KEY)] == [(rid, 8)]


async def test_retain_messages_renders_like_chat(server):
    url = server.url
    messages = [{"role": "system", "content": "You are the deployment's agent. Be brief."}]
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look it up",
                                               "parameters": {"type": "object"}}}]
    status, tok = await post_json(url, "/tokenize", {"messages": messages, "tools": tools},
                                  T1_KEY)
    assert status == 200, tok
    n = tok["count"]
    status, body = await retain(url, T1_KEY, messages=messages, tools=tools, ttl="24h")
    assert status == 200, body
    assert (body["num_prompt_tokens"], body["num_cached_tokens"], body["num_retained_tokens"],
            body["cache_creation_tokens"]) == (n, 0, n // B * B, n // B * B)
    # Warming again refreshes the same retention and reads it from the cache.
    status, again = await retain(url, T1_KEY, messages=messages, tools=tools, ttl="24h")
    assert (again["id"], again["num_cached_tokens"], again["num_retained_tokens"],
            again["cache_creation_tokens"]) == (body["id"], (n - 1) // B * B, n // B * B, 0)
    # A chat request with the same system prompt and tools hits what was warmed.
    chat = messages + [{"role": "user", "content": "What is up?"}]
    status, tok2 = await post_json(url, "/tokenize", {"messages": chat, "tools": tools}, T1_KEY)
    common = next(i for i, (a, b) in enumerate(zip(tok["tokens"], tok2["tokens"])) if a != b)
    status, reply = await post_json(url, "/v1/chat/completions",
                                    {"messages": chat, "tools": tools, "max_tokens": 1}, T1_KEY)
    assert status == 200, reply
    assert cached_tokens(reply) == common // B * B


async def test_retain_under_a_client_salt_stays_in_it(server):
    url, p = server.url, fresh_prompt(9)
    status, body = await retain(url, T1_KEY, prompt=p, ttl="5m", cache_salt="x")
    assert (status, body["num_retained_tokens"]) == (200, 8), body
    for key, extra, hit in ((T1_KEY, {}, 0), (T2_KEY, {"cache_salt": "x"}, 0),
                            (T1_KEY, {"cache_salt": "x"}, 8)):
        status, out = await complete(url, p + [1], key, **extra)
        assert cached_tokens(out) == hit, (key, extra)


async def test_retain_text_prompt_and_admin_release_all(server):
    url = server.url
    status, a = await retain(url, T1_KEY, prompt="The quick brown fox jumps over the lazy dog",
                             ttl="5m")
    assert status == 200, a
    status, tok = await post_json(url, "/tokenize",
                                  {"prompt": "The quick brown fox jumps over the lazy dog"}, T1_KEY)
    assert (a["num_prompt_tokens"], a["num_retained_tokens"]) == (tok["count"],
                                                                  tok["count"] // B * B)
    status, b = await retain(url, T2_KEY, prompt=fresh_prompt(5), ttl="1h")
    assert (status, b["num_retained_tokens"]) == (200, 4), b
    status, short = await retain(url, T2_KEY, prompt=fresh_prompt(3), ttl="1h")
    assert (status, short["id"], short["num_retained_tokens"], short["expires_in_s"]) == (
        200, None, 0, None)  # less than a block: nothing to retain
    assert sorted((r["tenant"], r["ttl"]) for r in await listed(url, ADMIN_KEY)) == [
        ("t1", "5m"), ("t2", "1h")]
    assert await delete(url, "/v1/cache/retentions?tenant=t2", ADMIN_KEY) == (
        200, {"object": "cache.retention.deleted", "deleted": True, "num_released": 1})
    assert [r["tenant"] for r in await listed(url, ADMIN_KEY)] == ["t1"]
    assert (await delete(url, "/v1/cache/retentions", ADMIN_KEY))[1]["num_released"] == 1
    assert await listed(url, ADMIN_KEY) == []


async def test_a_tenant_budget_clips_what_is_retained(server):
    url, long, other = server.url, fresh_prompt(22), fresh_prompt(9)
    status, body = await retain(url, T2_KEY, prompt=long, ttl="1h")
    assert status == 200, body
    # 20 tokens of full blocks asked for, 12 fit t2's budget: the longest prefix that fits.
    assert (body["num_retained_tokens"], body["cache_creation_tokens"]) == (12, 12)
    [ret] = await listed(url, T2_KEY)
    assert (ret["id"], ret["num_tokens"]) == (body["id"], 12)
    # The budget is spent: another prefix is not retained, and says so; t1 is unaffected.
    status, body = await retain(url, T2_KEY, prompt=other, ttl="1h")
    assert (status, body["id"], body["num_retained_tokens"], body["cache_creation_tokens"],
            body["expires_in_s"]) == (200, None, 0, 0, None)
    status, body = await retain(url, T1_KEY, prompt=long, ttl="1h")
    assert (body["num_retained_tokens"], body["num_cached_tokens"]) == (20, 0)  # t1's salt
    # A completion with prompt_cache_retention reports the clipped retention too.
    status, body = await complete(url, other, T2_KEY, max_tokens=2, ignore_eos=True,
                                  prompt_cache_retention="24h")
    assert status == 200, body
    assert body["radixkv"] == {"num_retained_tokens": 0, "cache_creation_tokens": 0}
    assert await delete(url, "/v1/cache/retentions", T2_KEY) == (
        200, {"object": "cache.retention.deleted", "deleted": True, "num_released": 1})
    status, body = await complete(url, other, T2_KEY, max_tokens=2, ignore_eos=True,
                                  prompt_cache_retention="24h")
    assert body["radixkv"] == {"num_retained_tokens": 8, "cache_creation_tokens": 0}


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2, 3, 4, 5]}, "ttl"),
    ({"prompt": [1, 2, 3, 4, 5], "ttl": "2h"}, "ttl"),
    ({"prompt": [1, 2, 3, 4, 5], "ttl": 300}, "ttl"),
    ({"ttl": "5m"}, "messages"),
    ({"prompt": [1, 2, 3, 4, 5], "messages": [{"role": "user", "content": "x"}], "ttl": "5m"},
     "prompt"),
    ({"prompt": [1, 2, 3, 4, 5], "ttl": "5m", "max_tokens": 4}, "max_tokens"),
    ({"prompt": [[1, 2, 3, 4, 5], [6, 7, 8, 9]], "ttl": "5m"}, "prompt"),
    ({"prompt": [1, 2, 3, 4, 5], "tools": [], "ttl": "5m"}, "tools"),
    ({"prompt": [1, 2, 3, 4, 5], "ttl": "5m", "cache_salt": ""}, "cache_salt"),
    ({"prompt": [1, 2, 10 ** 7], "ttl": "5m"}, "prompt[2]"),
    ({"messages": [{"role": "robot", "content": "x"}], "ttl": "5m"}, "messages[0].role"),
    ({"prompt": [1, 2, 3, 4, 5], "ttl": "5m", "model": "other"}, "model"),
])
async def test_bad_retain_bodies_are_400_naming_the_field(server, body, param):
    url = server.url
    _, before = await get(url, "/stats", ADMIN_KEY)
    status, err = await retain(url, T1_KEY, **body)
    assert status == (404 if param == "model" else 400), err
    assert err["error"]["param"] == param, err
    assert err["error"]["type"] == "invalid_request_error"
    _, after = await get(url, "/stats", ADMIN_KEY)
    assert after["requests_total"] == before["requests_total"]
    assert await listed(url, ADMIN_KEY) == []


async def test_routes_need_a_key(server):
    url = server.url
    for status, _ in (await get(url, "/v1/cache/retentions"),
                      await post_json(url, "/v1/cache/retain", {"prompt": [1], "ttl": "5m"})):
        assert status == 401


_TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
                max_size=40)
_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-5, 10 ** 6), _TEXT,
                  st.lists(st.integers(-1, 60000), max_size=3))
_RETAIN_BODIES = st.fixed_dictionaries({}, optional={
    "ttl": st.one_of(st.sampled_from(["5m", "1h", "24h"]), _JUNK),
    "prompt": st.one_of(st.lists(st.integers(-1, 50000), max_size=30), _TEXT,
                        st.lists(st.lists(st.integers(0, 100), min_size=1, max_size=6),
                                 max_size=2), _JUNK),
    "messages": st.one_of(st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant", "robot"]),
        "content": st.one_of(_TEXT, st.none())}), max_size=3), _JUNK),
    "tools": st.one_of(st.just([]), _JUNK),
    "cache_salt": st.one_of(_TEXT, _JUNK),
    "n": _JUNK,
})


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(body=_RETAIN_BODIES)
def test_any_retain_body_is_honoured_or_refused_in_the_error_shape(server, body):
    status, out = asyncio.run(retain(server.url, T1_KEY, **body))
    assert status in (200, 400), (body, out)
    if status == 400:
        assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param",
                                                               "code"}, out
        assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"], out
        return
    n = out["num_prompt_tokens"]
    assert 0 <= out["num_retained_tokens"] <= n // B * B and out["num_retained_tokens"] % B == 0
    assert out["num_cached_tokens"] + out["cache_creation_tokens"] <= n
    # An id names what the breakpoint retained (none: it retained nothing of its own, e.g.
    # less than a block, or the pool's retention budget is spent).
    assert out["id"] is None or out["num_retained_tokens"] > 0, out
    assert health_status(server.url) == 200

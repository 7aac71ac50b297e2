"""Tenancy: API keys, the tenant as part of the cache identity, per-tenant /stats,
no timing side channel across tenants.

One server for the module: tiny model, B = 4 (as the cases are written), three keys.
"""

from __future__ import annotations

import hmac
import itertools
import json
from collections.abc import Iterator

import openai
import pytest

from radixkv.server.auth import (
    KeyStore,
    Tenant,
    authenticate,
    cache_salt_for,
    load_api_keys,
    parse_api_keys,
)
from radixkv.server.errors import APIError
from tests.factories import make_async_engine
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import HI, cached_tokens, complete, get, post, post_json

B = 4
T1_KEY, T2_KEY, ADMIN_KEY = "key-tenant-one", "key-tenant-two", "key-the-admin"
KEYS = {T1_KEY: {"tenant": "t1", "admin": False}, T2_KEY: {"tenant": "t2", "admin": False},
        ADMIN_KEY: {"tenant": "ops", "admin": True}}
_fresh = itertools.count(1000)


def fresh_prompt(length: int) -> list[int]:
    """Token ids no other test used (distinct first block)."""
    base = next(_fresh) * 7
    return [base + i for i in range(length)]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[RunningServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    engine = make_async_engine(tiny_model, block_size=B, num_blocks=256)
    yield from run_server_in_thread(engine, api_keys=load_api_keys(path))


async def test_c05_tenant_isolation_by_salt(server):
    url, p = server.url, fresh_prompt(12)
    cached = {}
    for name, key, extra in [("R1", T1_KEY, {}), ("R2", T2_KEY, {}), ("R3", T1_KEY, {}),
                             ("R4", T1_KEY, {"cache_salt": "x"}),
                             ("R4-again", T1_KEY, {"cache_salt": "x"}),
                             ("T2-forged-client", T2_KEY, {"cache_salt": "x"}),
                             ("T2-forged-tenant", T2_KEY, {"cache_salt": "tenant:t1"}),
                             ("T2-forged-full", T2_KEY, {"cache_salt": "tenant:t1|salt:x"}),
                             ("T2-again", T2_KEY, {})]:
        status, body = await complete(url, p, key, **extra)
        assert status == 200, body
        cached[name] = cached_tokens(body)
    assert cached == {"R1": 0, "R2": 0, "R3": 8, "R4": 0, "R4-again": 8, "T2-forged-client": 0,
                      "T2-forged-tenant": 0, "T2-forged-full": 0, "T2-again": 8}
    # No key, a wrong key, a malformed header: 401 in the OpenAI error shape.
    for headers in ({}, {"Authorization": "Bearer nope-nope-nope"},
                    {"Authorization": f"Basic {T1_KEY}"}, {"Authorization": "Bearer "},
                    {"Authorization": T1_KEY}):
        status, raw, resp_headers = await post(url, "/v1/completions",
                                               {"prompt": p, "max_tokens": 1}, headers=headers)
        assert status == 401, headers
        err = json.loads(raw)["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
        assert resp_headers["WWW-Authenticate"].startswith("Bearer")
    for path in ("/v1/models", "/stats"):
        assert (await get(url, path))[0] == 401
    # Public routes need no key.
    assert await get(url, "/health") == (200, {"status": "ok"})
    assert (await get(url, "/openapi.json"))[0] == 200
    status, version = await get(url, "/version")
    assert status == 200 and set(version) == {"version"}


async def test_c05_chat_path_is_isolated_too(server):
    messages = [{"role": "system", "content": "tenant secret " * 8}, *HI]
    cached = []
    for key in (T1_KEY, T2_KEY, T1_KEY):
        status, body = await post_json(server.url, "/v1/chat/completions",
                                       {"messages": messages, "max_tokens": 1}, key)
        assert status == 200
        cached.append(cached_tokens(body))
    assert cached[0] == 0 and cached[1] == 0 and cached[2] > 0


async def test_c17_no_cross_tenant_hit_and_tenant_stats(server):
    url, secret = server.url, fresh_prompt(9)
    _, t2_before = await get(url, "/stats", T2_KEY)
    _, t1_before = await get(url, "/stats", T1_KEY)
    status, body = await complete(url, secret, T1_KEY)
    assert status == 200 and cached_tokens(body) == 0
    probe = list(secret)
    probe[0] += 1  # one token changed (in the first block, so T2's two probes share nothing)
    for prompt in (secret, probe):
        status, body = await complete(url, prompt, T2_KEY)
        assert status == 200 and cached_tokens(body) == 0
    status, body = await complete(url, secret, T1_KEY)
    assert status == 200 and cached_tokens(body) == 8  # the positive control
    _, t2 = await get(url, "/stats", T2_KEY)
    _, t1 = await get(url, "/stats", T1_KEY)
    # A tenant's view: its own counters only, no pool / tree gauges, no miss causes.
    assert t2["tenant"] == "t2" and t1["tenant"] == "t1"
    for view in (t1, t2):
        assert not {"pool", "tree", "miss_tokens", "tenants", "evicted_blocks_total"} & set(view)
        assert set(view["latency_ms"]) >= {"ttft_p50", "ttft_p99", "itl_p50"}
    assert t2["requests_total"] - t2_before["requests_total"] == 2
    assert t2["requests_with_hit_total"] == t2_before["requests_with_hit_total"]
    assert t2["cached_prompt_tokens_total"] == t2_before["cached_prompt_tokens_total"]
    assert t2["prompt_tokens_total"] - t2_before["prompt_tokens_total"] == 18
    assert t1["requests_total"] - t1_before["requests_total"] == 2
    assert t1["requests_with_hit_total"] - t1_before["requests_with_hit_total"] == 1
    assert t1["cached_prompt_tokens_total"] - t1_before["cached_prompt_tokens_total"] == 8
    assert t1["generated_tokens_total"] - t1_before["generated_tokens_total"] == 2
    # Global numbers need an admin key; admin sees every tenant too.
    status, admin = await get(url, "/stats", ADMIN_KEY)
    assert status == 200 and "pool" in admin and "tree" in admin and "miss_tokens" in admin
    assert set(admin["tenants"]) >= {"t1", "t2", "ops"}
    assert admin["tenants"]["t2"]["requests_total"] == t2["requests_total"]
    assert admin["requests_total"] >= sum(v["requests_total"] for v in admin["tenants"].values())
    assert admin["latency_ms"]["ttft_p50"] > 0


async def test_metrics_need_an_admin_key(server):
    status, body = await get(server.url, "/metrics", T1_KEY)
    assert status == 403 and body["error"]["code"] == "insufficient_permissions"
    assert (await get(server.url, "/metrics"))[0] == 401
    status, text = await get(server.url, "/metrics", ADMIN_KEY)
    assert status == 200 and "radixkv_prefix_cache_hits_tokens_total" in text
    assert 'radixkv_tenant_requests_total{tenant="t1"}' in text


def test_official_client_with_keys(server):
    p = fresh_prompt(12)
    t1 = openai.OpenAI(base_url=server.url + "/v1", api_key=T1_KEY, max_retries=0)
    t2 = openai.OpenAI(base_url=server.url + "/v1", api_key=T2_KEY, max_retries=0)
    model = server.engine.model_name
    assert [m.id for m in t1.models.list()] == [model]
    first = t1.completions.create(model=model, prompt=p, max_tokens=2, temperature=0)
    other = t2.completions.create(model=model, prompt=p, max_tokens=2, temperature=0)
    again = t1.completions.create(model=model, prompt=p, max_tokens=2, temperature=0)
    assert [r.usage.prompt_tokens_details.cached_tokens for r in (first, other, again)] == [0, 0, 8]
    assert first.choices[0].text == other.choices[0].text == again.choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-key-123",
                      max_retries=0).models.list()


# ---------------------------------------------------------------------------- pure units
def test_salt_derivation_only_narrows():
    t1, t2 = Tenant("t1", False), Tenant("t2", False)
    assert cache_salt_for(None, "x") == "x" and cache_salt_for(None, None) is None
    assert cache_salt_for(Tenant(None, True), "x") == "x"
    assert cache_salt_for(t1, None) == "tenant:t1"
    assert cache_salt_for(t1, "x") == "tenant:t1|salt:x"
    # Whatever t2 sends, its salt starts with its own tenant prefix.
    for forged in ("tenant:t1", "tenant:t1|salt:x", "x", "|salt:", "t1"):
        assert cache_salt_for(t2, forged).startswith("tenant:t2|salt:")
        assert cache_salt_for(t2, forged) not in {cache_salt_for(t1, s) for s in (None, "x")}


@pytest.mark.parametrize("data,fragment", [
    ([], "non-empty JSON object"),
    ({}, "non-empty JSON object"),
    ({"short": {"tenant": "a"}}, "at least 8"),
    ({"long-enough": {"tenant": "a|salt:b"}}, "'tenant' must match"),
    ({"long-enough": {"tenant": ""}}, "'tenant' must match"),
    ({"long-enough": {"tenant": "a", "admin": "yes"}}, "'admin'"),
    ({"long-enough": {"tenant": "a", "role": "x"}}, "must be"),
    ({"long-enough": "a"}, "must be"),
])
def test_key_file_validation(data, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        parse_api_keys(data)
    assert "long-enough" not in str(info.value)  # never echo a key


def test_key_file_loading(tmp_path):
    path = tmp_path / "k.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_api_keys(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(tmp_path / "missing.json")
    path.write_text(json.dumps(KEYS))
    keys = load_api_keys(path)
    assert keys[ADMIN_KEY] == Tenant("ops", True) and keys[T1_KEY] == Tenant("t1", False)


def test_every_key_is_compared(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    store = KeyStore(parse_api_keys(KEYS))
    for presented in (T1_KEY, ADMIN_KEY, "unknown-key", "ключ-не-ascii"):
        calls.clear()
        store.lookup(presented)
        assert len(calls) == len(KEYS)  # no early exit, whichever key matches
    assert authenticate(store, f"Bearer {T2_KEY}") == Tenant("t2", False)
    assert authenticate(store, f"bearer   {T2_KEY}  ") == Tenant("t2", False)
    with pytest.raises(APIError) as info:
        authenticate(store, "Bearer ключ")
    assert info.value.status == 401


def test_api_key_errors_count_entries_from_one():
    with pytest.raises(ValueError, match=r"entry 2 of keys.json: a key must be at least 8"):
        parse_api_keys({"admin-key-1": {"tenant": "ops", "admin": True},
                        "userkey": {"tenant": "u"}}, "keys.json")

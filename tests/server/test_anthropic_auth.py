"""Anthropic clients against a server with API keys: ``x-api-key`` as well as
``Authorization: Bearer``, Anthropic's 401 / 403 shapes, and tenant isolation of the cache
(the same conversation from another tenant reads nothing)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import aiohttp
import anthropic
import pytest

from radixkv.server.auth import load_api_keys
from tests.factories import make_async_engine
from tests.server.conftest import BLOCK_SIZE, RunningServer, run_server_in_thread
from tests.server.helpers import post

T1_KEY, T2_KEY = "key-tenant-one", "key-tenant-two"
KEYS = {T1_KEY: {"tenant": "t1", "max_retained_tokens": 256},
        T2_KEY: {"tenant": "t2", "admin": False}}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[RunningServer]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    engine = make_async_engine(tiny_model, block_size=BLOCK_SIZE, num_blocks=256)
    yield from run_server_in_thread(engine, api_keys=load_api_keys(path))


def test_x_api_key_and_bearer_both_authenticate(server):
    model = server.engine.model_name
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "tell me a story " * 6}]
    by_key = anthropic.Anthropic(base_url=server.url, api_key=T1_KEY, max_retries=0)
    first = by_key.messages.create(model=model, max_tokens=1, messages=messages)
    n = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert first.usage.cache_read_input_tokens == 0
    by_bearer = anthropic.Anthropic(base_url=server.url, auth_token=T1_KEY, api_key=None,
                                    max_retries=0)
    again = by_bearer.messages.create(model=model, max_tokens=1, messages=messages)
    assert again.usage.cache_read_input_tokens == (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    other = anthropic.Anthropic(base_url=server.url, api_key=T2_KEY, max_retries=0)
    isolated = other.messages.create(model=model, max_tokens=1, messages=messages)
    assert isolated.usage.cache_read_input_tokens == 0  # another tenant, another cache salt


async def test_missing_and_wrong_keys_are_anthropic_401s(server):
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for headers, message in [
        ({}, "You didn't provide an API key: send 'Authorization: Bearer <key>' or "
             "'x-api-key: <key>'"),
        ({"x-api-key": "not-a-key-at-all"}, "Incorrect API key provided"),
        ({"Authorization": "Bearer nope-nope-nope"}, "Incorrect API key provided"),
    ]:
        status, raw, _ = await post(server.url, "/v1/messages", body, headers=headers)
        out = json.loads(raw)
        assert status == 401
        assert (out["type"], out["error"]) == ("error", {"type": "authentication_error",
                                                         "message": message})
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong-key-123",
                            max_retries=0).messages.create(
            model=server.engine.model_name, max_tokens=1,
            messages=[{"role": "user", "content": "hi"}])
    # The OpenAI routes keep their shape, and take x-api-key too.
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/metrics", headers={"x-api-key": T1_KEY}) as resp:
            assert resp.status == 403
            assert (await resp.json())["error"]["code"] == "insufficient_permissions"
    status, raw, _ = await post(server.url, "/v1/chat/completions", {
        "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": T2_KEY})
    assert status == 200, raw

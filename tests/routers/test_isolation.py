"""Isolation through real routers: tenants, client salts, LoRA adapters, resets.

Two fleets of two tiny-model replicas (B = 16, adapter ``ad`` loaded) publishing KV events,
each behind vllm-router ``kv_aware`` (discovery, ``--router-temperature 0``, debug log for its
decisions) and sglang-router ``cache_aware``:

* ``keyed``: ``--api-keys`` with tenants a and b and an admin key. Every request is salted by
  its tenant, so nothing is ever published and ``kv_aware`` routes by load only; the
  ``Authorization`` header travels through both routers, but not with their ``/flush_cache``
  fan-out (with keys, each replica is reset directly with an admin key).
* ``open``: no keys. sglang-router drops a client ``cache_salt`` from chat requests (so a
  client salt is no isolation behind it); adapter blocks (published with ``lora_name``) never
  credit base-model requests; ``POST /flush_cache`` through either router empties both
  replicas and, through their ``AllBlocksCleared``, vllm-router's index.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import requests
import zmq

from radixkv.model.loader import LoadedModel
from radixkv.server.auth import load_api_keys
from tests.factories import make_async_engine
from tests.lora_files import write_adapter
from tests.routers.harness import RouterProcess, run_replicas, run_router
from tests.routers.test_kv_aware import (
    WAIT_S,
    B,
    cap,
    decisions,
    events_config,
    wait_indexed,
    wait_subscribed,
)
from tests.server.conftest import RunningServer
from tests.server.helpers import lcp

A_KEY, B_KEY, ADMIN_KEY = "key-tenant-a", "key-tenant-b", "key-fleet-admin"
KEYS = {A_KEY: {"tenant": "a", "admin": False}, B_KEY: {"tenant": "b", "admin": False},
        ADMIN_KEY: {"tenant": "ops", "admin": True}}
NUM_BLOCKS = 256
ADAPTER = "ad"


@contextlib.contextmanager
def fleet(model: LoadedModel, model_dir: Path, log_dir: Path, **serve_kwargs: Any
          ) -> Iterator[dict[str, Any]]:
    """Two replicas of ``model_dir`` with KV events and adapter ``ad`` loaded, vllm-router
    kv_aware and sglang-router cache_aware in front of them (``model``: its shape)."""
    adapter = write_adapter(log_dir / ADAPTER, model.shape, seed=3)

    def engine_for(_i, model):
        return make_async_engine(model, block_size=B, num_blocks=NUM_BLOCKS,
                                 kv_events=events_config(),
                                 lora_adapters=((ADAPTER, str(adapter)),))

    with contextlib.ExitStack() as stack:
        replicas = stack.enter_context(run_replicas(model_dir, 2, engine_for=engine_for,
                                                    **serve_kwargs))
        urls = [s.url for s in replicas]
        vllm = stack.enter_context(run_router(
            "vllm-router", urls, log_dir, policy="kv_aware",
            extra_args=["--router-temperature", "0", "--log-level", "debug"]))
        sglang = stack.enter_context(run_router("sglang-router", urls, log_dir,
                                                policy="cache_aware"))
        for server in replicas:
            wait_subscribed(vllm, server)
        yield {"replicas": replicas, "vllm": vllm, "sglang": sglang,
               "model": replicas[0].engine.model_name}


@pytest.fixture(scope="module")
def keyed(tiny_model: LoadedModel, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[dict[str, Any]]:
    log_dir = tmp_path_factory.mktemp("isolation-keyed")
    (log_dir / "keys.json").write_text(json.dumps(KEYS))
    with fleet(tiny_model, tiny_model_dir, log_dir, api_keys=load_api_keys(log_dir / "keys.json")) as f:
        yield f


@pytest.fixture(scope="module")
def open_fleet(tiny_model: LoadedModel, tiny_model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[str, Any]]:
    with fleet(tiny_model, tiny_model_dir, tmp_path_factory.mktemp("isolation-open")) as f:
        yield f


def chat(url: str, model: str, text: str, key: str | None = None, **extra: Any
         ) -> tuple[int, dict[str, Any]]:
    resp = requests.post(url + "/v1/chat/completions", timeout=60, headers=auth(key), json={
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2,
        "temperature": 0, **extra})
    return resp.status_code, resp.json()


def chat_ok(url: str, model: str, text: str, key: str | None = None, **extra: Any) -> dict:
    status, body = chat(url, model, text, key, **extra)
    assert status == 200, body
    return body


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def stats(server: RunningServer, key: str | None = None) -> dict[str, Any]:
    resp = requests.get(server.url + "/stats", headers=auth(key), timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def totals(fleet: dict[str, Any], key: str | None = None) -> list[int]:
    return [stats(s, key)["requests_total"] for s in fleet["replicas"]]


def routed(fleet: dict[str, Any], router: str, text: str, key: str | None = None,
           **extra: Any) -> tuple[int, dict[str, Any]]:
    """Send a chat through ``fleet[router]``; return (the replica that served it, the body)."""
    admin = ADMIN_KEY if key else None
    before = totals(fleet, admin)
    body = chat_ok(fleet[router].url, fleet["model"], text, key, **extra)
    moved = [a - b for a, b in zip(totals(fleet, admin), before)]
    assert sorted(moved) == [0, 1], moved
    return moved.index(1), body


def template_head(fleet: dict[str, Any], key: str | None = None) -> int:
    """Tokens every chat prompt shares (whole blocks): the chat template's fixed head."""
    ids = [requests.post(fleet["replicas"][0].url + "/tokenize", headers=auth(key), timeout=10,
                         json={"model": fleet["model"],
                               "messages": [{"role": "user", "content": text}]}).json()["tokens"]
           for text in ("one", "two")]
    return lcp(*ids) // B * B


def next_decision(router: RouterProcess, seen: int) -> tuple[str, str, int, int]:
    deadline = time.monotonic() + WAIT_S
    while len(decisions(router)) <= seen and time.monotonic() < deadline:
        time.sleep(0.05)
    return decisions(router)[seen]


def replayed(server: RunningServer, start: int) -> list[list[Any]]:
    """Every buffered batch from seq ``start`` on, asked of the replica's replay socket as
    vllm-router does (DEALER: ``[b"", start]``), decoded: ``[[seq, ts, events, rank], ...]``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.engine.kv_events.advertised_replay_endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        out = []
        while True:
            assert sock.poll(int(WAIT_S * 1000)), "no replay answer"
            _, topic, seq, payload = sock.recv_multipart()
            seq_n = int.from_bytes(seq, "big", signed=True)
            if seq_n == -1:
                return out
            assert topic == b""
            out.append([seq_n, *msgspec.msgpack.decode(payload)])
    finally:
        sock.close()


# ---- keyed fleet: tenants --------------------------------------------------------------------
@pytest.mark.parametrize("router", ["vllm", "sglang"])
def test_the_authorization_header_travels_through_the_router(keyed: dict[str, Any],
                                                             router: str) -> None:
    url, model = keyed[router].url, keyed["model"]
    # radixkv's own answer, passed back as is.
    assert chat(url, model, "no key") == (401, {"error": {
        "message": "You didn't provide an API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
    status, body = chat(url, model, "a wrong key", "key-not-configured")
    assert status == 401 and body["error"]["message"] == "Incorrect API key provided"
    body = chat_ok(url, model, f"a tenant's key through {router}", A_KEY)
    assert body["usage"]["prompt_tokens"] > cached(body)


@pytest.mark.parametrize("router", ["vllm", "sglang"])
def test_a_tenant_is_never_served_another_tenants_blocks(keyed: dict[str, Any],
                                                         router: str) -> None:
    text = f"tenant a's own prefix through {router} " * 8
    # Warmed on both replicas, so wherever the router sends a request the prefix is there.
    warm = [chat_ok(s.url, keyed["model"], text, A_KEY) for s in keyed["replicas"]]
    full = cap(warm[0]["usage"]["prompt_tokens"])
    # (tenant a's template head may be cached there already, from an earlier chat of a's)
    assert {cached(w) for w in warm} <= {0, template_head(keyed, A_KEY)}
    _, as_b = routed(keyed, router, text, B_KEY)
    # At most b's own template head (from b's earlier chats), never a's prefix.
    assert cached(as_b) in (0, template_head(keyed, B_KEY)) and cached(as_b) < full
    _, as_a = routed(keyed, router, text, A_KEY)
    assert cached(as_a) == full == 96


def test_salted_traffic_publishes_nothing(keyed: dict[str, Any]) -> None:
    text = "every tenant's traffic is salted " * 6
    for key in (A_KEY, B_KEY, ADMIN_KEY):
        for router in ("vllm", "sglang"):
            routed(keyed, router, text, key)
        for server in keyed["replicas"]:
            chat_ok(server.url, keyed["model"], text, key)
    for server in keyed["replicas"]:
        assert (server.engine.kv_events.next_seq,
                server.engine.kv_events.num_batches_published) == (0, 0)
    # So vllm-router had nothing to credit: every decision was by load.
    credited = [d[3] for d in decisions(keyed["vllm"])]
    assert len(credited) >= 3 and set(credited) == {0}


def test_flush_cache_through_a_router_does_not_reach_keyed_replicas(keyed: dict[str, Any]
                                                                     ) -> None:
    """Neither router sends the client's key with its fan-out, so with ``--api-keys`` each
    replica must be reset directly with an admin key."""
    for server in keyed["replicas"]:
        chat_ok(server.url, keyed["model"], "cached before the flush " * 6, A_KEY)
    blocks = [stats(s, ADMIN_KEY)["tree"]["cached_blocks"] for s in keyed["replicas"]]
    assert min(blocks) >= 2
    resp = requests.post(keyed["vllm"].url + "/flush_cache", headers=auth(ADMIN_KEY), timeout=30)
    assert (resp.status_code, resp.text) == (500, "Cache flush failed on one or more servers")
    resp = requests.post(keyed["sglang"].url + "/flush_cache", headers=auth(ADMIN_KEY),
                         timeout=30)
    assert resp.status_code == 206
    body = resp.json()
    assert (body["status"], body["workers_flushed"]) == ("partial_success", 0)
    assert sorted((f["worker"], f["error"]) for f in body["failed"]) == sorted(
        (s.url, "HTTP 401 Unauthorized") for s in keyed["replicas"])
    assert [stats(s, ADMIN_KEY)["tree"]["cached_blocks"] for s in keyed["replicas"]] == blocks
    for server in keyed["replicas"]:
        resp = requests.post(server.url + "/flush_cache", headers=auth(ADMIN_KEY), timeout=10)
        assert resp.json() == {"success": True, "num_evicted_blocks": blocks.pop(0)}


# ---- open fleet: client salts, adapters, flushes ---------------------------------------------
def test_sglang_router_drops_a_client_cache_salt(open_fleet: dict[str, Any]) -> None:
    text, model = "a salted tenant's prompt " * 8, open_fleet["model"]
    warm = [chat_ok(s.url, model, text) for s in open_fleet["replicas"]]  # unsalted, both
    full = cap(warm[0]["usage"]["prompt_tokens"])
    # Straight to a replica the salt is a separate identity: nothing cached under it.
    assert cached(chat_ok(open_fleet["replicas"][0].url, model, text, cache_salt="s0")) == 0
    # vllm-router passes unknown keys through: still a separate identity.
    assert cached(routed(open_fleet, "vllm", text, cache_salt="s1")[1]) == 0
    # sglang-router drops it: the "salted" request is served from the unsalted blocks.
    assert cached(routed(open_fleet, "sglang", text, cache_salt="s2")[1]) == full == 64


def test_adapter_blocks_never_credit_base_model_requests(open_fleet: dict[str, Any]) -> None:
    router, model = open_fleet["vllm"], open_fleet["model"]
    zero, one = open_fleet["replicas"]
    for server in (zero, one):  # an empty index to start from
        assert requests.post(server.url + "/reset_prefix_cache", timeout=10).status_code == 200
        wait_indexed(router, server)
    head = template_head(open_fleet)
    chat_ok(one.url, model, "one")  # the base model holds the template's head on replica 1
    wait_indexed(router, one)  # (and its batch is out before `start` is read)
    text = "adapter traffic only " * 10
    start = one.engine.kv_events.next_seq
    adapter_body = chat_ok(one.url, ADAPTER, text)
    assert cached(adapter_body) == 0  # an adapter never reads base-model blocks either
    wait_indexed(router, one)
    stored = [e for _seq, _ts, events, _rank in replayed(one, start) for e in events
              if e["type"] == "BlockStored"]
    full = cap(adapter_body["usage"]["prompt_tokens"])
    assert [e["lora_name"] for e in stored] == [ADAPTER]  # one run: the whole prompt
    assert len(stored[0]["block_hashes"]) == full // B
    assert stored[0]["extra_keys"] == [[ADAPTER]] * (full // B)
    seen = len(decisions(router))
    served, body = routed(open_fleet, "vllm", text)
    decision = next_decision(router, seen)
    # Credited with the base model's own blocks (the template's head), not the adapter's.
    assert (decision[1], decision[3]) == (one.url, head) and (head, full) == (16, 48)
    assert (served, cached(body)) == (1, head)


@pytest.mark.parametrize("router", ["vllm", "sglang"])
def test_flush_cache_through_the_router_empties_both_replicas(open_fleet: dict[str, Any],
                                                              router: str) -> None:
    kv_router, model = open_fleet["vllm"], open_fleet["model"]
    replicas = open_fleet["replicas"]
    text = f"flushed through {router} " * 10
    for server in replicas:
        chat_ok(server.url, model, text)
        wait_indexed(kv_router, server)
        assert stats(server)["tree"]["cached_blocks"] > 0
    seen = len(decisions(kv_router))
    _served, body = routed(open_fleet, "vllm", text)  # indexed before the flush
    assert next_decision(kv_router, seen)[3] == cap(body["usage"]["prompt_tokens"]) == cached(body)
    resp = requests.post(open_fleet[router].url + "/flush_cache", timeout=30)
    assert resp.status_code == 200, resp.text
    if router == "vllm":
        assert resp.text == "Cache flushed on all servers"
    else:
        assert resp.json() == {
            "status": "success", "message": "Successfully flushed cache on all 2 HTTP workers",
            "workers_flushed": 2, "total_http_workers": 2, "total_workers": 2}
    for server in replicas:
        assert stats(server)["tree"]["cached_blocks"] == 0
        wait_indexed(kv_router, server)  # its AllBlocksCleared
    seen = len(decisions(kv_router))
    _served, body = routed(open_fleet, "vllm", text)
    assert next_decision(kv_router, seen)[3] == 0 == cached(body)

"""vllm-router ``kv_aware`` fed by radixkv's KV events, a real router process over
two tiny-model replicas that publish events on loopback ZMQ sockets.

The router finds the publishers itself (discovery: ``GET /get_server_info`` and ``GET
/kv_event_sources``, no static flags), gets each request's token ids from every replica's
``/render`` endpoints, and routes to the replica whose published blocks cover the longest
prefix. It runs with ``--log-level debug`` so a test can wait, bounded, until the router has
applied a replica's batch (``kv_index live sequence advanced source=<instance> ... seq=N``) and
read each routing decision (``credited_prefix_tokens``). Replica pools are small (64 blocks of
16) so that a few long prompts evict.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from radixkv.engine.kv_events import KVEventsConfig
from radixkv.model.loader import load_model
from tests.factories import make_async_engine
from tests.routers.harness import RouterProcess, free_port, run_router
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import lcp

B = 16
NUM_BLOCKS = 64
WAIT_S = 10.0
DECISION = re.compile(r'KV prefix decision outcome="(\w+)" worker="([^"]+)" input_tokens=(\d+) '
                      r"new_prefill_tokens=(\d+) credited_prefix_tokens=(\d+)")


def events_config(port: int = 0, replay_port: int = 0) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}",
                          replay_endpoint=f"tcp://127.0.0.1:{replay_port}")


@contextlib.contextmanager
def replica(model_dir: Path, *, port: int = 0, events: KVEventsConfig | None = None
            ) -> Iterator[RunningServer]:
    engine = make_async_engine(load_model(str(model_dir)), block_size=B, num_blocks=NUM_BLOCKS,
                               kv_events=events or events_config())
    gen = run_server_in_thread(engine, port=port)
    try:
        yield next(gen)
    finally:
        next(gen, None)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[dict[str, Any]]:
    """Replica 0 (any ports), replica 1 (fixed ports, so a test can restart it in place) and
    the router. ``fleet["replicas"][1]`` is replaced by a restart."""
    ports = {"http": free_port(), "events": free_port(), "replay": free_port()}
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(replica(tiny_model_dir))
        second_cm = replica(tiny_model_dir, port=ports["http"],
                            events=events_config(ports["events"], ports["replay"]))
        second = second_cm.__enter__()
        state: dict[str, Any] = {"replicas": [first, second], "ports": ports,
                                 "model_dir": tiny_model_dir, "second_cm": second_cm}
        stack.callback(lambda: state["second_cm"].__exit__(None, None, None))
        router = stack.enter_context(run_router(
            "vllm-router", [first.url, second.url], tmp_path_factory.mktemp("kv-aware-log"),
            policy="kv_aware", extra_args=["--router-temperature", "0", "--log-level", "debug"]))
        state["router"] = router
        for server in state["replicas"]:
            wait_subscribed(router, server)
        yield state


@pytest.fixture
def router(fleet: dict[str, Any]) -> RouterProcess:
    return fleet["router"]


@pytest.fixture(scope="module")
def model_id(fleet: dict[str, Any]) -> str:
    return fleet["replicas"][0].engine.model_name


def wait_subscribed(router: RouterProcess, server: RunningServer) -> None:
    wait_for_log(router, f"kv_index subscriber for {server.engine.instance_id}")
    time.sleep(0.3)  # ZMQ's slow joiner: the SUB may still be connecting


def wait_for_log(router: RouterProcess, needle: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in router.log_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"router log never showed {needle!r}:\n{router.log_tail()}")


def wait_published(server: RunningServer) -> int:
    """Wait until the replica is idle and has sent every batch; return the last seq sent."""
    publisher = server.engine.kv_events
    deadline = time.monotonic() + WAIT_S
    last, since = -2, time.monotonic()
    while time.monotonic() < deadline:
        now_seq = publisher.next_seq - 1
        if (now_seq != last or server.engine.num_requests_in_flight
                or publisher.num_queued_batches):
            last, since = now_seq, time.monotonic()
        elif time.monotonic() - since > 0.3:
            return last
        time.sleep(0.02)
    raise AssertionError("the replica's publisher did not settle")


def wait_indexed(router: RouterProcess, server: RunningServer, source: str | None = None) -> int:
    """Bounded wait until the router applied the replica's last batch; returns its seq.
    ``source``: the instance id the router's subscriber was discovered with (a restarted
    replica's batches still arrive on its predecessor's subscriber)."""
    seq = wait_published(server)
    wait_for_log(router, f"source={source or server.engine.instance_id} rank=0 seq={seq}")
    return seq


def decisions(router: RouterProcess) -> list[tuple[str, str, int, int]]:
    """(outcome, worker, input_tokens, credited_prefix_tokens) of every kv_aware decision."""
    text = router.log_text()
    return [(m[1], m[2], int(m[3]), int(m[5])) for m in DECISION.finditer(text)]


def totals(fleet: dict[str, Any]) -> list[int]:
    return [requests.get(s.url + "/stats", timeout=10).json()["requests_total"]
            for s in fleet["replicas"]]


def chat(url: str, model: str, text: str, **extra: Any) -> dict[str, Any]:
    resp = requests.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2,
        "temperature": 0, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()


def template_head(url: str, model: str) -> int:
    """Tokens every chat prompt shares (whole blocks): the template's fixed head."""
    ids = [requests.post(url + "/tokenize", timeout=10, json={
        "model": model, "messages": [{"role": "user", "content": text}]}).json()["tokens"]
        for text in ("one", "two")]
    return lcp(*ids) // B * B


def cap(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // B * B


def route_and_check(fleet: dict[str, Any], model: str, text: str) -> tuple[int, dict, tuple]:
    """Send ``text`` through the router; return (the replica that served it, the response,
    the router's decision)."""
    router = fleet["router"]
    before, seen = totals(fleet), len(decisions(router))
    body = chat(router.url, model, text)
    moved = [a - b for a, b in zip(totals(fleet), before)]
    assert sorted(moved) == [0, 1], moved
    deadline = time.monotonic() + WAIT_S
    while len(decisions(router)) <= seen and time.monotonic() < deadline:
        time.sleep(0.05)
    return moved.index(1), body, decisions(router)[seen]


def test_discovery_endpoints(fleet: dict[str, Any]) -> None:
    server = fleet["replicas"][1]
    info = requests.get(server.url + "/get_server_info", timeout=10).json()
    assert (info["model_id"], info["instance_id"], info["kv_block_size"]) == (
        server.engine.model_name, server.engine.instance_id, B)
    assert info["instance_id"] != fleet["replicas"][0].engine.instance_id
    sources = requests.get(server.url + "/kv_event_sources", timeout=10).json()
    assert sources["0"]["endpoint"] == f"tcp://127.0.0.1:{fleet['ports']['events']}"
    assert sources["0"]["replay_endpoint"] == f"tcp://127.0.0.1:{fleet['ports']['replay']}"


def test_every_kind_of_request_succeeds_through_kv_aware(router: RouterProcess, model_id: str
                                                         ) -> None:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=model_id, max_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": "hello there"}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(
        model=model_id, max_tokens=3, temperature=0, stream=True,
        messages=[{"role": "user", "content": "hello there"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        reply.choices[0].message.content
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = client.chat.completions.create(
        model=model_id, max_tokens=3, temperature=0, tools=tools,
        messages=[{"role": "user", "content": "weather in Paris?"}])
    assert with_tools.usage.prompt_tokens > reply.usage.prompt_tokens
    text = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=3,
                                     temperature=0)
    ids = client.completions.create(model=model_id, prompt=[1, 2, 3, 4, 5], max_tokens=3,
                                    temperature=0)
    assert text.usage.completion_tokens == ids.usage.completion_tokens == 3


def test_a_prefix_warmed_on_one_replica_attracts_the_request(fleet: dict[str, Any],
                                                             model_id: str) -> None:
    router, second = fleet["router"], fleet["replicas"][1]
    text = "the warm prefix " * 40
    direct = chat(second.url, model_id, text)
    # (the template's head may be cached there already, from an earlier routed chat)
    assert direct["usage"]["prompt_tokens_details"]["cached_tokens"] in (
        0, template_head(second.url, model_id))
    wait_indexed(router, second)
    served, body, decision = route_and_check(fleet, model_id, text)
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert served == 1
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cap(prompt_tokens)
    assert decision == ("prefix_cost", second.url, prompt_tokens, cap(prompt_tokens))


def test_an_evicted_prefix_stops_attracting_requests(fleet: dict[str, Any], model_id: str) -> None:
    router, second = fleet["router"], fleet["replicas"][1]
    text = "soon to be evicted " * 30
    chat(second.url, model_id, text)
    wait_indexed(router, second)
    # Prompts that need more blocks than are free evict it (LRU: the oldest blocks first).
    for i in range(4):
        chat(second.url, model_id, f"filler {i} " * 300)
    assert second.engine.stats()["evicted_blocks_total"] > 0
    wait_indexed(router, second)
    _served, body, decision = route_and_check(fleet, model_id, text)
    # Only the chat template's head (its system turn), which every chat shares, is still
    # credited: far less than the prefix's cap before the eviction.
    assert decision[3] == template_head(second.url, model_id) < cap(body["usage"]["prompt_tokens"])


def test_a_withheld_batch_is_recovered_by_replay(fleet: dict[str, Any], model_id: str) -> None:
    router, second = fleet["router"], fleet["replicas"][1]
    publisher = second.engine.kv_events
    text = "only the replay carries this prefix " * 10
    publisher.withhold_seqs = {publisher.next_seq}
    try:
        chat(second.url, model_id, text)
        withheld = wait_published(second)
        assert withheld in publisher.withhold_seqs
        chat(second.url, model_id, "a later batch exposes the gap " * 5)
        wait_indexed(router, second)  # the router replays seq `withheld` before this one
    finally:
        publisher.withhold_seqs = set()
    assert (f"kv_index replay sequence advanced source={second.engine.instance_id} rank=0 "
            f"seq={withheld}") in router.log_text()
    served, body, decision = route_and_check(fleet, model_id, text)
    assert served == 1 and decision[3] == cap(body["usage"]["prompt_tokens"])
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == decision[3]


def test_a_restarted_replica_is_cleared_then_rebuilt(fleet: dict[str, Any], model_id: str) -> None:
    router, old = fleet["router"], fleet["replicas"][1]
    text = "held by the replica before its restart " * 8
    chat(old.url, model_id, text)
    wait_indexed(router, old)
    old_id = old.engine.instance_id
    fleet["second_cm"].__exit__(None, None, None)  # stop it; same ports for the new one
    ports = fleet["ports"]
    fleet["second_cm"] = replica(fleet["model_dir"], port=ports["http"],
                                 events=events_config(ports["events"], ports["replay"]))
    new = fleet["replicas"][1] = fleet["second_cm"].__enter__()
    assert new.engine.instance_id != old_id
    time.sleep(0.5)  # the router's SUB reconnects to the same endpoint by itself
    chat(new.url, model_id, "the first batch of the new process " * 5)  # its seq 0 < last
    assert wait_indexed(router, new, source=old_id) == 0
    assert f"kv_index {old_id}: restart seq 0 <" in router.log_text()
    _served, body, decision = route_and_check(fleet, model_id, text)
    assert decision[3] == template_head(new.url, model_id)  # the old claims are gone
    # (that request cached `text` wherever it went; the rebuild is shown with a fresh prefix)
    fresh = "warmed on the new process " * 8
    chat(new.url, model_id, fresh)  # rebuilt from the new process's events
    wait_indexed(router, new, source=old_id)
    served, body, decision = route_and_check(fleet, model_id, fresh)
    assert served == 1 and decision[3] == cap(body["usage"]["prompt_tokens"])

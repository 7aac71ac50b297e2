"""vllm-router and sglang-router ``cache_aware`` in front of two tiny-model replicas.

vllm-router's ``cache_aware`` asks every worker for the prompt's token ids on every request
(``/v1/chat/completions/render``, ``/v1/completions/render``; token-id prompts are used as
sent) and routes to the worker whose tree of earlier prompts matches most; when any worker
gives no ids the decision is ``missing_tokens`` (least load). sglang-router's ``cache_aware``
keeps a text tree and asks the workers for nothing; it forwards a request without ``model`` as
``model: "unknown"``, which radixkv serves as its only model, and refuses token-id prompts
itself. Every routed answer must equal what a replica answers directly (greedy, same weights).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.routers.harness import RouterProcess, run_router
from tests.routers.test_round_robin import chat_body, client, completion_body, counts, moved, post
from tests.server.conftest import BLOCK_SIZE, RunningServer
from tests.server.helpers import capped

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["vllm-router", "sglang-router"])
def cache_router(request: pytest.FixtureRequest, replicas: list[RunningServer],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """One ``cache_aware`` router process over ``replicas``, per module and router."""
    log_dir = tmp_path_factory.mktemp(f"{request.param}-cache-aware")
    extra = ["--log-level", "debug"] if request.param == "vllm-router" else []
    with run_router(request.param, [s.url for s in replicas], log_dir, policy="cache_aware",
                    extra_args=extra) as proc:
        yield proc


def direct(replicas: list[RunningServer], path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = post(replicas[1].url, path, body)
    assert status == 200, out
    return out


def routed(router: RouterProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = post(router.url, path, body)
    assert status == 200, out
    return out


def test_chat_json_and_streamed(cache_router: RouterProcess, replicas: list[RunningServer],
                                model_id: str) -> None:
    ref = direct(replicas, "/v1/chat/completions", chat_body(model_id))
    out = routed(cache_router, "/v1/chat/completions", chat_body(model_id))
    assert out["object"] == "chat.completion" and out["model"] == model_id
    assert out["choices"][0]["message"] == ref["choices"][0]["message"]
    assert out["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    chunks = list(client(cache_router).chat.completions.create(
        model=model_id, messages=chat_body(model_id)["messages"],
        max_completion_tokens=chat_body(model_id)["max_tokens"], temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["choices"][0]["message"]["content"]
    assert chunks[-1].usage.prompt_tokens == ref["usage"]["prompt_tokens"]


def test_chat_with_tools(cache_router: RouterProcess, replicas: list[RunningServer],
                         model_id: str) -> None:
    for choice in ("auto", "required"):
        body = {"model": model_id, "messages": WEATHER, "tools": TOOLS, "tool_choice": choice,
                "max_tokens": 12, "temperature": 0}
        ref = direct(replicas, "/v1/chat/completions", body)
        out = routed(cache_router, "/v1/chat/completions", body)
        assert out["choices"][0] == ref["choices"][0]
        assert out["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        reply = client(cache_router).chat.completions.create(
            model=model_id, messages=WEATHER, tools=TOOLS, tool_choice=choice, max_tokens=12,
            temperature=0)
        assert reply.choices[0].message.content == ref["choices"][0]["message"]["content"]
        assert reply.choices[0].finish_reason == ref["choices"][0]["finish_reason"]


def test_text_completions(cache_router: RouterProcess, replicas: list[RunningServer],
                          model_id: str) -> None:
    ref = direct(replicas, "/v1/completions", completion_body(model_id))["choices"][0]
    out = routed(cache_router, "/v1/completions", completion_body(model_id))
    assert (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == \
        (ref["text"], ref["finish_reason"])
    streamed = list(client(cache_router).completions.create(
        model=model_id, prompt=completion_body(model_id)["prompt"],
        max_tokens=completion_body(model_id)["max_tokens"], temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref["text"]


def test_token_id_prompts_through_vllm_router(cache_router: RouterProcess,
                                              replicas: list[RunningServer],
                                              model_id: str) -> None:
    body = {"model": model_id, "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0}
    if cache_router.name == "sglang-router":  # the router refuses token-id prompts itself
        resp = requests.post(cache_router.url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 422 and "StringOrArray" in resp.text, resp.text
        return
    ref = direct(replicas, "/v1/completions", body)["choices"][0]["text"]
    assert routed(cache_router, "/v1/completions", body)["choices"][0]["text"] == ref


def test_request_without_model(cache_router: RouterProcess, replicas: list[RunningServer],
                               model_id: str) -> None:
    body = chat_body(model_id)
    del body["model"]
    ref = direct(replicas, "/v1/chat/completions", body)
    out = routed(cache_router, "/v1/chat/completions", body)
    assert out["model"] == model_id
    assert out["choices"][0]["message"] == ref["choices"][0]["message"]
    text = client(cache_router).completions.create(
        model="unknown", prompt="Hello", max_tokens=3, temperature=0).choices[0].text
    assert text == direct(replicas, "/v1/completions", {"prompt": "Hello", "max_tokens": 3,
                                                        "temperature": 0})["choices"][0]["text"]


def router_metrics(router: RouterProcess) -> dict[str, float]:
    """vllm-router's Prometheus samples (``name{labels}`` → value); {} for sglang-router."""
    if router.name != "vllm-router":
        return {}
    argv = list(router.proc.args)
    port = argv[argv.index("--prometheus-port") + 1]
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {key: float(value) for key, _, value in
            (line.rpartition(" ") for line in text.splitlines() if line and line[0] != "#")}


def metric_deltas(router: RouterProcess, before: dict[str, float]) -> dict[str, float]:
    """The counters of interest that moved since ``before``."""
    names = ("kv_routing_inputs_total", "prefix_routing_decisions_total",
             "policy_decisions_total")
    return {key: value - before.get(key, 0.0) for key, value in router_metrics(router).items()
            if any(n in key for n in names) and value != before.get(key, 0.0)}


def test_conversation_stays_on_one_replica_and_hits_its_cache(
        cache_router: RouterProcess, replicas: list[RunningServer], model_id: str) -> None:
    """Three turns, each sending back the model's reply: one replica serves all three, and
    turns 2 and 3 hit all of the previous prompt + reply (the reply memory keeps its
    generated ids): cached = floor(min(match, N - 1) / B) * B with match = previous prompt +
    every generated id but the last (whose K/V is never computed)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"{uuid.uuid4().hex} You are a terse assistant. " * 3},
        {"role": "user", "content": "Describe a fox in one line."}]
    before = counts(replicas)
    metrics_before = router_metrics(cache_router)
    cached, expected = [], []
    previous: tuple[int, int] | None = None  # (prompt tokens, completion tokens)
    for turn in range(3):
        out = routed(cache_router, "/v1/chat/completions",
                     {"model": model_id, "messages": messages, "max_tokens": 8,
                      "temperature": 0})
        usage = out["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        expected.append(0 if previous is None else
                        capped(sum(previous) - 1, usage["prompt_tokens"], BLOCK_SIZE))
        previous = (usage["prompt_tokens"], usage["completion_tokens"])
        messages = messages + [{"role": "assistant",
                                "content": out["choices"][0]["message"]["content"]},
                               {"role": "user", "content": f"And turn {turn + 2}?"}]
    delta = moved(replicas, before)
    assert sorted(delta) == [0, 3], delta
    assert cached == expected and cached[1] > 0 and cached[2] > cached[1], cached
    if cache_router.name == "vllm-router":
        # Ids came from /render on both workers, every turn: one miss, then two prefix hits.
        assert metric_deltas(cache_router, metrics_before) == {
            'vllm_router_kv_routing_inputs_total{transport="http",result="render"}': 6,
            'vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",'
            'outcome="prefix_miss"}': 1,
            'vllm_router_prefix_routing_decisions_total{policy="cache_aware",stage="regular",'
            'outcome="prefix_hit"}': 2,
            'vllm_router_policy_decisions_total{policy="cache_aware",worker="'
            f'{replicas[delta.index(3)].url}"}}': 3}
        log = cache_router.log_text()
        assert "missing_tokens" not in log and "render_unavailable" not in log
        # Over the module: ids from /render or as sent (token-id prompts), never a fallback.
        results = {k.split('result="')[1].split('"')[0] for k in router_metrics(cache_router)
                   if "kv_routing_inputs_total{" in k}
        assert "render" in results and results <= {"render", "token_ids"}, results

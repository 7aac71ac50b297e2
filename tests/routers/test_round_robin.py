"""vllm-router and sglang-router (``round_robin``) in front of two tiny-model replicas.

Both routers re-serialize every request with their own default fields (``no_stop_trim: false``,
``skip_special_tokens: true``, ...; sglang-router also renames ``max_tokens``), so a routed
request only succeeds when radixkv accepts those neutral values. Every request sends ``model``
(a missing one reaches radixkv as ``"unknown"`` through sglang-router: test_cache_aware.py
covers that). Requests go one at a time, so
``round_robin`` gives each replica exactly half of an even count, whatever its starting point.
"""

from __future__ import annotations

from typing import Any

import openai
import requests

from tests.routers.harness import RouterProcess, requests_total
from tests.server.conftest import RunningServer

MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"
MAX_TOKENS = 6


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = requests.post(url + path, json=body, timeout=60)
    return resp.status_code, resp.json()


def chat_body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            **extra}


def completion_body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def counts(replicas: list[RunningServer]) -> list[int]:
    return [requests_total(s) for s in replicas]


def moved(replicas: list[RunningServer], before: list[int]) -> list[int]:
    return [after - b for after, b in zip(counts(replicas), before)]


def client(router: RouterProcess) -> openai.OpenAI:
    # No retries: a failed routed request must show as a failure, not as a second attempt.
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(replicas: list[RunningServer], path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The answer a replica gives directly (greedy, same weights on both replicas)."""
    status, out = post(replicas[0].url, path, body)
    assert status == 200, out
    return out


def test_chat_completions_spread_over_both_replicas(router: RouterProcess,
                                                    replicas: list[RunningServer],
                                                    model_id: str) -> None:
    ref = reference(replicas, "/v1/chat/completions", chat_body(model_id))
    before = counts(replicas)
    ids = set()
    for _ in range(4):
        status, out = post(router.url, "/v1/chat/completions", chat_body(model_id))
        assert status == 200, out
        assert out["object"] == "chat.completion" and out["model"] == model_id
        assert out["id"].startswith("chatcmpl-")
        ids.add(out["id"])
        [choice] = out["choices"]
        assert choice["index"] == 0
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == ref["choices"][0]["message"]["content"]
        assert choice["finish_reason"] == ref["choices"][0]["finish_reason"]
        assert out["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert out["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    assert len(ids) == 4
    assert moved(replicas, before) == [2, 2]


def test_streamed_chat_through_the_openai_client(router: RouterProcess,
                                                  replicas: list[RunningServer],
                                                  model_id: str) -> None:
    ref = reference(replicas, "/v1/chat/completions", chat_body(model_id))["choices"][0]
    before = counts(replicas)
    for _ in range(2):
        stream = client(router).chat.completions.create(
            model=model_id, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        choices = [c.choices[0] for c in chunks if c.choices]
        assert {c.object for c in chunks} == {"chat.completion.chunk"}
        assert len({c.id for c in chunks}) == 1
        assert choices[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in choices) == ref["message"]["content"]
        assert [c.finish_reason for c in choices if c.finish_reason] == [ref["finish_reason"]]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert moved(replicas, before) == [1, 1]


def test_completions_streamed_and_not(router: RouterProcess, replicas: list[RunningServer],
                                      model_id: str) -> None:
    ref = reference(replicas, "/v1/completions", completion_body(model_id))["choices"][0]
    before = counts(replicas)
    for _ in range(2):
        status, out = post(router.url, "/v1/completions", completion_body(model_id))
        assert status == 200, out
        assert out["object"] == "text_completion" and out["model"] == model_id
        assert out["id"].startswith("cmpl-")
        [choice] = out["choices"]
        assert (choice["text"], choice["finish_reason"]) == (ref["text"], ref["finish_reason"])
        assert out["usage"]["completion_tokens"] > 0
    for _ in range(2):
        chunks = list(client(router).completions.create(
            model=model_id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True))
        assert {c.object for c in chunks} == {"text_completion"}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
        assert [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason] == [ref["finish_reason"]]
    assert moved(replicas, before) == [2, 2]


def test_both_workers_stay_healthy_in_the_router(router: RouterProcess,
                                                 replicas: list[RunningServer]) -> None:
    """After the routed traffic the router still counts both workers healthy (its circuit
    breaker ejected none), and each replica's own /health is 200."""
    resp = requests.get(router.url + "/readiness", timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.json()["healthy_workers"] == 2
    for server in replicas:
        assert requests.get(server.url + "/health", timeout=10).status_code == 200

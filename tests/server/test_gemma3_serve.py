"""``--model gemma3-270m`` over HTTP: /v1/models, chat with Gemma 3's template, completions, and
a chat whose turns do not alternate refused as a 400 (skipped without the gemma3 extra)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from radixkv.model import shipped
from radixkv.model.loader import LoadedModel
from tests.factories import make_async_engine
from tests.server.conftest import RunningServer, run_server_in_thread
from tests.server.helpers import complete, get, post_json

pytestmark = [
    pytest.mark.gemma3,
    pytest.mark.skipif(any(importlib.util.find_spec(module) is None for module, _ in shipped._GEMMA3_270M_PARTS),
                       reason=f"the gemma3 extra is not installed: {shipped.GEMMA3_270M_INSTALL}"),
]

CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name three prime numbers."}]


@pytest.fixture(scope="module")
def gemma3_server(gemma3: LoadedModel) -> Iterator[RunningServer]:
    yield from run_server_in_thread(make_async_engine(gemma3, block_size=16, num_blocks=64))


async def test_models_lists_the_shipped_name(gemma3_server: RunningServer) -> None:
    status, body = await get(gemma3_server.url, "/v1/models")
    assert status == 200
    assert [m["id"] for m in body["data"]] == ["gemma3-270m"]
    assert body["data"][0]["max_model_len"] == 32768
    assert body["data"][0]["kv_bytes_per_token"] == 18 * 2 * 256 * 4


async def test_chat_renders_gemma_turns(gemma3_server: RunningServer, gemma3: LoadedModel) -> None:
    status, body = await post_json(gemma3_server.url, "/v1/chat/completions",
                                   {"messages": CHAT, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    prompt_ids = gemma3.tokenizer.apply_chat_template(CHAT)
    assert gemma3.tokenizer.decode(prompt_ids, skip_special_tokens=False) == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nName three prime numbers.<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert body["model"] == "gemma3-270m"
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    choice = body["choices"][0]
    # A stop is <eos> or <end_of_turn>, before the 12th token.
    assert (choice["finish_reason"], body["usage"]["completion_tokens"] == 12) in (
        ("length", True), ("stop", False))
    again = (await post_json(gemma3_server.url, "/v1/chat/completions",
                             {"messages": CHAT, "max_tokens": 12, "temperature": 0}))[1]
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]  # greedy


async def test_completion_continues_the_prompt(gemma3_server: RunningServer, gemma3: LoadedModel) -> None:
    # add_special_tokens defaults to true (vLLM's default): the text goes behind Gemma's <bos>.
    assert gemma3.tokenizer.prompt_prefix_ids == (2,)
    text_ids = gemma3.tokenizer.encode("The capital of France is")
    status, body = await complete(gemma3_server.url, "The capital of France is", max_tokens=16,
                                  temperature=0, model="gemma3-270m", return_token_ids=True)
    assert status == 200, body
    assert body["choices"][0]["prompt_token_ids"] == [2, *text_ids] and len(text_ids) == 5
    # The same greedy continuation as tests/model/test_gemma3_gguf.py checks against transformers.
    reply = body["choices"][0]["text"]
    assert reply.startswith(" the capital of the country of France.")
    # The next turn re-sends prompt + reply as text: its remembered ids are reused behind the
    # one <bos> they already hold (not a second one), so the whole first turn is a prefix hit.
    status, again = await complete(gemma3_server.url, "The capital of France is" + reply + " Paris",
                                   max_tokens=1, temperature=0, model="gemma3-270m",
                                   return_token_ids=True)
    assert status == 200, again
    ids = again["choices"][0]["prompt_token_ids"]
    assert ids[:len(text_ids) + 1] == [2, *text_ids] and ids.count(2) == 1
    # Without the BOS, as sent; a BOS written into the text is read as the special token.
    status, plain = await complete(gemma3_server.url, "The capital of France is", max_tokens=1,
                                   model="gemma3-270m", add_special_tokens=False,
                                   return_token_ids=True)
    assert status == 200 and plain["choices"][0]["prompt_token_ids"] == text_ids
    status, tok = await post_json(gemma3_server.url, "/tokenize", {"prompt": "The capital of France is"})
    assert status == 200 and tok["tokens"] == [2, *text_ids]
    status, tok = await post_json(gemma3_server.url, "/tokenize",
                                  {"prompt": "<bos>The capital of France is", "add_special_tokens": False})
    assert status == 200 and tok["tokens"] == [2, *text_ids]


async def test_turns_that_do_not_alternate_are_a_400(gemma3_server: RunningServer) -> None:
    status, body = await post_json(gemma3_server.url, "/v1/chat/completions",
                                   {"messages": [{"role": "user", "content": "a"},
                                                 {"role": "user", "content": "b"}], "max_tokens": 4})
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "messages"
    assert "Conversation roles must alternate" in body["error"]["message"]


def test_bench_serve_client_tokenizer_is_the_servers(gemma3_server: RunningServer) -> None:
    # `bench serve --tokenizer gemma3-270m` counts ideal hits with the tokenizer and chat
    # template radixkv serve converted from the GGUF (the GGUF alone carries no template).
    from radixkv.tools.transcripts import load_tau_bench
    from tests.server.test_bench_serve import _server_tokens
    from tests.server.test_bench_serve_targets import _modules

    tokens_mod, _ = _modules()
    tokenizer, name = tokens_mod.load_client_tokenizer("gemma3-270m")
    assert name == "gemma3-270m" and 106 in tokenizer.eos_token_ids  # <end_of_turn>
    requests = [r for s in load_tau_bench()[:2] for r in s[:2]]
    flat = [tokens_mod.flatten_request(r) for r in requests]
    ours = tokens_mod.client_tokens(tokenizer, flat)
    assert ours == _server_tokens(gemma3_server.url, requests)
    assert all(ids[0] == 2 and ids.count(105) >= 2 for ids in ours)  # <bos>, <start_of_turn> x 2+
    with pytest.raises(ValueError, match="--tokenizer"):
        tokens_mod.load_client_tokenizer("gemma9-1b")


@pytest.fixture(scope="module")
def gemma3_window_server(gemma3: LoadedModel) -> Iterator[RunningServer]:
    yield from run_server_in_thread(make_async_engine(
        gemma3, block_size=16, num_blocks=128, sliding_window_kv="window", window_num_blocks=80))


async def test_window_kv_serves_a_next_turn_from_the_cache(
        gemma3_window_server: RunningServer, gemma3: LoadedModel) -> None:
    """``--sliding-window-kv window`` over HTTP: a 900-token chat (past the 512-token window)
    then its next turn; the next turn hits the whole first prompt's aligned blocks (the window
    blocks before the prompt's end are anchors), /stats says ``window`` and shows the pool."""
    history = [{"role": "user", "content": " ".join(f"item {i}" for i in range(300))}]
    status, first = await post_json(gemma3_window_server.url, "/v1/chat/completions",
                                    {"messages": history, "max_tokens": 4, "temperature": 0})
    assert status == 200, first
    num_prompt = first["usage"]["prompt_tokens"]
    assert num_prompt > 600
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Count them."}]
    status, second = await post_json(gemma3_window_server.url, "/v1/chat/completions",
                                     {"messages": history, "max_tokens": 4, "temperature": 0})
    assert status == 200, second
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= num_prompt // 16 * 16
    status, stats = await get(gemma3_window_server.url, "/stats")
    assert status == 200
    assert stats["hit_granularity"]["window_kv"] == "window"
    window = stats["pool"]["window"]
    assert window["num_blocks"] == 80 and window["num_held_blocks"] == 0
    assert window["num_anchor_blocks"] > 0 and stats["miss_tokens"]["window_evicted"] == 0

"""``bench serve`` across targets: client-side tokens, flattened requests, labelled compare
targets, and cached-token parsing of other servers' replies (llama.cpp's ``timings``)."""

from __future__ import annotations

import json

import pytest

from radixkv.cli import load_bench
from radixkv.tools.transcripts import ideal_cached_tokens, load_source, load_tau_bench
from tests.server.conftest import BLOCK_SIZE
from tests.server.test_bench_serve import _server_tokens

pytestmark = pytest.mark.shared_data  # reads the shipped samples


def _modules():
    load_bench("serve")  # puts bench/ on sys.path
    import _serve_targets
    import _serve_tokens

    return _serve_tokens, _serve_targets


def test_flatten_renders_tool_calls_as_the_fallback_and_results_as_user_text():
    tokens_mod, _ = _modules()
    request = {"session_id": "s", "turn": 1, "tools": [
        {"type": "function", "function": {"name": "get_user", "parameters": {"type": "object"}}}],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Who is u1?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_user", "arguments": '{"id": "u1", "n": 2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_user", "content": '{"name": "Ann"}'}]}
    flat = tokens_mod.flatten_request(request)
    assert set(flat) == {"session_id", "turn", "messages"}  # tools went into the system turn
    assert flat["messages"] == [
        {"role": "system", "content": (
            "Be brief.\n\nYou may call one or more functions to assist with the user query. The "
            "available functions are listed as JSON schemas within <tools></tools>:\n<tools>\n"
            '{"function":{"name":"get_user","parameters":{"type":"object"}},"type":"function"}\n'
            "</tools>\nTo call a function, reply with one line per call: <tool_call>{\"name\": "
            '<function-name>, "arguments": <args-json-object>}</tool_call>')},
        {"role": "user", "content": "Who is u1?"},
        {"role": "assistant",
         "content": '<tool_call>{"arguments":{"id":"u1","n":2},"name":"get_user"}</tool_call>'},
        {"role": "user", "content": '<tool_response>\n{"name": "Ann"}\n</tool_response>'}]
    assert request["messages"][2]["content"] is None  # the input is left as it was


def test_read_usage_openai_details_and_llama_cpp_timings():
    tokens_mod, _ = _modules()
    read = tokens_mod.read_usage
    # llama.cpp llama-server's last streamed chunk: usage without details, timings with cache_n.
    llama = {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}],
             "created": 1, "id": "chatcmpl-x", "model": "m", "object": "chat.completion.chunk",
             "usage": {"completion_tokens": 16, "prompt_tokens": 1210, "total_tokens": 1226},
             "timings": {"cache_n": 1184, "prompt_n": 26, "prompt_ms": 410.5,
                         "predicted_n": 16, "predicted_ms": 870.2}}
    assert read(llama) == {"prompt_tokens": 1210, "completion_tokens": 16, "cached_tokens": 1184}
    # timings alone (no usage): prompt = cache_n + prompt_n.
    assert read({"timings": {"cache_n": 0, "prompt_n": 7, "predicted_n": 3}}) == {
        "prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 0}
    # OpenAI / vLLM / radixkv: prompt_tokens_details wins.
    assert read({"usage": {"prompt_tokens": 40, "completion_tokens": 2,
                           "prompt_tokens_details": {"cached_tokens": 32}},
                 "timings": {"cache_n": 5}})["cached_tokens"] == 32
    # vLLM without --enable-prompt-tokens-details: not reported, which is not 0.
    assert read({"usage": {"prompt_tokens": 40, "completion_tokens": 2,
                           "prompt_tokens_details": None}})["cached_tokens"] is None
    assert read({"choices": [{"delta": {"content": "x"}}]}) is None


def test_target_and_block_size_flags_parse():
    _, targets = _modules()
    assert targets.parse_target("vllm-cpu=http://127.0.0.1:8001/") == targets.Target(
        "http://127.0.0.1:8001", "vllm-cpu")
    assert targets.parse_target("http://h:1/x?a=b") == targets.Target("http://h:1/x?a=b", None)
    assert targets.parse_block_sizes(["128", "llama.cpp=1"]) == {None: 128, "llama.cpp": 1}
    for bad in ("0", "x=abc"):
        with pytest.raises(ValueError, match="--block-size"):
            targets.parse_block_sizes([bad])
    with pytest.raises(ValueError, match="LABEL=URL"):
        targets.parse_target("=http://h:1")


def test_client_tokens_agree_with_tokenize_on_the_shipped_samples(server, tmp_path):
    bench = load_bench("serve")
    tokens_mod, _ = _modules()
    tokenizer, name = tokens_mod.load_client_tokenizer(None)
    assert name == "embedded SmolLM2-135M-Instruct"
    # tau-bench's sample has no tool messages: flattening changes nothing the server sees.
    requests = [r for s in load_tau_bench()[:2] for r in s[:2]]
    flat = [tokens_mod.flatten_request(r) for r in requests]
    assert tokens_mod.client_tokens(tokenizer, flat) == _server_tokens(server.url, requests)
    # crewai's sample has tools, tool calls and tool results: /tokenize of the flattened
    # requests is the cross-check of every one of them.
    crew = [r for s in load_source("crewai") for r in s]
    out = tmp_path / "crew.json"
    assert bench.main(["--url", server.url, "--source", "crewai", "--max-tokens", "2",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["tokenize_mismatches"], data["tokenize_checked_url"]) == (0, server.url)
    assert data["tokenizer"] == "embedded SmolLM2-135M-Instruct"
    assert data["requests"] + data["skipped_requests"] == len(crew) == 9
    assert data["max_model_len"] == 2048  # the tiny model's, from /v1/models
    crew_tokens = tokens_mod.client_tokens(tokenizer, [tokens_mod.flatten_request(r) for r in crew])
    fits = [t for t in crew_tokens if len(t) + 2 <= 2048]
    assert data["skipped_requests"] == len(crew) - len(fits)
    assert data["prompt_tokens"] == sum(len(t) for t in fits)


def test_two_labelled_compare_targets_get_the_same_requests(server, tmp_path, capsys):
    bench = load_bench("serve")
    requests = [r for s in load_tau_bench()[:2] for r in s[:2]]
    ideal = sum(ideal_cached_tokens(_server_tokens(server.url, requests), BLOCK_SIZE))
    out = tmp_path / "three.json"
    assert bench.main(["--url", server.url, "--sessions", "2", "--max-turns", "2",
                       "--max-tokens", "3", "--concurrency", "1", "--label", "main",
                       "--compare-url", f"first={server.url}", "--compare-url",
                       f"second={server.url}/", "--block-size", "64", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [t["label"] for t in data["targets"]] == ["main", "first", "second"]
    assert data["label"] == "main" and data["compare"]["label"] == "first"
    assert data["ttft_ms_p50_ratio"] == pytest.approx(
        data["compare"]["ttft_ms_p50"] / data["ttft_ms_p50"])
    assert data["tokenize_mismatches"] == 0
    for t in data["targets"]:
        assert (t["url"], t["model"]) == (server.url, server.engine.model_name)
        # radixkv's /stats wins over --block-size; each run has its own fresh cache_salt.
        assert (t["block_size"], t["block_size_source"]) == (BLOCK_SIZE, "/stats")
        assert (t["requests"], t["skipped_requests"], t["failed_requests"]) == (4, 0, 0)
        assert t["cached_tokens_reported"] is True
        assert t["cached_tokens"] == t["ideal_cached_tokens"] == ideal
        assert t["server_requests"] == 4 and len(t["per_request"]) == 4
        assert t["decode_ms_per_token_p50"] > 0
    assert len({t["cache_salt"] for t in data["targets"]}) == 3
    printed = capsys.readouterr().out
    assert "main" in printed and "first" in printed and "second" in printed
    assert "client-side tokens vs" in printed and "0 of 4 requests differ" in printed
    assert (tmp_path / "three.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_without_reported_cached_tokens_says_so():
    load_bench("serve")
    import _serve_replay

    sample = _serve_replay.Sample("s", 0, {"messages": []}, [1, 2, 3], url="u", prompt_tokens=3,
                                  completion_tokens=5, ttft_ms=10.0, decode_ms=40.0)
    out = _serve_replay.summarise([sample], 1)
    assert (out["cached_tokens_reported"], out["cached_tokens"], out["cached_over_prompt"]) == (
        False, None, None)
    assert out["decode_ms_per_token_p50"] == 10.0  # 40 ms over 4 tokens after the first
    sample.cached_tokens = 2
    assert _serve_replay.summarise([sample], 1)["cached_over_prompt"] == pytest.approx(2 / 3)


def test_client_tokenizer_errors_name_the_flag(tmp_path) -> None:
    tokens_mod, _ = _modules()
    (tmp_path / "notes.txt").write_text("not a tokenizer")
    for spec, match in ((str(tmp_path), "holds no tokenizer"), ("", "empty"),
                        (str(tmp_path / "missing"), "neither a model folder"),
                        (str(tmp_path / "notes.txt"), "neither a model folder")):
        with pytest.raises(ValueError, match=f"^--tokenizer: .*{match}"):
            tokens_mod.load_client_tokenizer(spec)

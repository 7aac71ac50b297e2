"""``radixkv bench cold-prefill`` against a real tiny radixkv server (127.0.0.1, a free port):
every target measured at every length, the server's prompt-token count equal to the length
sent, tokens/s = N ÷ best TTFT, provenance in the JSON; a dead target is an error naming it;
prompts are fresh and in range; bad flags exit 2 naming the flag."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.cli import BENCHES, load_bench, main
from tests.server.helpers import wait_process_healthy
from tests.server.test_lifecycle import _free_port

cold = load_bench("cold-prefill")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="radixkv bench cold-prefill")
    cold.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.cli", "serve", "--model", str(tiny_model_dir), "--device",
         "cpu", "--port", str(port), "--num-blocks", "64", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_process_healthy(proc, url))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_registered_as_a_bench() -> None:
    assert "cold-prefill" in BENCHES


def test_two_targets_every_length(tiny_server: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cold.json"
    result = cold.run(parse("--url", tiny_server, "--compare-url", f"again={tiny_server}",
                            "--tokens", "40,300", "--repeats", "2", "--json", str(out)))
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert "error" not in result
    assert result["provenance"]["machine"]["cores"] >= 1 and result["max_tokens"] == 1
    assert [t["label"] for t in result["targets"]] == ["radixkv", "again"]
    for target in result["targets"]:
        assert target["url"] == tiny_server and target["model"]
        assert [p["tokens"] for p in target["points"]] == [40, 300]
        for p in target["points"]:
            assert len(p["runs"]) == 2
            # The server counted exactly the ids sent (checked by the driver; recorded here).
            assert [r["prompt_tokens"] for r in p["runs"]] == [p["tokens"]] * 2
            assert all(r["prompt_tokens_checked"] for r in p["runs"])
            assert all(0 < r["ttft_s"] <= r["total_s"] for r in p["runs"])
            assert p["best_ttft_s"] == min(r["ttft_s"] for r in p["runs"])
            assert p["tokens_per_s"] == pytest.approx(p["tokens"] / p["best_ttft_s"])
    first, again = result["targets"]
    for p, q in zip(first["points"], again["points"]):
        assert p["vs_first"] == 1.0
        assert q["vs_first"] == pytest.approx(q["tokens_per_s"] / p["tokens_per_s"])
    table = capsys.readouterr().out
    assert "radixkv" in table and "again" in table and "N ÷ best TTFT" in table


def test_a_server_without_usage_is_recorded_unchecked(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    sent = iter([{"ttft_s": 0.5, "total_s": 0.6, "prompt_tokens": None},
                 {"ttft_s": 0.4, "total_s": 0.5, "prompt_tokens": 16}])
    monkeypatch.setattr(cold, "timed_completion", lambda *a, **k: next(sent))
    result = cold.run(parse("--url", "http://127.0.0.1:1", "--model", "m", "--tokens", "16",
                            "--repeats", "2", "--warmup", "0"))
    runs = result["targets"][0]["points"][0]["runs"]
    assert [r["prompt_tokens_checked"] for r in runs] == [False, True]
    captured = capsys.readouterr()
    assert captured.err.count("prompt token count not checked") == 1
    assert "(1 with no usage: token count not checked)" in captured.out


def test_a_dead_target_is_an_error_naming_it(tiny_server: str) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    result = cold.run(parse("--url", tiny_server, "--compare-url", f"gone={dead}", "--tokens", "16",
                            "--repeats", "1", "--warmup", "0", "--timeout", "5"))
    assert result["error"] == "failed targets: gone"
    gone = result["targets"][1]
    assert gone["label"] == "gone" and dead in gone["error"] and "points" not in gone
    assert result["targets"][0]["points"][0]["vs_first"] == 1.0


def test_a_length_past_the_context_is_an_error(tiny_server: str) -> None:
    # The tiny model's context is 2,048 tokens: 2,048 prompt tokens leave no room for one more.
    result = cold.run(parse("--url", tiny_server, "--tokens", "2048", "--repeats", "1",
                            "--warmup", "0"))
    assert "HTTP 400" in result["targets"][0]["error"]


def test_prompts_are_fresh_and_in_range() -> None:
    a, b = cold.cold_prompt(512, (1000, 1010)), cold.cold_prompt(512, (1000, 1010))
    assert len(a) == 512 and set(a) <= set(range(1000, 1010)) and a != b


@pytest.mark.parametrize("argv, flag", [
    (["--tokens", "0"], "--tokens"), (["--id-range", "5,5"], "--id-range"),
    (["--compare-url", "x=localhost:1"], "--compare-url"), (["--repeats", "-1"], "--repeats"),
    ([], "--url")])
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], flag: str,
                                          capsys: pytest.CaptureFixture) -> None:
    url = [] if flag == "--url" else ["--url", "http://127.0.0.1:1"]
    with pytest.raises(SystemExit) as exc:
        main(["bench", "cold-prefill", *url, *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err

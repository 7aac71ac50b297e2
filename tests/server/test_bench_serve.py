"""``bench/serve.py`` end to end against a real tiny-model server, with exact cache numbers.

The transcripts are the samples shipped in the package (the benchmark's default data), so these
tests run in a clone with no shared data folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from radixkv.cli import load_bench
from radixkv.cli import main as cli_main
from radixkv.tools.data import SharedDataMissing
from radixkv.tools.transcripts import ideal_cached_tokens, load_tau_bench
from tests.server.conftest import BLOCK_SIZE

pytestmark = pytest.mark.shared_data  # reads the shipped samples

KEYS = {"requests", "skipped_requests", "prompt_tokens", "cached_tokens", "ideal_cached_tokens",
        "cached_over_ideal", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50",
        "output_tokens_per_s"}


def _server_tokens(url: str, requests: list[dict]) -> list[list[int]]:
    async def go():
        async with aiohttp.ClientSession() as http:
            out = []
            for req in requests:
                async with http.post(f"{url}/tokenize", json={"messages": req["messages"]}) as r:
                    out.append((await r.json())["tokens"])
            return out
    return asyncio.run(go())


def test_replay_two_sessions_exact_cached_and_ideal(server, tmp_path):
    bench = load_bench("serve")
    requests = [r for s in load_tau_bench()[:2] for r in s[:2]]
    tokens = _server_tokens(server.url, requests)
    assert all(len(t) + 16 <= 2048 for t in tokens)  # all fit the tiny model's context
    out = tmp_path / "serve.json"
    results = bench.main(["--url", server.url, "--source", "tau-bench", "--sessions", "2",
                          "--concurrency", "1", "--max-turns", "2", "--json", str(out)])
    assert results == 0
    data = json.loads(out.read_text())
    assert KEYS <= set(data)
    # Concurrency 1 runs in file order: session 0 turns 0, 1, then session 1 turns 0, 1.
    ideal = ideal_cached_tokens(tokens, BLOCK_SIZE)
    assert ideal[0] == 0 and min(ideal[1:]) > 1000  # shared policy prompt, then in-session
    assert (data["requests"], data["skipped_requests"], data["failed_requests"]) == (4, 0, 0)
    assert data["prompt_tokens"] == sum(len(t) for t in tokens)
    assert data["ideal_cached_tokens"] == sum(ideal)
    # A fresh server with room for everything reuses exactly the ideal prefix.
    assert data["cached_tokens"] == sum(ideal) == data["server_cached_prompt_tokens"]
    assert (data["server_requests"], data["tokenize_url"]) == (4, None)
    assert data["cached_over_ideal"] == 1.0
    assert 0 < data["ttft_ms_p50"] <= data["ttft_ms_p90"] <= data["ttft_ms_p99"]
    assert data["itl_ms_p50"] > 0 and data["output_tokens_per_s"] > 0
    assert data["output_tokens"] <= 4 * 16


def test_cli_counts_skipped_requests_and_compares(server, tmp_path, capsys, monkeypatch):
    # The CLI configures structlog to print to the sys.stderr of the moment (pytest's capture
    # of this test) and caches loggers: keep it from rebinding the process's logging.
    monkeypatch.setattr("radixkv.log.configure_logging", lambda *a, **k: None)
    requests = [r for s in load_tau_bench()[:2] for r in s[:2]]
    lengths = sorted(len(t) for t in _server_tokens(server.url, requests))
    # Pick max_tokens so that exactly the two longest prompts no longer fit 2048 tokens.
    max_tokens = 2048 - lengths[1]
    assert lengths[2] + max_tokens > 2048
    out = tmp_path / "serve.json"
    rc = cli_main(["bench", "serve", "--url", server.url, "--sessions", "2", "--concurrency",
                   "2", "--max-turns", "2", "--max-tokens", str(max_tokens), "--json", str(out),
                   "--compare-url", server.url])
    assert rc == 0
    data = json.loads(out.read_text())
    for run in (data, data["compare"]):
        assert KEYS <= set(run)
        assert (run["requests"], run["skipped_requests"], run["failed_requests"]) == (2, 2, 0)
        assert run["prompt_tokens"] == lengths[0] + lengths[1]
    printed = capsys.readouterr().out
    assert "cached/ideal" in printed and "TTFT p50 ms" in printed


def test_open_loop_with_warmup_writes_json_and_png(server, tmp_path):
    from radixkv.tools.transcripts import load_source

    bench = load_bench("serve")
    requests = [r for s in load_source("mini-swe-agent") for r in s]
    tokens = _server_tokens(server.url, requests)
    by_turn = {(r["session_id"], r["turn"]): t for r, t in zip(requests, tokens)}
    fits = [t for t in tokens if len(t) + 16 <= 2048]
    out = tmp_path / "rate.json"
    # One request in flight at a time (--concurrency caps the open loop): no request can miss
    # a prefix because the request holding it is still running, so the numbers are exact.
    assert bench.main(["--url", server.url, "--source", "mini-swe-agent", "--sessions", "2",
                       "--request-rate", "1000", "--concurrency", "1", "--warmup-requests", "2",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert KEYS | {"computed_tokens", "per_request", "itl_ms_p90"} <= set(data)
    assert (data["mode"], data["request_rate"], data["warmup_requests"]) == ("poisson", 1000.0, 2)
    assert (data["requests"], data["skipped_requests"]) == (len(fits), 12 - len(fits))
    assert data["prompt_tokens"] == sum(len(t) for t in fits)
    # Warm-up requests ran under throwaway salts: the measured run starts cold.
    rows = data["per_request"]
    ideal = ideal_cached_tokens([by_turn[r["session_id"], r["turn"]] for r in rows], BLOCK_SIZE)
    assert [r["ideal_cached_tokens"] for r in rows] == ideal
    assert [r["cached_tokens"] for r in rows] == ideal
    assert data["cached_tokens"] == data["ideal_cached_tokens"] == sum(ideal)
    assert data["server_cached_prompt_tokens"] == data["cached_tokens"]
    assert data["computed_tokens"] == data["prompt_tokens"] - data["cached_tokens"]
    turns = {}
    for row in rows:  # each session's turns went out in order, one after the other
        assert row["turn"] == turns.get(row["session_id"], -1) + 1
        turns[row["session_id"]] = row["turn"]
    assert (tmp_path / "rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tokenize_url_gives_ids_while_requests_go_to_url(server, tmp_path):
    # The same server both ways: --tokenize-url only moves /v1/models, /tokenize and /stats.
    bench = load_bench("serve")
    out = tmp_path / "t.json"
    assert bench.main(["--url", server.url, "--tokenize-url", server.url + "/", "--source",
                       "mini-swe-agent", "--sessions", "1", "--max-turns", "2", "--max-tokens", "2",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["url"], data["tokenize_url"], data["requests"]) == (server.url, server.url + "/", 2)
    assert data["server_requests"] == 2
    assert data["server_cached_prompt_tokens"] == data["cached_tokens"] > 0
    with pytest.raises(SystemExit, match=rf"cannot use the server at {server.url} with --tokenize-url "
                                           r"http://127.0.0.1:1: "):
        bench.main(["--url", server.url, "--tokenize-url", "http://127.0.0.1:1", "--source",
                    "mini-swe-agent", "--sessions", "1", "--json", str(tmp_path / "u.json")])


def test_bad_flags_exit_with_a_message(server):
    bench = load_bench("serve")
    for flags, message in [(["--request-rate", "0"], "--request-rate"),
                           (["--warmup-requests", "-1"], "--warmup-requests"),
                           (["--source", "crewai", "--path", "/nonexistent"], "path")]:
        try:
            bench.main(["--url", server.url, *flags])
        except SystemExit as exc:
            assert message in str(exc)
        else:
            raise AssertionError(f"{flags} did not exit")


def test_missing_output_folders_are_created_json_first(server, tmp_path, capsys):
    bench = load_bench("serve")
    out, png = tmp_path / "x" / "b3.json", tmp_path / "x" / "sub" / "dir" / "p.png"
    assert bench.main(["--url", server.url, "--source", "crewai", "--sessions", "2",
                       "--max-turns", "2", "--max-tokens", "4", "--json", str(out),
                       "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data["source"] == "crewai" and data["requests"] + data["skipped_requests"] == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The default plot (next to --json) gets its folder too.
    out2 = tmp_path / "y" / "z" / "m.json"
    assert bench.main(["--url", server.url, "--source", "mini-swe-agent", "--sessions", "1",
                       "--max-turns", "1", "--max-tokens", "2", "--json", str(out2)]) == 0
    assert json.loads(out2.read_text())["requests"] == 1
    assert (tmp_path / "y" / "z" / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "warning" not in capsys.readouterr().err


def test_plot_failure_keeps_the_json_and_warns(server, tmp_path, capsys, monkeypatch):
    bench = load_bench("serve")
    out = tmp_path / "r.json"

    def failing_plot(results, path, title):
        assert json.loads(out.read_text())["requests"] == 1  # the JSON is already written
        raise OSError("disk full")

    monkeypatch.setattr(bench, "plot_ttft", failing_plot)
    assert bench.main(["--url", server.url, "--source", "mini-swe-agent", "--sessions", "1",
                       "--max-turns", "1", "--max-tokens", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["requests"] == 1
    err = capsys.readouterr().err
    assert f"warning: the TTFT plot {tmp_path / 'r.png'} was not written: OSError: disk full" in err
    assert f"the results are in {out}" in err


def test_bad_output_paths_fail_before_the_run(tmp_path):
    bench = load_bench("serve")
    (tmp_path / "afile").write_text("")
    unreachable = "http://127.0.0.1:1"  # the run would fail differently: the paths fail first
    for flags, message in [
            (["--json", str(tmp_path)], f"--json {tmp_path} is a folder"),
            (["--json", str(tmp_path / "j.json"), "--plot", str(tmp_path)], "--plot"),
            (["--json", str(tmp_path / "afile" / "j.json")], "cannot create its folder"),
            (["--json", str(tmp_path / "same.png")], "would both be")]:
        with pytest.raises(SystemExit, match=message):
            bench.main(["--url", unreachable, "--source", "mini-swe-agent", *flags])


def test_bad_transcript_paths_exit_with_a_clear_message(tmp_path):
    # Each fails before any server is contacted.
    crewai_dir = tmp_path / "cassettes"
    crewai_dir.mkdir()
    (crewai_dir / "c.yaml").write_text("interactions: []\n")
    cases = [(["--source", "crewai", "--path", str(tmp_path / "nonexistent")],
              f"bench serve: path: {tmp_path / 'nonexistent'} does not exist"),
             (["--source", "tau-bench", "--path", str(crewai_dir)],
              f"bench serve: path: {crewai_dir} is a folder; the tau-bench source reads one "
              "file, a tau-bench trajectories JSON file"),
             (["--source", "tau-bench", "--path", str(crewai_dir / "c.yaml")],
              f"bench serve: path: {crewai_dir / 'c.yaml'} is not JSON")]
    for flags, message in cases:
        proc = subprocess.run([sys.executable, "-m", "radixkv.cli", "bench", "serve", "--url",
                               "http://127.0.0.1:1", *flags], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 1, (flags, proc.stderr)
        assert message in proc.stderr, (flags, proc.stderr)
        assert "Traceback" not in proc.stderr and "Errno" not in proc.stderr


def test_defaults_sample_data_local_url_and_a_new_results_folder(server, tmp_path, monkeypatch,
                                                                 capsys):
    bench = load_bench("serve")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    defaults = parser.parse_args([])
    assert (defaults.url, defaults.source, defaults.path, defaults.shared, defaults.json) == (
        "http://127.0.0.1:8000", "tau-bench", None, False, None)
    # No --json: results.json and results.png in ./radixkv-bench-results/serve-<timestamp>/.
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--url", server.url, "--source", "mini-swe-agent", "--sessions", "1",
                       "--max-turns", "1", "--max-tokens", "2"]) == 0
    (folder,) = (tmp_path / "radixkv-bench-results").iterdir()
    assert folder.name.startswith("serve-")
    assert sorted(p.name for p in folder.iterdir()) == ["results.json", "results.png"]
    data = json.loads((folder / "results.json").read_text())
    assert (data["requests"], data["source"]) == (1, "mini-swe-agent")
    assert data["data_path"].endswith("radixkv/tools/data/agent-transcripts/mini-swe-agent")
    err = capsys.readouterr().err
    assert "bench serve: wrote radixkv-bench-results/serve-" in err and "results.png" in err


def test_a_run_that_fails_leaves_no_empty_results_folder(tmp_path, monkeypatch):
    bench = load_bench("serve")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="cannot use the server at http://127.0.0.1:1"):
        bench.main(["--url", "http://127.0.0.1:1", "--source", "mini-swe-agent", "--sessions", "1"])
    assert list((tmp_path / "radixkv-bench-results").iterdir()) == []


def test_shared_reads_the_full_data_under_radixkv_shared_dir(tmp_path, monkeypatch):
    bench = load_bench("serve")
    monkeypatch.setenv("RADIXKV_SHARED_DIR", str(tmp_path / "nowhere"))
    missing = tmp_path / "nowhere" / "agent-transcripts" / "crewai-cassettes"
    with pytest.raises(SharedDataMissing, match=f"^--shared: {missing} does not exist "):
        bench.main(["--url", "http://127.0.0.1:1", "--source", "crewai", "--shared"])
    with pytest.raises(SystemExit):  # --path and --shared exclude each other
        bench.main(["--shared", "--path", str(tmp_path)])

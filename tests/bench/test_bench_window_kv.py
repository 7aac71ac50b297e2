"""``radixkv bench window-kv``: the dry-run plan (three servers, one at a time, the constrained
pool's GiB from ``--pool-gib`` or left to the unconstrained run), missing data and a missing
pool size exit 2 naming the flag, and the sizing, merge and ratio arithmetic on synthetic
``bench serve`` results and ``/stats`` (no server started)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from radixkv.cli import BENCHES, load_bench, main

wkv = load_bench("window-kv")
PY = sys.executable


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="radixkv bench window-kv")
    wkv.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_registered() -> None:
    assert "window-kv" in BENCHES


def test_dry_run_plans_three_servers_with_the_given_pool(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "trajs"
    data.mkdir()
    out = tmp_path / "res" / "result.json"
    result = wkv.run(parse("--dry-run", "--out", str(out), "--path", str(data), "--port", "8555",
                           "--pool-gib", "0.8584", "--sessions", "3", "--concurrency", "2"))
    assert result["dry_run"] is True
    url = "http://127.0.0.1:8555"
    serve = [PY, "-m", "radixkv.cli", "serve", "--model", "gemma3-270m", "--host", "127.0.0.1",
             "--port", "8555", "--kv-cache-memory"]
    replay = [PY, "-m", "radixkv.cli", "bench", "serve", "--url", url, "--source",
              "mini-swe-agent-gemini3", "--path", str(data), "--sessions", "3", "--concurrency",
              "2", "--max-tokens", "16", "--max-model-len", "32768", "--tokenizer", "gemma3-270m",
              "--cache-salt", "none", "--request-timeout", "3600", "--label", "radixkv", "--json"]
    expected = [
        ("unconstrained", 8.0, ["8.0", "--sliding-window-kv", "keep-all"]),
        ("keep-all", 0.8584, ["0.8584", "--sliding-window-kv", "keep-all"]),
        ("window", 0.8584, ["0.8584", "--sliding-window-kv", "window",
                            "--window-kv-fraction", "0.25"]),
    ]
    assert [s["config"] for s in result["plan"]] == [e[0] for e in expected]
    for step, (label, gib, tail) in zip(result["plan"], expected):
        assert step["kv_memory_gib"] == gib
        assert step["server"].split() == serve + tail + ["--log-level", "info"]
        assert step["replay"].split() == replay + [str(tmp_path / "res" / "parts" /
                                                       f"serve-{label}.json")]
    printed = capsys.readouterr().out
    assert printed.count("  server: ") == 3 and "window: kv-cache-memory 0.8584 GiB" in printed
    assert not out.parent.exists()  # nothing started, nothing written


def test_dry_run_without_pool_gib_leaves_the_pool_to_the_unconstrained_run(
        tmp_path: Path) -> None:
    result = wkv.run(parse("--dry-run", "--path", str(tmp_path), "--configs", "window,keep-all",
                           "--pool-gib", "1", "--max-turns", "4"))
    assert [s["config"] for s in result["plan"]] == ["keep-all", "window"]  # always in order
    assert result["plan"][0]["replay"].endswith("--max-turns 4")
    plan = wkv.run(parse("--dry-run", "--path", str(tmp_path)))["plan"]
    assert [s["kv_memory_gib"] for s in plan] == [8.0, "<from unconstrained>", "<from unconstrained>"]
    assert "'<free port>'" in plan[0]["server"]


@pytest.mark.parametrize("argv, flag", [
    (["--out", "OUT"], "--shared"),  # the shared folder lacks the source
    (["--out", "OUT", "--path", "/nonexistent/trajs"], "--path"),
    (["--out", "OUT", "--path", "TMP", "--configs", "keep-all,window"], "--pool-gib"),
    (["--path", "TMP"], "--out"),
])
def test_missing_prerequisites_exit_2_naming_the_flag(argv: list[str], flag: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("RADIXKV_SHARED_DIR", str(tmp_path / "no-shared"))
    subst = {"OUT": str(tmp_path / "out" / "r.json"), "TMP": str(tmp_path)}
    with pytest.raises(SystemExit) as exc:
        main(["bench", "window-kv", *[subst.get(a, a) for a in argv]])
    assert exc.value.code == 2
    assert f"radixkv bench window-kv: {flag}:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_working_set_and_constrained_pool() -> None:
    rows = [{"session_id": "a", "prompt_tokens": 1000}, {"session_id": "b", "prompt_tokens": 2000},
            {"session_id": "a", "prompt_tokens": 3000}, {"session_id": "b", "prompt_tokens": 1500}]
    assert wkv.working_set_tokens(rows) == 5000
    per_token = wkv.bytes_per_token({"pool": {"bytes_per_block": 589824, "block_size_tokens": 16}})
    assert per_token == 36864.0
    # 100,000 x 0.25 x 36,864 B = 0.858306884765625 GiB, rounded up to 1e-4.
    assert wkv.constrained_gib(100_000, per_token, 0.25) == 0.8584
    # Exactly 1 GiB stays 1 GiB: 2**30 / 36864 / 0.25 tokens is not whole, so use a block's bytes.
    assert wkv.constrained_gib(4 * 2**14, 2**16, 0.25) == 1.0


def _serve(cached_over_ideal: float, failed: int = 0) -> dict:
    return {"requests": 10, "failed_requests": failed, "prompt_tokens": 1000,
            "cached_tokens": 500, "ideal_cached_tokens": 800, "cached_over_ideal": cached_over_ideal,
            "cached_over_prompt": 0.5, "ttft_ms_p50": 1500.0, "ttft_ms_p90": 4000.0,
            "itl_ms_p50": 90.0, "wall_s": 600.0,
            "per_request": [{"session_id": "a", "prompt_tokens": 100}]}


def _stats(total_blocks: int, bytes_per_block: int, window_evicted: int = 0,
           window: dict | None = None) -> dict:
    pool = {"block_size_tokens": 16, "bytes_per_block": bytes_per_block,
            "total_blocks": total_blocks, "free_blocks": 3}
    if window is not None:
        pool["window"] = window
    return {"pool": pool, "miss_tokens": {"cold": 7, "evicted": 11, "window_evicted": window_evicted},
            "hit_granularity": {"block_size_tokens": 16, "window_kv": "keep-all"},
            "cached_prompt_tokens_total": 500, "prompt_tokens_total": 1000, "requests_total": 10}


def test_merge_derives_tokens_per_gib_and_the_ratios_exactly() -> None:
    args = parse("--path", "x")
    runs = {"unconstrained": {"serve": _serve(0.5), "stats": _stats(14_563, 589_824),
                              "server": "S0", "replay": "R0", "log": "L0", "part": "P0",
                              "code": {"commit": "c" * 40, "dirty": True}},
            "keep-all": {"serve": _serve(0.25), "stats": _stats(250, 589_824)},
            "window": {"serve": _serve(0.375), "stats": _stats(1125, 98_304, window_evicted=64,
                                                              window={"num_blocks": 70})}}
    gibs = {"unconstrained": 8.0, "keep-all": 0.5, "window": 0.5}
    result = wkv.merge(args, runs, gibs, {"working_set_tokens": 5000, "pool_gib": 0.5})
    assert "error" not in result and result["working_set_tokens"] == 5000
    c = result["configs"]
    assert list(c) == ["unconstrained", "keep-all", "window"]
    assert [c[k]["sliding_window_kv"] for k in c] == ["keep-all", "keep-all", "window"]
    assert [c[k]["cacheable_tokens"] for k in c] == [233_008, 4000, 18_000]
    assert [c[k]["tokens_per_gib"] for k in c] == [29_126.0, 8000.0, 36_000.0]
    assert c["window"]["pool"]["window"] == {"num_blocks": 70}
    assert c["window"]["miss_tokens"]["window_evicted"] == 64
    assert c["keep-all"]["ttft_ms_p90"] == 4000.0 and c["keep-all"]["itl_ms_p50"] == 90.0
    assert "per_request" not in c["keep-all"] and "requests_total" not in c["keep-all"]
    assert c["unconstrained"]["server"] == "S0" and "log_tail" not in c["unconstrained"]
    assert c["unconstrained"]["code"] == {"commit": "c" * 40, "dirty": True}
    assert result["ratios"] == {"window_over_keep_all_tokens_per_gib": 4.5,
                                "keep_all_hit_over_unconstrained": 0.5,
                                "window_hit_over_unconstrained": 0.75}
    table = wkv.format_table(result)
    assert "window / keep-all tokens per GiB: 4.500" in table
    assert table.splitlines()[3].split()[:6] == ["window", "0.5", "18,000", "36,000", "0.375", "0"]


def test_a_failed_configuration_is_an_error_and_its_ratios_are_none() -> None:
    runs = {"unconstrained": {"serve": _serve(0.5), "stats": _stats(100, 589_824)},
            "keep-all": {"serve": _serve(0.25, failed=2), "stats": _stats(25, 589_824)},
            "window": {"serve": None, "stats": None, "error": "bench serve exited with status 1",
                       "log_tail": "Traceback ..."}}
    result = wkv.merge(parse("--path", "x"), runs,
                       {"unconstrained": 8.0, "keep-all": 0.5, "window": 0.5}, {})
    assert result["error"] == "window: bench serve exited with status 1"
    assert result["configs"]["window"]["log_tail"] == "Traceback ..."
    assert "cacheable_tokens" not in result["configs"]["window"]
    assert result["configs"]["keep-all"]["failed_requests"] == 2
    assert result["ratios"] == {"window_over_keep_all_tokens_per_gib": None,
                                "keep_all_hit_over_unconstrained": 0.5,
                                "window_hit_over_unconstrained": None}
    assert "ERROR: bench serve exited with status 1" in wkv.format_table(result)

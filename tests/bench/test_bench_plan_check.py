"""``radixkv bench plan-check``: ``radixkv plan --trace`` against a real server replaying the
same trace on the same pool (tiny model, SmolLM2's tokenizer)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from radixkv.cli import load_bench
from radixkv.tools.transcripts import default_path

plan_check = load_bench("plan-check")


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_check.add_arguments(parser)
    return parser.parse_args(argv)


def test_compare_gives_each_ratio_and_whether_it_is_within_the_tolerance() -> None:
    plan = {"token_hit_rate": 0.5, "peak_live_blocks": 100, "peak_used_blocks": 200}
    server = {"token_hit_rate": 0.5, "peak_in_use_blocks": 96, "peak_used_blocks": 205}
    rows = plan_check.compare(plan, server, 0.05)
    assert [(r["measure"], r["plan"], r["server"]) for r in rows] == [
        ("token hit rate", 0.5, 0.5), ("peak live blocks", 100, 96), ("peak used blocks", 200, 205)]
    assert [r["plan_over_server"] for r in rows] == [1.0, 100 / 96, 200 / 205]
    assert [r["within"] for r in rows] == [True, True, True]
    assert [r["within"] for r in plan_check.compare(plan, server, 0.04)] == [True, False, True]
    # Nothing measured on the server but something planned: never "within".
    zero = plan_check.compare(plan, {**server, "peak_in_use_blocks": 0}, 0.05)
    assert zero[1]["within"] is False


@pytest.mark.parametrize("flag,value", [("--poll-ms", "0"), ("--poll-ms", "2000"), ("--pools", "1.5"),
                                        ("--pools", "huge"), ("--max-tokens", "0"), ("--block-size", "0"),
                                        ("--tolerance", "-1"), ("--startup-timeout", "-1")])
def test_bad_flags_exit_2_naming_the_flag(flag: str, value: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # Usage errors, before any server starts.
    with pytest.raises(SystemExit) as exc:
        _args([flag, value])
    assert exc.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err


def test_plan_predicts_a_real_servers_hits_and_peaks_on_an_evicting_pool(tmp_path: Path) -> None:
    # Two sessions of the shipped sample, 5 turns each, one at a time on a pool of half the
    # working set: the second session evicts the first's blocks on the server and in the replay.
    records = json.loads(default_path("tau-bench").read_text())[:2]
    for record in records:
        record["traj"] = record["traj"][:11]
    trace = tmp_path / "gpt-4o-airline.json"
    trace.write_text(json.dumps(records))
    out = tmp_path / "plan-check.json"
    result = plan_check.run(_args(["--trace-path", str(trace), "--concurrency", "1",
                                   "--pools", "0.5", "--json", str(out)]))
    (run,) = result["runs"]
    plan, server = run["plan"], run["server"]
    assert plan["num_blocks"] == run["num_blocks"]
    assert server["requests"] == plan["num_requests"] and server["failed_requests"] == 0
    assert server["prompt_tokens"] == plan["num_prompt_tokens"]
    assert server["evicted_blocks"] > 0 and plan["allocation_failures"] == 0
    # One request at a time: the hits are the same tokens, not just close.
    assert server["cached_tokens"] == plan["num_cached_tokens"] > 0
    assert server["peak_used_blocks"] == plan["peak_used_blocks"] == run["num_blocks"]
    assert result["all_within"] is True
    assert json.loads(out.read_text())["runs"][0]["rows"] == run["rows"]

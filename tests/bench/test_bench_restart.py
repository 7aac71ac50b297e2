"""``radixkv bench restart`` on the tiny model with a short session (B = 4): four servers one at
a time (write, restarted, cold, a bit-flipped file; the truncated-file run is the same code with
another damage, and tests/cli/test_disk_restart.py truncates a file under a real server),
every check passing with exact cached-token counts, the result JSON with provenance; a bad
``--damage`` exits 2."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from radixkv.cli import load_bench

restart = load_bench("restart")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="radixkv bench restart")
    restart.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.slow
def test_a_restarted_server_reads_the_session_from_disk(tiny_model_dir: Path, tmp_path: Path):
    out, kv, logs = tmp_path / "restart.json", tmp_path / "kv", tmp_path / "logs"
    result = restart.run(parse(
        "--model", str(tiny_model_dir), "--tokens", "300", "--block-size", "4",
        "--reply-tokens", "8", "--next-tokens", "4", "--max-ratio", "100",
        "--serve-arg=--device=cpu", "--serve-arg=--num-blocks=512", "--damage", "flip",
        "--kv-dir", str(kv),
        "--log-dir", str(logs), "--json", str(out)))
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert "error" not in result, result.get("error")
    assert result["checks"] == dict.fromkeys((
        "restarted_reads_turn1_from_disk", "cold_reads_nothing", "same_output_restarted_and_cold",
        "ttft_ratio_at_most_max", "damaged-flip_computed_from_the_damaged_block",
        "damaged-flip_same_output_as_cold", "damaged-flip_refused_and_counted"), True)
    assert result["all_checks_ok"] is True and result["log_dir"] == str(logs)
    servers = result["servers"]
    assert list(servers) == ["write", "restarted", "cold", "damaged-flip"]
    assert all(s["exit_status"] == 0 for s in servers.values())
    turn1 = result["turn1"]
    assert abs(turn1["prompt_tokens"] - 300) <= 16 and turn1["completion_tokens"] == 8
    assert turn1["blocks"] == (turn1["prompt_tokens"] + 8 - 1) // 4
    assert servers["write"]["disk_num_blocks"] >= turn1["blocks"]
    warm, cold = servers["restarted"]["turn2"], servers["cold"]["turn2"]
    assert warm["prompt_tokens"] == cold["prompt_tokens"] > turn1["prompt_tokens"]
    assert warm["cached_tokens"] >= turn1["prompt_tokens"] // 4 * 4 and cold["cached_tokens"] == 0
    store = servers["restarted"]["store"]
    assert store["backend"] == "disk"
    assert store["disk_found_blocks_at_start"] == servers["write"]["disk_num_blocks"]
    assert store["hit_blocks_total"] == warm["cached_tokens"] // 4
    flip = servers["damaged-flip"]
    assert flip["damaged_block"] == turn1["prompt_tokens"] // 4 // 4
    assert flip["turn2"]["cached_tokens"] == 4 * flip["damaged_block"]
    assert flip["turn2"]["text"] == cold["text"]
    assert flip["store"]["disk_rejected_blocks_by_reason"] == {
        "size": 0, "header": 0, "foreign": 0, "checksum": 1, "io": 0, "format": 0}
    assert result["ttft_ratio"] == warm["ttft_s"] / cold["ttft_s"]
    assert result["provenance"]["machine"]["cores"] >= 1
    assert not kv.exists() or kv.is_dir()  # a given --kv-dir is kept
    assert (logs / "write.log").exists()


def test_a_bad_damage_name_exits_2(capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as exit_info:
        parse("--damage", "melt")
    assert exit_info.value.code == 2
    assert "argument --damage: expected flip, truncate or none, got 'melt'" in \
        capsys.readouterr().err
    assert parse("--damage", "none").damage == []

"""``radixkv bench eviction`` on tiny traces: serving rules (hit cap, full blocks, locked request),
the formats, the outputs and the oracle's place at the top."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from radixkv.cli import load_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _eviction_replay as replay_mod  # noqa: E402
import _eviction_trace as trace_mod  # noqa: E402

from radixkv.eviction.cost_model import PRESETS, prefill_flops  # noqa: E402


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def args_for(trace: Path, out: Path, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    load_bench("eviction").add_arguments(parser)
    argv = ["--trace", str(trace), "--out", str(out), "--jobs", "1"]
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return parser.parse_args(argv)


def test_mooncake_hit_cap_and_full_blocks(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 2000, "input_length": 1500, "output_length": 1, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 1600, "output_length": 1, "hash_ids": [0, 1, 2, 3]},
    ])
    t = trace_mod.load_trace("mooncake", str(trace), 512)
    assert t.distinct_blocks == 4 and [r.time_s for r in t.requests] == [0.0, 1.0, 2.0, 3.0]
    assert len(t.prompt(t.requests[2])) == 4 * 1500  # last block partial (476 tokens)
    shape = PRESETS["llama3-8b"]
    r = replay_mod.replay(t, "lru", 64, shape)
    # B: cap (1024-1)//512 = 1 block; C: 2 blocks; D: blocks 0, 1 only (C's block 2 is partial).
    assert r["cached_tokens"] == 0 + 512 + 1024 + 1024
    assert r["token_hit_rate"] == pytest.approx(2560 / (1024 + 1024 + 1500 + 1600))
    saved = prefill_flops(shape, 0, 512) + 2 * prefill_flops(shape, 0, 1024)
    total = sum(prefill_flops(shape, 0, n) for n in (1024, 1024, 1500, 1600))
    assert r["flop_hit_rate"] == pytest.approx(saved / total)
    assert replay_mod.infinite_cache(t, shape)["token_hit_rate"] == pytest.approx(r["token_hit_rate"])
    # A pool of 2 blocks: every request needs all its blocks while served; D (4 blocks) cannot
    # be served from the cache at all and counts as a miss.
    small = replay_mod.replay(t, "lru", 2, shape)
    assert small["skipped_requests"] == 2 and small["cached_tokens"] == 512


def test_tokens_format_salts_never_share(tmp_path: Path) -> None:
    prefix = list(range(100, 132))
    trace = write_jsonl(tmp_path / "t.jsonl", [
        {"token_ids": prefix + [1], "cache_salt": "a"},
        {"token_ids": prefix + [2], "cache_salt": "b"},
        {"token_ids": prefix + [3], "cache_salt": "a"},
    ])
    t = trace_mod.load_trace("tokens", str(trace), 16)
    assert t.distinct_blocks == 4 + 3  # per salt: two full blocks, one partial per distinct tail
    r = replay_mod.replay(t, "cost", 100, PRESETS["smollm2-135m"])
    assert r["cached_tokens"] == 32  # only the third request, under salt "a"


def test_interleave_round_robin() -> None:
    sessions = [["a0", "a1", "a2"], ["b0"], ["c0", "c1"]]
    assert trace_mod.interleave(sessions, 2) == ["a0", "b0", "a1", "c0", "a2", "c1"]
    assert trace_mod.interleave(sessions, 1) == ["a0", "a1", "a2", "b0", "c0", "c1"]


def test_driver_outputs_and_oracle_on_top(tmp_path: Path) -> None:
    rows = []
    for i in range(60):  # 6 conversations, interleaved, each turn extends the last
        conv, turn = i % 6, i // 6
        history = list(range(1000 * conv, 1000 * conv + 16 * (turn + 1)))
        rows.append({"token_ids": [conv + 1] * 16 + history + [7], "timestamp": 1000 * i})
    trace = write_jsonl(tmp_path / "t.jsonl", rows)
    out = tmp_path / "out"
    result = load_bench("eviction").run(args_for(trace, out, format="tokens", block_size=16,
                                                 policies="lru,gdsf,s3fifo,cost,belady",
                                                 capacity="0.1,0.3"))
    assert not result.get("error")
    data = json.loads((out / "results.json").read_text())
    records = data["records"]
    assert len(records) == 10 and (out / "results.csv").is_file() and (out / "hit_rate.png").is_file()
    keys = {"policy", "capacity_fraction", "capacity_blocks", "token_hit_rate", "flop_hit_rate",
            "fraction_of_belady", "evicted_blocks", "wall_s"}
    assert all(keys <= set(r) for r in records)
    for frac in (0.1, 0.3):
        rows_at = {r["policy"]: r for r in records if r["capacity_fraction"] == frac}
        best = rows_at["belady"]
        assert best["fraction_of_belady"] == 1.0
        assert all(r["token_hit_rate"] <= best["token_hit_rate"] + 1e-12 for r in rows_at.values())
        assert all(r["token_hit_rate"] <= data["infinite_cache"]["token_hit_rate"] + 1e-12
                   for r in rows_at.values())


def test_driver_reports_bad_input(tmp_path: Path) -> None:
    bench = load_bench("eviction")
    assert "error" in bench.run(args_for(tmp_path / "missing.jsonl", tmp_path / "o"))
    trace = write_jsonl(tmp_path / "t.jsonl", [{"token_ids": [1, 2, 3]}])
    assert "error" in bench.run(args_for(trace, tmp_path / "o", format="tokens", policies="nope"))


def test_swe_agent_loader_counts_and_prefixes() -> None:
    from radixkv.tools.transcripts import DEFAULT_TRANSCRIPTS_DIR, load_source

    if not (DEFAULT_TRANSCRIPTS_DIR / "swe-agent").is_dir():
        pytest.skip("../shared/agent-transcripts not present")
    sessions = load_source("swe-agent")
    assert len(sessions) == 22 and sum(len(s) for s in sessions) == 230  # SOURCES.md
    for session in sessions:
        for prev, cur in zip(session, session[1:]):
            assert cur["messages"][: len(prev["messages"])] == prev["messages"]
    tool = [m for s in sessions for r in s for m in r["messages"] if m["role"] == "tool"]
    assert tool and all(isinstance(m.get("tool_call_id"), str) for m in tool)

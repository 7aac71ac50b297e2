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
from radixkv.tools.data import SHARED_TRACE, TRACE_SAMPLE, SharedDataMissing, sample_path  # noqa: E402
from tests.shared_data import shared_path  # noqa: E402


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


@pytest.mark.shared_data
@pytest.mark.parametrize("data, counts", [("sample", (2, 9)), ("shared", (22, 230))])
def test_swe_agent_loader_counts_and_prefixes(data, counts) -> None:
    from radixkv.tools.transcripts import load_source

    relative = "agent-transcripts/swe-agent"
    path = sample_path(relative) if data == "sample" else shared_path(relative)
    sessions = load_source("swe-agent", path)
    assert (len(sessions), sum(len(s) for s in sessions)) == counts  # SOURCES.md for "shared"
    for session in sessions:
        for prev, cur in zip(session, session[1:]):
            assert cur["messages"][: len(prev["messages"])] == prev["messages"]
    tool = [m for s in sessions for r in s for m in r["messages"] if m["role"] == "tool"]
    assert tool and all(isinstance(m.get("tool_call_id"), str) for m in tool)


@pytest.mark.shared_data
def test_no_trace_runs_the_shipped_mooncake_sample_into_a_new_results_folder(
        tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    bench = load_bench("eviction")
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args(["--policies", "lru,belady", "--capacity", "0.1",
                                          "--jobs", "1"]))
    assert not result.get("error")
    assert result["trace"] == str(sample_path(TRACE_SAMPLE))
    assert (result["format"], result["block_size"], result["model_shape"]) == ("mooncake", 512,
                                                                                "llama3-8b")
    # The first 400 requests of the Mooncake conversation trace (radixkv/tools/data/README.md).
    assert (result["requests"], result["distinct_blocks"]) == (400, 9821)
    assert result["infinite_cache"]["token_hit_rate"] == pytest.approx(780800 / 5710530, rel=1e-12)
    rows = {r["policy"]: r for r in result["records"]}
    assert {p: (r["capacity_blocks"], r["prompt_tokens"], r["cached_tokens"], r["skipped_requests"])
            for p, r in rows.items()} == {"lru": (982, 5710530, 204288, 0),
                                          "belady": (982, 5710530, 678912, 0)}
    (folder,) = (tmp_path / "radixkv-bench-results").iterdir()
    assert folder.name.startswith("eviction-")
    assert sorted(p.name for p in folder.iterdir()) == ["hit_rate.png", "results.csv", "results.json"]
    assert f"wrote radixkv-bench-results/{folder.name}/results.json" in capsys.readouterr().err


@pytest.mark.shared_data
def test_no_arguments_run_pools_where_the_policies_differ(tmp_path: Path, monkeypatch) -> None:
    # On the shipped sample, pools of 2-20 % of its distinct blocks left lru, lfu, fifo, gdsf,
    # s3fifo, cost and predicted-reuse-prior on the same hit rates: a table that taught nothing.
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    bench = load_bench("eviction")
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args([]))
    assert not result.get("error")
    assert result["trace"] == str(sample_path(TRACE_SAMPLE))
    records = result["records"]
    assert sorted({r["capacity_fraction"] for r in records}) == [0.35, 0.5, 0.6, 0.7]
    assert {r["policy"] for r in records} == set(bench.DEFAULT_POLICIES.split(","))
    cached = {(r["policy"], r["capacity_fraction"]): r["cached_tokens"] for r in records}
    assert [cached["lru", f] for f in (0.35, 0.5, 0.6, 0.7)] == [270336, 360960, 515072, 575488]
    assert [cached["gdsf", f] for f in (0.35, 0.5, 0.6, 0.7)] == [246784, 494080, 672256, 733184]
    assert cached["fifo", 0.5] == 457216 and cached["predicted-reuse", 0.35] == 348160
    assert cached["belady", 0.5] == 780800  # the infinite cache's hits
    online = [p for p in bench.DEFAULT_POLICIES.split(",") if not p.startswith("belady")]
    for f in (0.35, 0.5, 0.6, 0.7):
        assert len({cached[p, f] for p in online}) >= 4, f


@pytest.mark.shared_data
def test_shared_reads_the_trace_under_radixkv_shared_dir(tmp_path: Path, monkeypatch) -> None:
    bench = load_bench("eviction")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    monkeypatch.setenv("RADIXKV_SHARED_DIR", str(tmp_path / "shared"))
    (tmp_path / "shared" / "traces").mkdir(parents=True)
    write_jsonl(tmp_path / "shared" / SHARED_TRACE, [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]}])
    result = bench.run(parser.parse_args(["--shared", "--policies", "lru", "--capacity-blocks", "8",
                                          "--jobs", "1", "--out", str(tmp_path / "o")]))
    assert result["trace"] == str(tmp_path / "shared" / SHARED_TRACE)
    assert (result["requests"], result["records"][0]["cached_tokens"]) == (2, 1024)
    # Chat: the source's sample, or its full data under the shared folder.
    assert bench._trace_path(parser.parse_args(["--format", "chat", "--source", "swe-agent"])) == \
        str(sample_path("agent-transcripts/swe-agent"))
    tau = (tmp_path / "shared" / "agent-transcripts" / "tau-bench" / "historical_trajectories"
           / "gpt-4o-airline.json")
    with pytest.raises(SharedDataMissing, match=f"^--shared: {tau} does not exist"):
        bench._trace_path(parser.parse_args(["--format", "chat", "--shared"]))
    tau.parent.mkdir(parents=True)
    tau.write_text("[]")
    assert bench._trace_path(parser.parse_args(["--format", "chat", "--shared"])) == str(tau)
    assert "--trace is required" in bench.run(parser.parse_args(["--format", "tokens"]))["error"]
    with pytest.raises(SystemExit):  # --trace and --shared exclude each other
        parser.parse_args(["--shared", "--trace", "t.jsonl"])


@pytest.mark.shared_data
def test_the_mooncake_sample_is_the_head_of_the_shared_trace() -> None:
    full = shared_path(str(SHARED_TRACE))
    sample = sample_path(TRACE_SAMPLE).read_bytes()
    with open(full, "rb") as f:
        assert sample == b"".join(f.readline() for _ in range(400))
    t = trace_mod.load_trace("mooncake", str(full), 512)
    assert (len(t.requests), t.distinct_blocks) == (12031, 182790)  # SOURCES.md

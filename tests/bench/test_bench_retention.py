"""Think time and retention in the bench drivers: the ``--think-time-s`` / ``--retain-share``
flag types, the think-time clock of ``bench eviction`` (chat schedule and timestamped traces),
and retention replayed on the simulated clock through the cache's retention API (exact cached
tokens per session with and without retention, before and after the TTL)."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pytest

from radixkv.cli import load_bench
from radixkv.cli import main as cli_main

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _arg_types  # noqa: E402
import _eviction_chat as chat_mod  # noqa: E402
import _eviction_replay as replay_mod  # noqa: E402
import _eviction_trace as trace_mod  # noqa: E402

from radixkv.eviction.cost_model import PRESETS  # noqa: E402

SHAPE = PRESETS["smollm2-135m"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- flag types -----------------------------------------------------------------------------

def test_think_time_spec_parses_fixed_and_exponential() -> None:
    assert _arg_types.think_time("30") == _arg_types.ThinkTime("fixed", 30.0)
    assert _arg_types.think_time("fixed:2.5") == _arg_types.ThinkTime("fixed", 2.5)
    spec = _arg_types.think_time("exp:60")
    assert spec == _arg_types.ThinkTime("exp", 60.0) and str(spec) == "exp:60"
    assert str(_arg_types.think_time("0")) == "0"
    # A fixed gap is the value; an exponential draw depends on (seed, session, turn) only.
    assert _arg_types.ThinkTime("fixed", 7.0).draw_s(3, "s", 1) == 7.0
    expected = random.Random("0|s1|2").expovariate(1 / 60)
    assert spec.draw_s(0, "s1", 2) == expected
    assert spec.draw_s(0, "s1", 2) != spec.draw_s(1, "s1", 2) != spec.draw_s(0, "s2", 2)
    for bad in ("", "-1", "exp:-3", "gamma:4", "nan", "inf", "exp:x"):
        with pytest.raises(argparse.ArgumentTypeError, match="S or fixed:S or exp:MEAN"):
            _arg_types.think_time(bad)


def test_share_and_chosen_sessions_are_exact_and_even() -> None:
    assert _arg_types.share("0") == 0.0 and _arg_types.share("1") == 1.0
    for bad in ("-0.1", "1.5", "x", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"in \[0, 1\]"):
            _arg_types.share(bad)
    assert _arg_types.chosen_sessions(8, 0.5) == [False, True] * 4
    assert _arg_types.chosen_sessions(8, 0.25) == [False, False, False, True] * 2
    assert _arg_types.chosen_sessions(3, 0.0) == [False] * 3
    assert _arg_types.chosen_sessions(3, 1.0) == [True] * 3
    assert [sum(_arg_types.chosen_sessions(n, f)) for n, f in ((10, 0.3), (40, 0.25), (7, 0.5))] \
        == [3, 10, 3]
    with pytest.raises(ValueError, match="retain_share"):
        _arg_types.chosen_sessions(3, 1.2)


@pytest.mark.parametrize("flag, value", [("--think-time-s", "exp:-1"), ("--retain-share", "2"),
                                         ("--retain-ttl", "2h")])
def test_eviction_cli_bad_flags_exit_2_naming_the_flag(flag, value, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "eviction", flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


# ---- the think-time clock of bench eviction ---------------------------------------------------

def test_chat_schedule_adds_think_time_to_each_gap() -> None:
    # Two sessions live; turns last 10 tokens x 10 ms; tool latency 1 s; think 5 s (session 0)
    # and 2 s (session 1) before every later turn.
    order = chat_mod.schedule([[10, 10, 10], [10, 10]], 2, 0.01, 1.0,
                              think_s=lambda s, k: 5.0 if s == 0 else 2.0)
    assert [(round(t, 6), s, k) for t, _, s, k in order] == [
        (0.0, 0, 0), (0.0, 1, 0), (3.1, 1, 1), (6.1, 0, 1), (12.2, 0, 2)]


def test_timestamped_trace_think_time_shifts_each_session_cumulatively(tmp_path) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", [
        {"token_ids": [1] * 8, "timestamp": 0, "session": "a"},
        {"token_ids": [2] * 8, "timestamp": 500, "session": "b"},
        {"token_ids": [1] * 12, "timestamp": 1000, "session": "a"},
        {"token_ids": [3] * 8, "timestamp": 1200},
        {"token_ids": [2] * 12, "timestamp": 1500, "session": "b"},
        {"token_ids": [1] * 16, "timestamp": 2000, "session": "a"},
    ])
    t = trace_mod.load_trace("tokens", str(trace), 4, think_time=_arg_types.think_time("10"))
    assert [(r.session, r.time_s) for r in t.requests] == [
        ("a", 0.0), ("b", 0.5), (None, 1.2), ("a", 11.0), ("b", 11.5), ("a", 22.0)]
    assert t.notes["think_time_s"] == "10"
    plain = trace_mod.load_trace("tokens", str(trace), 4)
    assert [r.time_s for r in plain.requests] == [0.0, 0.5, 1.0, 1.2, 1.5, 2.0]


def test_retaining_sessions_in_order_of_first_request(tmp_path) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", [
        {"token_ids": [i] * 8, "timestamp": i, "session": s}
        for i, s in enumerate(["c", "a", "c", "b", "d"])])
    t = trace_mod.load_trace("tokens", str(trace), 4)
    assert replay_mod.retaining_sessions(t, 0.5) == frozenset({"a", "d"})  # 2nd and 4th seen
    assert replay_mod.retaining_sessions(t, 0.0) == frozenset()


def test_merge_retention_pairs_each_replay_with_its_reference() -> None:
    eviction = load_bench("eviction")

    def group(cached, prompt, ideal):
        return {"sessions": 1, "token_hit_rate": cached / prompt, "cached_over_ideal": cached / ideal}

    common = {"policy": "lru", "capacity_blocks": 10}
    with_ret = dict(common, retention_active=True, token_hit_rate=0.5, flop_hit_rate=0.4,
                    groups={"retained": group(95, 200, 100), "not_retained": group(40, 100, 60)})
    reference = dict(common, retention_active=False, token_hit_rate=0.45, flop_hit_rate=0.35,
                     groups={"retained": group(50, 200, 100), "not_retained": group(50, 100, 60)})
    (merged,) = eviction.merge_retention([reference, with_ret], 0.5, "5m")
    assert merged["retained_cached_over_ideal"] == 0.95
    assert merged["retained_cached_over_ideal_no_retention"] == 0.5
    assert (merged["others_token_hit_rate"], merged["others_token_hit_rate_no_retention"]) == (0.4, 0.5)
    assert merged["others_hit_rate_ratio"] == pytest.approx(0.8)
    assert merged["retention_target_met"] is True
    assert (merged["token_hit_rate_no_retention"], merged["flop_hit_rate_no_retention"]) == (0.45, 0.35)
    assert (merged["retain_share"], merged["retain_ttl"]) == (0.5, "5m")


# ---- retention on the simulated clock ---------------------------------------------------------
# B = 4, a pool of 6 blocks (retention budget: half of it, 3 blocks). x and y never retain; a
# does (the second session to appear: what --retain-share 0.5 picks of three). Ideal cached
# tokens: r2 8 (x's first 2 blocks), r4 8 (a's).
#   r0 x [1]*8+[9]             publishes x1 x2
#   r1 a [2]*8+[9]             publishes a1 a2 (a retains them: 2 blocks)
#   r2 x [1]*8+[9]+[5]*4       hits 8, publishes x3; 5 blocks cached, 1 free
#   r3 y [3]*8+[9]             needs 3 blocks: evicts 2. LRU takes a (last used at r1) unless a
#                              is retained, then x's tail x3 x2
#   r4 a [2]*8+[9]+[6]*4       hits 8 if a was kept, else 0
def retention_trace(path: Path, times_s: list[float]) -> Path:
    prompts = [("x", [1] * 8 + [9]), ("a", [2] * 8 + [9]), ("x", [1] * 8 + [9] + [5] * 4),
               ("y", [3] * 8 + [9]), ("a", [2] * 8 + [9] + [6] * 4)]
    return write_jsonl(path, [{"token_ids": toks, "timestamp": 1000 * t, "session": s}
                              for (s, toks), t in zip(prompts, times_s)])


def groups(result: dict) -> dict:
    return {name: (g["requests"], g["prompt_tokens"], g["cached_tokens"], g["ideal_cached_tokens"])
            for name, g in result["groups"].items()}


def test_retained_session_keeps_its_prefix_under_pressure(tmp_path) -> None:
    policy = "lru"
    t = trace_mod.load_trace("tokens", str(retention_trace(tmp_path / "t.jsonl", [0, 1, 2, 3, 4])), 4)
    assert replay_mod.ideal_cached(t) == [0, 0, 8, 0, 8]
    # Peak live working set, at r2: x's 4 blocks (x1 x2 x3 and a partial) and a's 3 (x's r0
    # blocks are its latest request's no more, and y is not live yet).
    assert trace_mod.peak_working_set(t) == 7
    sessions = replay_mod.retaining_sessions(t, 0.5)
    assert sessions == frozenset({"a"})
    kept = replay_mod.replay(t, policy, 6, SHAPE, retention=replay_mod.Retention(sessions, "5m"))
    plain = replay_mod.replay(t, policy, 6, SHAPE,
                              retention=replay_mod.Retention(sessions, "5m", active=False))
    assert kept["retention_active"] is True and plain["retention_active"] is False
    # (requests, prompt tokens, cached tokens, ideal cached tokens) per group
    assert groups(kept) == {"retained": (2, 22, 8, 8), "not_retained": (3, 31, 8, 8)}
    assert groups(plain) == {"retained": (2, 22, 0, 8), "not_retained": (3, 31, 8, 8)}
    assert kept["groups"]["retained"]["cached_over_ideal"] == 1.0
    assert plain["groups"]["retained"]["cached_over_ideal"] == 0.0
    assert kept["cached_tokens"] == 16 and plain["cached_tokens"] == 8
    # Retained: r3 evicts x3 x2, r4 x1. Not: r3 evicts a2 a1, r4 x3 x2 x1.
    assert kept["evicted_blocks"] == 3 and plain["evicted_blocks"] == 5
    stats = kept["retention_stats"]
    assert stats["retained_blocks"] == 3 and stats["max_retained_blocks"] == 3
    assert "retention_stats" not in plain


def test_retention_expires_on_the_trace_clock(tmp_path) -> None:
    # r3 comes 400 s after a's retain at r1: past 5 minutes, within an hour.
    t = trace_mod.load_trace("tokens", str(retention_trace(tmp_path / "t.jsonl",
                                                           [0, 1, 2, 400, 401])), 4)
    sessions = frozenset({"a"})
    five = replay_mod.replay(t, "lru", 6, SHAPE, retention=replay_mod.Retention(sessions, "5m"))
    hour = replay_mod.replay(t, "lru", 6, SHAPE, retention=replay_mod.Retention(sessions, "1h"))
    assert groups(five)["retained"] == (2, 22, 0, 8)  # expired: LRU evicted a at r3
    assert groups(hour)["retained"] == (2, 22, 8, 8)
    assert five["retention_stats"]["expired_total"] == 1  # r1's, at r3; r4's is still live
    assert hour["retention_stats"]["expired_total"] == 0



@pytest.mark.parametrize("policy", ["lfu", "fifo", "gdsf", "s3fifo", "cost", "predicted-reuse"])
def test_no_policy_evicts_a_retained_prefix(tmp_path, policy) -> None:
    t = trace_mod.load_trace("tokens", str(retention_trace(tmp_path / "t.jsonl", [0, 1, 2, 3, 4])), 4)
    kept = replay_mod.replay(t, policy, 6, SHAPE,
                             retention=replay_mod.Retention(frozenset({"a"}), "5m"))
    assert groups(kept)["retained"] == (2, 22, 8, 8)
    assert kept["retention_stats"]["retained_blocks"] == 3


def test_eviction_cli_reports_both_groups_against_a_run_without_retention(tmp_path, capsys) -> None:
    trace = retention_trace(tmp_path / "t.jsonl", [0, 1, 2, 3, 4])
    bench = load_bench("eviction")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--format", "tokens", "--trace", str(trace), "--block-size", "4",
                              "--capacity-blocks", "6", "--policies", "lru", "--jobs", "1",
                              "--retain-share", "0.5", "--retain-ttl", "5m", "--out", str(out)])
    summary = bench.run(args)
    (rec,) = summary["records"]
    assert (summary["retain_share"], summary["retain_ttl"], summary["retaining_sessions"]) == (
        0.5, "5m", ["a"])
    assert summary["max_retained_fraction"] == 0.5
    assert (summary["peak_working_set_blocks"], summary["capacity_basis"]) == (7, "distinct")
    assert (rec["retained_sessions"], rec["other_sessions"]) == (1, 2)
    assert (rec["retained_cached_over_ideal"], rec["retained_cached_over_ideal_no_retention"]) == (
        1.0, 0.0)
    assert rec["others_token_hit_rate"] == rec["others_token_hit_rate_no_retention"] == 8 / 31
    assert rec["others_hit_rate_ratio"] == 1.0 and rec["retention_target_met"] is True
    assert (rec["token_hit_rate"], rec["token_hit_rate_no_retention"]) == (16 / 53, 8 / 53)
    assert rec["groups"]["retained"]["cached_tokens"] == 8
    assert rec["groups_no_retention"]["retained"]["cached_tokens"] == 0
    assert rec["retention_stats"]["retained_blocks"] == 3
    printed = capsys.readouterr().out
    assert "kept/ideal" in printed and "1.0000  0.0000" in printed
    saved = json.loads((out / "results.json").read_text())
    assert saved["records"][0]["others_hit_rate_ratio"] == 1.0
    header = (out / "results.csv").read_text().splitlines()[0]
    assert header.endswith("flop_hit_rate_no_retention,retention_target_met")


def test_eviction_cli_retain_share_needs_sessions(tmp_path, capsys) -> None:
    trace = retention_trace(tmp_path / "t.jsonl", [0, 1, 2, 3, 4])
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "eviction", "--format", "tokens", "--trace", str(trace),
                  "--block-size", "4", "--no-sessions", "--retain-share", "0.5",
                  "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "--retain-share needs session keys" in capsys.readouterr().err


def test_eviction_cli_capacity_of_the_working_set(tmp_path) -> None:
    trace = retention_trace(tmp_path / "t.jsonl", [0, 1, 2, 3, 4])
    bench = load_bench("eviction")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--format", "tokens", "--trace", str(trace), "--block-size", "4",
                              "--capacity", "0.5,1", "--capacity-basis", "working-set",
                              "--policies", "lru", "--jobs", "1", "--out", str(tmp_path / "o")])
    summary = bench.run(args)
    assert summary["capacity_basis"] == "working-set"
    assert [(r["capacity_fraction"], r["capacity_blocks"]) for r in summary["records"]] == [
        (0.5, 4), (1.0, 7)]  # round(0.5 * 7) = 4 (half to even)

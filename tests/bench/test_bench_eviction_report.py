"""``radixkv bench eviction`` report fields: exact hits, the gap arithmetic against the
better oracle, the policy-hook timer, session keys and durations handed to the cache, and the
modeled chat clock on a two-session fixture."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import pytest

from radixkv.cli import load_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _eviction_chat as chat_mod  # noqa: E402
import _eviction_replay as replay_mod  # noqa: E402
import _eviction_report as report_mod  # noqa: E402
import _eviction_timing as timing_mod  # noqa: E402
import _eviction_trace as trace_mod  # noqa: E402

from radixkv.cache.manager import CacheManager  # noqa: E402
from radixkv.eviction.cost_model import PRESETS, prefill_flops  # noqa: E402

OPENHANDS = Path(__file__).resolve().parents[1] / "data" / "openhands"
SHAPE = PRESETS["smollm2-135m"]
SEQ = "ABACBDEFDE"


def tiny_trace(tmp_path: Path) -> Path:
    """Ten 9-token prompts (block 4: two full blocks + a private tail; hit cap 2 blocks) over six
    8-token prefixes in the order ``SEQ``, each with its own last token and session key."""
    rows = [{"token_ids": [100 * (ord(ch) - 64) + j for j in range(8)] + [1000 + i],
             "session": ch, "output_length": i}
            for i, ch in enumerate(SEQ)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_exact_hits_fraction_and_gap_on_a_hand_made_trace(tmp_path: Path) -> None:
    # Pool of 5 blocks: a request holds 3 while served, so each miss after the second request
    # evicts one whole 2-block prefix.
    # lru:    A hits at 2; then C evicts B, B evicts A, D..E each evict the oldest: 1 hit, and
    #         every request from C on evicts 2 blocks (7 x 2 = 14).
    # fifo:   C evicts A (inserted first, its hit does not count), so B hits at 4; D..E miss:
    #         2 hits, evictions at C, D, E, F, D, E (12 blocks).
    # belady: A at 2; C evicts A (never again) so B hits; F evicts E (next use 9) not D (8), so
    #         D hits at 8: 3 hits, evictions at C, D, E, F, E (10 blocks).
    t = trace_mod.load_trace("tokens", str(tiny_trace(tmp_path)), 4)
    oracle = replay_mod.Oracle(t)
    runs = {p: replay_mod.replay(t, p, 5, SHAPE, oracle=oracle if p in replay_mod.ORACLES
                                 else None)
            for p in ("lru", "fifo", "belady", "belady-cost")}
    assert {p: (r["cached_tokens"], r["evicted_blocks"]) for p, r in runs.items()} == {
        "lru": (8, 14), "fifo": (16, 12), "belady": (24, 10), "belady-cost": (24, 10)}
    f8, f9 = prefill_flops(SHAPE, 0, 8), prefill_flops(SHAPE, 0, 9)
    for p, hits in (("lru", 1), ("fifo", 2), ("belady", 3)):
        assert runs[p]["flop_hit_rate"] == pytest.approx(hits * f8 / (10 * f9), rel=1e-12)
        assert runs[p]["token_hit_rate"] == pytest.approx(8 * hits / 90, rel=1e-12)
    # belady-cost also keeps 24 tokens but partly as one-block hits (cheaper blocks), so its
    # FLOP hit is lower and belady is the better oracle here.
    assert runs["belady-cost"]["flop_hit_rate"] < runs["belady"]["flop_hit_rate"]
    records = report_mod.annotate(list(runs.values()))
    got = {r["policy"]: (r["best_oracle"], r["fraction_of_belady"], r["gap_closed"])
           for r in records}
    assert {p: v[0] for p, v in got.items()} == dict.fromkeys(runs, "belady")
    # fifo: (2 - 1) / (3 - 1) of the gap, 2/3 of belady (the per-hit FLOPs cancel out).
    assert got["fifo"][1:] == pytest.approx((2 / 3, 0.5), rel=1e-12)
    assert got["lru"][1:] == pytest.approx((1 / 3, 0.0), abs=1e-12)
    assert got["belady"][1:] == (1.0, 1.0)
    bc = runs["belady-cost"]["flop_hit_rate"]
    assert got["belady-cost"][2] == pytest.approx(
        (bc - runs["lru"]["flop_hit_rate"]) / (runs["belady"]["flop_hit_rate"]
                                               - runs["lru"]["flop_hit_rate"]), rel=1e-12)
    for r in runs.values():  # hook time per evicted block, from the same unrounded sum
        assert r["policy_us_per_eviction"] == pytest.approx(
            1e6 * r["policy_hook_s"] / r["evicted_blocks"], abs=0.05)
        assert r["hook_calls"] > 0 and r["train_cpu_s"] is None


def test_annotate_picks_the_better_oracle_and_guards_the_gap() -> None:
    def rec(policy, rate, cap=10):
        return {"policy": policy, "capacity_blocks": cap, "flop_hit_rate": rate}

    rows = report_mod.annotate([rec("lru", 0.2), rec("cost", 0.35), rec("belady", 0.5),
                                rec("belady-cost", 0.6), rec("lru", 0.4, 20),
                                rec("belady", 0.4, 20), rec("cost", 0.3, 30)])
    cost = rows[1]
    assert (cost["best_oracle"], cost["best_oracle_flop_hit_rate"]) == ("belady-cost", 0.6)
    assert cost["gap_closed"] == pytest.approx((0.35 - 0.2) / (0.6 - 0.2), rel=1e-12)
    assert cost["fraction_of_belady"] == pytest.approx(0.35 / 0.6, rel=1e-12)
    assert rows[4]["gap_closed"] is None  # the oracle is not above LRU at 20 blocks
    assert (rows[6]["best_oracle"], rows[6]["fraction_of_belady"], rows[6]["gap_closed"]) == (
        None, None, None)  # neither oracle nor LRU run at 30 blocks
    assert report_mod.gap_closed(0.1, 0.2, 0.6) == pytest.approx(-0.25)
    assert report_mod.gap_closed(0.9, 0.9058, 0.9059) is None  # both at the infinite cache


def test_hook_timer_counts_outer_calls_once(monkeypatch) -> None:
    ticks = iter(range(100))
    monkeypatch.setattr(timing_mod.time, "perf_counter", lambda: float(next(ticks)))

    class Fake:
        train_cpu_s = 3.0
        background_train_cpu_s = 1.0

        def priority(self, node):
            return node

        def on_evict(self, node, n):
            return self.priority(node)  # nested: counted, not timed twice

    policy = timing_mod.HookTimer()
    fake = policy.install(Fake())
    assert fake.on_evict(7, 1) == 7 and fake.priority(8) == 8 and fake.priority(9) == 9
    assert policy.calls == {"priority": 3, "on_evict": 1}
    assert policy.seconds == {"priority": 2.0, "on_evict": 1.0}  # one tick per outer call
    cost = timing_mod.policy_cost(policy, fake, evicted_blocks=4)
    assert cost == {"policy_hook_s": 3.0, "policy_us_per_eviction": 750000.0,
                    "train_cpu_s": 3.0, "background_train_cpu_s": 1.0,
                    "sync_train_cpu_s": 2.0, "hook_calls": 4}
    assert timing_mod.policy_cost(policy, object(), 0)["policy_us_per_eviction"] is None


def test_learned_policies_train_synchronously_with_a_seed() -> None:
    assert replay_mod.policy_kwargs("predicted-reuse") == {"train_mode": "sync", "seed": 0}
    assert replay_mod.policy_kwargs("predicted-reuse-prior") == {"train_mode": "sync", "seed": 0}
    assert replay_mod.policy_kwargs("cost") == {}


def test_learned_policy_replays_and_reports_its_training(tmp_path: Path) -> None:
    t = trace_mod.load_trace("tokens", str(tiny_trace(tmp_path)), 4)
    r = replay_mod.replay(t, "predicted-reuse", 5, SHAPE)
    assert r["train_cpu_s"] is not None and r["background_train_cpu_s"] == 0.0
    assert r["evicted_blocks"] > 0 and r["policy_us_per_eviction"] is not None


def test_sessions_and_end_times_reach_the_cache(tmp_path: Path, monkeypatch) -> None:
    seen = []

    class Spy(CacheManager):
        def begin(self, request_id, root, prompt, *, session_key=None, **kw):
            seen.append(("begin", session_key))
            return super().begin(request_id, root, prompt, session_key=session_key, **kw)

        def release(self, request_id, *, end_s=None):
            seen.append(("release", end_s))
            return super().release(request_id, end_s=end_s)

    monkeypatch.setattr(replay_mod, "CacheManager", Spy)
    t = trace_mod.load_trace("tokens", str(tiny_trace(tmp_path)), 4, itl_ms=500)
    replay_mod.replay(t, "lru", 5, SHAPE)
    # Request i (clock i: its ordinal) decodes output_length = i tokens at 0.5 s each.
    assert seen[0::2] == [("begin", ch) for ch in SEQ]
    assert seen[1::2] == [("release", pytest.approx(i + 0.5 * i)) for i in range(10)]


def test_the_swapped_in_policy_hears_the_ghost_list(tmp_path: Path, monkeypatch) -> None:
    from radixkv.eviction.lru import LRUPolicy

    heard: dict[str, list] = {"drop": [], "hit": []}

    class NotingLRU(LRUPolicy):
        def on_evict(self, node, num_blocks):
            return ("evicted", node.uid)

        def on_ghost_drop(self, notes):
            heard["drop"].extend(notes)

        def on_ghost_hit(self, node, notes):
            heard["hit"].extend(notes)

    monkeypatch.setattr(replay_mod, "make_policy", lambda name, **kw: NotingLRU())
    monkeypatch.setattr(replay_mod, "GHOST_BLOCKS", 2)
    t = trace_mod.load_trace("tokens", str(tiny_trace(tmp_path)), 4)
    r = replay_mod.replay(t, "lru", 5, SHAPE)
    assert r["cached_tokens"] == 8  # the subclass evicts as lru does
    # B, evicted at request 3 and asked for at 4, comes back from the ghost list; runs pushed
    # out of its two blocks reach on_ghost_drop (the notes of the swapped-in policy).
    assert heard["hit"] and heard["drop"]
    assert all(n[0] == "evicted" for n in heard["drop"] + heard["hit"])


def test_mooncake_sessions_from_hash_chains_and_durations(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"timestamp": 0, "input_length": 1500, "output_length": 100, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 2000, "output_length": 50, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 900, "input_length": 100, "output_length": 10, "hash_ids": [0]},
        {"timestamp": 1000, "input_length": 600, "hash_ids": [0, 4]}]))
    t = trace_mod.load_trace("mooncake", str(path), 512)
    assert [(r.time_s, r.session, r.duration_s) for r in t.requests] == [
        (0.0, "m1", pytest.approx(2.0)), (0.5, "m1", pytest.approx(1.0)),
        (0.9, None, pytest.approx(0.2)), (1.0, "m4", 0.0)]
    t = trace_mod.load_trace("mooncake", str(path), 512, itl_ms=10, sessions=False,
                             max_requests=2)
    assert [(r.session, r.duration_s) for r in t.requests] == [(None, pytest.approx(1.0)),
                                                               (None, pytest.approx(0.5))]


class FakeTokenizer:
    """One token per character; a message is its role's id, its characters, then 9."""

    ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 4}

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tools=None) -> list[int]:
        out = []
        for m in messages:
            out += [self.ROLES[m["role"]], *self.encode(m["content"]), 9]
        return out


def test_schedule_two_sessions_exact() -> None:
    # Session 0 decodes 13 then 4 tokens, session 1 8 then 10; ITL 20 ms, tool latency 1 s.
    both = chat_mod.schedule([[13, 4], [8, 10]], 2, 0.02, 1.0)
    assert [(s, k) for _, _, s, k in both] == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert [x for a, d, _, _ in both for x in (a, d)] == pytest.approx(
        [0.0, 0.26, 0.0, 0.16, 1.16, 0.2, 1.26, 0.08])
    one = chat_mod.schedule([[13, 4], [8, 10]], 1, 0.02, 1.0)  # session 1 waits for the slot
    assert [(s, k) for _, _, s, k in one] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [a for a, _, _, _ in one] == pytest.approx([0.0, 1.26, 1.34, 2.5])
    exp = chat_mod.schedule([[1, 1, 1]], 1, 0.0, 1.0, dist="exp", seed=0)
    assert exp == chat_mod.schedule([[1, 1, 1]], 1, 0.0, 1.0, dist="exp", seed=0)  # seeded
    assert exp[1][0] > 0 and exp[2][0] > exp[1][0] and exp[1][0] != 1.0
    with pytest.raises(ValueError, match="concurrency"):
        chat_mod.schedule([[1]], 0, 0.02, 1.0)


def test_chat_trace_clock_on_the_openhands_fixture(tmp_path: Path) -> None:
    tok = FakeTokenizer()
    sessions = chat_mod.tokenize_sessions("openhands", str(OPENHANDS), tok, str(tmp_path))
    assert [(sid, [t.output_tokens for t in turns]) for sid, turns in sessions] == [
        ("AgentA/test_one", [13, 4]), ("AgentB/test_two", [8, None])]  # "I will run ls", ...
    assert len(sessions[0][1][0].prompt) == 4 * (1 + 5 + 1 + 1 + 8 + 1)  # "SYS A", "Task one"
    (cached,) = tmp_path.glob("chat-openhands-*.pkl")
    assert chat_mod.tokenize_sessions("openhands", str(OPENHANDS), tok, str(tmp_path)) == sessions
    t = chat_mod.chat_trace("openhands", sessions, 4, concurrency=2, itl_ms=20,
                            tool_latency_ms=1000, default_output_tokens=10)
    assert [(r.session, r.time_s, r.duration_s) for r in t.requests] == [
        ("AgentA/test_one", 0.0, pytest.approx(0.26)), ("AgentB/test_two", 0.0, pytest.approx(0.16)),
        ("AgentB/test_two", pytest.approx(1.16), pytest.approx(0.2)),
        ("AgentA/test_one", pytest.approx(1.26), pytest.approx(0.08))]
    assert t.requests[3].tokens == sessions[0][1][1].prompt
    assert (t.notes["unknown_replies"], t.notes["modeled_span_s"]) == (1, 1.36)
    bare = chat_mod.chat_trace("openhands", sessions, 4, concurrency=2, itl_ms=20,
                               tool_latency_ms=1000, with_sessions=False)
    assert {r.session for r in bare.requests} == {None}


def test_driver_writes_the_new_fields(tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    bench = load_bench("eviction")
    bench.add_arguments(parser)
    out = tmp_path / "o"
    result = bench.run(parser.parse_args([
        "--trace", str(tiny_trace(tmp_path)), "--format", "tokens", "--block-size", "4",
        "--policies", "lru,fifo,belady,belady-cost", "--capacity-blocks", "5", "--jobs", "1",
        "--model-shape", "smollm2-135m", "--out", str(out), "--label", "tiny"]))
    assert not result.get("error")
    rows = {r["policy"]: r for r in json.loads((out / "results.json").read_text())["records"]}
    assert {p: (r["cached_tokens"], r["best_oracle"]) for p, r in rows.items()} == {
        "lru": (8, "belady"), "fifo": (16, "belady"), "belady": (24, "belady"),
        "belady-cost": (24, "belady")}
    assert rows["fifo"]["gap_closed"] == pytest.approx(0.5, rel=1e-12)
    with open(out / "results.csv") as f:
        header = next(csv.reader(f))
    assert {"gap_closed", "best_oracle", "policy_us_per_eviction",
            "background_train_cpu_s"} <= set(header)
    assert result["label"] == "tiny" and result["session_keys"] == 6
    md = report_mod.suite_markdown([result])
    assert "| tiny | " in md and "**0.178**" in md  # fifo, the best online policy, in bold
    assert "gap = (p - lru) / (best - lru)" in capsys.readouterr().out
    err = bench.run(parser.parse_args(["--format", "chat", "--source", "openhands"]))["error"]
    assert "no sample of openhands is shipped" in err

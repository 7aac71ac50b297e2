"""``radixkv plan --trace``: the replay through radixkv's own tree and pool, on hand-sized
sessions (every value worked by hand) and on the shipped tau-bench sample."""

from __future__ import annotations

import argparse
import json

import pytest

from radixkv.tools.plan.command import add_arguments, main
from radixkv.tools.plan.replay import percentile, replay_sessions

A8 = list(range(1, 9))  # 8 tokens: two blocks of 4


def test_a_later_turn_hits_the_earlier_turns_blocks_under_the_hit_cap() -> None:
    # K/V is held for every token but the last sampled one. Turn 1: 8 prompt + 1 output slots
    # = 3 blocks (3 slots of waste). Turn 2: 12 prompt tokens, of which floor(11 / 4) = 2
    # blocks (8 tokens) hit; 13 slots -> 4 blocks, 2 of them the cached prefix: 4 blocks used at
    # the peak. Waste: (3 + 3) / (12 + 16) slots.
    r = replay_sessions([[A8, list(range(1, 13))]], num_blocks=100, block_size=4, max_tokens=2)
    assert (r.num_requests, r.num_prompt_tokens, r.num_cached_tokens) == (2, 20, 8)
    assert r.token_hit_rate == 0.4
    assert (r.peak_used_blocks, r.peak_live_blocks) == (4, 4)
    assert r.tail_waste_fraction == 6 / 28
    assert r.allocation_failures == 0


def test_a_later_request_of_a_wave_hits_the_prefix_an_earlier_one_prefills() -> None:
    sessions = [[A8], [A8 + [50, 51]]]
    one = replay_sessions(sessions, num_blocks=100, block_size=4, max_tokens=0, concurrency=1)
    two = replay_sessions(sessions, num_blocks=100, block_size=4, max_tokens=0, concurrency=2)
    # One at a time: the second session's prompt hits the first's 2 blocks; 3 blocks at most.
    assert (one.num_cached_tokens, one.peak_used_blocks) == (8, 3)
    # Together: the scheduler defers the second until the first's prefill is published, so it
    # hits the same 2 blocks; both live at once hold 2 shared + 1 private = 3 blocks.
    assert (two.num_cached_tokens, two.peak_used_blocks, two.peak_live_blocks) == (8, 3, 3)


def test_allocation_failure_is_counted_and_served_without_a_hit() -> None:
    # 2 blocks for the first session, 3 for the unrelated second: 5 > 4 blocks at once.
    r = replay_sessions([[A8], [list(range(100, 112))]], num_blocks=4, block_size=4, max_tokens=0,
                        concurrency=2)
    assert (r.allocation_failures, r.num_cached_tokens, r.peak_used_blocks) == (1, 0, 2)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([0.0, 10.0], 50) == 5.0
    assert percentile([3.0, 1.0, 2.0], 90) == pytest.approx(2.8)
    assert percentile([], 50) is None


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="radixkv plan")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_tau_bench_sample_one_session_at_a_time_reaches_the_ideal_hit(capsys) -> None:
    from radixkv.tools.plan.trace_input import trace_prompts
    from radixkv.tools.transcripts import ideal_cached_tokens

    code = main(_parse(["--model", "SmolLM2-135M-Instruct", "--trace", "tau-bench",
                        "--max-tokens", "0", "--kv-memory-gib", "4", "--json"]))
    replay = json.loads(capsys.readouterr().out)["replay"]
    assert code == 0
    prompts = [p for s in trace_prompts("tau-bench") for p in s]
    # A pool far larger than the sample (5,825 blocks of 16) and one request at a time: every
    # reusable block of every earlier prompt is still cached.
    assert replay["num_blocks"] == 4 * (1 << 30) // (16 * 46_080) == 5825
    assert (replay["num_sessions"], replay["num_requests"]) == (3, 31)
    assert replay["num_prompt_tokens"] == sum(len(p) for p in prompts)
    assert replay["num_cached_tokens"] == sum(ideal_cached_tokens(prompts, 16))
    assert replay["allocation_failures"] == 0


def test_trace_flags_are_checked(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(["--model", "x", "--trace", "sharegpt"])
    assert exc.value.code == 2
    assert "--trace: invalid choice: 'sharegpt'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["--model", "x", "--trace", "tau-bench", "--concurrency", "0"])
    assert "--concurrency: expected an int >= 1" in capsys.readouterr().err

"""``bench/eviction_conversation_bound.py``: the per-request features read only earlier
requests (exact values on a four-request trace), and ``cost`` with a given P keeps the leaf
whose releasing request has the larger P."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _eviction_replay as replay_mod  # noqa: E402
import _eviction_trace as trace_mod  # noqa: E402
import eviction_conversation_bound as bound  # noqa: E402
import eviction_tier_bounds as tier_bounds  # noqa: E402

from radixkv.cache.hashing import pack_tokens  # noqa: E402
from radixkv.eviction.cost_model import get_shape  # noqa: E402

B = 4
A = list(range(1, 33))  # 8 blocks
C = list(range(101, 133))  # 8 blocks, another conversation


def conversation() -> trace_mod.Trace:
    """A at 0 (8 blocks), A + 4 blocks at 10, C at 20, A + 8 blocks at 25; durations 1 s."""
    return trace_mod.trace_from_prompts("four", "mooncake", B, [
        (0.0, None, pack_tokens(A), None, 1.0),
        (10.0, None, pack_tokens(A + list(range(33, 49))), None, 1.0),
        (20.0, None, pack_tokens(C), None, 1.0),
        (25.0, None, pack_tokens(A + list(range(33, 65))), None, 1.0),
    ])


def test_features_and_next_request() -> None:
    X, next_s = bound.features(conversation())
    assert X.shape == (4, len(bound.FEATURES))
    # prompt_blocks, duration_s, turn, parent_gap_s, grandparent_gap_s, matched_blocks,
    # deepest_block_uses, second_block_uses, conversation_requests, conversation_age_s,
    # new_blocks
    assert X.tolist() == [
        [8, 1, 0, -1, -1, 0, 0, 0, 0, 0, -1],
        [12, 1, 1, 10, -1, 8, 1, 1, 1, 10, 4],
        [8, 1, 0, -1, -1, 0, 0, 0, 0, 0, -1],
        [16, 1, 2, 15, 10, 12, 1, 2, 2, 25, 4],
    ]
    assert next_s[:2].tolist() == [10.0, 15.0]
    assert math.isinf(next_s[2]) and math.isinf(next_s[3])


def two_leaves() -> trace_mod.Trace:
    """A and C (8 blocks each) fill a 16-block pool; D (8 blocks) at 2 evicts one of them;
    A comes back at 3."""
    d = list(range(201, 233))
    return trace_mod.trace_from_prompts("two-leaves", "mooncake", B, [
        (0.0, None, pack_tokens(A), None, 0.1),
        (1.0, None, pack_tokens(C), None, 0.1),
        (2.0, None, pack_tokens(d), None, 0.1),
        (3.0, None, pack_tokens(A), None, 0.1),
    ])


def replay_given(p_by_request: list[float]) -> dict:
    t = two_leaves()
    shape = get_shape("llama3-8b")
    index = replay_mod.Oracle(t)
    policy = bound.GivenCreditPolicy(shape, np.asarray(p_by_request),
                                     lambda: index.current)
    return tier_bounds.replay_with(t, policy, "given", 16, shape, index)


def test_given_credit_keeps_the_leaf_of_larger_p() -> None:
    # cost alone evicts A (older, same credit); A's return then misses.
    cost = replay_mod.replay(two_leaves(), "cost", 16, get_shape("llama3-8b"))
    assert cost["cached_tokens"] == 0
    # A released with P = 1, C with 0.01: D evicts C's 8 blocks, and A's return hits 7 blocks
    # (hit cap N - 1); its recomputed last block takes one of D's.
    keep_a = replay_given([1.0, 0.01, 0.5, 0.5])
    assert keep_a["cached_tokens"] == 28
    assert keep_a["evicted_blocks"] == 8 + 1
    swap = replay_given([0.01, 1.0, 0.5, 0.5])
    assert swap["cached_tokens"] == 0

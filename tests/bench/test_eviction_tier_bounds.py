"""``bench/eviction_tier_bounds.py``: the live tier ordered by the oracle's next use evicts the
live leaf whose session never comes back, where ``predicted-reuse`` (latest release first)
evicts the one that does; its tiers otherwise hold the policy's own state exactly."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _eviction_replay as replay_mod  # noqa: E402
import _eviction_trace as trace_mod  # noqa: E402
import eviction_tier_bounds as bounds  # noqa: E402

from radixkv.cache.hashing import pack_tokens  # noqa: E402
from radixkv.eviction.cost_model import get_shape  # noqa: E402

B = 4


def trace() -> trace_mod.Trace:
    """Session b (8 blocks) is released at 0.1 and never returns; session a (8 blocks) is
    released at 0.3 and returns at 1.3 with 4 more blocks; session c (8 blocks) arrives at 0.5
    and needs a 16-block pool's room (one session's 8 blocks)."""
    pa = list(range(1, 33))
    pb = list(range(101, 133))
    pc = list(range(201, 233))
    return trace_mod.trace_from_prompts("two-sessions", "chat", B, [
        (0.0, None, pack_tokens(pb), "b", 0.1),
        (0.2, None, pack_tokens(pa), "a", 0.1),
        (0.5, None, pack_tokens(pc), "c", 0.1),
        (1.3, None, pack_tokens(pa + list(range(33, 49))), "a", 0.1),
    ])


def replay(policy_or_name, name: str) -> dict:
    t = trace()
    shape = get_shape("smollm2-135m")
    if isinstance(policy_or_name, str):
        return replay_mod.replay(t, policy_or_name, 16, shape)
    oracle = replay_mod.Oracle(t)
    return bounds.replay_with(t, policy_or_name(shape, oracle.next_use), name, 16, shape, oracle)


def test_live_oracle_keeps_the_returning_session() -> None:
    saved = replay_mod.ORACLES
    replay_mod.ORACLES = tuple(saved) + tuple(bounds.BOUNDS)
    try:
        own = replay("predicted-reuse", "predicted-reuse")
        live = replay(lambda s, nu: bounds.TierOraclePolicy(s, nu, False, True), "oracle-live")
        overdue = replay(lambda s, nu: bounds.TierOraclePolicy(s, nu, True, False),
                         "oracle-overdue")
    finally:
        replay_mod.ORACLES = saved
    # predicted-reuse evicts a (released last: furthest predicted next use), so a's return
    # (48 tokens, hit cap 44) finds nothing; the live oracle evicts b and a's 8 blocks hit.
    assert (own["cached_tokens"], live["cached_tokens"]) == (0, 32)
    assert own["prompt_tokens"] == live["prompt_tokens"] == 3 * 32 + 48
    # No leaf is overdue before the first return gap is learned: the overdue oracle changes
    # nothing.
    assert overdue["cached_tokens"] == own["cached_tokens"]
    assert overdue["evicted_blocks"] == own["evicted_blocks"]

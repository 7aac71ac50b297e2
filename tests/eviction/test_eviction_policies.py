"""Eviction order of every registered policy on small hand-built radix trees, leaf-first
eviction under random workloads, GreedyDual inflation, S3-FIFO queues and the oracles."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from radixkv.cache.hashing import BlockHasher, CacheIdentity
from radixkv.cache.manager import CacheManager
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.eviction import available_policies, get_policy, make_policy
from radixkv.eviction.cost_model import CostShape

B = 4
# A toy shape where attention dominates, so depth visibly changes a block's recompute cost:
# 20 FLOPs per token (linear) + 4 per visible key.
TINY = CostShape("tiny", num_layers=1, hidden_size=1, intermediate_size=1, num_q_heads=1,
                 num_kv_heads=1, head_dim=1)

SYS = [9] * 4 + [8] * 4
A = [1] * 4 + [1, 1, 1, 2]
SCENARIO = [  # (clock, prompt tokens before the 1-token tail, ids of its new blocks)
    (1.0, SYS + A, [10, 11, 12, 13]),     # one node X = sys + a
    (2.0, SYS + [5] * 4, [14]),           # splits X into S = sys (hit) and A = a; new leaf B
    (3.0, [7] * 8, [20, 21]),             # C under the root
    (4.0, SYS + A + [6] * 4, [15]),       # hits S and A, A grows in place to 3 blocks
    (5.0, [3] * 4, [30]),                 # D
    (6.0, [7] * 8, []),                   # hits C
]
# Tail block id -> request index of its next use (for the oracles).
NEXT = {15: 100, 13: 100, 12: 100, 14: 50, 21: math.inf, 20: 10, 30: 70, 11: 5, 10: 5}


class Served:
    """A radix tree driven like the engine drives it, one whole request at a time."""

    def __init__(self, policy) -> None:
        self.now = [0.0]
        self.tree = RadixTree(B, policy, clock=lambda: self.now[0])
        self.root = self.tree.root(b"root")
        self.hasher = BlockHasher()

    def serve(self, t: float, tokens: list[int], new_ids: list[int], hold: bool = False):
        self.now[0] = t
        prompt = tokens + [0]
        m = self.tree.match(self.root, prompt, (len(prompt) - 1) // B)
        self.tree.lock(m.node)
        node, k = m.node, len(m.block_ids)
        if new_ids:
            node = self.tree.insert(node, tokens[k * B :], new_ids, self.hasher).node
        if not hold:
            self.tree.unlock(node)
        return node

    def evictable_tails(self) -> set[int]:
        return {n.block_ids[-1] for n in self.tree.iter_nodes()
                if not n.children and n.lock_ref == 0}

    def drain(self, cursors: tuple = ()) -> list[int]:
        """Evict one block at a time; each must be the tail of an unlocked childless node."""
        order = []
        while True:
            allowed = self.evictable_tails()
            freed = self.tree.evict(1)
            if not freed:
                assert not allowed
                return order
            assert freed[0] in allowed, f"evicted block {freed[0]} of a node with children"
            order.append(freed[0])
            self.tree.check_integrity(list(cursors))


def build(policy_name: str) -> Served:
    kwargs = {}
    if policy_name in ("belady", "belady-cost"):
        kwargs = {"next_use": lambda node: NEXT[node.block_ids[-1]], "now": lambda: 0.0}
    served = Served(make_policy(policy_name, model_shape=TINY, **kwargs))
    for t, tokens, ids in SCENARIO:
        served.serve(t, tokens, ids)
    return served


EXPECTED = {
    # (last_access, -depth, created): B@2, A@4 (tail first), then S becomes a leaf @4, D@5, C@6.
    "lru": [14, 15, 13, 12, 11, 10, 30, 21, 20],
    # hits: B 0, D 0, A 1, C 1; S (2 hits) only once A is gone.
    "lfu": [14, 30, 15, 13, 12, 21, 20, 11, 10],
    # created: A (X) 1, B 2, S waits for B, C 3, D 5.
    "fifo": [15, 13, 12, 14, 11, 10, 21, 20, 30],
    # H = L + (hits+1)·C/S with TINY: D 120, B 248, C 304, A 624, S 456 (after A).
    "gdsf": [30, 14, 21, 20, 15, 13, 12, 11, 10],
    # S holds X(hit), B, C(hit), D; M holds the split head S. B and D go (X, C promoted), then
    # M in FIFO order: X (freq 0), C, and S after CLOCK passes.
    "s3fifo": [14, 30, 15, 13, 12, 21, 20, 11, 10],
    # Farthest next use of the tail block first (C's tail never again).
    "belady": [21, 15, 13, 12, 30, 14, 20, 11, 10],
    # GreedyDual with credit C_tail / (next use - now): C's tail (never used) is worth 0; D
    # (use at 70, shallow) is worth less than A's deep tail (use at 100) and B (use at 50).
    "belady-cost": [21, 30, 15, 13, 12, 14, 20, 11, 10],
    # Credits (γ = 1 before any eviction): P = (h+1)/(h+4) times cost per block ÷ c₀:
    # B 0.25·2.07, D 0.25·1.0, A 0.4·2.6, C 0.4·1.27; the drifting clock adds recency, so the
    # never-reused B and D go first, then A (and S behind it, last used at 4) before C (at 6).
    "cost": [14, 30, 15, 13, 12, 11, 10, 21, 20],
    # Two returns seen (A released at 1 and hit at 4, C at 3 and 6): median gap 3, regular.
    # At 6, B (released at 2 < 6 - 1.1 x 3) is overdue and goes first; then the latest
    # release first (furthest predicted next use): C@6, D@5, A@4, S once A is gone.
    "predicted-reuse": [14, 21, 20, 30, 15, 13, 12, 11, 10],
    # No next use predictable: cost's order.
    "predicted-reuse-prior": [14, 30, 15, 13, 12, 11, 10, 21, 20],
}


def test_every_registered_policy_is_pinned() -> None:
    assert set(available_policies()) >= set(EXPECTED)  # (other tests register more)


@pytest.mark.parametrize("policy_name", sorted(EXPECTED))
def test_eviction_order_on_hand_built_tree(policy_name: str) -> None:
    served = build(policy_name)
    assert served.drain() == EXPECTED[policy_name]


def test_scenario_tree_shape() -> None:
    served = build("lru")
    by_tail = {n.block_ids[-1]: n for n in served.tree.iter_nodes()}
    s, a, b, c, d = (by_tail[k] for k in (11, 15, 14, 21, 30))
    assert (a.parent, b.parent, s.num_blocks, a.num_blocks) == (s, s, 2, 3)
    assert [n.hit_count for n in (s, a, b, c, d)] == [2, 1, 0, 1, 0]
    assert [n.last_access_s for n in (s, a, b, c, d)] == [4.0, 4.0, 2.0, 6.0, 5.0]


@pytest.mark.parametrize("policy_name", sorted(EXPECTED))
def test_locked_path_survives_and_parents_wait_for_children(policy_name: str) -> None:
    served = build(policy_name)
    held = served.serve(7.0, SYS + A + [6] * 4, [], hold=True)  # holds S and A
    order = served.drain((held,))
    assert set(order) == {14, 20, 21, 30}
    assert served.tree.num_cached_blocks == 5 and held.num_blocks == 3
    served.tree.unlock(held)
    rest = served.drain()
    assert rest.index(15) < rest.index(11) and rest.index(12) < rest.index(10)


@pytest.mark.parametrize("policy_name", sorted(EXPECTED))
def test_random_workload_evicts_leaves_only(policy_name: str) -> None:
    rng = random.Random(policy_name)
    future = {}
    kwargs = {}
    if policy_name.startswith("belady"):
        kwargs = {"next_use": lambda n: future.setdefault(n.block_ids[-1], rng.random()),
                  "now": lambda: 0.0}
    served = Served(make_policy(policy_name, model_shape=TINY, **kwargs))
    ids = itertools.count()
    held = []
    for step in range(120):
        tokens = []
        for _ in range(rng.randint(1, 4)):
            tokens += [rng.randint(1, 3)] * B
        m = served.tree.match_length(served.root, tokens + [0], len(tokens) // B)
        hold = rng.random() < 0.2
        node = served.serve(float(step), tokens, [next(ids) for _ in range(len(tokens) // B - m)],
                            hold=hold)
        if hold:
            held.append(node)
        if len(held) > 3:
            served.tree.unlock(held.pop(0))
        for _ in range(rng.randint(0, 3)):
            allowed = served.evictable_tails()
            freed = served.tree.evict(1)
            assert (freed[0] in allowed) if freed else not allowed
        served.tree.check_integrity(held)


def test_greedy_dual_credits_interior_access_at_its_time() -> None:
    """A node accessed while interior becomes a leaf later: its L is the one of its access."""
    served = Served(make_policy("gdsf", model_shape=TINY))
    served.serve(1.0, [1] * 8, [0, 1])
    served.serve(2.0, [1] * 8 + [2] * 4, [2])  # grows in place: N = [0, 1, 2]
    served.serve(3.0, [1] * 8 + [3] * 4, [3])  # splits: H = [0, 1] (interior), N = [2], M = [3]
    served.serve(4.0, [5] * 4, [4])            # P
    policy = served.tree.policy
    # Credits (TINY): P 120, M 248, N 2·248 = 496; L rises to each victim's H.
    assert served.tree.evict(3) == [4, 3, 2]
    assert policy.inflation * 1e12 == pytest.approx(496.0)  # credits are in TFLOPs
    served.serve(5.0, [6] * 4, [5])            # Q: L(5) + 120 = 616
    # H became a leaf after the evictions but was accessed at t=3, when L was 0: 0 + 3·152.
    assert policy.level_at(3.0) == 0.0 and policy.level_at(5.0) * 1e12 == pytest.approx(496.0)
    assert served.tree.evict(3) == [1, 0, 5]


def test_cost_credit_grows_with_reuse_and_depth() -> None:
    policy = make_policy("cost", model_shape=TINY)

    class View:  # a NodeView without hashes: no ghost history
        def __init__(self, uid, hits, depth):
            self.uid, self.hit_count, self.depth_tokens = uid, hits, depth
            self.last_access_s = self.created_s = 1.0
            self.num_blocks, self.num_tokens, self.lock_ref = 1, B, 0

    assert policy.gamma == 1.0
    by_hits = [policy.value(View(i, h, 0)) for i, h in enumerate((0, 1, 2, 5))]
    assert by_hits == sorted(by_hits) and by_hits[0] == pytest.approx(0.25)  # Beta(1, 3) prior
    by_depth = [policy.value(View(10 + i, 0, d)) for i, d in enumerate((0, 8, 64))]
    assert by_depth == sorted(by_depth) and by_depth[1] == pytest.approx(0.25 * 248 / 120)


def test_cost_keeps_reuse_history_across_eviction() -> None:
    """A session whose tip was evicted comes back: its new node inherits the old reuses. The
    history travels in the cache's ghost list (the policy keeps no ghost): ``on_evict``'s note
    is kept with the evicted run and handed back by ``on_ghost_hit``."""
    now = [0.0]
    cm = CacheManager(16, B, eviction_policy="cost", model_shape=TINY, clock=lambda: now[0])
    root = cm.identity_root(CacheIdentity("rev", B, "float32", "rope"))
    policy = cm.tree.policy

    def serve(t: float, tokens: list[int]) -> None:
        now[0] = t
        prompt = tokens + [0]
        cm.begin("r", root, prompt)
        assert cm.allocate("r", len(prompt))
        cm.publish("r", prompt, len(prompt))
        cm.release("r")

    serve(1.0, [1] * 8)
    serve(2.0, [1] * 8 + [2] * 4)  # grows in place, h = 1
    assert cm.evict(3) == 3  # the ghost list keeps the run with the note (h = 1, t = 2)
    assert [run.note for run in cm.ghost.parts(cm.ghost.keys()[0])] == [(1, 2.0)]
    serve(9.0, [1] * 8 + [2] * 4 + [3] * 4)
    (node,) = cm.tree.iter_nodes()
    assert node.hit_count == 0 and policy.reuses(node) == 2  # h_old + 1
    # Reuse gaps seen: 1 s (the hit at t=2), then 7 s (the return at t=9), in a running mean.
    assert policy.reuse_gap_s == pytest.approx(1.0 + policy.ewma * (7.0 - 1.0))
    assert policy.priority(node) == cm.tree.leaves.sorted[0][0]  # stable key
    cm.check_integrity(verify_hashes=True)


def test_oracles_refuse_without_the_future() -> None:
    for name in ("belady", "belady-cost"):
        with pytest.raises(ValueError, match="eviction_policy"):
            get_policy(name)


def test_make_policy_passes_shape_only_where_used() -> None:
    assert make_policy("gdsf", model_shape="qwen2.5-7b").shape.name == "qwen2.5-7b"
    assert make_policy("cost", model_shape=TINY).shape is TINY
    assert make_policy("lru", model_shape=TINY).name == "lru"
    assert make_policy("s3fifo", model_shape=TINY).kind == "victims"
    with pytest.raises(ValueError, match="eviction_policy"):
        make_policy("nope", model_shape=TINY)


def test_cost_drift_pressure_scales_the_clock_drift() -> None:
    """``drift_pressure = κ``: the clock drift of ``L`` is scaled by ``min(1, κ·T̂/ĝ)²`` when
    its rate is next set (``cost`` itself keeps κ = 0: a fixed drift)."""
    rates = {}
    for kappa in (0.0, 4.0):
        policy = make_policy("cost", model_shape=TINY)
        policy.drift_pressure = kappa
        policy.reuse_gap_s, policy.mean_victim_idle_s, policy.mean_credit = 100.0, 5.0, 2.0
        policy._restamp(10.0, None)
        rates[kappa] = policy.level_at(30.0) - policy.level_at(10.5)  # L(t) is linear past 10
    # κ = 0: 3 · 2.0 / 5 per second over 19.5 s; κ = 4: times (4 · 5 / 100)² = 0.04.
    assert rates[0.0] == pytest.approx(3 * 2.0 / 5 * 19.5)
    assert rates[4.0] == pytest.approx(rates[0.0] * 0.04)
    policy = make_policy("cost", model_shape=TINY)
    policy.drift_pressure = 4.0
    assert policy.drift_scale() == 1.0  # no means yet
    policy.reuse_gap_s, policy.mean_victim_idle_s = 100.0, 30.0  # 4 · 30 / 100 ≥ 1
    assert policy.drift_scale() == 1.0
    assert make_policy("predicted-reuse", model_shape=TINY).value_policy.drift_pressure == 4.0
    assert make_policy("predicted-reuse-prior", model_shape=TINY).value_policy.drift_pressure == 0.0
    with pytest.raises(ValueError, match="drift_pressure"):
        make_policy("cost", model_shape=TINY, drift_pressure=-1.0)

"""Block-by-block eviction: each evicted block is the tail of the leaf ranked first
when it is taken, so a policy keyed on a leaf's last block keeps a long leaf's reused front."""

from __future__ import annotations

import math

import pytest

from radixkv.cache.hashing import BlockHasher
from radixkv.cache.tree.edit import trim_tail
from radixkv.cache.tree.evict import key_on_trim
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.eviction import make_policy
from radixkv.eviction.cost_model import CostShape
from radixkv.eviction.lru import LRUPolicy

B = 4
TINY = CostShape("tiny", num_layers=1, hidden_size=1, intermediate_size=1, num_q_heads=1,
                 num_kv_heads=1, head_dim=1)


class Tree:
    """A radix tree fed whole requests at given clock readings."""

    def __init__(self, policy) -> None:
        self.now = [0.0]
        self.tree = RadixTree(B, policy, clock=lambda: self.now[0])
        self.root = self.tree.root(b"root")
        self.hasher = BlockHasher()

    def serve(self, t: float, tokens: list[int], new_ids: list[int]):
        self.now[0] = t
        prompt = tokens + [0]
        m = self.tree.match(self.root, prompt, (len(prompt) - 1) // B)
        self.tree.lock(m.node)
        node = m.node
        if new_ids:
            node = self.tree.insert(node, tokens[len(m.block_ids) * B :], new_ids,
                                    self.hasher).node
        self.tree.unlock(node)
        return node

    def held(self) -> dict[int, list[int]]:
        """First block id of each node -> its block ids."""
        return {n.block_ids[0]: list(n.block_ids) for n in self.tree.iter_nodes()}


# ---- a long leaf whose tail is never reused and whose front is --------------------------
LONG = [[100 + j] * B for j in range(8)]  # blocks 0..7
OTHER = [[200 + j] * B for j in range(4)]  # blocks 10..13
# Next use of each block (request index): the long leaf's front soon, its tail never; the
# other leaf later than the front.
NEXT_USE = {**{j: 5.0 for j in range(4)}, **{j: math.inf for j in range(4, 8)},
            **{10 + j: 20.0 for j in range(4)}}


def long_leaf_tree(policy_name: str) -> Tree:
    policy = make_policy(policy_name, model_shape=TINY,
                         next_use=lambda node: NEXT_USE[node.block_ids[-1]], now=lambda: 0.0)
    t = Tree(policy)
    t.serve(1.0, sum(LONG, []), list(range(8)))
    t.serve(2.0, sum(OTHER, []), [10, 11, 12, 13])
    return t


@pytest.mark.parametrize("policy_name", ["belady", "belady-cost"])
def test_long_leaf_keeps_its_reused_front(policy_name: str) -> None:
    """The long leaf's never-reused tail 7..4 goes first; its front (used at 5) then ranks
    after the other leaf (used at 20), which loses 13 and 12. Taking the whole shortfall from
    the long leaf (the rule before) freed 7..2 instead, losing front blocks 3 and 2."""
    t = long_leaf_tree(policy_name)
    evicted: list = []
    assert t.tree.evict(6, evicted) == [7, 6, 5, 4, 13, 12]
    assert t.held() == {0: [0, 1, 2, 3], 10: [10, 11]}
    # One ghost run per leaf, in token order, with the very hashes the nodes held.
    runs = [(run.tokens, len(run.hashes)) for _, run in evicted]
    assert runs == [(b"".join(bytes([100 + j, 0, 0, 0]) * B for j in range(4, 8)), 4),
                    (b"".join(bytes([200 + j, 0, 0, 0]) * B for j in (2, 3)), 2)]
    t.tree.check_integrity()
    # Then the front goes last: the other leaf first (next use 20 after 5).
    assert t.tree.evict(6) == [11, 10, 3, 2, 1, 0]


@pytest.mark.parametrize("policy_name", ["belady", "belady-cost"])
def test_one_call_equals_one_block_at_a_time(policy_name: str) -> None:
    whole, single = long_leaf_tree(policy_name), long_leaf_tree(policy_name)
    assert whole.tree.evict(12) == [b for _ in range(12) for b in single.tree.evict(1)]


# ---- policies keyed on node-level fields: same victims as the rule before ---------------
def reference_whole_shortfall(tree: RadixTree, num_blocks: int) -> list[int]:
    """The earlier rule: the whole shortfall from the first leaf, re-ranked after."""
    freed: list[int] = []
    leaves = tree.leaves
    while len(freed) < num_blocks:
        victim = leaves.first()
        if victim is None:
            break
        take = min(num_blocks - len(freed), victim.num_blocks)
        leaves.remove(victim)
        trim_tail(victim, take, freed, False)
        tree.num_cached_blocks -= take
        tree.policy.on_evict(victim, take)
        if victim.block_ids:
            leaves.add(victim)
            continue
        parent = victim.parent
        del parent.children[victim.key]
        if parent.parent is None:
            holders = tree.root_child_keys[victim.key]
            del holders[parent]
            if not holders:
                del tree.root_child_keys[victim.key]
        victim.parent = None
        tree.num_nodes -= 1
        if parent.parent is not None and not parent.children and parent.lock_ref == 0:
            leaves.add(parent)
    return freed


SYS = [9] * B + [8] * B
SCENARIO = [  # (clock, prompt tokens before the 1-token tail, ids of its new blocks)
    (1.0, SYS + [1] * 12, [0, 1, 2, 3, 4]),                     # X: sys + a 3-block run
    (2.0, SYS + [5] * 4 + [6] * 4 + [7] * 4 + [8] * 4, [10, 11, 12, 13]),  # splits X at sys
    (3.0, [7] * 20, [20, 21, 22, 23, 24]),                      # C under the root
    (4.0, SYS + [1] * 12 + [6] * 8, [5, 6]),                    # hits sys + a, grows a
    (5.0, [3] * 8, [30, 31]),                                   # D
    (6.0, [7] * 20, []),                                        # hits C
]
# Victims (evict 3, 5, 2, then the rest) for each policy, the same under both rules.
SAME_VICTIMS = {
    # Least recently used first: B (2), the grown leaf (4) from its tail, then sys (4, a leaf
    # once both children are gone), D (5), C (6).
    "lru": [13, 12, 11, 10, 6, 5, 4, 3, 2, 1, 0, 31, 30, 24, 23, 22, 21, 20],
    # GDSF: H = L + (hits+1)·C/S; the shallow D goes first; trimming a leaf lowers its
    # C/S (its deepest blocks go), so a leaf once first stays first.
    "gdsf": [31, 30, 13, 12, 11, 10, 24, 23, 22, 21, 20, 6, 5, 4, 3, 2, 1, 0],
    # cost: the never-reused B and D first, then the reused leaves by credit and recency.
    "cost": [13, 12, 11, 10, 31, 30, 6, 5, 4, 3, 2, 1, 0, 24, 23, 22, 21, 20],
}


def scenario(policy_name: str) -> Tree:
    t = Tree(make_policy(policy_name, model_shape=TINY))
    for clock, tokens, ids in SCENARIO:
        t.serve(clock, tokens, ids)
    return t


@pytest.mark.parametrize("policy_name", sorted(SAME_VICTIMS))
def test_node_level_policies_keep_their_victims(policy_name: str) -> None:
    """LRU keys on recency and depth (a trim changes neither), GDSF and cost on the node's
    FLOPs per block, which a trim only lowers: the first leaf stays first, so block by block
    takes the very blocks the whole-shortfall rule took (and, one ``on_evict`` per run as
    before, the policies' state follows the same path)."""
    new, old = scenario(policy_name), scenario(policy_name)
    got, ref = [], []
    for k in (3, 5, 2, 100):
        got += new.tree.evict(k)
        ref += reference_whole_shortfall(old.tree, k)
        new.tree.check_integrity()
    assert got == ref == SAME_VICTIMS[policy_name]


@pytest.mark.parametrize("policy_name", ["lru", "lfu", "fifo", "gdsf", "cost", "belady",
                                         "belady-cost"])
def test_any_call_size_takes_the_blocks_one_at_a_time_would(policy_name: str) -> None:
    kwargs = {"next_use": lambda node: 7.0 + node.block_ids[-1] % 5, "now": lambda: 0.0} \
        if policy_name.startswith("belady") else {}
    trees = [Tree(make_policy(policy_name, model_shape=TINY, **kwargs)) for _ in range(2)]
    for t in trees:
        for clock, tokens, ids in SCENARIO:
            t.serve(clock, tokens, ids)
    batched = trees[0].tree.evict(7) + trees[0].tree.evict(100)
    single = [b for _ in range(18) for b in trees[1].tree.evict(1)]
    assert batched == single and len(single) == 18


def test_key_on_trim_picks_the_path() -> None:
    got = {name: key_on_trim(make_policy(name, model_shape=TINY))
           for name in ("lru", "lfu", "fifo", "gdsf", "cost", "s3fifo")}
    assert got == {"lru": "same", "lfu": "same", "fifo": "same", "gdsf": "falls",
                   "cost": "falls", "s3fifo": "any"}

    class Declared(LRUPolicy):
        key_on_trim = "any"

    assert key_on_trim(Declared()) == "any"
    Declared.key_on_trim = "sometimes"
    with pytest.raises(ValueError, match="eviction_policy: key_on_trim"):
        key_on_trim(Declared())


def test_a_policy_keyed_on_the_tail_declared_any_is_re_ranked_per_block() -> None:
    """An LRU subclass that also ranks by the tail block's next use: declared "any", it is
    re-ranked per block, so the long leaf keeps its front as under belady."""

    class TailAware(LRUPolicy):
        key_on_trim = "any"

        def priority(self, node):
            return (-NEXT_USE[node.block_ids[-1]],)

    t = Tree(TailAware())
    t.serve(1.0, sum(LONG, []), list(range(8)))
    t.serve(2.0, sum(OTHER, []), [10, 11, 12, 13])
    assert t.tree.evict(6) == [7, 6, 5, 4, 13, 12]

"""Radix tree: match by stored tokens, split under locks (C09), eviction order, leaf index."""

from __future__ import annotations

import itertools
import random

import pytest

from radixkv.eviction import NodeView, VictimPolicy, get_policy
from radixkv.hashing import BlockHasher
from radixkv.radix_tree import Node, RadixTree

B = 4


def make_tree(policy=None) -> tuple[RadixTree, Node, BlockHasher]:
    ticks = itertools.count()
    tree = RadixTree(B, policy or get_policy("lru"), clock=lambda: float(next(ticks)))
    hasher = BlockHasher()
    root = tree.root(b"root-1")
    return tree, root, hasher


def blocks_of(tokens: list[int]) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + B]) for i in range(0, len(tokens) - B + 1, B)]


def insert(tree: RadixTree, root: Node, hasher: BlockHasher, tokens: list[int], ids: list[int]):
    """Insert as a request would: lock the root as its cursor, insert, return the result."""
    tree.lock(root)
    return tree.insert(root, root.root_hash, blocks_of(tokens), ids, hasher.block_hash)


def test_c09_unlock_never_locked_raises() -> None:
    tree, root, _ = make_tree()
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(root)
    assert root.lock_ref == 0


def test_c09_split_keeps_both_halves_locked() -> None:
    tree, root, hasher = make_tree()
    a = insert(tree, root, hasher, [1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    assert (a.node.num_blocks, a.node.lock_ref, a.inserted_ids) == (2, 1, [10, 11])
    b = insert(tree, root, hasher, [1, 2, 3, 4, 9, 9, 9, 9], [20, 21])
    head = a.node.parent
    assert head is not root and head.block_ids == [10] and a.node.block_ids == [11]
    assert b.node.parent is head and b.node.block_ids == [21]
    assert b.duplicate_ids == [20] and b.inserted_ids == [21]
    # Both halves of the split node stay locked; the head carries both cursors.
    assert (head.lock_ref, a.node.lock_ref, b.node.lock_ref, root.lock_ref) == (2, 1, 1, 2)
    assert (tree.num_cached_blocks, tree.num_locked_blocks, tree.num_evictable_blocks) == (3, 3, 0)
    tree.check_integrity([a.node, b.node])
    assert tree.evict(3) == []  # everything is held
    tree.unlock(b.node)
    assert (tree.num_locked_blocks, tree.num_evictable_blocks) == (2, 1)
    tree.check_integrity([a.node])
    assert tree.evict(3) == [21]  # only the unlocked leaf; the held path is untouched
    assert head.lock_ref == 1 and a.node.block_ids == [11] and head.block_ids == [10]
    tree.check_integrity([a.node])
    tree.unlock(a.node)
    assert tree.evict(5) == [11, 10]  # leaf first, then its parent once it became a leaf
    assert (tree.num_nodes, tree.num_cached_blocks) == (0, 0)
    tree.check_integrity([])


def test_match_compares_tokens_and_splits_at_the_match_end() -> None:
    tree, root, hasher = make_tree()
    a = insert(tree, root, hasher, list(range(1, 13)), [0, 1, 2])
    tree.unlock(a.node)
    count_before = hasher.num_block_hashes
    res = tree.match(root, tuple(range(1, 13)) + (99,), max_blocks=2)
    assert res.block_ids == [0, 1]
    assert res.node.block_ids == [0, 1] and list(res.node.children.values())[0].block_ids == [2]
    assert hasher.num_block_hashes == count_before  # matching hashes nothing
    assert res.last_hash == hasher.chain(root.root_hash, list(range(1, 9)), B)[-1]
    # A prompt differing inside the second block matches only the first.
    res2 = tree.match(root, (1, 2, 3, 4, 5, 6, 7, 0, 9), max_blocks=5)
    assert res2.block_ids == [0]
    assert tree.match(root, [4, 3, 2, 1, 5], max_blocks=5).block_ids == []
    tree.check_integrity([])


def test_in_place_extension_keeps_one_node() -> None:
    tree, root, hasher = make_tree()
    r = insert(tree, root, hasher, [1, 2, 3, 4], [0])
    for k in range(1, 6):
        r = tree.insert(r.node, r.last_hash, [(k, k, k, k)], [k], hasher.block_hash)
    assert tree.num_nodes == 1 and r.node.block_ids == [0, 1, 2, 3, 4, 5]
    assert r.last_hash == hasher.chain(root.root_hash, [1, 2, 3, 4] + [
        t for k in range(1, 6) for t in (k, k, k, k)], B)[-1]
    tree.check_integrity([r.node])


def test_lru_evicts_least_recent_leaf_tail_first() -> None:
    tree, root, hasher = make_tree()
    leaves = {}
    for first, ids in ((1, [0, 1]), (2, [2, 3]), (3, [4, 5])):
        r = insert(tree, root, hasher, [first] * 8, ids)
        leaves[first] = r.node
    for first in (2, 1, 3):  # release order sets recency
        tree.unlock(leaves[first])
    assert tree.match(root, (1,) * 8 + (0,), max_blocks=2).block_ids == [0, 1]  # hit: 1 is newest
    assert tree.evict(3) == [3, 2, 5]
    assert tree.evict(10) == [4, 1, 0]
    tree.check_integrity([])


def test_evict_order_matches_naive_reference() -> None:
    """C18 (test part): the sorted leaf index evicts exactly what a full scan would."""
    rng = random.Random(7)
    tree, root, hasher = make_tree()
    ids = itertools.count()
    nodes = []
    for i in range(200):
        tokens = [i + 1, 0, 0, 0] * rng.randint(1, 3)
        n = len(tokens) // B
        r = insert(tree, root, hasher, tokens, [next(ids) for _ in range(n)])
        nodes.append(r.node)
    rng.shuffle(nodes)
    for node in nodes:
        tree.unlock(node)
    for i in rng.sample(range(200), 50):  # hits re-key leaves in the middle of the order
        tree.match(root, (i + 1, 0, 0, 0, 5), max_blocks=1)
    policy = tree.policy
    while tree.num_cached_blocks:
        leaves = [n for n in tree.iter_nodes() if n.lock_ref == 0 and not n.children]
        expected = min(leaves, key=lambda n: (policy.priority(n), n.uid))
        tail_block = expected.block_ids[-1]
        assert tree.evict(1) == [tail_block]
    tree.check_integrity([])


class FifoVictims(VictimPolicy):
    """Test-only victim-naming policy: evict leaves in the order they became evictable."""

    def __init__(self) -> None:
        self.queue: dict[int, NodeView] = {}

    def add_leaf(self, node: NodeView) -> None:
        self.queue[node.uid] = node

    def remove_leaf(self, node: NodeView) -> None:
        del self.queue[node.uid]

    def choose_victim(self) -> NodeView | None:
        return next(iter(self.queue.values()), None)


def test_victim_naming_policy() -> None:
    tree, root, hasher = make_tree(FifoVictims())
    a = insert(tree, root, hasher, [1] * 8, [0, 1])
    b = insert(tree, root, hasher, [2] * 4, [2])
    tree.unlock(b.node)
    tree.unlock(a.node)
    assert tree.evict(2) == [2, 1]  # b became evictable first; then a's tail
    tree.check_integrity([])
    assert tree.evict(2) == [0]

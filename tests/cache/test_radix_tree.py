"""Radix tree: match by stored tokens, split under locks, eviction order, leaf index."""

from __future__ import annotations

import itertools
import random

import pytest

from radixkv.cache.hashing import BlockHasher, pack_tokens
from radixkv.cache.tree.radix_tree import Node, RadixTree
from radixkv.eviction import NodeView, VictimPolicy, get_policy

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
    return tree.insert(root, tokens, ids, hasher)


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
    assert head is not root and list(head.block_ids) == [10] and list(a.node.block_ids) == [11]
    assert b.node.parent is head and list(b.node.block_ids) == [21]
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
    assert head.lock_ref == 1 and list(a.node.block_ids) == [11] and list(head.block_ids) == [10]
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
    assert list(res.block_ids) == [0, 1]
    assert list(res.node.block_ids) == [0, 1] and list(list(res.node.children.values())[0].block_ids) == [2]
    assert hasher.num_block_hashes == count_before  # matching hashes nothing
    assert res.last_hash == hasher.chain(root.root_hash, list(range(1, 9)), B)[-1]
    # A prompt differing inside the second block matches only the first.
    res2 = tree.match(root, (1, 2, 3, 4, 5, 6, 7, 0, 9), max_blocks=5)
    assert list(res2.block_ids) == [0]
    assert list(tree.match(root, [4, 3, 2, 1, 5], max_blocks=5).block_ids) == []
    tree.check_integrity([])


def test_in_place_extension_keeps_one_node() -> None:
    tree, root, hasher = make_tree()
    r = insert(tree, root, hasher, [1, 2, 3, 4], [0])
    for k in range(1, 6):
        r = tree.insert(r.node, [k, k, k, k], [k], hasher)
    assert tree.num_nodes == 1 and list(r.node.block_ids) == [0, 1, 2, 3, 4, 5]
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
    assert list(tree.match(root, (1,) * 8 + (0,), max_blocks=2).block_ids) == [0, 1]  # hit: 1 is newest
    assert tree.evict(3) == [3, 2, 5]
    assert tree.evict(10) == [4, 1, 0]
    tree.check_integrity([])


@pytest.mark.parametrize("policy_name", ["lru", "lfu", "fifo"])
def test_evict_order_matches_naive_reference(policy_name: str) -> None:
    """The sorted leaf index (eviction cost that does not grow with the cache) evicts exactly
    what a full scan would pick."""
    rng = random.Random(7)
    tree, root, hasher = make_tree(get_policy(policy_name))
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
    for i in rng.choices(range(200), k=80):  # hits re-key leaves in the middle of the order
        tree.match(root, (i + 1, 0, 0, 0, 5), max_blocks=1)
    policy = tree.policy
    while tree.num_cached_blocks:
        leaves = [n for n in tree.iter_nodes() if n.lock_ref == 0 and not n.children]
        expected = min(leaves, key=lambda n: (policy.priority(n), n.uid))
        tail_block = expected.block_ids[-1]
        assert tree.evict(1) == [tail_block]
        if tree.num_cached_blocks % 37 == 0:
            tree.check_integrity([])
    tree.check_integrity([])


def test_match_finds_mismatch_inside_long_runs() -> None:
    """Binary search over block ranges agrees with a block-by-block reference."""
    rng = random.Random(3)
    tree, root, hasher = make_tree()
    base = [rng.randrange(1, 50) for _ in range(40 * B)]
    r = insert(tree, root, hasher, base, list(range(40)))
    tree.unlock(r.node)
    for _ in range(60):
        probe = list(base)
        cut = rng.randrange(0, 40 * B)
        probe[cut] = 99
        cap = rng.randrange(0, 42)
        expected = min(cut // B, cap, 40)
        assert tree.match_length(root, probe, cap) == expected
    res = tree.match(root, base[:13 * B] + [99] * B, 20)
    assert list(res.block_ids) == list(range(13)) and tree.num_nodes == 2
    tree.check_integrity([], hasher.hash_fn)


def test_extras_are_part_of_the_key_and_compared() -> None:
    tree, root, hasher = make_tree()
    x = b"mm-extras"
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    tree.lock(root)
    r = tree.insert(root, tokens, [0, 1, 2], hasher, extras=[b"", x, b""])
    tree.unlock(r.node)
    assert tree.match_length(root, tokens, 3) == 1  # text prompt stops at the image block
    assert tree.match_length(root, tokens, 3, extras=[b"", x, b""]) == 3
    assert tree.match_length(root, tokens, 3, extras=[b"", b"other", b""]) == 1
    assert tree.match_length(root, tokens, 3, extras=[x, x, b""]) == 0  # key includes extras
    tree.check_integrity([], hasher.hash_fn)


def test_root_child_key_index_tracks_identities() -> None:
    tree, root, hasher = make_tree()
    other = tree.root(b"root-2")
    a = insert(tree, root, hasher, [1, 2, 3, 4], [0])
    b = insert(tree, other, hasher, [1, 2, 3, 4], [1])
    key = pack_tokens([1, 2, 3, 4])
    assert tree.roots_holding(key, root) == [other] and tree.roots_holding(key, other) == [root]
    tree.unlock(a.node)
    tree.unlock(b.node)
    assert tree.evict(1) == [0]
    assert tree.roots_holding(key, other) == []
    tree.check_integrity([])


def test_match_without_touch_and_touch_path() -> None:
    tree, root, hasher = make_tree()
    r = insert(tree, root, hasher, [1] * 8, [0, 1])
    tree.unlock(r.node)
    before = (r.node.hit_count, r.node.last_access_s, r.node.leaf_entry)
    res = tree.match(root, [1] * 9, 2, touch=False)
    assert (r.node.hit_count, r.node.last_access_s, r.node.leaf_entry) == before
    tree.touch_path(res.node)
    assert r.node.hit_count == before[0] + 1 and r.node.leaf_entry != before[2]
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


def test_bare_identity_roots_are_dropped_and_reattached() -> None:
    tree, root, hasher = make_tree()
    # A lookup that finds nothing locks the bare root as its cursor; its release drops the root.
    tree.lock(root)
    assert set(tree.roots) == {b"root-1"}
    tree.unlock(root)
    assert tree.roots == {}
    # A caller that kept the object may lock it again: it is re-attached, not orphaned.
    r = insert(tree, root, hasher, [1, 2, 3, 4, 5, 6, 7, 8], [0, 1])
    assert tree.roots == {b"root-1": root}
    tree.unlock(r.node)
    assert tree.roots == {b"root-1": root}  # it holds blocks: kept
    assert tree.evict(1) == [1] and tree.roots == {b"root-1": root}
    assert tree.evict(1) == [0] and tree.roots == {}  # its last block evicted: dropped
    tree.check_integrity([])
    new = tree.root(b"root-1")
    assert new is not root
    with pytest.raises(RuntimeError, match="stale root"):
        tree.lock(root)
    assert tree.root(b"root-1") is new and new.lock_ref == 0


def test_roots_holding_limit() -> None:
    tree, root, hasher = make_tree()
    others = [tree.root(f"other-{i}".encode()) for i in range(6)]
    for i, other in enumerate(others):
        tree.unlock(insert(tree, other, hasher, [1, 2, 3, 4], [i]).node)
    key = pack_tokens([1, 2, 3, 4])
    assert tree.roots_holding(key, root, 4) == others[:4]
    assert tree.roots_holding(key, others[0], 2) == others[1:3]
    assert tree.roots_holding(key, root) == others


def test_insert_with_a_bad_block_id_changes_nothing() -> None:
    tree, root, hasher = make_tree()
    r = insert(tree, root, hasher, [1, 2, 3, 4], [0])
    leaf = r.node
    for bad in (["x"], [1.5], [None], [2**70]):
        with pytest.raises((TypeError, OverflowError)):
            tree.insert(leaf, pack_tokens([5, 6, 7, 8]), bad, hasher)  # the fast path
        with pytest.raises((TypeError, OverflowError)):
            tree.insert(leaf, pack_tokens([5, 6, 7, 8]), bad, hasher,
                        known_hashes=[b"h" * 16])  # the general path
        assert (leaf.num_blocks, bytes(leaf.tokens), len(leaf.hashes)) == (
            1, pack_tokens([1, 2, 3, 4]), 1)
    tree.check_integrity([leaf], hasher.hash_fn)
    tree.unlock(leaf)
    # Where the insert would first follow the cached block (moving the lock): still nothing
    # changes.
    tree.lock(root)
    before = [(n.num_blocks, n.lock_ref) for n in tree.iter_nodes()]
    with pytest.raises(TypeError):
        tree.insert(root, pack_tokens([1, 2, 3, 4, 9, 9, 9, 9]), [5, "x"], hasher)
    assert [(n.num_blocks, n.lock_ref) for n in tree.iter_nodes()] == before == [(1, 0)]
    tree.check_integrity([root], hasher.hash_fn)


def test_constructor_refuses_bad_arguments() -> None:
    for bad in (True, "4", 0, 2.0):
        with pytest.raises(ValueError, match=r"block_size: must be an int in \[1, 1024\]"):
            RadixTree(bad, get_policy("lru"))
    with pytest.raises(ValueError, match="policy: must be an EvictionPolicy instance, got str"):
        RadixTree(4, "lru")

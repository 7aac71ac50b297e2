"""The cache manager's ``check_integrity``: pool, tree and every request's state agree.

``check_manager`` takes the objects it checks (it imports neither the manager nor anything that
does); tests call it after every operation, the engine when idle. O(num_blocks + tree size).
"""

from __future__ import annotations

from typing import Callable

from radixkv.cache.miss_causes import MISS_CAUSES
from radixkv.cache.pool import FREE, OWNED, BlockPool
from radixkv.cache.request_state import RequestState
from radixkv.cache.tree.radix_tree import RadixTree


def check_manager(pool: BlockPool, tree: RadixTree, requests: dict[str, RequestState],
                  block_size: int, enable_prefix_caching: bool,
                  hash_fn: Callable[[bytes], bytes] | None) -> None:
    """Verify pool, tree, and their agreement with every active request.

    Args:
        pool: The block pool (``num_blocks`` blocks).
        tree: The radix tree.
        requests: Every active request's state, by request id.
        block_size: B.
        enable_prefix_caching: When False, the tree must hold nothing.
        hash_fn: When given, every stored chained hash is recomputed.

    Raises:
        AssertionError: describing the first violated invariant.
    """
    pool.check_integrity()
    cursors = [r.cursor for r in requests.values() if r.cursor is not None]
    tree_ids = tree.check_integrity(cursors, hash_fn)
    # Every lookup locks the root it makes, and the last unlock or eviction drops a bare one:
    # a root without children or locks is state kept for an identity that holds nothing.
    for root in tree.roots.values():
        assert root.children or root.lock_ref, f"bare identity root {root!r} kept"
    # The tree's blocks are the cached ones: each owned exactly once (by the tree) in the pool.
    assert len(tree_ids) == pool.num_cached_blocks, (
        f"tree holds {len(tree_ids)} blocks, pool counts {pool.num_cached_blocks} cached")
    for block_id in tree_ids:
        assert pool.state(block_id) == OWNED and pool.ref_count(block_id) == 1, (
            f"block {block_id}: in the tree but owned {pool.ref_count(block_id)} times "
            f"(state {pool.state(block_id)}) in the pool")
    private_refs: dict[int, int] = {}
    bs = block_size
    for request_id, req in requests.items():
        table = req.block_table
        assert req.num_published_blocks <= len(table), f"{request_id}: published past table"
        assert set(req.miss) == set(MISS_CAUSES), f"{request_id}: miss causes {sorted(req.miss)}"
        path_ids: list[int] = []
        node = req.cursor
        while node is not None and node.parent is not None:
            path_ids[:0] = node.block_ids
            node = node.parent
        if req.cursor is not None:
            assert node is req.root, f"{request_id}: cursor is not under its identity root"
            assert len(path_ids) == req.num_published_blocks, (
                f"{request_id}: cursor path has {len(path_ids)} blocks, "
                f"published {req.num_published_blocks}")
            assert req.last_hash == req.cursor.end_hash, f"{request_id}: chain hash drifted"
        assert req.num_published_blocks * bs <= req.num_computed_tokens, (
            f"{request_id}: published blocks past its {req.num_computed_tokens} computed tokens")
        dups = set(req.duplicate_ids)
        for pos in range(req.num_published_blocks):
            if table[pos] in dups:
                continue
            assert table[pos] == path_ids[pos], (
                f"{request_id}: block position {pos} holds {table[pos]}, tree path "
                f"has {path_ids[pos]}")
        for block_id in [*req.duplicate_ids, *table[req.num_published_blocks :]]:
            private_refs[block_id] = private_refs.get(block_id, 0) + 1
    for block_id in range(pool.num_blocks):
        if block_id in tree_ids:
            assert block_id not in private_refs, (
                f"block {block_id}: cached in the tree and held privately by a request")
            continue
        assert pool.ref_count(block_id) == private_refs.get(block_id, 0), (
            f"block {block_id}: ref count {pool.ref_count(block_id)}, "
            f"held by {private_refs.get(block_id, 0)} requests")
    in_use = pool.num_private_blocks + tree.num_locked_blocks
    total = pool.num_free_blocks + tree.num_evictable_blocks + in_use
    assert total == pool.num_blocks, (
        f"free + cached_evictable + in_use = {total} != num_blocks {pool.num_blocks}")
    if not enable_prefix_caching:
        assert tree.num_cached_blocks == 0, "prefix caching off but the tree holds blocks"


def block_states(pool: BlockPool, tree: RadixTree) -> list[str]:
    """State of every block: "free", "private", "cached_evictable" or "cached_locked"."""
    states = ["private"] * pool.num_blocks
    for block_id in range(pool.num_blocks):
        if pool.state(block_id) == FREE:
            states[block_id] = "free"
    for node in tree.iter_nodes():
        label = "cached_locked" if node.lock_ref > 0 else "cached_evictable"
        for block_id in node.block_ids:
            states[block_id] = label
    return states

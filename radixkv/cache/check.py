"""Per-request cache state and the cache manager's ``check_integrity``.

``RequestState`` is what :class:`radixkv.cache.manager.CacheManager` keeps per active request;
``check_manager`` verifies the pool, the tree and their agreement with every such state.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Callable

from radixkv.cache.hashing import MMItem
from radixkv.cache.miss_causes import MISS_CAUSES, empty_breakdown
from radixkv.cache.pool import OWNED
from radixkv.cache.tree.node import Node

if TYPE_CHECKING:
    from radixkv.cache.manager import CacheManager


class RequestState:
    """Cache-side state of one active request (a plain slots class: built on every lookup).

    Attributes:
        root: The identity root node (None when prefix caching is off).
        cursor: Tree node at whose end the request's cached/published prefix ends (it holds one
            lock there); None when prefix caching is off.
        last_hash: Chained hash of the last published/matched block (root hash at first).
        block_table: Physical block per block position (``array('q')``).
        num_cached_tokens: m, the capped hit returned by ``begin``.
        num_published_blocks: Leading positions that are in the tree (matched or published).
        mm_items: The request's multimodal items (sorted ``MMItem`` tuples).
        duplicate_ids: Private blocks at published positions whose content the tree already had
            (a concurrent request published it first); freed at release.
        num_computed_tokens: Most tokens reported computed (``publish``), at least m.
        miss: Missed prompt tokens by cause, from the lookup.
        known_hashes: Chained hashes the lookup recovered from the ghost list for positions
            ``known_start, …``, reused by ``publish`` instead of hashing those blocks again.
        known_start: Block position of ``known_hashes[0]``.
        known_tokens: The packed prompt the lookup compared (immutable ``bytes``, token 0
            first): ``publish`` reuses a known hash only for these very tokens.
        admitted: The hit was recorded on the matched path (first successful allocate).
        counted: The miss breakdown was added to the cumulative counters.
        match_node: Node at whose end the lookup's match stopped (None on a miss).
    """

    __slots__ = ("root", "cursor", "last_hash", "block_table", "num_cached_tokens",
                 "num_published_blocks", "mm_items", "duplicate_ids", "num_computed_tokens",
                 "miss", "known_hashes", "known_start", "known_tokens", "admitted", "counted",
                 "match_node")

    def __init__(self, root: Node | None, cursor: Node | None, last_hash: bytes,
                 block_table: array, num_cached_tokens: int, num_published_blocks: int,
                 mm_items: tuple[MMItem, ...] = (), *, duplicate_ids: list[int] | None = None,
                 num_computed_tokens: int = 0, miss: dict[str, int] | None = None,
                 known_hashes: list[bytes] | None = None, known_start: int = 0,
                 known_tokens: bytes = b"", admitted: bool = False, counted: bool = False,
                 match_node: Node | None = None) -> None:
        self.root = root
        self.cursor = cursor
        self.last_hash = last_hash
        self.block_table = block_table
        self.num_cached_tokens = num_cached_tokens
        self.num_published_blocks = num_published_blocks
        self.mm_items = mm_items
        self.duplicate_ids = duplicate_ids if duplicate_ids is not None else []
        self.num_computed_tokens = num_computed_tokens
        self.miss = miss if miss is not None else empty_breakdown()
        self.known_hashes = known_hashes if known_hashes is not None else []
        self.known_start = known_start
        self.known_tokens = known_tokens
        self.admitted = admitted
        self.counted = counted
        self.match_node = match_node


def check_manager(cm: CacheManager, requests: dict[str, RequestState],
                  hash_fn: Callable[[bytes], bytes] | None) -> None:
    """Verify pool, tree, and their agreement with every active request.

    Raises:
        AssertionError: describing the first violated invariant.
    """
    cm.pool.check_integrity()
    cursors = [r.cursor for r in requests.values() if r.cursor is not None]
    tree_ids = cm.tree.check_integrity(cursors, hash_fn)
    # Every lookup locks the root it makes, and the last unlock or eviction drops a bare one:
    # a root without children or locks is state kept for an identity that holds nothing.
    for root in cm.tree.roots.values():
        assert root.children or root.lock_ref, f"bare identity root {root!r} kept"
    # The tree's blocks are the cached ones: each owned exactly once (by the tree) in the pool.
    assert len(tree_ids) == cm.pool.num_cached_blocks, (
        f"tree holds {len(tree_ids)} blocks, pool counts {cm.pool.num_cached_blocks} cached")
    for block_id in tree_ids:
        assert cm.pool.state(block_id) == OWNED and cm.pool.ref_count(block_id) == 1, (
            f"block {block_id}: in the tree but owned {cm.pool.ref_count(block_id)} times "
            f"(state {cm.pool.state(block_id)}) in the pool")
    private_refs: dict[int, int] = {}
    bs = cm.block_size
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
    for block_id in range(cm.num_blocks):
        if block_id in tree_ids:
            assert block_id not in private_refs, (
                f"block {block_id}: cached in the tree and held privately by a request")
            continue
        assert cm.pool.ref_count(block_id) == private_refs.get(block_id, 0), (
            f"block {block_id}: ref count {cm.pool.ref_count(block_id)}, "
            f"held by {private_refs.get(block_id, 0)} requests")
    total = cm.num_free_blocks + cm.num_cached_evictable_blocks + cm.num_in_use_blocks
    assert total == cm.num_blocks, (
        f"free + cached_evictable + in_use = {total} != num_blocks {cm.num_blocks}")
    if not cm.enable_prefix_caching:
        assert cm.tree.num_cached_blocks == 0, "prefix caching off but the tree holds blocks"

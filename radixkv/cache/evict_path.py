"""The cache's eviction path and the request-history fields it feeds to the policy.

``CacheManager`` evicts in three steps, always together: the tree picks and trims blocks
(block by block, :mod:`radixkv.cache.tree.evict`), the pool puts them back on the free list, the
ghost list remembers the trimmed runs (``ghost.GhostList``), whose forgotten notes go to
the policy's optional ``on_ghost_drop``. Also here: taking blocks for a request (evicting the
shortfall) and stamping a released request's end on the path it held.
"""

from __future__ import annotations

from array import array
from typing import Callable

from radixkv.cache.events import KVEventLog
from radixkv.cache.ghost import GhostList
from radixkv.cache.pool import BlockPool
from radixkv.cache.tree.node import BLOCK_ID_TYPECODE, Node
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.cache.window_cache import WindowBlocks
from radixkv.eviction import EvictionPolicy


def make_ghost_list(policy: EvictionPolicy, capacity: int) -> GhostList:
    """The cache's one ghost list (``capacity`` blocks), wired to the policy's
    ``on_ghost_drop(notes)`` when it defines one that does something."""
    # Every policy subclasses EvictionPolicy, so the hook always exists: a renamed hook fails
    # here instead of silently dropping a learned policy's negative labels.
    if type(policy).on_ghost_drop is EvictionPolicy.on_ghost_drop:
        return GhostList(capacity, on_drop=None)  # the base class's no-op: collect no notes
    return GhostList(capacity, on_drop=policy.on_ghost_drop)


def evict(tree: RadixTree, pool: BlockPool, ghost: GhostList, events: KVEventLog | None,
          num_blocks: int, window: WindowBlocks | None = None) -> int:
    """Evict up to ``num_blocks`` blocks through the policy: the tree drops them, the pool
    frees them, the ghost list remembers them (KV events record the removal), and the window
    groups' pool (``window``, under KV groups) drops their cached window blocks, which no
    lookup can reach without them. Returns the number evicted. One block (each decode step's
    eviction once the pool is full) goes through ``tree.take_tail_block`` where it applies, in
    the fewest calls. The tree's methods are looked up per call (a benchmark may wrap them)."""
    if num_blocks == 1 and events is None:
        taken = tree.take_tail_block()
        if taken is not None:  # the commonest eviction, in the fewest calls
            pool.free_one_cached(taken[0])
            ghost.add_block(taken[1], taken[2], taken[3])
            if window is not None:
                window.evict_cached(bytes(taken[3]))
            return 1
    evicted: list = []
    freed = tree.evict(num_blocks, evicted, array(BLOCK_ID_TYPECODE))
    pool.free_cached(freed)
    if window is not None:
        for _, run in evicted:
            hashes, w = run[1], run[4]
            for j in range(0, len(hashes), w):
                window.evict_cached(bytes(hashes[j:j + w]))
    ghost.add(evicted)
    if events is not None:
        events.removed(evicted)
    return len(freed)


def take_blocks(pool: BlockPool, tree: RadixTree, evict_fn: Callable[[int], int],
                num: int) -> list[int] | None:
    """``num`` private blocks, evicting (``evict_fn``) if the free list is short; None changes
    nothing (free + evictable blocks cannot cover ``num``)."""
    short = num - pool.num_free_blocks
    if short > 0:
        if short > tree.num_evictable_blocks:
            return None
        evict_fn(short)
    ids = pool.allocate(num)
    if ids is None:  # pragma: no cover - guarded by the evictable count above
        raise RuntimeError(f"allocate: {num} blocks not free after evicting {short}")
    return ids


def stamp_request_end(cursor: Node, end_s: float) -> None:
    """Set ``request_end_s`` on every non-root node of the path a request holds (cursor up)."""
    node: Node | None = cursor
    while node is not None and node.parent is not None:
        node.request_end_s = end_s
        node = node.parent

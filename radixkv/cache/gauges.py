"""The cache manager's gauges and counters (docs/design.md §7 units).

``free + cached_evictable + in_use = num_blocks`` always holds. A mixin of ``CacheManager``:
it reads the manager's pool, tree, miss counters and active requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.cache.pool import BlockPool
    from radixkv.cache.request_state import RequestState
    from radixkv.cache.tree.radix_tree import RadixTree


class CacheGauges:
    """Read-only gauges over ``pool``, ``tree``, ``_miss_tokens``, ``_evicted_blocks_total``
    and ``_requests`` (set by ``CacheManager``)."""

    pool: BlockPool
    tree: RadixTree
    _miss_tokens: dict[str, int]
    _evicted_blocks_total: int
    _requests: dict[str, RequestState]
    _forks_total: int
    _fork_shared_blocks_total: int
    _cow_copied_blocks_total: int
    block_size: int

    @property
    def miss_tokens(self) -> dict[str, int]:
        """Counter: missed prompt tokens by cause (``miss_causes.MISS_CAUSES``), summed over
        admitted requests (each lookup counted once, at admission)."""
        return dict(self._miss_tokens)

    @property
    def evicted_blocks_total(self) -> int:
        """Counter: cached blocks evicted (dropped from the tree) since start."""
        return self._evicted_blocks_total

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no content."""
        return self.pool.num_free_blocks

    @property
    def num_deferred_blocks(self) -> int:
        """Released private blocks waiting for the in-flight step to end (part of in-use)."""
        return self.pool.num_deferred_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks held by the tree (evictable + locked)."""
        return self.tree.num_cached_blocks

    @property
    def num_cached_evictable_blocks(self) -> int:
        """Cached blocks no running request holds."""
        return self.tree.num_evictable_blocks

    @property
    def num_in_use_blocks(self) -> int:
        """Blocks held by running requests (or an in-flight step): private + cached-locked."""
        return self.pool.num_private_blocks + self.tree.num_locked_blocks

    @property
    def num_tree_nodes(self) -> int:
        """Non-root tree nodes."""
        return self.tree.num_nodes

    @property
    def num_active_requests(self) -> int:
        return len(self._requests)

    @property
    def num_live_tail_waste_tokens(self) -> int:
        """Token slots allocated to active requests and holding no token: for each request,
        ``len(block_table) * B`` minus the slots it fills (``num_slot_tokens``, at least its
        published blocks), i.e. the empty rest of its last block (< B per request).

        Cached blocks have no such waste (the tree holds full blocks only). O(active requests).
        """
        bs = self.block_size
        waste = 0
        for req in self._requests.values():
            filled = req.num_slot_tokens
            published = req.num_published_blocks * bs
            waste += len(req.block_table) * bs - (filled if filled > published else published)
        return waste

    @property
    def allocated_blocks_total(self) -> int:
        """Counter: blocks taken off the free list (``BlockPool.allocate``)."""
        return self.pool.allocated_blocks_total

    @property
    def freed_blocks_total(self) -> int:
        """Counter: blocks returned to the free list (released private blocks, evicted
        cached blocks)."""
        return self.pool.freed_blocks_total

    @property
    def forks_total(self) -> int:
        """Counter: sequences started as a fork of a running one (``fork``; ``n > 1``)."""
        return self._forks_total

    @property
    def fork_shared_blocks_total(self) -> int:
        """Counter: blocks forked sequences share with their parent instead of copying."""
        return self._fork_shared_blocks_total

    @property
    def cow_copied_blocks_total(self) -> int:
        """Counter: partial tail blocks copied at a fork (copy-on-write; one per fork whose
        computed tokens do not end on a block boundary)."""
        return self._cow_copied_blocks_total

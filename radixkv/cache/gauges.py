"""Gauges and counters of the cache manager (a mixin of ``CacheManager``), in the units
DESIGN.md §7 names: block counts, token counts, request counts.

Block states: free, cached-evictable, cached-locked, private (deferred blocks count as private
until the in-flight step ends). ``free + cached_evictable + in_use = num_blocks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.cache.pool import FREE

if TYPE_CHECKING:
    from radixkv.cache.pool import BlockPool
    from radixkv.cache.tree.radix_tree import RadixTree


class CacheGauges:
    """Read-only views over ``pool``, ``tree`` and the counters ``CacheManager`` keeps."""

    num_blocks: int
    pool: BlockPool
    tree: RadixTree
    _miss_tokens: dict[str, int]
    _evicted_blocks_total: int
    _requests: dict

    @property
    def miss_tokens(self) -> dict[str, int]:
        """Counter: missed prompt tokens by cause (cold, evicted, isolated, unaligned_tail),
        summed over admitted requests (each lookup counted once, at admission)."""
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

    def block_states(self) -> list[str]:
        """State of every block: "free", "private", "cached_evictable" or "cached_locked".

        O(num_blocks + tree size); for tests and debugging.
        """
        states = ["private"] * self.num_blocks
        for block_id in range(self.num_blocks):
            if self.pool.state(block_id) == FREE:
                states[block_id] = "free"
        for node in self.tree.iter_nodes():
            label = "cached_locked" if node.lock_ref > 0 else "cached_evictable"
            for block_id in node.block_ids:
                states[block_id] = label
        return states

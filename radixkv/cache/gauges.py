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

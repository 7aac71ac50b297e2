"""Least-frequently-used eviction.

Priority of an evictable leaf = ``(hit_count, last_access_s, -depth_tokens, created_s)``: the
leaf matched by the fewest lookups goes first; ties fall back to LRU order (least recent, then
deeper, then older). ``hit_count`` changes only on a hit, which re-keys the leaf.
"""

from __future__ import annotations

from .base import NodeView, PriorityPolicy, register


@register("lfu")
class LFUPolicy(PriorityPolicy):
    """Evict the least frequently hit leaf first (ties: least recent, deeper, older)."""

    def priority(self, node: NodeView) -> tuple[int, float, int, float]:
        """Return ``(hit_count, last_access_s, -depth_tokens, created_s)`` for ``node``."""
        return (node.hit_count, node.last_access_s, -node.depth_tokens, node.created_s)

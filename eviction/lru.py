"""Least-recently-used eviction.

Priority of an evictable leaf = ``(last_access_s, -depth_tokens, created_s)``: the leaf touched
longest ago goes first; among leaves touched at the same clock reading the deeper one goes
first (so a chain released in one event is trimmed from its tail), then the older one.
"""

from __future__ import annotations

from .base import NodeView, PriorityPolicy, register


@register("lru")
class LRUPolicy(PriorityPolicy):
    """Evict the least recently used leaf first (ties: deeper, then older)."""

    def priority(self, node: NodeView) -> tuple[float, int, float]:
        """Return ``(last_access_s, -depth_tokens, created_s)`` for ``node``."""
        return (node.last_access_s, -node.depth_tokens, node.created_s)

"""First-in-first-out eviction.

Priority of an evictable leaf = ``(created_s, -depth_tokens)``: the leaf whose run was created
first goes first, deeper before shallower among runs created at the same clock reading (so a
chain is trimmed from its tail). Hits and unlocks never change the order.
"""

from __future__ import annotations

from .base import NodeView, PriorityPolicy, register


@register("fifo")
class FIFOPolicy(PriorityPolicy):
    """Evict the oldest leaf first, ignoring hits (ties: deeper first)."""

    def priority(self, node: NodeView) -> tuple[float, int]:
        """Return ``(created_s, -depth_tokens)`` for ``node``."""
        return (node.created_s, -node.depth_tokens)

"""Cost-aware eviction (``cost``): keep the blocks whose expected saved recompute is largest.

DRAFT — formula being tuned; final docstring follows the measurements.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from .base import NodeView, register
from .cost_model import CostShape
from .gdsf import GreedyDualPolicy


@register("cost")
class CostAwarePolicy(GreedyDualPolicy):
    """GreedyDual with credit ``P(reuse) · C / S``."""

    def __init__(self, model_shape: str | CostShape | Any | None = None, *,
                 prior_hits: float = 1.0, prior_misses: float = 2.0,
                 exponent: float = 1.0, cost_exponent: float = 1.0, ghost: bool = True,
                 adaptive: float = 0.0, ghost_size: int = 1 << 16, ewma: float = 0.01,
                 adaptive_all: bool = False, gamma_max: float = 4.0,
                 recency_rate: float = 0.0) -> None:
        super().__init__(model_shape)
        self.prior_hits = prior_hits
        self.prior_misses = prior_misses
        self.exponent = exponent
        self.cost_exponent = cost_exponent
        self.use_ghost = ghost
        self.adaptive = adaptive
        self.ghost_size = ghost_size
        self.ewma = ewma
        self.adaptive_all = adaptive_all
        self.recency_rate = recency_rate
        self.gamma_max = gamma_max
        self._inherited: dict[int, int] = {}
        self._tail: dict[int, bytes] = {}
        self._seen: dict[int, tuple[float, int]] = {}
        self._ghost: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self.reuse_gap_s = 0.0       # EWMA of observed reuse gaps
        self.eviction_age_s = 0.0    # EWMA of victims' idle time at eviction

    def _avg(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.ewma * (new - old)

    def hits(self, node: NodeView) -> int:
        uid = node.uid
        inherited = self._inherited.get(uid)
        if inherited is None:
            inherited = 0
            hashes = getattr(node, "hashes", None) if self.use_ghost else None
            if hashes and self._ghost:
                ghost = self._ghost
                for h in hashes:
                    entry = ghost.pop(h, None)
                    if entry is not None:
                        inherited = max(inherited, entry[0] + 1)
                        gap = node.last_access_s - entry[1]
                        if gap > 0:
                            self.reuse_gap_s = self._avg(self.reuse_gap_s, gap)
            self._inherited[uid] = inherited
        h = node.hit_count
        seen = self._seen.get(uid)
        if seen is not None and h > seen[1] and node.last_access_s > seen[0]:
            self.reuse_gap_s = self._avg(self.reuse_gap_s, node.last_access_s - seen[0])
        self._seen[uid] = (node.last_access_s, h)
        return h + inherited

    def reuse_probability(self, h: int) -> float:
        return (h + self.prior_hits) / (h + self.prior_hits + self.prior_misses)

    def value(self, node: NodeView) -> float:
        h = self.hits(node)
        hashes = getattr(node, "hashes", None)
        if hashes:
            self._tail[node.uid] = hashes[-1]
        p = self.reuse_probability(h)
        gamma = self.exponent
        if self.adaptive and self.eviction_age_s > 0 and self.reuse_gap_s > 0:
            gamma = min(self.gamma_max, self.adaptive * self.reuse_gap_s / self.eviction_age_s)
        c = self.node_flops(node) / max(1, node.num_blocks)
        if self.adaptive_all:
            return (p * c / self._c0(node)) ** gamma
        return (p ** gamma) * (c ** self.cost_exponent)

    def _c0(self, node: NodeView) -> float:
        bs = node.num_tokens // max(1, node.num_blocks)
        return self.node_flops_at(0, bs)

    def node_flops_at(self, start: int, n: int) -> float:
        from .cost_model import prefill_flops
        return prefill_flops(self.shape, start, n) * 1e-12

    def on_evict(self, node: NodeView, num_blocks: int) -> None:
        super().on_evict(node, num_blocks)
        uid = node.uid
        age = self._latest - node.last_access_s
        if age >= 0:
            self.eviction_age_s = self._avg(self.eviction_age_s, age)
        tail = self._tail.pop(uid, None)
        if tail is not None and self.use_ghost:
            self._ghost[tail] = (node.hit_count + self._inherited.get(uid, 0), node.last_access_s)
            if len(self._ghost) > self.ghost_size:
                self._ghost.popitem(last=False)
        if node.num_blocks == 0:
            self._inherited.pop(uid, None)
            self._seen.pop(uid, None)

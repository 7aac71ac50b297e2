"""Offline oracles ``belady`` and ``belady-cost`` (benchmarks only: they read the future).

Belady's MIN (L. A. Belady, "A study of replacement algorithms for a virtual-storage computer",
IBM Systems Journal 5(2), 1966) evicts the block whose next use lies farthest in the future.
On the radix tree eviction trims the tail of an evictable leaf, and a leaf's tail block is never
needed before the blocks in front of it, so the oracle keys each leaf by the next use of its
*tail* block: ``(-next_use(node), depth)`` (never used again = ``+inf`` goes first). The key only
changes when the tail block is used (a hit re-keys the leaf) or trimmed (a trim re-keys it).

``belady-cost`` weighs the same knowledge by recompute cost: the tail block is worth
``C_tail / (next_use - now)`` (FLOPs saved per unit of time it occupies a slot), kept static
between events with the GreedyDual inflation clock of :mod:`eviction.gdsf` (blocks never used
again are worth 0). It targets saved FLOPs rather than hits; it is a heuristic, not an optimum
(offline weighted caching is a min-cost-flow problem, too slow to replay here).

Both take ``next_use``: a callable ``(node) -> float`` the benchmark builds from the trace
(request index or time of the next lookup that would match the node's tail block, ``inf`` if
none), and ``now`` (a callable returning the same unit for the current request). They are
registered for ``bench eviction`` and refuse to be built without the oracle.
"""

from __future__ import annotations

import math
from typing import Callable

from .base import NodeView, PriorityPolicy, register
from .cost_model import prefill_flops
from .gdsf import _TERA, GreedyDualPolicy

NextUse = Callable[[NodeView], float]


def _require(next_use: NextUse | None, name: str) -> NextUse:
    if next_use is None:
        raise ValueError(f"eviction_policy: {name!r} is an offline oracle for benchmarks; it "
                         "needs next_use= from the trace")
    return next_use


@register("belady")
class BeladyPolicy(PriorityPolicy):
    """Evict the leaf whose tail block is used again farthest in the future.

    Args:
        next_use: ``(node) -> float``, next use of the node's tail block (``inf`` if never).
        now: Unused (accepted so both oracles take the same arguments).
        model_shape: Unused (same reason).
    """

    uses_model_shape = True

    def __init__(self, next_use: NextUse | None = None, now: Callable[[], float] | None = None,
                 model_shape: object = None) -> None:
        self.next_use = _require(next_use, "belady")

    def priority(self, node: NodeView) -> tuple[float, int]:
        return (-self.next_use(node), -node.depth_tokens)


@register("belady-cost")
class BeladyCostPolicy(GreedyDualPolicy):
    """GreedyDual with the oracle's credit ``C_tail / (next_use - now)`` (0 if never used).

    Args:
        next_use: As for :class:`BeladyPolicy`.
        now: ``() -> float``, the current request's position in the same unit as ``next_use``.
        model_shape: Cost-model shape (default ``llama3-8b``).
    """

    def __init__(self, next_use: NextUse | None = None, now: Callable[[], float] | None = None,
                 model_shape: object = None) -> None:
        super().__init__(model_shape)
        self.next_use = _require(next_use, "belady-cost")
        if now is None:
            raise ValueError("eviction_policy: 'belady-cost' needs now= from the benchmark")
        self.now = now

    def value(self, node: NodeView) -> float:
        nxt = self.next_use(node)
        if math.isinf(nxt) or node.num_blocks == 0:
            return 0.0
        bs = node.num_tokens // node.num_blocks
        tail = prefill_flops(self.shape, node.depth_tokens + node.num_tokens - bs, bs) * _TERA
        return tail / max(1e-9, nxt - self.now())

"""GreedyDual-Size-Frequency eviction (``gdsf``) and the GreedyDual machinery ``cost`` shares.

GreedyDual (Young 1994; GreedyDual-Size: Cao & Irani, "Cost-Aware WWW Proxy Caching
Algorithms", USITS 1997) gives each cached object a credit ``H = L + value`` when it is
accessed and evicts the object of least ``H``; on each eviction the *inflation clock* ``L``
rises to the victim's ``H``. Objects that are not accessed again therefore age relative to new
ones without any rescoring: recency enters through ``L``, never through a wall-clock scan.
GDSF (Cherkasova, "Improving WWW Proxy Performance with Greedy-Dual-Size-Frequency Caching
Policy", HP Labs TR HPL-98-69, 1998) uses ``value = F · C / S`` with ``F`` the access count,
``C`` the cost to fetch the object again and ``S`` its size.

On the radix tree an object is an evictable leaf (a run of blocks trimmed from its tail):

* ``F = hit_count + 1`` (lookups that matched the node, plus its insertion),
* ``C`` = prefill FLOPs to recompute the node's tokens at their depth
  (``eviction.cost_model``: deeper blocks cost more),
* ``S = num_blocks``,
* ``L`` in effect for the node is the clock as it stood when the node was last accessed
  (``last_access_s``): :class:`GreedyDualPolicy` keeps the history of ``L`` by clock reading, so
  a node that was accessed while interior (not in the leaf index) and becomes a leaf later still
  gets the credit of its access time. The key is a pure function of the node's fields and that
  append-only history, so the tree's event-driven re-keying stays exact.

Value units are TFLOPs per block.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from .base import NodeView, PriorityPolicy, register
from .cost_model import CostShape, get_shape, prefill_flops

_TERA = 1e-12


class GreedyDualPolicy(PriorityPolicy):
    """Priority ``(L(last access) + value(node), last_access_s, -depth_tokens)``; subclasses
    define :meth:`value`. ``L`` rises to each victim's ``H`` (on :meth:`on_evict`).

    Args:
        model_shape: Cost-model shape: a preset name, a ``CostShape``, a ``ModelShape``-like
            object, or None (``llama3-8b``).

    Attributes:
        inflation: The current inflation clock ``L``.
    """

    uses_model_shape = True
    recency_rate = 0.0

    def __init__(self, model_shape: str | CostShape | Any | None = None) -> None:
        self.shape = get_shape(model_shape)
        self.inflation = 0.0
        # L history: _levels[i] is L after the evictions stamped _times[i] (strictly increasing
        # times); an access at clock t sees the last level stamped strictly before t.
        self._times: list[float] = [-math.inf]
        self._levels: list[float] = [0.0]
        self._latest = -math.inf  # latest clock reading seen in any node
        self._keys: dict[int, float] = {}  # uid -> H of its current leaf-index entry

    # ---- subclass hook ------------------------------------------------------------------
    def value(self, node: NodeView) -> float:  # pragma: no cover - abstract
        """Credit a node earns on access (same units as ``L``)."""
        raise NotImplementedError

    # ---- helpers ------------------------------------------------------------------------
    def node_flops(self, node: NodeView) -> float:
        """TFLOPs to recompute the node's tokens at their depth."""
        return prefill_flops(self.shape, node.depth_tokens, node.num_tokens) * _TERA

    def level_at(self, t: float) -> float:
        """``L`` in effect for an access at clock reading ``t``."""
        return self._levels[bisect.bisect_left(self._times, t) - 1]

    # ---- policy protocol ----------------------------------------------------------------
    def priority(self, node: NodeView) -> tuple[float, float, int]:
        t = node.last_access_s
        if t > self._latest:
            self._latest = t
        h = self.level_at(t) + self.value(node) + self.recency_rate * t
        self._keys[node.uid] = h
        return (h, t, -node.depth_tokens)

    def on_evict(self, node: NodeView, num_blocks: int) -> None:
        h = self._keys.get(node.uid)
        if node.num_blocks == 0:
            self._keys.pop(node.uid, None)
        if h is None or h <= self.inflation:
            return
        self.inflation = h
        stamp = self._latest
        if self._times[-1] == stamp:
            self._levels[-1] = h
        else:
            self._times.append(stamp)
            self._levels.append(h)


@register("gdsf")
class GDSFPolicy(GreedyDualPolicy):
    """GDSF: ``H = L + (hit_count + 1) · C / S`` with ``C`` the node's recompute TFLOPs."""

    def value(self, node: NodeView) -> float:
        return (node.hit_count + 1) * self.node_flops(node) / max(1, node.num_blocks)

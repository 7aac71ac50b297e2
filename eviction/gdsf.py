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
  gets the credit of its access time. Entries are stamped with the latest clock reading seen
  and an access at ``t`` reads the last entry stamped strictly before ``t``, so an entry added
  later never changes a key already given out; the key is also memoised per node state, so the
  tree's event-driven re-keying (and its integrity check) see one key per event.

Value units are TFLOPs per block. Subclasses may set ``drift`` (used by ``cost``): ``L`` then
also advances with the clock between evictions (see :class:`GreedyDualPolicy`).
"""

from __future__ import annotations

import bisect
import math

from .base import NodeView, PriorityPolicy, register
from .cost_model import get_shape, prefill_flops

_TERA = 1e-12
#: Entries of the ``L`` history kept (about 24 bytes each, times three lists).
_HISTORY = 1 << 17


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
    #: Clock drift: besides rising to each victim's ``H``, ``L`` advances with the clock at
    #: ``drift × mean credit ÷ mean idle time of victims`` per second, so that among leaves of
    #: nearly equal credit the least recently used goes first (0 = plain GreedyDual).
    drift = 0.0
    #: Weight of each new sample in the running means the drift uses.
    ewma = 0.01

    def __init__(self, model_shape: object = None) -> None:
        self.shape = get_shape(model_shape)
        self.inflation = 0.0
        # L history: from clock reading _times[i] on, L = _levels[i] + _rates[i] · (t - _times[i])
        # (strictly increasing times); an access at clock t sees the entry stamped strictly
        # before t, so later entries never change a key already given out.
        self._times: list[float] = [-math.inf]
        self._levels: list[float] = [0.0]
        self._rates: list[float] = [0.0]
        self._latest = -math.inf  # latest clock reading seen in any node
        self._keys: dict[int, float] = {}  # uid -> H of its current leaf-index entry
        self._memo: dict[int, tuple[tuple, tuple]] = {}  # uid -> (node state, key)
        self.mean_credit = 0.0  # running mean of the credits given (drift only)
        self.mean_victim_idle_s = 0.0  # running mean of victims' idle time (drift only)
        self._first: float | None = None  # first clock reading seen (drift only)

    # ---- subclass hook ------------------------------------------------------------------
    def value(self, node: NodeView) -> float:  # pragma: no cover - abstract
        """Credit a node earns on access (same units as ``L``)."""
        raise NotImplementedError

    def drift_scale(self) -> float:
        """Factor on ``drift`` for the next stretch of ``L`` (1; ``cost`` may lower it)."""
        return 1.0

    # ---- helpers ------------------------------------------------------------------------
    def node_flops(self, node: NodeView) -> float:
        """TFLOPs to recompute the node's tokens at their depth."""
        return prefill_flops(self.shape, node.depth_tokens, node.num_tokens) * _TERA

    def _mean(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.ewma * (new - old)

    def level_at(self, t: float) -> float:
        """``L`` in effect for an access at clock reading ``t``."""
        i = bisect.bisect_left(self._times, t) - 1
        rate = self._rates[i]
        return self._levels[i] + rate * (t - self._times[i]) if rate else self._levels[i]

    # ---- policy protocol ----------------------------------------------------------------
    def priority(self, node: NodeView) -> tuple[float, float, int]:
        t = node.last_access_s
        # The key is fixed by the node's state at its last event: asked again without a new
        # event (the tree's integrity check does), the same key comes back.
        state = (t, node.hit_count, node.num_blocks, node.depth_tokens)
        memo = self._memo.get(node.uid)
        if memo is not None and memo[0] == state:
            return memo[1]
        prev = self._latest
        if t > prev:
            self._latest = t
        v = self.value(node)
        if self.drift:
            self.mean_credit = self._mean(self.mean_credit, v)
            if self._first is None:
                self._first = t
            if self.mean_victim_idle_s == 0.0 and t > self._times[-1]:
                self._restamp(prev, None)  # warming up: pace the drift by the time elapsed
        h = self.level_at(t) + v
        self._keys[node.uid] = h
        key = (h, t, -node.depth_tokens)
        self._memo[node.uid] = (state, key)
        return key

    def cap_key(self, uid: int, level: float) -> None:
        """Lower the ``H`` recorded for leaf ``uid`` to ``level`` when above it: a policy that
        evicts the leaf out of GreedyDual's order (``predicted-reuse``) keeps ``L`` from rising
        past the least key, where GreedyDual's own victim would have left it."""
        h = self._keys.get(uid)
        if h is not None and h > level:
            self._keys[uid] = level

    def on_evict(self, node: NodeView, num_blocks: int) -> object | None:
        h = self._keys.get(node.uid)
        if node.num_blocks == 0:
            self._keys.pop(node.uid, None)
            self._memo.pop(node.uid, None)
        if self.drift:
            idle = self._latest - node.last_access_s
            if idle > 0:
                self.mean_victim_idle_s = self._mean(self.mean_victim_idle_s, idle)
        self._restamp(self._latest, h)
        return None  # no note (``cost``, a subclass, returns one)

    def _restamp(self, stamp: float, h: float | None) -> None:
        """From ``stamp`` on: ``L`` = max(its current value, ``h``), advancing at the drift rate."""
        if stamp == -math.inf:
            return
        rate = 0.0
        if self.drift:
            idle = self.mean_victim_idle_s
            if idle == 0.0 and self._first is not None:
                idle = stamp - self._first
            if idle > 0:
                rate = self.drift * self.drift_scale() * self.mean_credit / idle
        last_rate = self._rates[-1]
        now = self._levels[-1]
        if last_rate:
            now += last_rate * (stamp - self._times[-1])
        level = now if h is None or h <= now else h
        if level == now and rate == last_rate:
            return
        self.inflation = level
        if self._times[-1] == stamp:
            self._levels[-1], self._rates[-1] = level, rate
        else:
            self._times.append(stamp)
            self._levels.append(level)
            self._rates.append(rate)
            if len(self._times) > _HISTORY:  # bound memory in a long-running server
                self._forget()

    def _forget(self) -> None:
        """Drop the older half of the ``L`` history: a node last accessed before what remains
        (idle through ~``_HISTORY / 2`` evictions) is credited as if ``L`` had been 0 then, so
        it goes before anything accessed since."""
        cut = len(self._times) // 2
        del self._times[1:cut], self._levels[1:cut], self._rates[1:cut]
        self._levels[0], self._rates[0] = 0.0, 0.0


@register("gdsf")
class GDSFPolicy(GreedyDualPolicy):
    """GDSF: ``H = L + (hit_count + 1) · C / S`` with ``C`` the node's recompute TFLOPs."""

    def value(self, node: NodeView) -> float:
        return (node.hit_count + 1) * self.node_flops(node) / max(1, node.num_blocks)

"""Cost-aware eviction (``cost``, ours): keep the blocks whose expected saved recompute, per block
held, is largest.

Formula
-------
A GreedyDual policy (:class:`eviction.gdsf.GreedyDualPolicy`): an evictable leaf ``ν`` accessed
at clock ``t`` gets the key ``H(ν) = L(t) + v(ν)`` and the leaf of least ``H`` loses its tail
block first; the inflation clock ``L`` rises to each victim's ``H``. The credit is

    v(ν) = ( P(ν) · c(ν) / c₀ ) ^ γ

* ``c(ν)`` — recompute FLOPs per block of the node at its depth (``eviction.cost_model``:
  ``C(depth, tokens) / blocks``; deeper blocks cost more), ``c₀`` the same for a block at depth
  0, so the credit is dimensionless ("blocks' worth of shallow prefill").
* ``P(ν)`` — probability that a later lookup reaches the node again, from its own reuse
  history: ``P = (h + 1) / (h + 4)`` (a Beta(1, 3) prior updated by ``h`` observed reuses).
  ``h`` is the node's ``hit_count`` (every lookup through the node counts, so a shared prefix
  with a large fan-out has a large ``h``) **plus the history it had before an eviction**: when
  a leaf's tail is evicted, the policy's ``on_evict`` note ``(h, last access)`` is kept with
  the evicted run in the cache's ghost list (the idea of S3-FIFO's ghost queue); a new node
  that brings the run back (the session came back after its tip was evicted) gets the note
  through ``on_ghost_hit`` and inherits ``h_old + 1``. The prior and the slope come from the
  shared Mooncake conversation trace: the tip of a request that continues ``k`` earlier turns
  is reused again with probability 0.33, 0.40, 0.55, 0.60, 0.75 for ``k = 0 … 4``.
* ``γ`` — how strongly value overrides recency, adapted event by event to the cache's own
  pressure: ``γ = min(3, (ĝ / T̂)²)``, with ``ĝ`` the running mean of observed reuse gaps (a
  node hit again, or a ghost coming back) and ``T̂`` the running mean idle time of evicted
  leaves. When leaves are evicted long before the typical reuse (small pool, ``T̂ ≪ ĝ``) only
  the most valuable leaves can be kept until their reuse and the credit decides (S3-FIFO-like
  quick demotion of one-off tails); when the pool outlives typical reuse gaps (``T̂ ≫ ĝ``) the
  credits flatten toward 1 and eviction tends to LRU, which is near optimal there (on the
  Mooncake trace the remaining reuse probability of a 10-minute-idle tip no longer depends on
  its history). Until both means exist ``γ = 1``.
* Clock drift (``drift = 3``): ``L`` also advances with the clock at ``3 × mean credit ÷ T̂`` per
  second, integrated piecewise in the history of ``L`` so no key changes after it is given out.
  Without it, leaves of nearly equal credit accessed between two rises of ``L`` tie on
  ``L(t)`` and the credit alone orders them, ignoring recency (GreedyDual's plateaus).
  Optionally (``drift_pressure = κ > 0``; off in ``cost``, on in ``predicted-reuse``) the drift
  is scaled by ``min(1, κ · T̂ / ĝ)²`` when the rate is next set: in a pool that evicts leaves
  long before the typical reuse gap (``T̂ ≪ ĝ``), how recently a leaf was used says little about
  whether it is reused before it would be evicted (over an idle time much shorter than the
  reuse gap, the chance of a return barely changes; LHD's hit density as a function of age),
  so recency weighs less against the credit. With ``κ = 4`` it acts only while
  ``T̂ < ĝ / 4`` (on the Mooncake trace: the 2 % pool, ``T̂ / ĝ ≈ 0.17``; from 5 % on
  ``T̂ / ĝ ≳ 0.45``).

Everything is event-driven: a key is computed when the tree re-keys a leaf (insert, hit,
unlock, split, trim); ``ĝ``, ``T̂`` and ``L`` change on hits and evictions; nothing rescans the
tree or rescores by wall clock.

Sources: N. Young, "The k-server dual and loose competitiveness for paging", Algorithmica 1994
(GreedyDual); P. Cao and S. Irani, "Cost-Aware WWW Proxy Caching Algorithms", USITS 1997
(GreedyDual-Size); L. Cherkasova, "Improving WWW Proxy Performance with Greedy-Dual-Size-
Frequency Caching Policy", HP Labs HPL-98-69, 1998 (frequency in the credit); J. Yang et al.,
"FIFO queues are all you need for cache eviction", SOSP 2023 (ghost history, quick demotion);
N. Beckmann, H. Chen, A. Cidon, "LHD: Improving Cache Hit Rate by Maximizing Hit Density",
NSDI 2018 (value per space-time, hence the dependence on reuse gaps vs. residency).

The policy keeps no ghost of its own: the history of evicted runs comes back from the cache's
ghost list (a cache without one, or too small a one, simply gives no inherited history).
"""

from __future__ import annotations

from .base import NodeView, register
from .cost_model import prefill_flops
from .gdsf import _TERA, GreedyDualPolicy


@register("cost")
class CostAwarePolicy(GreedyDualPolicy):
    """GreedyDual with credit ``(P(reuse) · c / c₀) ^ γ`` (see the module docstring).

    Args:
        model_shape: Cost-model shape: a preset name, ``CostShape``, a ``ModelShape``-like
            object, or None (``llama3-8b``).
        prior_hits, prior_misses: The Beta prior of ``P`` (1, 3).
        gamma_max: Largest ``γ`` (3).
        drift: Clock drift, in mean credits per mean victim idle time (3).
        drift_pressure: ``κ``: scale the drift by ``min(1, κ · T̂ / ĝ)²`` (0, the default:
            never; module docstring).

    Attributes:
        gamma: ``γ`` used for the latest credit.
        reuse_gap_s: ``ĝ``, running mean of observed reuse gaps (clock units).
        eviction_idle_s: ``T̂``, running mean idle time of evicted leaves (clock units).
    """

    drift = 3.0

    def __init__(self, model_shape: object = None, *,
                 prior_hits: float = 1.0, prior_misses: float = 3.0, gamma_max: float = 3.0,
                 drift: float = 3.0, drift_pressure: float = 0.0) -> None:
        super().__init__(model_shape)
        if prior_hits <= 0 or prior_misses <= 0:
            raise ValueError("prior_hits, prior_misses: must be positive")
        if not drift_pressure >= 0:
            raise ValueError(f"drift_pressure: must be ≥ 0, got {drift_pressure!r}")
        self.drift_pressure = drift_pressure
        self.prior_hits = prior_hits
        self.prior_misses = prior_misses
        self.gamma_max = gamma_max
        self.drift = drift
        self.gamma = 1.0
        self.reuse_gap_s = 0.0
        self._c0: dict[int, float] = {}  # block size -> FLOPs of one block at depth 0
        self._inherited: dict[int, int] = {}  # uid -> reuses before its blocks were evicted
        self._seen: dict[int, tuple[float, int]] = {}  # uid -> (last access, hit_count) seen
        # uid -> notes (reuses, last access) of evicted runs a new node brought back
        self._ghost_hits: dict[int, list[tuple[int, float]]] = {}

    @property
    def eviction_idle_s(self) -> float:
        return self.mean_victim_idle_s

    # ---- reuse history ------------------------------------------------------------------
    def reuses(self, node: NodeView) -> int:
        """``h``: lookups through the node plus those of its evicted past (ghost)."""
        uid = node.uid
        t, hits = node.last_access_s, node.hit_count
        inherited = self._inherited.get(uid)
        if inherited is None:  # first sight: a new run, a split head, or a grown-back session
            inherited = 0
            for old_reuses, old_access_s in self._ghost_hits.pop(uid, ()):
                inherited = max(inherited, old_reuses + 1)
                if t > old_access_s:
                    self.reuse_gap_s = self._mean(self.reuse_gap_s, t - old_access_s)
            self._inherited[uid] = inherited
        seen = self._seen.get(uid)
        if seen is not None and hits > seen[1] and t > seen[0]:
            self.reuse_gap_s = self._mean(self.reuse_gap_s, t - seen[0])
        self._seen[uid] = (t, hits)
        return hits + inherited

    def reuse_probability(self, h: int) -> float:
        """``P = (h + a) / (h + a + b)`` with the Beta(a, b) prior."""
        return (h + self.prior_hits) / (h + self.prior_hits + self.prior_misses)

    def drift_scale(self) -> float:
        """``min(1, κ · T̂ / ĝ)²`` with ``drift_pressure = κ > 0`` once both means exist, else 1."""
        k, g, idle = self.drift_pressure, self.reuse_gap_s, self.mean_victim_idle_s
        if k <= 0 or g <= 0 or idle <= 0:
            return 1.0
        f = k * idle / g
        return 1.0 if f >= 1.0 else f * f

    # ---- credit -------------------------------------------------------------------------
    def value(self, node: NodeView) -> float:
        p = self.reuse_probability(self.reuses(node))
        blocks = max(1, node.num_blocks)
        bs = max(1, node.num_tokens // blocks)
        c0 = self._c0.get(bs)
        if c0 is None:
            c0 = self._c0[bs] = prefill_flops(self.shape, 0, bs) * _TERA
        idle = self.mean_victim_idle_s
        if idle > 0 and self.reuse_gap_s > 0:
            self.gamma = min(self.gamma_max, (self.reuse_gap_s / idle) ** 2)
        return (p * self.node_flops(node) / blocks / c0) ** self.gamma

    def on_evict(self, node: NodeView, num_blocks: int) -> tuple[int, float]:
        """GreedyDual's inflation; returns the note ``(h, last access)`` for the ghost list."""
        super().on_evict(node, num_blocks)
        uid = node.uid
        note = (node.hit_count + self._inherited.get(uid, 0), node.last_access_s)
        if node.num_blocks == 0:
            self._inherited.pop(uid, None)
            self._seen.pop(uid, None)
            self._ghost_hits.pop(uid, None)
        return note

    def on_ghost_hit(self, node: NodeView, notes: list) -> None:
        """A node not yet keyed brought evicted runs back: its first key inherits their ``h``.

        A node already keyed (grown back in place) keeps its own ``hit_count`` instead."""
        if node.uid not in self._inherited:
            self._ghost_hits.setdefault(node.uid, []).extend(notes)

"""Learned-reuse eviction (``predicted-reuse``, ours) and its prior-only twin
(``predicted-reuse-prior``): keep the blocks whose expected saved recompute per block-second held
is largest, with the probability of reuse learned online from the cache's own ghost list.

Formula
-------
A GreedyDual policy with ``cost``'s machinery (:class:`eviction.cost_aware.CostAwarePolicy`:
inflation clock ``L`` rising to each victim's key, clock drift, pressure exponent ``γ``, ghost
inheritance of the reuse count ``h``). A leaf accessed at clock ``t`` gets ``H = L(t) + v`` with

    v = ( P̂ · c / c₀ · (ĝ / τ̂) ^ β ) ^ γ

* ``c / c₀`` — recompute FLOPs per block at the node's depth over those of a block at depth 0
  (``eviction.cost_model``, as ``cost``).
* ``P̂`` — probability that the node is asked for again within the horizon. The prior is
  ``cost``'s Beta(1, 3) estimate ``P₀ = (h + 1) / (h + 4)``; the learned model is a logistic
  regression over :data:`FEATURES` (the prior's logit among them) fitted by
  :class:`eviction._reuse_learner.ReuseLearner` on evicted runs, and ``P̂ = P₀ · σ(w·x + b) /
  r`` with ``r`` the share of evicted runs that came back (the model's *lift* over an average
  victim, clipped to ``[1/4, 4]``), so an untrained or uninformative model gives the prior.
* ``τ̂`` — expected time to that reuse: the mean of the node's last inter-access gaps
  (``access_gaps``), else the gap between its session's last two requests (a live agent
  session comes back within its tool-call latency), else ``ĝ``, the running mean of observed
  reuse gaps; ``(ĝ / τ̂) ^ β`` is clipped to ``[1/4, 4]`` so one feature cannot dominate.
  Dividing by ``τ̂`` turns the saved recompute into a rate: value per block-second held
  (N. Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing Hit Density", NSDI 2018).

Keys are computed at tree events only (insert, hit, unlock, split, trim); a model refit changes
the keys given out afterwards, never those already in the leaf index.

Labels (LRB: Z. Song et al., "Learning Relaxed Belady for Content Distribution Network
Caching", NSDI 2020): :meth:`on_evict` returns the note ``(h, last access, sample id)`` that the
cache keeps in its ghost list, and remembers the features the node was keyed with. The sample
is labelled 1 when the run comes back (:meth:`on_ghost_hit`) within the horizon
(``horizon_factor`` × the mean idle time of victims), and 0 when the ghost list forgets it
(:meth:`on_ghost_drop`) or the horizon passes first.

Training: every ``train_every`` evictions on the last ``window`` samples, synchronously with a
fixed seed (``train_mode="sync"``, benchmarks: reproducible) or on a one-thread background
worker (``"background"``, the server: the step loop never waits). ``train_cpu_s`` and
``background_train_cpu_s`` report the time spent. scikit-learn is imported only by the fit.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from ._reuse_learner import ReuseLearner, logistic
from .base import NodeView, register
from .cost_aware import CostAwarePolicy
from .cost_model import CostShape, prefill_flops

#: Names of the predictor's inputs, in vector order (all known when the node is keyed).
FEATURES = (
    "prior_logit",          # logit of the Beta prior (h + 1) / (h + 4)
    "log_reuses",           # log(1 + h), h = hits + inherited ghost reuses
    "has_gaps",             # 1 when the node was hit at least twice (access_gaps non-empty)
    "log_gap_ratio",        # log(mean access gap / ĝ), 0 without gaps
    "log_depth",            # log(1 + depth_tokens / 1024)
    "log_max_children",     # log(1 + most children the node ever had)
    "has_session",          # 1 when a request carried a session key into the node
    "log_session_gap",      # log(1 + gap between the session's last two requests / ĝ)
    "log_request_s",        # log(1 + (request end - last access) / ĝ): how long it was held
    "log_blocks",           # log(1 + num_blocks)
)
#: Bound of the pending (unlabelled) samples and of the per-session state kept.
_PENDING_MAX = 1 << 16
_SESSIONS_MAX = 1 << 16


@register("predicted-reuse")
class PredictedReusePolicy(CostAwarePolicy):
    """GreedyDual with credit ``(P̂ · c / c₀ · (ĝ / τ̂)^β)^γ`` (see the module docstring).

    Args:
        model_shape: Cost-model shape (preset name, ``CostShape``, ``ModelShape``-like, None:
            ``llama3-8b``).
        learn: False replaces the learned ``P̂`` by its prior (``predicted-reuse-prior``).
        train_mode: ``"background"`` (default; the server) or ``"sync"`` (benchmarks).
        seed: Seed of the fit (reproducible sync runs).
        train_every: Evictions (blocks) between fits (4096).
        window: Labelled samples a fit uses, newest first (4096).
        horizon_factor: Horizon of the label in mean victim idle times (2).
        gap_weight: ``β``, weight of the expected time to reuse (1).
        lift_max: Bound of the learned lift over the prior (4).
        regularization: Inverse L2 strength ``C`` of the logistic fit (1).
        lift_outside: Apply the learned lift outside the exponent ``γ`` (False).
        prior_hits, prior_misses, gamma_max, drift: As ``cost``.

    Attributes:
        train_cpu_s: CPU seconds spent fitting (any thread).
        background_train_cpu_s: The part spent on the background worker.
        train_mode: ``"sync"`` or ``"background"``.
        learner: The :class:`ReuseLearner` (its ``coef``, ``fits``, label counts).

    Raises:
        ValueError: naming the argument when a value is out of range.
    """

    def __init__(self, model_shape: str | CostShape | Any | None = None, *, learn: bool = True,
                 train_mode: str = "background", seed: int = 0, train_every: int = 4096,
                 window: int = 4096, horizon_factor: float = 2.0, gap_weight: float = 1.0,
                 lift_max: float = 4.0, regularization: float = 1.0, lift_outside: bool = False,
                 prior_hits: float = 1.0, prior_misses: float = 3.0, gamma_max: float = 3.0,
                 drift: float = 3.0) -> None:
        super().__init__(model_shape, prior_hits=prior_hits, prior_misses=prior_misses,
                         gamma_max=gamma_max, drift=drift)
        if horizon_factor <= 0:
            raise ValueError(f"horizon_factor: must be positive, got {horizon_factor!r}")
        if gap_weight < 0:
            raise ValueError(f"gap_weight: must be ≥ 0, got {gap_weight!r}")
        self.learn = learn
        self.horizon_factor = horizon_factor
        self.gap_weight = gap_weight
        self.lift_max = lift_max
        self.lift_outside = lift_outside
        self.learner = ReuseLearner(len(FEATURES), window=window, train_every=train_every,
                                    train_mode=train_mode, seed=seed,
                                    regularization=regularization)
        self._features: dict[int, tuple[float, ...]] = {}  # uid -> features of its latest key
        self._pending: dict[int, tuple[float, ...]] = {}  # sample id -> features, unlabelled
        self._pending_order: deque[tuple[int, float]] = deque()  # (sample id, eviction clock)
        self._next_sample = 0
        # uid -> (last access, hit count, P̂ · rate) of its latest key: a trim keeps them
        self._credit: dict[int, tuple[float, int, float, float]] = {}
        # The run being trimmed (blocks of one leaf taken in a row): one sample per run, as
        # the tree records one ghost run (and note) per leaf per eviction pass.
        self._run_uid, self._run_sid = -1, -1
        self._sessions: dict[str, tuple[float, float]] = {}  # key -> (last request, gap before)

    # ---- reporting --------------------------------------------------------------------------
    @property
    def train_mode(self) -> str:
        return self.learner.train_mode

    @property
    def train_cpu_s(self) -> float:
        return self.learner.train_cpu_s

    @property
    def background_train_cpu_s(self) -> float:
        return self.learner.background_train_cpu_s

    # ---- prediction -------------------------------------------------------------------------
    def features(self, node: NodeView, h: int) -> tuple[float, ...]:
        """The feature vector of :data:`FEATURES` for ``node`` keyed now with ``h`` reuses."""
        p0 = self.reuse_probability(h)
        g = self.reuse_gap_s
        gaps = getattr(node, "access_gaps", ())
        gap_ratio = 0.0
        if gaps and g > 0:
            mean_gap = sum(gaps) / len(gaps)
            gap_ratio = math.log(max(mean_gap, 1e-9) / g)
        session = getattr(node, "session_key", None)
        session_gap = request_s = 0.0
        if session is not None and g > 0:
            state = self._sessions.get(session)
            if state is not None and state[1] > 0:
                session_gap = math.log1p(state[1] / g)
        end_s = getattr(node, "request_end_s", None)
        if end_s is not None and g > 0 and end_s > node.last_access_s:
            request_s = math.log1p((end_s - node.last_access_s) / g)
        return (math.log(p0 / (1.0 - p0)), math.log1p(h), 1.0 if gaps else 0.0, gap_ratio,
                math.log1p(node.depth_tokens / 1024.0),
                math.log1p(getattr(node, "max_children", 0)), 0.0 if session is None else 1.0,
                session_gap, request_s, math.log1p(node.num_blocks))

    def reuse_probability_of(self, x: tuple[float, ...]) -> float:
        """``P̂`` for feature vector ``x``: the prior's (before a fit, or ``learn=False``) times
        the learned lift ``σ(w · x + b) / base rate``, clipped to ``[1/lift_max, lift_max]``.

        The model sees only evicted runs, most of which never return (a base rate of a few
        per cent), so its raw probability is on another scale than the prior's; the lift keeps
        the credits of an average victim where the prior puts them and lets the model move
        each node up or down from there."""
        p0 = logistic(x[0])
        coef = self.learner.coef if self.learn else None
        if coef is None:
            return p0
        weights, intercept, base = coef
        z = intercept
        for w, v in zip(weights, x):
            z += w * v
        lift = logistic(z) / base
        hi = self.lift_max
        return p0 * (hi if lift > hi else 1.0 / hi if lift * hi < 1.0 else lift)

    def expected_reuse_s(self, node: NodeView) -> float:
        """``τ̂``: mean of the node's access gaps, else its session's gap, else ``ĝ`` (0 when
        nothing was observed yet)."""
        gaps = getattr(node, "access_gaps", ())
        if gaps:
            return sum(gaps) / len(gaps)
        session = getattr(node, "session_key", None)
        if session is not None:
            state = self._sessions.get(session)
            if state is not None and state[1] > 0:
                return state[1]
        return self.reuse_gap_s

    def _track_session(self, node: NodeView) -> None:
        """Remember when the node's session last sent a request, and the gap before it."""
        session = getattr(node, "session_key", None)
        if session is None:
            return
        t = node.last_access_s
        state = self._sessions.get(session)
        if state is None:
            if len(self._sessions) >= _SESSIONS_MAX:
                self._sessions.clear()  # rare: forget old sessions wholesale
            self._sessions[session] = (t, 0.0)
        elif t > state[0]:
            self._sessions[session] = (t, t - state[0])

    def value(self, node: NodeView) -> float:
        uid, t, hits = node.uid, node.last_access_s, node.hit_count
        g = self.reuse_gap_s
        cached = self._credit.get(uid)
        if cached is not None and cached[0] == t and cached[1] == hits:
            reuse_rate, lift = cached[2], cached[3]  # a trim: only the node's length changed
        else:
            h = self.reuses(node)
            self._track_session(node)
            x = self.features(node, h)
            self._features[uid] = x
            rate = 1.0
            tau = self.expected_reuse_s(node)
            if self.gap_weight and tau > 0 and g > 0:
                rate = min(4.0, max(0.25, (g / tau) ** self.gap_weight))
            p0 = logistic(x[0])
            reuse_rate = self.reuse_probability_of(x) * rate
            lift = 1.0
            if self.lift_outside:  # the credit is (P₀ · rate · c / c₀)^γ · lift
                lift = reuse_rate / (p0 * rate)
                reuse_rate = p0 * rate
            self._credit[uid] = (t, hits, reuse_rate, lift)
        blocks = node.num_blocks or 1
        bs = node.num_tokens // blocks or 1
        c0 = self._c0.get(bs)
        if c0 is None:
            c0 = self._c0[bs] = prefill_flops(self.shape, 0, bs) * 1e-12
        idle = self.mean_victim_idle_s
        if idle > 0 and g > 0:
            self.gamma = min(self.gamma_max, (g / idle) ** 2)
        return (reuse_rate * self.node_flops(node) / blocks / c0) ** self.gamma * lift

    # ---- labels -----------------------------------------------------------------------------
    def on_evict(self, node: NodeView, num_blocks: int) -> tuple[int, float, int]:
        """Inflation (GreedyDual); returns the ghost note ``(h, last access, sample id)``."""
        h, last_s = super().on_evict(node, num_blocks)
        uid = node.uid
        x = self._features.get(uid)
        if node.num_blocks == 0:
            self._features.pop(uid, None)
            self._credit.pop(uid, None)
        sid = -1
        if x is not None and self.learn:
            self.learner.tick()
            if uid == self._run_uid:  # the same run grows: the tree keeps one note per run
                return (h, last_s, self._run_sid)
            sid = self._next_sample
            self._next_sample += 1
            self._pending[sid] = x
            self._pending_order.append((sid, self._latest))
            self._expire(self._latest)
        self._run_uid, self._run_sid = uid, sid
        return (h, last_s, sid)

    def _expire(self, now: float) -> None:
        """Label 0 every pending sample whose horizon passed (or beyond the bound)."""
        order = self._pending_order
        horizon = self.horizon_factor * self.mean_victim_idle_s
        while order and (len(order) > _PENDING_MAX
                         or (horizon > 0 and now - order[0][1] > horizon)):
            sid, _ = order.popleft()
            x = self._pending.pop(sid, None)
            if x is not None:
                self.learner.add(x, 0)

    def on_ghost_hit(self, node: NodeView, notes: list) -> None:
        """Runs came back: their samples are labelled 1; ``h`` is inherited as in ``cost``."""
        inherited = []
        for note in notes:
            h, last_s, sid = note
            x = self._pending.pop(sid, None)
            if x is not None:
                self.learner.add(x, 1)
            inherited.append((h, last_s))
        super().on_ghost_hit(node, inherited)

    def on_ghost_drop(self, notes: list) -> None:
        """The ghost list forgot these runs before they came back: labelled 0."""
        for note in notes:
            x = self._pending.pop(note[2], None)
            if x is not None:
                self.learner.add(x, 0)


@register("predicted-reuse-prior")
class PredictedReusePriorPolicy(PredictedReusePolicy):
    """``predicted-reuse`` with ``P̂`` replaced by its Beta prior (no learning, no labels)."""

    def __init__(self, model_shape: str | CostShape | Any | None = None, **kwargs: Any) -> None:
        kwargs["learn"] = False
        super().__init__(model_shape, **kwargs)

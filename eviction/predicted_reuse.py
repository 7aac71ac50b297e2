"""Predicted-reuse eviction (``predicted-reuse``, ours) and its prior-only twin
(``predicted-reuse-prior``): keep the blocks whose expected saved recompute per block-second
held is largest, with *when* each leaf is used next predicted from a learned model of how
sessions come back.

Formula
-------
The value of holding a leaf ``ν`` is its expected saved recompute per block-second,

    ρ(ν) = P(ν) · c(ν) / (t̂(ν) − now)

(``P`` the probability that it is asked for again, ``c`` the recompute FLOPs of its blocks at
their depth, ``t̂`` the predicted time of that reuse; N. Beckmann et al., "LHD: Improving Cache
Hit Rate by Maximizing Hit Density", NSDI 2018, for value per space-time). The policy evicts the
leaf of least ``ρ``, in one of two regimes chosen by the learned return-gap model
(:class:`eviction._return_gaps.ReturnGapModel`: the distribution of the time from a session's
request end to its next request, learned from the cache's own hits and ghost-list returns):

* **Regular returns** (gaps banded around their median, as an agent's calls one tool latency
  apart, or spread but held by the pool, as random tool latencies; ``ĝ`` the return window, the
  median or a higher percentile: :class:`~eviction._return_gaps.ReturnGapModel`): a leaf
  released at ``e`` by its session is *live* while ``now ≤ e + k·ĝ`` (``k = 1.1``) and *overdue*
  after (for its own session, ``P ≈ 0``: the session ended or moved on). Overdue leaves go
  first. An overdue leaf whose *session* is still active (it released or hit some other node
  within ``k·ĝ``: a multi-agent crew whose next call went to another agent's branch) is used
  again when its branch's turn comes back; one whose session went quiet too has ended, and only
  other sessions may still reuse it (a shared prompt, a task run again). So ended sessions'
  leaves go before active sessions' branches and shared prefixes (a node that had ≥ 2 children
  is used by whichever session comes, not ended with one), each group in ``cost``'s order (reuse
  history, depth). A branch whose session goes quiet later joins the ended group when a victim
  is next chosen (its session's activity, as last read, past the horizon, and none since).
  Among live leaves ``ρ`` is least for the furthest ``t̂``, the offline optimum's choice (L.
  Belady, IBM Systems Journal 1966) with the next use predicted: a live leaf is used again
  within its window with a learned probability ``P`` (:mod:`eviction._live_reuse`:
  scikit-learn's logistic regression on binned features of the leaf at its release, labelled by
  the cache's own hits and ghost-list returns; an agent that rewrites its history's tail, or a
  session's last call, leaves a leaf that is not continued), so its expected next use is
  ``t̂ = e + ĝ / P`` (one window of ``ĝ`` per try); before the first fit ``P = 1`` and the latest
  ``e`` goes first. A shared prefix's own mean access gap, when longer than ``ĝ``, sets how long it
  stays live. Keys are absolute times (``t̂``, ``e``) and ``cost``'s keys, set at tree events
  with the model of that moment; the clock only decides which of the oldest release times (and
  of the branches' session activity times) are past the horizon.
* **Irregular returns** (chat users coming back after seconds or hours): ``t̂`` is not
  predictable and ``ρ`` reduces to ``cost``'s credit — a GreedyDual key ``L + (P·c/c₀)^γ`` with
  ``P`` from the leaf's reuse history (:class:`eviction.cost_aware.CostAwarePolicy`, kept
  up to date in both regimes so a switch is instant), with one change: its clock drift (the
  weight of recency against the credit) shrinks as ``min(1, 4 · T̂ / ĝ)²`` when the pool
  evicts leaves long before the typical reuse gap (``T̂`` the mean idle time of victims, ``ĝ``
  the mean reuse gap; ``cost``'s ``drift_pressure``): there a leaf's age says little about
  whether it is reused before it would go.

Before 32 gap samples the model assumes regular returns (its prior); without session keys
(``prompt_cache_key`` / ``user``) a node's own release-to-next-hit gaps are the samples.
``predicted-reuse-prior`` has the no-information prior instead (no next use predictable,
``cost``'s fixed drift): ``cost``'s ordering exactly.

Both orders are kept over every evictable leaf in sorted indexes (``sortedcontainers``), keyed
at tree events (insert, hit, unlock, trim): choosing a victim is O(log n). A victim keeps its key
when it loses its tail (times do not move; ``cost``'s credit never rises), so the tree's
block-by-block rule takes the shortfall from it in one run. ``on_evict`` returns ``cost``'s ghost
note: a run that comes back inherits its reuse history.
"""

from __future__ import annotations

from typing import Any, Callable

from sortedcontainers import SortedList

from ._live_reuse import LiveReuseModel, features
from ._return_gaps import ReturnGapModel
from .base import NodeView, VictimPolicy, register
from .cost_aware import CostAwarePolicy

_TRAIN_MODES = ("sync", "background")
#: Sessions whose latest activity is remembered; past this the table is cleared (rare).
_SESSIONS_MAX = 1 << 16


@register("predicted-reuse")
class PredictedReusePolicy(VictimPolicy):
    """Evict the leaf of least predicted saved recompute per block-second (module docstring).

    Args:
        model_shape: Cost-model shape (preset name, ``CostShape``, ``ModelShape``-like, None:
            ``llama3-8b``).
        learn: False replaces the learned return-gap model by the no-information prior
            (``predicted-reuse-prior``: ``cost``'s ordering).
        overdue_factor: ``k``: a live leaf is overdue ``k · ĝ`` after its release (> 1).
        min_samples: Gap samples before the fitted regime replaces the prior (32).
        train_mode: Where the live tier's reuse model fits (:class:`LiveReuseModel`):
            ``"background"`` (default, the server: one worker thread, the step loop never
            waits) or ``"sync"`` (on the calling thread: ``bench eviction``, reproducible). The
            return-gap model refits inline either way (a sort of ≤ 256 floats every 8 samples).
        seed: ``random_state`` of every fit.
        prior_hits, prior_misses, gamma_max, drift: ``cost``'s parameters (irregular regime).
        drift_pressure: ``cost``'s ``κ`` (:class:`~eviction.cost_aware.CostAwarePolicy`): its
            clock drift scaled by ``min(1, κ · T̂ / ĝ)²`` (4; the prior twin keeps ``cost``'s
            fixed drift, 0).

    Attributes:
        gaps: The :class:`ReturnGapModel`.
        live_model: The live tier's :class:`LiveReuseModel` (None for the prior twin).
        victims_by_rule: Victims named so far per rule: ``overdue`` (ended session),
            ``branch`` (overdue leaf of a session still active, or a shared prefix),
            ``latest`` (live, furthest predicted next use), ``value`` (``cost``'s credit).

    Raises:
        ValueError: naming the argument when a value is out of range.
    """

    uses_model_shape = True

    def __init__(self, model_shape: object = None, *, learn: bool = True,
                 overdue_factor: float = 1.1, min_samples: int = 32, train_mode: str = "background",
                 seed: int = 0, prior_hits: float = 1.0, prior_misses: float = 3.0,
                 gamma_max: float = 3.0, drift: float = 3.0, drift_pressure: float = 4.0) -> None:
        if train_mode not in _TRAIN_MODES:
            raise ValueError(f"train_mode: must be 'sync' or 'background', got {train_mode!r}")
        if not overdue_factor > 1.0:
            raise ValueError(f"overdue_factor: must be > 1, got {overdue_factor!r}")
        self.learn = learn
        self.overdue_factor = overdue_factor
        self.seed = seed
        self._train_mode = train_mode
        self.value_policy = CostAwarePolicy(model_shape, prior_hits=prior_hits,
                                            prior_misses=prior_misses, gamma_max=gamma_max,
                                            drift=drift,
                                            drift_pressure=drift_pressure if learn else 0.0)
        vp = self.value_policy
        self.gaps = ReturnGapModel(min_samples=min_samples,
                                   victim_idle=lambda: vp.mean_victim_idle_s)
        self.live_model = LiveReuseModel(train_mode=train_mode, seed=seed) if learn else None
        self.victims_by_rule = {"overdue": 0, "branch": 0, "latest": 0, "value": 0}
        self._leaves: dict[int, NodeView] = {}
        self._by_time: SortedList[tuple] = SortedList()  # (release time key, uid): live leaves
        # (predicted next use - ĝ, uid): live leaves (learn=True)
        self._live: SortedList[tuple] = SortedList()
        self._live_key: dict[int, tuple] = {}
        # (session active, cost key, uid): leaves found overdue
        self._overdue: SortedList[tuple] = SortedList()
        self._overdue_key: dict[int, tuple] = {}
        # (session's latest activity when checked, uid): overdue leaves of an active session,
        # demoted to the ended group once that activity too is past the horizon
        self._branches: SortedList[tuple] = SortedList()
        self._branch_key: dict[int, tuple] = {}
        self._session_seen: dict[object, float] = {}  # session key -> its latest release or hit
        self._by_value: SortedList[tuple] = SortedList()  # (cost key, uid): every leaf
        self._time_key: dict[int, tuple] = {}
        self._value_key: dict[int, tuple] = {}
        self._is_overdue: set[int] = set()
        self._released: dict[int, float] = {}  # uid -> request end of its latest release
        self._key_hits: dict[int, int] = {}  # uid -> hit_count when last keyed (no ends)
        self._victim_rule: str | None = None
        self.now_s = float("-inf")  # latest clock reading seen on any node
        self._clock: Callable[[], float] | None = None

    def bind_clock(self, clock: Callable[[], float]) -> None:
        """The tree's clock: read when naming a victim, to tell which release times are past
        their horizon (without it, the latest reading seen on a node stands in)."""
        self._clock = clock

    # ---- reporting --------------------------------------------------------------------------
    @property
    def train_mode(self) -> str:
        return self._train_mode

    @property
    def train_cpu_s(self) -> float:
        """Seconds of fitting on the calling thread (return gaps, and ``sync`` reuse fits)."""
        model = self.live_model
        return self.gaps.fit_s + (model.fit_s if model is not None else 0.0)

    @property
    def background_train_cpu_s(self) -> float:
        """Thread CPU seconds of reuse fits in the background worker."""
        model = self.live_model
        return model.background_fit_s if model is not None else 0.0

    def close(self) -> None:
        """Stop the background trainer (waits for a fit in flight)."""
        if self.live_model is not None:
            self.live_model.close()

    @property
    def regular(self) -> bool:
        """The regime in force: regular returns (learned), never for the prior twin."""
        return self.learn and self.gaps.regular

    # ---- events -----------------------------------------------------------------------------
    def _seen(self, t: float) -> None:
        if t > self.now_s:
            self.now_s = t

    def _session_active(self, session: object, t: float) -> None:
        seen = self._session_seen
        if t > seen.get(session, float("-inf")):
            if len(seen) >= _SESSIONS_MAX and session not in seen:
                seen.clear()  # rare: forgetting only costs an ended-or-active guess
            seen[session] = t

    def on_hit(self, node: NodeView) -> None:
        t = node.last_access_s
        self._seen(t)
        session = getattr(node, "session_key", None)
        if session is None:
            self.gaps.observe_return(node.uid, t)
        else:
            self.gaps.observe_return(session, t)
            self._session_active(session, t)
        if self.live_model is not None:
            self.live_model.reused(node.uid)

    def on_insert(self, node: NodeView, num_blocks: int) -> None:
        self._seen(node.last_access_s)

    def release_time(self, node: NodeView) -> float:
        """``e``: the end of the latest request holding the node, else its last access."""
        end = getattr(node, "request_end_s", None)
        t = node.last_access_s
        return end if end is not None and end > t else t

    def time_key(self, node: NodeView) -> float:
        """The release time, pushed later for a shared prefix whose own mean access gap is
        longer than the sessions' return window ``ĝ`` (it stays live that much longer)."""
        e = self.release_time(node)
        g = self.gaps.window_s
        if g > 0 and getattr(node, "max_children", 0) >= 2:
            gaps = getattr(node, "access_gaps", ())
            if gaps:
                mean = sum(gaps) / len(gaps)
                if mean > g:
                    e += (mean - g) * self.overdue_factor
        return e

    def add_leaf(self, node: NodeView) -> None:
        uid = node.uid
        if uid in self._leaves:
            self.remove_leaf(node)
        e = self.release_time(node)
        self._seen(node.last_access_s)
        end = getattr(node, "request_end_s", None)
        if end is not None:
            # A release stamps a new request end; a hit on an unlocked leaf re-keys it with the
            # end unchanged: that is its return, not a release (recording it as one would
            # measure a zero gap). A leaf its own session grew in place is hit (while locked)
            # and released by the same request: a release.
            new_release = self._released.get(uid) != end
            mark = end
        else:  # a view without request ends: a re-key with more hits is a hit, not a release
            hits = node.hit_count
            new_release = (hits <= self._key_hits.get(uid, hits)
                           and self._released.get(uid) != e)
            self._key_hits[uid] = hits
            mark = e
        if new_release:
            self._released[uid] = mark
            session = getattr(node, "session_key", None)
            if session is None:
                self.gaps.observe_end(uid, e)
            else:
                self.gaps.observe_end(session, e)
                self._session_active(session, e)
        tk = (self.time_key(node), uid)
        vk = (self.value_policy.priority(node), uid)
        self._time_key[uid], self._value_key[uid] = tk, vk
        self._by_time.add(tk)
        self._by_value.add(vk)
        self._leaves[uid] = node
        if self.learn:
            lk = self.live_entry(node, tk[0], e if new_release else None)
            self._live_key[uid] = lk
            self._live.add(lk)

    def live_entry(self, node: NodeView, time_key_s: float, release_s: float | None) -> tuple:
        """The live tier's sort entry of ``node`` (greatest evicted first): its predicted next
        use ``t̂ = time key + ĝ / P`` less ``ĝ``, with ``P`` the learned probability that it is
        used again within the return window (:mod:`eviction._live_reuse`; expected wait
        ``ĝ / P`` for a leaf reused with probability ``P`` each window). ``P = 1`` before the
        first fit: the release-time order. ``release_s``: set on a new release, which opens a
        labelled example in the regular regime."""
        g = self.gaps.window_s
        if g <= 0:
            return (time_key_s, node.uid)
        model: LiveReuseModel = self.live_model  # type: ignore[assignment]  # learn=True: set
        p = 1.0
        if release_s is not None and self.regular:
            x = features(node, release_s, g)
            # Windows close here too, not only when a victim is chosen: a pool that never
            # fills would keep every open example otherwise.
            model.expire(self.now_s)
            model.observe_release(node.uid, release_s, x, release_s + self.overdue_factor * g)
            if model.fitted is not None:
                p = model.probability(x)
        elif model.fitted is not None:
            p = model.probability(features(node, self.release_time(node), g))
        return (time_key_s + g * (1.0 / p - 1.0), node.uid)

    def remove_leaf(self, node: NodeView) -> None:
        uid = node.uid
        if self._leaves.pop(uid, None) is None:
            return
        tk = self._time_key.pop(uid)
        vk = self._value_key.pop(uid)
        lk = self._live_key.pop(uid, None)
        if uid in self._is_overdue:
            self._is_overdue.discard(uid)
            self._overdue.remove(self._overdue_key.pop(uid))
            branch = self._branch_key.pop(uid, None)
            if branch is not None:
                self._branches.remove(branch)
        else:
            self._by_time.remove(tk)
            if lk is not None:
                self._live.remove(lk)
        self._by_value.remove(vk)

    def choose_victim(self) -> NodeView | None:
        if not self._leaves:
            return None
        if self.regular:
            g = self.gaps.window_s
            by_time, overdue = self._by_time, self._overdue
            if g > 0:
                if self._clock is not None:
                    self._seen(self._clock())
                horizon = self.now_s - self.overdue_factor * g
                self.live_model.expire(self.now_s)  # type: ignore[union-attr]  # regular: learn
                while by_time and by_time[0][0] < horizon:
                    uid = by_time.pop(0)[1]
                    self._live.remove(self._live_key[uid])
                    entry = self.overdue_entry(uid, horizon)
                    self._overdue_key[uid] = entry
                    overdue.add(entry)
                    self._is_overdue.add(uid)
                if self._branches and self._branches[0][0] <= horizon:
                    self._end_branches(horizon)
            if overdue:
                first = overdue[0]
                self._victim_rule = "branch" if first[0] else "overdue"
                return self._leaves[first[-1]]
            self._victim_rule = "latest"
            return self._leaves[self._live[-1][-1]]
        if self._overdue:  # back from the regular regime: nothing is known to be overdue
            for uid in self._is_overdue:
                self._by_time.add(self._time_key[uid])
                self._live.add(self._live_key[uid])
            self._overdue.clear()
            self._overdue_key.clear()
            self._is_overdue.clear()
            self._branches.clear()
            self._branch_key.clear()
        self._victim_rule = "value"
        return self._leaves[self._by_value[0][1]]

    def overdue_entry(self, uid: int, horizon: float) -> tuple:
        """The overdue tier's sort entry of leaf ``uid`` as it turns overdue: ``(1 if its
        session was active after ``horizon`` else 0, cost key, uid)``, least first. A leaf of
        an active session is registered as a branch, to be demoted (:meth:`_end_branches`)
        once its session is quiet too. A shared prefix (it had ≥ 2 children) is used by
        whichever session comes next, not ended with one: ``1`` for good."""
        node = self._leaves[uid]
        if getattr(node, "max_children", 0) >= 2:
            return (1,) + self._value_key[uid]
        session = getattr(node, "session_key", None)
        seen = self._session_seen.get(session) if session is not None else None
        if seen is not None and seen > horizon:
            branch = (seen, uid)
            self._branch_key[uid] = branch
            self._branches.add(branch)
            return (1,) + self._value_key[uid]
        return (0,) + self._value_key[uid]

    def _end_branches(self, horizon: float) -> None:
        """Branches whose session's activity, as last checked, is past ``horizon``: still
        active (later activity) is checked again at that activity; else the session ended
        and the leaf joins the ended group (the flag alone changes, at this check)."""
        branches, overdue = self._branches, self._overdue
        while branches and branches[0][0] <= horizon:
            uid = branches.pop(0)[1]
            session = getattr(self._leaves[uid], "session_key", None)
            seen = self._session_seen.get(session, horizon) if session is not None else horizon
            if seen > horizon:
                branch = (seen, uid)
                self._branch_key[uid] = branch
                branches.add(branch)
                continue
            del self._branch_key[uid]
            entry = self._overdue_key[uid]
            overdue.remove(entry)
            entry = (0,) + entry[1:]
            self._overdue_key[uid] = entry
            overdue.add(entry)

    def on_evict(self, node: NodeView, num_blocks: int) -> tuple:
        """Returns ``cost``'s ghost note ``(h, last access)``, with the node's uid appended
        when the reuse model learns (``(h, last access, uid)``: a run that comes back, or is
        forgotten, labels the leaf's open example).

        A victim named by the time rule may carry a larger GreedyDual key than the least one;
        ``L`` must not rise past that least key (``cost`` would have evicted it first), so the
        victim's key is capped there before ``cost`` records the eviction."""
        rule = self._victim_rule
        if rule is not None:
            self.victims_by_rule[rule] += 1
            self._victim_rule = None
        vp = self.value_policy
        if rule != "value" and self._by_value:
            vp.cap_key(node.uid, self._by_value[0][0][0])  # entries: ((H, t, -depth), uid)
        if node.num_blocks == 0:
            self._released.pop(node.uid, None)
            self._key_hits.pop(node.uid, None)
        note = vp.on_evict(node, num_blocks)
        model = self.live_model
        if model is None:
            return note
        model.note_evicted(num_blocks)
        return note + (node.uid,)

    def on_ghost_hit(self, node: NodeView, notes: list) -> None:
        """Evicted runs came back: a return of the node's session (a gap sample, when no
        resident node of the request counted it already), a reuse label for the leaves they
        were cut from, and ``cost``'s inherited history."""
        session = getattr(node, "session_key", None)
        if session is not None:
            self.gaps.observe_return(session, node.last_access_s)
            self._session_active(session, node.last_access_s)
        model = self.live_model
        if model is not None:
            for note in notes:
                model.reused(note[2])
            notes = [note[:2] for note in notes]
        self.value_policy.on_ghost_hit(node, notes)

    def on_ghost_drop(self, notes: list) -> None:
        """The ghost list forgot evicted runs: a no-reuse label for the leaves they were cut
        from (when their example is still open)."""
        model = self.live_model
        if model is not None:
            for note in notes:
                model.forgotten(note[2])


@register("predicted-reuse-prior")
class PredictedReusePriorPolicy(PredictedReusePolicy):
    """``predicted-reuse`` with the return-gap model replaced by the no-information prior
    (every leaf's next use equally unpredictable): ``cost``'s ordering."""

    def __init__(self, model_shape: object = None, **kwargs: Any) -> None:
        kwargs["learn"] = False
        super().__init__(model_shape, **kwargs)

"""Learned probability that a released leaf is used again within its session's return window,
for ``predicted-reuse``'s live tier (:mod:`eviction.predicted_reuse`).

A leaf released at ``e`` by an agent session is predicted to be used next at ``e + ĝ`` (the
learned return window: the median return gap, or a higher percentile of spread gaps). That
holds for the leaf the session continues from; not for a leaf whose tail the next call
rewrites (an agent that condenses or re-renders its history: the next prompt diverges a few
blocks before the old one ends), nor for the last call of a session.
How often each happens, and what marks it, differs from one agent framework to the next (on
OpenHands a leaf never hit before is almost never continued; on SWE-agent it almost always
is), so it is learned online from the cache's own history rather than fixed:

* **example**: a leaf released in the regular regime, with the features of :func:`features`
  (all from :class:`~eviction.base.NodeView`, read at the release);
* **label**: 1 if the leaf is hit, or an evicted run of it comes back from the ghost list,
  before ``e + k·ĝ`` (the policy's overdue horizon); 0 when that horizon passes first, or the
  ghost list forgets the run;
* **learner**: scikit-learn's L2-regularised logistic regression (``C = 2``; its
  ``newton-cholesky`` solver, ~5 Newton steps on ≤ 48 columns, half of ``lbfgs``'s time) on
  one-hot quantile bins of each feature (6 per feature, fewer for a feature with few values:
  :func:`fit_binned_logistic`), on the newest ``window`` labels: an additive model whose
  per-feature effect is a step function, so it can learn effects that are not monotone or
  that saturate, where a linear model of the raw features could only tilt the order one way
  (on the agent chat traces of ``bench eviction --format chat`` it moved OpenHands 20 % from
  0.510 to 0.532 FLOP hit); refitted
  after ``refit_labels`` new labels and ``refit_blocks`` evicted blocks (a 512-label fit takes
  ~2.5 ms alone on this 2-core VM and up to twice that beside a second replay, so every 512
  evicted blocks it adds ~5–10 µs per evicted block), either on the calling thread
  (``sync``: reproducible, for ``bench eviction``) or in one background worker thread whose
  result is swapped in when done (``background``: the server's step loop never waits for a
  fit).

Before the first fit :meth:`LiveReuseModel.probability` answers 1 (the prior: every live leaf
is continued), which keeps the policy's order exactly the release-time order.

Inference is one table entry per feature (a bisection on its bin edges) summed in Python,
~1 µs, not a call into scikit-learn (≈ 80 µs per ``predict_proba`` call). The policy turns
``P`` into an expected next use ``e + ĝ / P``: with a reuse chance ``P`` per return window,
the number of windows to the first reuse is geometric with mean ``1 / P``.

Sources: Z. Song, D. S. Berger, K. Li, W. Lloyd, "Learning Relaxed Belady for Content
Distribution Network Caching", NSDI 2020 (next-use prediction learned online from a sliding
window of the cache's own labelled history); scikit-learn's ``LogisticRegression``
(https://scikit-learn.org/1.5/modules/linear_model.html#logistic-regression) and its
``KBinsDiscretizer(strategy="quantile")``, whose edges :func:`bin_edges` reproduces; T. Hastie,
R. Tibshirani, "Generalized Additive Models", Statistical Science 1(3), 1986 (additive
per-feature effects).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_right
from collections import deque
from typing import TYPE_CHECKING, Any, NamedTuple

from .base import NodeView

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

_log = logging.getLogger("radixkv.eviction")

#: Feature names, in :func:`features` order (documentation and tests).
FEATURE_NAMES = ("log_hits", "shared", "log_depth_tokens", "log_num_blocks", "num_gaps",
                 "mean_gap_over_g", "log_lifetime_over_g", "duration_over_g")


def features(node: NodeView, release_s: float, gap_s: float) -> tuple[float, ...]:
    """Features of a leaf released at ``release_s`` (clock units), ``gap_s`` the return
    window ``ĝ`` (> 0): ``log1p(hit_count)``, 1.0 if it ever had ≥ 2 children, ``log1p`` of its
    depth in tokens and of its blocks, the number of its recorded access gaps and their mean
    over ``ĝ`` (−1 without any), ``log1p`` of its lifetime (last access − creation) over
    ``ĝ``, and the holding request's duration (release − last access) over ``ĝ``."""
    gaps = getattr(node, "access_gaps", ())
    last = node.last_access_s
    return (math.log1p(node.hit_count),
            1.0 if getattr(node, "max_children", 0) >= 2 else 0.0,
            math.log1p(node.depth_tokens), math.log1p(node.num_blocks), float(len(gaps)),
            sum(gaps) / len(gaps) / gap_s if gaps else -1.0,
            math.log1p(max(0.0, last - node.created_s) / gap_s),
            (release_s - last) / gap_s)


class BinnedLogit(NamedTuple):
    """A fitted additive logistic model on binned features: feature ``j`` falls in bin
    ``bisect_right(edges[j], x_j)`` and adds ``weights[j][bin]`` to the score.

    Attributes:
        edges: Per feature, its inner bin edges (ascending; ``len(weights[j]) - 1`` of them).
        weights: Per feature, the logistic regression's coefficient of each bin.
        intercept: The regression's intercept.
    """

    edges: tuple[tuple[float, ...], ...]
    weights: tuple[tuple[float, ...], ...]
    intercept: float

    def score(self, x: tuple) -> float:
        """The linear score (log-odds) of features ``x``."""
        z = self.intercept
        for e, w, v in zip(self.edges, self.weights, x):
            z += w[bisect_right(e, v)]
        return z


def bin_edges(column: Any, n_bins: int) -> tuple[float, ...]:
    """Inner edges of ``n_bins`` quantile bins of a numpy ``column`` (the
    ``averaged_inverted_cdf`` quantiles, as scikit-learn's ``KBinsDiscretizer(strategy=
    "quantile")`` computes them), bins of width ≤ 1e-8 merged into their left neighbour as that
    discretizer removes them: a feature with few distinct values (hit counts, flags) gets
    fewer bins (at most one per value)."""
    import numpy as np

    return _column_edges(np.asarray(column, dtype=np.float64).reshape(-1, 1), n_bins)[0]


def _column_edges(xs: Any, n_bins: int) -> list[tuple[float, ...]]:
    """:func:`bin_edges` of every column of the 2-D array ``xs``, in one percentile call."""
    import numpy as np

    quantiles = np.percentile(xs, np.linspace(0, 100, n_bins + 1), axis=0,
                              method="averaged_inverted_cdf")
    edges = []
    for q in quantiles.T:
        keep = np.ediff1d(q, to_begin=np.inf) > 1e-8
        edges.append(tuple(float(v) for v in q[keep][1:-1]))
    return edges


def fit_binned_logistic(X: list, y: list, n_bins: int, C: float,
                        seed: int) -> BinnedLogit | None:
    """Fit scikit-learn's logistic regression on one-hot quantile bins of each column of ``X``
    (rows of floats) against ``y`` (0/1): an additive model, each feature's effect a step
    function (a generalised additive model: the bins let a feature's effect be non-monotone or
    saturate). Returns None while one class is missing. Raises ImportError when scikit-learn is
    not installed."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression

    ys = np.asarray(y)
    positives = int(ys.sum())
    if positives == 0 or positives == len(ys):
        return None
    xs = np.asarray(X, dtype=np.float64)
    edges = _column_edges(xs, n_bins)
    blocks, offsets = [], [0]
    for j, e in enumerate(edges):
        index = np.searchsorted(np.asarray(e), xs[:, j], side="right")
        onehot = np.zeros((len(xs), len(e) + 1))
        onehot[np.arange(len(xs)), index] = 1.0
        blocks.append(onehot)
        offsets.append(offsets[-1] + len(e) + 1)
    model = LogisticRegression(C=C, solver="newton-cholesky", random_state=seed).fit(
        np.hstack(blocks), ys)
    w = model.coef_[0]
    weights = tuple(tuple(float(v) for v in w[a:b]) for a, b in zip(offsets, offsets[1:]))
    return BinnedLogit(tuple(edges), weights, float(model.intercept_[0]))


class LiveReuseModel:
    """Online P(a released leaf is used again within the return window) (module docstring).

    Args:
        train_mode: ``"sync"`` (fit on the calling thread) or ``"background"`` (one worker).
        seed: ``random_state`` of every fit.
        window: Labels kept (newest), ≥ 2.
        refit_labels: New labels before a refit, ≥ 1.
        refit_blocks: Evicted blocks (reported with :meth:`note_evicted`) before a refit, ≥ 0.
        n_bins: Quantile bins per feature (:func:`fit_binned_logistic`), ≥ 2.
        C: Inverse L2 strength of the logistic regression (scikit-learn's ``C``), > 0.

    Attributes:
        fitted: The latest fit (:class:`BinnedLogit`), None before one.
        num_fits, num_labels, num_positive: Counters.
        fit_s: Wall seconds of fits on the calling thread (``sync``).
        background_fit_s: Thread CPU seconds of fits in the worker (``background``).

    Raises:
        ValueError: naming the argument when a value is out of range.
    """

    def __init__(self, *, train_mode: str = "sync", seed: int = 0, window: int = 512,
                 refit_labels: int = 16, refit_blocks: int = 512, n_bins: int = 6,
                 C: float = 2.0) -> None:
        if train_mode not in ("sync", "background"):
            raise ValueError(f"train_mode: must be 'sync' or 'background', got {train_mode!r}")
        if window < 2:
            raise ValueError(f"window: must be ≥ 2, got {window!r}")
        if refit_labels < 1:
            raise ValueError(f"refit_labels: must be ≥ 1, got {refit_labels!r}")
        if refit_blocks < 0:
            raise ValueError(f"refit_blocks: must be ≥ 0, got {refit_blocks!r}")
        if n_bins < 2:
            raise ValueError(f"n_bins: must be ≥ 2, got {n_bins!r}")
        if not C > 0:
            raise ValueError(f"C: must be > 0, got {C!r}")
        self.train_mode = train_mode
        self.seed = seed
        self.refit_labels = refit_labels
        self.refit_blocks = refit_blocks
        self.n_bins = n_bins
        self.C = C
        self.fitted: BinnedLogit | None = None
        self.num_fits = self.num_labels = self.num_positive = 0
        self.fit_s = 0.0
        self.background_fit_s = 0.0
        self._X: deque = deque(maxlen=window)
        self._y: deque = deque(maxlen=window)
        self._new_labels = 0
        self._new_blocks = 0
        self._pending: dict[int, tuple[float, tuple]] = {}  # uid -> (release, features)
        self._deadlines: deque = deque()  # (deadline, uid, release), in release order
        self._worker: ThreadPoolExecutor | None = None
        self._job: Future[None] | None = None
        self._lock = threading.Lock()
        self._one_thread: Any = None  # a threadpoolctl.ThreadpoolController (no stubs)
        self._fit_failed = False
        if train_mode == "sync":
            # One-off costs paid here, not on the first eviction that refits: the import (~1 s)
            # and the solver's first call (~5 ms of lazy set-up inside scikit-learn / SciPy).
            self._fit([(0.0,), (1.0,)], [0, 1])
            # A 512 x 8 fit gains nothing from BLAS / OpenMP threads, and with replays in
            # parallel processes their spinning threads made fits ~5x slower; the limit is
            # process-wide, so only the calling-thread mode sets it (never beside a model
            # forward in the server's process).
            from threadpoolctl import ThreadpoolController
            self._one_thread = ThreadpoolController()

    # ---- examples and labels ----------------------------------------------------------------
    def observe_release(self, uid: int, release_s: float, x: tuple, deadline_s: float) -> None:
        """Leaf ``uid`` was released at ``release_s`` with features ``x``; it is labelled 0 if
        nothing reuses it before ``deadline_s``. A newer release replaces a pending example
        unlabelled (the leaf was held again meanwhile, which is neither outcome)."""
        self._pending[uid] = (release_s, x)
        self._deadlines.append((deadline_s, uid, release_s))

    def pending(self, uid: int) -> bool:
        """Whether leaf ``uid`` has an open example (a hit or a ghost return would label it)."""
        return uid in self._pending

    def reused(self, uid: int) -> None:
        """Leaf ``uid`` (or an evicted run of it) was asked for again: label 1 if open."""
        example = self._pending.pop(uid, None)
        if example is not None:
            self._label(example[1], 1)

    def forgotten(self, uid: int) -> None:
        """The ghost list forgot an evicted run of leaf ``uid``: label 0 if open."""
        example = self._pending.pop(uid, None)
        if example is not None:
            self._label(example[1], 0)

    def expire(self, now_s: float) -> None:
        """Label 0 every open example whose deadline is before ``now_s``."""
        deadlines, pending = self._deadlines, self._pending
        while deadlines and deadlines[0][0] < now_s:
            _, uid, release = deadlines.popleft()
            example = pending.get(uid)
            if example is not None and example[0] == release:
                del pending[uid]
                self._label(example[1], 0)

    def _label(self, x: tuple, y: int) -> None:
        self._X.append(x)
        self._y.append(y)
        self.num_labels += 1
        self.num_positive += y
        self._new_labels += 1

    # ---- training and inference ---------------------------------------------------------------
    def note_evicted(self, num_blocks: int) -> None:
        """``num_blocks`` blocks were evicted; refit when enough labels and blocks are new."""
        self._new_blocks += num_blocks
        if self._new_labels >= self.refit_labels and self._new_blocks >= self.refit_blocks:
            self._new_labels = self._new_blocks = 0
            X, y = list(self._X), list(self._y)
            if self.train_mode == "sync":
                t0 = time.perf_counter()
                with self._one_thread.limit(limits=1):
                    self._install(self._fit(X, y))
                self.fit_s += time.perf_counter() - t0
            elif self._job is None or self._job.done():
                if self._worker is None:
                    from concurrent.futures import ThreadPoolExecutor
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixkv-reuse-fit")
                self._job = self._worker.submit(self._fit_in_worker, X, y)

    def _fit_in_worker(self, X: list, y: list) -> None:
        t0 = time.thread_time()
        try:
            fitted = self._fit(X, y)
        except Exception:  # noqa: BLE001 - a failed fit keeps the last one; say so once
            fitted = None
            if not self._fit_failed:
                self._fit_failed = True
                _log.warning("predicted-reuse: a background fit of the live reuse model "
                             "failed; the policy keeps its last fit (P = 1 before any)",
                             exc_info=True)
        with self._lock:
            self.background_fit_s += time.thread_time() - t0
        self._install(fitted)

    def _fit(self, X: list, y: list) -> BinnedLogit | None:
        return fit_binned_logistic(X, y, self.n_bins, self.C, self.seed)

    def _install(self, fitted: BinnedLogit | None) -> None:
        if fitted is not None:
            self.fitted = fitted  # one reference swap: readers see the old fit or the new one
            self.num_fits += 1

    def probability(self, x: tuple) -> float:
        """P(reuse within the window) for features ``x``: 1.0 before the first fit, else the
        logistic of the fitted additive score, clamped to [1e-3, 1]."""
        fitted = self.fitted
        if fitted is None:
            return 1.0
        z = fitted.score(x)
        if z < -30.0:
            return 1e-3
        return max(1e-3, 1.0 / (1.0 + math.exp(-z)))

    def close(self) -> None:
        """Wait for a fit in flight and stop the worker (background mode)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

"""The reuse predictor of ``predicted-reuse``: an online logistic model over a sliding window of
labelled evictions, fitted by scikit-learn and applied inline.

A sample is the feature vector of an evicted run (see ``predicted_reuse.FEATURES``) and a label
(1: the run came back within the horizon; 0: the ghost list forgot it, or the horizon passed).
Every ``train_every`` evictions the last ``window`` samples are fitted with
``sklearn.linear_model.LogisticRegression`` (L2, lbfgs: deterministic for a given window, so a
synchronous replay is reproducible), and so is a model of the prior's logit alone. The full
model is published only while it predicts the samples labelled since the previous fit (held
out from it) with a lower log loss than the prior-only model does; else the policy falls back
to its prior. The policy then evaluates ``σ(w · x + b)`` itself in pure
Python (~1 µs for a handful of features) instead of calling ``predict_proba`` (~50 µs a call).

``train_mode="sync"`` fits on the caller's thread (benchmarks); ``"background"`` hands a copy of
the window to a one-thread worker and returns at once; the worker publishes the new coefficients
by one attribute assignment (atomic under the GIL), so a caller never waits and never sees a
half-written model. A fit requested while one is still running is skipped.

Source: the logistic model stands in for LRB's gradient-boosted trees (Z. Song et al.,
"Learning Relaxed Belady for Content Distribution Network Caching", NSDI 2020): same labels
(reuse within a horizon), same features in spirit (past inter-access gaps, counts), but a model
small enough to apply per key without a library call.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Sequence

TRAIN_MODES = ("sync", "background")


class ReuseLearner:
    """Sliding window of labelled samples, periodic fits, and the current coefficients.

    Args:
        num_features: Length of each feature vector.
        window: Samples kept (the newest).
        train_every: Fit after this many :meth:`tick` calls (evictions).
        min_samples: Fewer samples (or a single class) keep the previous model.
        train_mode: ``"sync"`` or ``"background"``.
        seed: Seed handed to the solver (lbfgs itself is deterministic).
        regularization: Inverse L2 strength ``C`` of the logistic regression.

    Attributes:
        coef: ``(weights tuple, intercept, base rate)`` of the latest fit (the base rate is the
            share of positive labels it saw), or None before the first.
        train_cpu_s: Thread CPU seconds spent fitting, on whichever thread.
        background_train_cpu_s: The part of it spent on the background worker.
        fits: Completed fits.
        trusted_fits: Fits whose model was published (it beat the prior-only model on the
            samples that arrived after the previous fit: a held-out check).

    Raises:
        ValueError: naming the argument when a value is out of range.
    """

    def __init__(self, num_features: int, *, window: int = 4096, train_every: int = 4096,
                 min_samples: int = 64, train_mode: str = "background", seed: int = 0,
                 regularization: float = 1.0) -> None:
        if train_mode not in TRAIN_MODES:
            raise ValueError(f"train_mode: must be one of {TRAIN_MODES}, got {train_mode!r}")
        for name, value in (("window", window), ("train_every", train_every),
                            ("min_samples", min_samples)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        self.num_features = num_features
        self.train_every = train_every
        self.min_samples = min_samples
        self.train_mode = train_mode
        self.seed = seed
        self.regularization = regularization
        self.samples: deque[tuple[Sequence[float], int]] = deque(maxlen=window)
        self.coef: tuple[tuple[float, ...], float] | None = None
        self.train_cpu_s = 0.0
        self.background_train_cpu_s = 0.0
        self.fits = 0
        self.positives = 0
        self.negatives = 0
        self._ticks = 0
        self._worker: threading.Thread | None = None
        self._added_at_fit = 0  # samples added when the latest fit started
        self._models: tuple | None = None  # (full model, prior-only model) of the latest fit
        self.trusted_fits = 0
        if train_mode == "sync":
            # Import now (~2 s, once per process), not inside the first timed fit; the
            # background worker imports on its own thread instead.
            import sklearn.linear_model  # noqa: F401

    def add(self, x: Sequence[float], label: int) -> None:
        """Record one labelled sample (``label`` 1: reused within the horizon)."""
        self.samples.append((x, label))
        if label:
            self.positives += 1
        else:
            self.negatives += 1

    def tick(self) -> None:
        """One eviction happened: fit when ``train_every`` of them have passed."""
        self._ticks += 1
        if self._ticks < self.train_every:
            return
        self._ticks = 0
        if len(self.samples) < self.min_samples:
            return
        batch = list(self.samples)
        num_new = min(len(batch), self.positives + self.negatives - self._added_at_fit)
        if self.train_mode == "sync":
            self._added_at_fit += num_new
            self._fit(batch, num_new, background=False)
        elif self._worker is None or not self._worker.is_alive():
            self._added_at_fit += num_new
            self._worker = threading.Thread(target=self._fit, args=(batch, num_new, True),
                                            name="predicted-reuse-train", daemon=True)
            self._worker.start()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until a background fit in flight finished (tests, shutdown)."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout_s)

    def _fit(self, batch: list[tuple[Sequence[float], int]], num_new: int,
             background: bool) -> None:
        """Fit the full model and a prior-only one (feature 0 alone) on ``batch``; publish the
        full model's coefficients only if the previous fit's full model predicted the
        ``num_new`` samples that arrived since (held out from it) with a lower log loss than
        its prior-only model did, else publish None (the policy falls back to its prior)."""
        start = time.thread_time()
        try:
            labels = [y for _, y in batch]
            if 0 < sum(labels) < len(labels):
                from sklearn.linear_model import LogisticRegression  # lazy: heavy import
                from sklearn.metrics import log_loss
                from threadpoolctl import threadpool_limits

                xs = [x for x, _ in batch]
                full = LogisticRegression(C=self.regularization, max_iter=200,
                                          random_state=self.seed)
                prior = LogisticRegression(C=self.regularization, random_state=self.seed)
                # One BLAS thread: on a few thousand rows more threads only add spin-up time
                # (3x the wall time measured on 2 cores) and contend with the step loop.
                with threadpool_limits(limits=1):
                    trusted = False
                    held_y = labels[len(labels) - num_new :]
                    if self._models is not None and 0 < sum(held_y) < len(held_y):
                        held_x = xs[len(xs) - num_new :]
                        old_full, old_prior = self._models
                        trusted = (log_loss(held_y, old_full.predict_proba(held_x)[:, 1])
                                   < log_loss(held_y, old_prior.predict_proba(
                                       [x[:1] for x in held_x])[:, 1]))
                    full.fit(xs, labels)
                    prior.fit([x[:1] for x in xs], labels)
                self._models = (full, prior)
                weights = tuple(float(w) for w in full.coef_[0])
                intercept = float(full.intercept_[0])
                self.fits += 1
                if trusted and all(math.isfinite(w) for w in weights) and math.isfinite(intercept):
                    self.trusted_fits += 1
                    # one assignment: the atomic swap
                    self.coef = (weights, intercept, sum(labels) / len(labels))
                else:
                    self.coef = None
        finally:
            spent = time.thread_time() - start
            self.train_cpu_s += spent
            if background:
                self.background_train_cpu_s += spent


def logistic(z: float) -> float:
    """``σ(z) = 1 / (1 + e^(-z))``, safe for large ``|z|``."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)

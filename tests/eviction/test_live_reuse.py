"""``eviction._live_reuse``: examples and labels (hit, ghost return, ghost drop, window), the
binned fit and its probability against scikit-learn's own discretizer + logistic pipeline,
refit gating, the background worker giving the same fit as the calling thread, and argument
errors."""

from __future__ import annotations

import inspect
import math
import random

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import KBinsDiscretizer

from radixkv.eviction._live_reuse import (
    FEATURE_NAMES,
    BinnedLogit,
    LiveReuseModel,
    bin_edges,
    features,
    fit_binned_logistic,
)


def _data(n: int, seed: int = 0) -> tuple[list[tuple], list[int]]:
    """Two informative features (the first raises P, the second lowers it), one of noise and a
    count of three values (its duplicate quantiles merge)."""
    rng = random.Random(seed)
    X, y = [], []
    for _ in range(n):
        x = (rng.gauss(0, 1), rng.gauss(3, 2), rng.random(), float(rng.choice((0, 0, 0, 1, 2))))
        z = 1.5 * x[0] - 0.8 * (x[1] - 3) + rng.gauss(0, 1)
        X.append(x)
        y.append(1 if z > 0.5 else 0)
    return X, y


def test_labels_from_hits_ghost_drops_and_the_window():
    m = LiveReuseModel(refit_blocks=1 << 30)
    x1, x2 = (1.0,) * 8, (2.0,) * 8
    m.observe_release(1, 2.0, x1, 3.1)
    assert m.pending(1)
    m.reused(1)
    m.reused(1)  # closed: a second reuse of the same example is not a second label
    assert (m.num_labels, m.num_positive) == (1, 1) and not m.pending(1)
    m.observe_release(2, 2.0, x1, 3.1)
    m.forgotten(2)
    assert (m.num_labels, m.num_positive) == (2, 1)
    m.observe_release(3, 2.0, x1, 3.1)
    m.expire(3.0)
    assert m.num_labels == 2 and m.pending(3)
    m.expire(3.2)
    assert (m.num_labels, m.num_positive) == (3, 1) and not m.pending(3)
    # A newer release replaces the open example unlabelled; only its own deadline closes it.
    m.observe_release(4, 2.0, x1, 3.1)
    m.observe_release(4, 2.5, x2, 3.6)
    m.expire(3.2)
    assert m.num_labels == 3 and m.pending(4)
    m.expire(3.7)
    assert m.num_labels == 4 and list(m._X)[-1] == x2 and list(m._y) == [1, 0, 0, 0]


@pytest.mark.filterwarnings("ignore:Bins whose width are too small")
@pytest.mark.skipif("quantile_method" not in inspect.signature(KBinsDiscretizer).parameters,
                    reason="KBinsDiscretizer before scikit-learn 1.7 computes other quantiles")
def test_fitted_probability_equals_scikit_learns_pipeline():
    X, y = _data(400)
    fitted = fit_binned_logistic(X, y, n_bins=6, C=2.0, seed=0)
    disc = KBinsDiscretizer(n_bins=6, encode="onehot-dense", strategy="quantile",
                            quantile_method="averaged_inverted_cdf")
    ref = make_pipeline(disc, LogisticRegression(C=2.0, solver="newton-cholesky",
                                                 random_state=0)).fit(X, y)
    # Same bins as the discretizer: 5 inner edges for the continuous features, 1 for the count
    # (its quantiles are 0, 0, 0, 0, 1, 2, 2: duplicates merged, 1 and 2 share the top bin).
    assert [len(e) for e in fitted.edges] == [5, 5, 5, 1]
    for e, ref_e in zip(fitted.edges, disc.bin_edges_):
        assert e == pytest.approx(tuple(ref_e[1:-1]), abs=1e-12)
    m = LiveReuseModel()
    m.fitted = fitted
    # Points inside bins and on edges (a value on an edge falls in the bin to its right).
    probe = [(0.0, 3.0, 0.5, 0.0), (2.0, 1.0, 0.1, 1.0), (-1.5, 7.0, 0.9, 2.0),
             (fitted.edges[0][2], fitted.edges[1][0], fitted.edges[2][4], fitted.edges[3][0])]
    want = ref.predict_proba(np.array(probe))[:, 1]
    got = [m.probability(x) for x in probe]
    assert got == pytest.approx(list(want), abs=1e-9)
    assert got[1] > got[0] > got[2]  # the first feature raises P, the second lowers it
    assert fit_binned_logistic(X, [1] * len(X), 6, 2.0, 0) is None  # one class: nothing to fit


def test_bin_edges_merge_duplicate_quantiles():
    assert bin_edges(np.array([0.0] * 6 + [1.0] * 3 + [5.0]), 4) == (1.0,)
    assert bin_edges(np.arange(8, dtype=float), 4) == (1.5, 3.5, 5.5)
    assert bin_edges(np.zeros(5), 6) == ()  # one value: one bin, no edge


def test_probability_prior_and_clamp():
    m = LiveReuseModel()
    assert m.probability((5.0,) * 8) == 1.0  # before a fit: every live leaf is continued
    flat = ((0.0,),) * 8  # no edges: one bin per feature
    m.fitted = BinnedLogit(((),) * 8, flat, -100.0)
    assert m.probability((0.0,) * 8) == 1e-3
    # Feature 0 split at 2.0: below it adds 0, from it on log 3 (P = 0.75 with intercept 0).
    m.fitted = BinnedLogit(((2.0,),) + ((),) * 7, ((0.0, math.log(3.0)),) + flat[1:], 0.0)
    assert m.probability((1.9,) + (0.0,) * 7) == pytest.approx(0.5)
    assert m.probability((2.0,) + (0.0,) * 7) == pytest.approx(0.75)


def _same_fit(a, b) -> bool:
    """Equal fits up to float rounding (the solver's sums may run in another order)."""
    return (a.edges == b.edges and a.intercept == pytest.approx(b.intercept)
            and all(w == pytest.approx(v, rel=1e-9, abs=1e-12)
                    for w, v in zip(a.weights, b.weights)))


def _labelled(m: LiveReuseModel, X, y) -> None:
    for uid, (x, label) in enumerate(zip(X, y)):
        m.observe_release(uid, 0.0, x, 1.0)
        if label:
            m.reused(uid)
    m.expire(2.0)


def test_refit_needs_new_labels_and_evicted_blocks():
    X, y = _data(40)
    m = LiveReuseModel(refit_labels=40, refit_blocks=10)
    _labelled(m, X, y)
    assert m.num_labels == 40 and m.num_positive == sum(y)
    m.note_evicted(9)
    assert m.fitted is None and m.num_fits == 0
    m.note_evicted(1)
    assert m.num_fits == 1 and _same_fit(m.fitted, fit_binned_logistic(X, y, 6, 2.0, 0))
    assert m.fit_s > 0
    m.note_evicted(100)  # blocks without new labels: no refit
    assert m.num_fits == 1


def test_background_worker_fits_the_same_model_off_the_calling_thread():
    X, y = _data(64, seed=3)
    m = LiveReuseModel(train_mode="background", refit_labels=64, refit_blocks=0)
    _labelled(m, X, y)
    m.note_evicted(1)
    m.close()  # waits for the fit in flight
    assert m.num_fits == 1 and _same_fit(m.fitted, fit_binned_logistic(X, y, 6, 2.0, 0))
    assert m.fit_s == 0.0 and m.background_fit_s > 0


def test_features_of_a_node_view():
    class View:
        hit_count, max_children, depth_tokens, num_blocks = 3, 2, 63, 4
        access_gaps = (1.0, 3.0)
        last_access_s, created_s = 10.0, 4.0

    x = features(View(), release_s=10.5, gap_s=2.0)
    assert len(x) == len(FEATURE_NAMES) == 8
    assert x == pytest.approx((math.log(4), 1.0, math.log(64), math.log(5), 2.0, 1.0,
                               math.log(4), 0.25))


@pytest.mark.parametrize("kw,name", [({"train_mode": "later"}, "train_mode"),
                                     ({"window": 1}, "window"),
                                     ({"refit_labels": 0}, "refit_labels"),
                                     ({"refit_blocks": -1}, "refit_blocks"),
                                     ({"n_bins": 1}, "n_bins"), ({"C": 0.0}, "C")])
def test_argument_errors_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        LiveReuseModel(**kw)


def test_a_failed_background_fit_keeps_the_last_fit_and_says_so_once(monkeypatch, caplog):
    import radixkv.eviction._live_reuse as live_reuse

    def broken(*args):
        raise FloatingPointError("solver diverged")

    X, y = _data(64, seed=3)
    m = LiveReuseModel(train_mode="background", refit_labels=16, refit_blocks=0)
    monkeypatch.setattr(live_reuse, "fit_binned_logistic", broken)
    with caplog.at_level("WARNING", logger="radixkv.eviction"):
        for start in (0, 32):  # two refits, each failing
            _labelled(m, X[start:start + 32], y[start:start + 32])
            m.note_evicted(1)
            m._job.result()
        m.close()
    assert m.fitted is None and m.num_fits == 0 and m.num_labels == 64
    assert [r.getMessage() for r in caplog.records].count(
        "predicted-reuse: a background fit of the live reuse model failed; the policy keeps "
        "its last fit (P = 1 before any)") == 1

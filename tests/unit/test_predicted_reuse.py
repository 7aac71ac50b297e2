"""``predicted-reuse`` / ``predicted-reuse-prior``: exact keys on hand-built node views, labels
from the ghost list's hit / drop hooks, reproducible synchronous training, a background fit that
never blocks a hook, and the session key path from a chat request to the node."""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, field

import pytest

from radixkv.cache.hashing import CacheIdentity
from radixkv.cache.manager import CacheManager
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.eviction import available_policies, make_policy
from radixkv.eviction.cost_model import get_shape, prefill_flops
from radixkv.eviction.predicted_reuse import FEATURES, PredictedReusePolicy

BS = 16


@dataclass
class FakeNode:
    """A NodeView with the contract's extra fields (session_key … max_children)."""

    uid: int
    last_access_s: float = 1.0
    hit_count: int = 0
    created_s: float = 0.0
    depth_tokens: int = 0
    num_blocks: int = 1
    lock_ref: int = 0
    hashes: list = field(default_factory=list)
    session_key: str | None = None
    request_end_s: float | None = None
    access_gaps: tuple = ()
    max_children: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * BS


def prior(**kw) -> PredictedReusePolicy:
    return make_policy("predicted-reuse-prior", model_shape="smollm2-135m", **kw)


def learned(**kw) -> PredictedReusePolicy:
    kw.setdefault("train_mode", "sync")
    return make_policy("predicted-reuse", model_shape="smollm2-135m", **kw)


def test_registered_names_and_modes():
    assert {"predicted-reuse", "predicted-reuse-prior"} <= set(available_policies())
    assert learned().train_mode == "sync"
    assert make_policy("predicted-reuse").train_mode == "background"
    assert prior().learn is False
    with pytest.raises(ValueError, match="train_mode"):
        learned(train_mode="later")


def test_prior_keys_are_beta_prior_times_depth_cost():
    p = prior()
    # Fresh policy: L = 0, γ = 1, no gap observed (rate 1): H = (h + 1) / (h + 4) · c / c0.
    assert p.priority(FakeNode(1, hit_count=0)) == (0.25, 1.0, 0)
    assert p.priority(FakeNode(2, hit_count=2)) == (0.5, 1.0, 0)
    shape = get_shape("smollm2-135m")
    ratio = prefill_flops(shape, 4096, BS) / prefill_flops(shape, 0, BS)
    key = p.priority(FakeNode(3, depth_tokens=4096))
    assert key[0] == pytest.approx(0.25 * ratio, rel=1e-12) and key[1:] == (1.0, -4096)
    # Eviction order: the cheap one-off node first, the often-hit one, then the deep one.
    keys = sorted((p.priority(n), n.uid) for n in
                  (FakeNode(1), FakeNode(2, hit_count=2), FakeNode(3, depth_tokens=4096)))
    assert [uid for _, uid in keys] == [1, 2, 3]


def test_expected_reuse_time_divides_the_credit():
    p = prior()
    p.reuse_gap_s = 10.0  # ĝ as if observed
    # β = 1: τ̂ = mean access gap 5 -> ĝ / τ̂ = 2; τ̂ = 20 -> 0.5; clipped to [1/4, 4].
    assert p.priority(FakeNode(1, access_gaps=(4.0, 6.0)))[0] == pytest.approx(0.5)
    assert p.priority(FakeNode(2, access_gaps=(20.0,)))[0] == pytest.approx(0.125)
    assert p.priority(FakeNode(3, access_gaps=(0.001,)))[0] == pytest.approx(1.0)
    assert p.priority(FakeNode(4))[0] == pytest.approx(0.25)  # no gaps: τ̂ = ĝ


def test_learned_coefficients_are_applied_inline():
    p = learned()
    weights = [0.0] * len(FEATURES)
    weights[FEATURES.index("has_session")] = math.log(3.0)
    p.learner.coef = (tuple(weights), 0.0, 0.25)
    # Lift σ(z) / base rate 0.25 times the prior 0.25: σ(0) -> lift 2 without a session,
    # σ(ln 3) = 0.75 -> lift 3 with one; a 1.0 base rate would give lift 0.5 and 0.75.
    assert p.priority(FakeNode(1))[0] == pytest.approx(0.5)
    assert p.priority(FakeNode(2, session_key="s"))[0] == pytest.approx(0.75)
    p.learner.coef = (tuple(weights), -20.0, 0.25)  # lift clipped to 1/4
    assert p.priority(FakeNode(3, session_key="s"))[0] == pytest.approx(0.25 / 4)
    assert prior().reuse_probability_of(p.features(FakeNode(2, session_key="s"), 0)) == 0.25


def _evict(p: PredictedReusePolicy, node: FakeNode):
    p.priority(node)
    node.num_blocks = 0
    return p.on_evict(node, 1)


def test_labels_from_ghost_hit_drop_and_horizon():
    p = learned(train_every=10_000)
    a, b, c = FakeNode(1, last_access_s=1.0), FakeNode(2, last_access_s=1.0), FakeNode(3)
    xa, xb = p.features(a, 0), p.features(b, 0)
    note_a, note_b = _evict(p, a), _evict(p, b)
    assert note_a == (0, 1.0, 0) and note_b == (0, 1.0, 1)
    p.on_ghost_hit(FakeNode(10, last_access_s=2.0), [note_a])  # came back: 1
    p.on_ghost_drop([note_b])                                   # forgotten: 0
    p.on_ghost_drop([note_a])                                   # already labelled: nothing
    assert list(p.learner.samples) == [(xa, 1), (xb, 0)]
    # Horizon: 4 × mean victim idle time. c is evicted idle 1 s (mean idle 1 -> horizon 4);
    # an eviction at clock 10 labels c's still pending sample 0.
    c.last_access_s = 2.0
    p.priority(FakeNode(50, last_access_s=3.0))
    note_c = _evict(p, c)
    assert note_c[2] == 2 and p.learner.negatives == 1
    _evict(p, FakeNode(4, last_access_s=10.0))
    assert p.learner.negatives == 2 and p.learner.samples[-1][1] == 0
    p.on_ghost_hit(FakeNode(11, last_access_s=11.0), [note_c])  # too late: stays 0
    assert p.learner.positives == 1


def _workload(policy) -> tuple[list[int], PredictedReusePolicy]:
    """A seeded multi-session workload on a 48-block pool; returns per-request hits."""
    clock = [0.0]
    cache = CacheManager(48, 4, eviction_policy="lru", clock=lambda: clock[0], ghost_capacity=256)
    cache.tree = RadixTree(4, policy, lambda: clock[0])
    root = cache.identity_root(CacheIdentity(model_revision="t", block_size=4, kv_dtype="none",
                                             rope="none"))
    rng = random.Random(7)
    sessions = {k: [1000 * k + i for i in range(8)] for k in range(12)}
    hits = []
    for step in range(400):
        clock[0] = float(step)
        k = rng.randrange(12) if rng.random() < 0.7 else rng.randrange(4)
        prompt = sessions[k] + [rng.randrange(50_000, 60_000) for _ in range(rng.randrange(4, 12))]
        sessions[k] = prompt if len(prompt) < 80 else sessions[k][:8]
        hits.append(cache.begin("r", root, prompt))
        assert cache.allocate("r", len(prompt))
        cache.publish("r", prompt, len(prompt))
        cache.release("r")
    return hits, policy


def test_sync_training_is_reproducible_with_a_seed():
    h1, p1 = _workload(learned(seed=0, train_every=128, window=256))
    h2, p2 = _workload(learned(seed=0, train_every=128, window=256))
    assert p1.learner.fits >= 1 and p1.learner.positives > 0 and p1.learner.negatives > 0
    assert h1 == h2
    assert p1.learner.coef == p2.learner.coef and p1.learner.trusted_fits == p2.learner.trusted_fits
    assert p1.learner._models[0].coef_.tolist() == p2.learner._models[0].coef_.tolist()
    assert p1.train_cpu_s > 0 and p1.background_train_cpu_s == 0.0


def test_background_training_never_blocks_the_hook(monkeypatch):
    p = learned(train_mode="background", train_every=2, window=64)
    p.learner.min_samples = 2
    for i in range(4):
        p.learner.add(tuple(float(i % 2) for _ in FEATURES), i % 2)
    release, started = threading.Event(), threading.Event()
    real_fit = p.learner._fit

    def slow_fit(batch, num_new, background):
        started.set()
        release.wait(10)
        real_fit(batch, num_new, background)

    monkeypatch.setattr(p.learner, "_fit", slow_fit)
    _evict(p, FakeNode(1))
    _evict(p, FakeNode(2))  # the second tick starts a fit on the worker ...
    assert started.wait(10)
    _evict(p, FakeNode(3))  # ... and hooks keep returning while it runs
    _evict(p, FakeNode(4))  # (a fit asked for meanwhile is skipped)
    assert p.learner.coef is None and p.learner._worker.is_alive()
    release.set()
    p.learner.wait(10)
    # A first fit has no held-out samples to be checked on: fitted, not published.
    assert p.learner.fits == 1 and p.learner._models is not None and p.learner.coef is None
    assert p.background_train_cpu_s == p.train_cpu_s > 0


@pytest.mark.parametrize("hints,expected", [({"prompt_cache_key": "conv-42", "user": "u"}, "conv-42"),
                                            ({"user": "u"}, "u"), ({}, None)])
def test_chat_session_hint_reaches_the_nodes(tiny_model, hints, expected):
    from radixkv.engine.sampling import SamplingParams
    from radixkv.server.protocol import parse_chat_request
    from tests.factories import make_engine

    body = {"messages": [{"role": "user", "content": "hi"}], **hints}
    req = parse_chat_request(body, "m")
    assert req.session_key == expected
    engine = make_engine(tiny_model)
    prompt = [100 + 7 * i for i in range(13)]  # 3 full blocks of 4 cached
    (done,) = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0,
                                                       ignore_eos=True),
                              session_key=req.session_key)
    assert done.session_key == expected
    nodes = [n for n in engine.cache.tree.iter_nodes() if n.num_blocks]
    assert nodes and {n.session_key for n in nodes} == {expected}
    assert all(n.request_end_s is not None for n in nodes)

"""``predicted-reuse`` / ``predicted-reuse-prior``: the learned return-gap model (exact medians,
bands and regimes), the victims of each regime on a real cache (exact blocks), the prior twin
making exactly ``cost``'s choices, and the session key path from a chat request to the node."""

from __future__ import annotations

import random

import pytest

from radixkv.cache.evict_path import make_ghost_list
from radixkv.cache.hashing import CacheIdentity
from radixkv.cache.manager import CacheManager
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.eviction import available_policies, make_policy
from radixkv.eviction._live_reuse import BinnedLogit
from radixkv.eviction._return_gaps import ReturnGapModel
from radixkv.eviction.predicted_reuse import PredictedReusePolicy

BS = 4


def learned(**kw) -> PredictedReusePolicy:
    kw.setdefault("train_mode", "sync")
    return make_policy("predicted-reuse", model_shape="smollm2-135m", **kw)


def test_registered_names_kinds_and_argument_errors():
    assert {"predicted-reuse", "predicted-reuse-prior"} <= set(available_policies())
    p = learned()
    assert p.kind == "victims" and p.learn and p.train_mode == "sync"
    assert p.live_model.train_mode == "sync"
    # The server's construction (no arguments) fits in the background.
    assert make_policy("predicted-reuse").train_mode == "background"
    assert make_policy("predicted-reuse-prior").live_model is None
    assert make_policy("predicted-reuse-prior").learn is False
    with pytest.raises(ValueError, match="train_mode"):
        learned(train_mode="later")
    with pytest.raises(ValueError, match="overdue_factor"):
        learned(overdue_factor=1.0)
    for kw, name in (({"window": 0}, "window"), ({"min_samples": 0}, "min_samples"),
                     ({"refit_every": 0}, "refit_every"), ({"band": 1.0}, "band"),
                     ({"share_min": 0.0}, "share_min"), ({"quantiles": (0.5, 1.0)}, "quantiles"),
                     ({"quantiles": ()}, "quantiles"), ({"return_share_min": 1.5}, "return_share_min")):
        with pytest.raises(ValueError, match=name):
            ReturnGapModel(**kw)


def test_return_gap_model_median_band_and_regime():
    m = ReturnGapModel(window=8, min_samples=4, refit_every=2, band=1.5, share_min=0.6,
                       prior_regular=False)
    for g in (1.0, 1.2, 0.9):
        m.add(g)
    # Three samples (< min_samples): fitted, but the prior still answers.
    assert m.median_s == 1.0 and m.in_band_share == 1.0 and m.regular is False
    m.add(1.1)
    assert m.median_s == 1.1 and m.regular is True  # sorted [0.9, 1.0, 1.1, 1.2]
    for g in (10.0, 100.0, 1000.0, 5.0):  # ring of 8 now full: [0.9 1 1.1 1.2 5 10 100 1000]
        m.add(g)
    assert m.median_s == 5.0 and m.in_band_share == 1 / 8 and m.regular is False
    for g in (1.0, 1.0, 1.0, 1.0):  # replace the four oldest: [1 1 1 1 5 10 100 1000]
        m.add(g)
    assert m.median_s == 5.0 and m.regular is False
    assert m.num_samples == 12 and m.fit_s > 0


def test_spread_gaps_are_regular_when_bounded_by_the_victim_idle_time_and_most_releases_return():
    idle = [0.0]
    m = ReturnGapModel(window=10, min_samples=10, refit_every=10, prior_regular=False,
                       victim_idle=lambda: idle[0])
    gaps = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.4, 2.0, 2.5, 4.0)  # 3 of 10 within 1.5x of 1.0
    for i, g in enumerate(gaps):
        m.observe_end(i, 0.0)
        m.observe_return(i, g)
    # Median 1.0 (s[5]); T-hat unknown (0): irregular, window = median.
    assert (m.median_s, m.in_band_share) == (1.0, 0.3)
    assert m.regular is False and m.bounded is False and m.window_s == 1.0
    # Deciles 50..90 % are s[5..9] = 1.0, 1.4, 2.0, 2.5, 4.0: the window is the largest <= T-hat.
    for t, regular, window in ((0.99, False, 1.0), (1.0, True, 1.0), (2.2, True, 2.0),
                               (3.9, True, 2.5), (4.0, True, 4.0), (50.0, True, 4.0)):
        idle[0] = t
        m._fit()
        assert (m.regular, m.bounded, m.window_s) == (regular, regular, window), t
    for i in range(10, 17):  # 7 more releases nobody returns to: 10 returns of 17 < 0.6
        m.observe_end(i, 5.0)
    m._fit()
    assert m.num_ends == 17 and m.num_samples == 10
    assert m.regular is False and m.bounded is False and m.window_s == 1.0
    banded = ReturnGapModel(min_samples=1, victim_idle=lambda: 100.0)
    for g in (1.0, 1.1, 0.9, 1.0):
        banded.add(g)
    # Banded gaps: regular by the band, the window stays the median.
    assert banded.regular is True and banded.bounded is False and banded.window_s == 1.0


def test_the_return_share_is_recent_halved_every_16_windows_of_releases():
    m = ReturnGapModel(window=2, min_samples=1, victim_idle=lambda: 10.0)
    for i in range(10):  # ten releases, each returned to
        m.observe_end(i, 0.0)
        m.observe_return(i, 1.0)
    for i in range(10, 31):  # 21 releases nobody returns to: 10 of 31
        m.observe_end(i, 0.0)
    assert (m._recent_returns, m._recent_ends) == (10, 31)
    m.observe_end(31, 0.0)  # the 32nd = 16 x window: both halve, the share stays
    assert (m._recent_returns, m._recent_ends) == (5, 16)
    assert (m.num_samples, m.num_ends) == (10, 32)


def test_predicted_reuse_bounds_returns_by_its_own_victim_idle_time():
    p = learned()
    assert p.gaps.victim_idle() == p.value_policy.mean_victim_idle_s == 0.0
    p.value_policy.mean_victim_idle_s = 2.5
    assert p.gaps.victim_idle() == 2.5


def test_return_gap_is_counted_once_per_return():
    m = ReturnGapModel(min_samples=1)
    m.observe_end("s", 2.0)
    assert m.observe_return("s", 1.5) is None  # before the end: not a return
    assert m.observe_return("s", 3.25) == 1.25
    assert m.observe_return("s", 3.5) is None  # the same request's deeper hit
    assert m.num_samples == 1 and m.median_s == 1.25


class Replay:
    """A real cache (tree + pool + ghost list) on a settable clock, requests served whole."""

    def __init__(self, policy, num_blocks: int) -> None:
        self.t = 0.0
        self.cache = CacheManager(num_blocks, BS, clock=lambda: self.t)
        self.cache.tree = RadixTree(BS, policy, lambda: self.t)
        self.cache.ghost = make_ghost_list(policy, 1024)
        self.root = self.cache.identity_root(CacheIdentity(model_revision="t", block_size=BS,
                                                              kv_dtype="none", rope="none"))
        self.policy = policy

    def request(self, t: float, tokens: list[int], session: str | None, end_s: float) -> int:
        self.t = t
        c = self.cache
        hit = c.begin("r", self.root, tokens, session_key=session)
        assert c.allocate("r", len(tokens))
        c.publish("r", tokens, len(tokens))
        c.release("r", end_s=end_s)
        return hit

    def blocks_of(self, first_token: int) -> list[int]:
        """Block ids of the leaf path whose first token is ``first_token``, root to tip."""
        out = []
        for node in self.cache.tree.iter_nodes():
            if node.num_blocks and bytes(node.tokens)[:4] == first_token.to_bytes(4, "little"):
                out = list(node.block_ids)
        return out


def _tokens(first: int, n_blocks: int) -> list[int]:
    return [first] + [first * 100 + i for i in range(1, n_blocks * BS)]


def test_regular_returns_evict_the_latest_live_session_then_an_overdue_one():
    p = learned(min_samples=1)
    r = Replay(p, num_blocks=9)
    a, b = _tokens(1, 4), _tokens(2, 4)
    assert r.request(0.0, a[: 2 * BS], "A", 0.5) == 0
    assert r.request(0.1, b[: 2 * BS], "B", 0.6) == 0
    assert r.request(1.5, a[: 3 * BS], "A", 2.0) == 2 * BS  # A returns 1.0 after its end
    assert r.request(1.6, b[: 3 * BS], "B", 2.1) == 2 * BS  # so does B
    assert p.regular and p.gaps.median_s == 1.0
    a_ids, b_ids = r.blocks_of(1), r.blocks_of(2)
    assert len(a_ids) == 3 and len(b_ids) == 3  # 6 of 9 blocks held, 3 free
    # C needs 5 blocks at 2.2: both A (released 2.0) and B (2.1) are live; B's next use is
    # predicted last (2.1 + 1.0), so B loses its tail -- LRU would take A's (accessed first).
    assert r.request(2.2, _tokens(3, 5), "C", 2.5) == 0
    assert r.blocks_of(2) == b_ids[:1] and r.blocks_of(1) == a_ids
    assert p.victims_by_rule == {"overdue": 0, "branch": 0, "latest": 1, "value": 0}
    # At 3.3, A (released 2.0) is overdue (3.3 - 2.0 > 1.1 x 1.0): its tail goes first, though
    # C (released 2.5, live) was accessed last.
    c_ids = r.blocks_of(3)
    assert r.request(3.3, _tokens(4, 2), "D", 3.6) == 0
    assert r.blocks_of(1) == a_ids[:1] and r.blocks_of(3) == c_ids
    assert p.victims_by_rule["overdue"] == 1
    assert r.cache.evicted_blocks_total == 4


def _two_live_sessions(fitted) -> tuple[Replay, PredictedReusePolicy, list[int], list[int]]:
    """A (4 blocks) and B (2 blocks) both returned once (ĝ = 1.0), released at 2.0 and 2.1;
    ``fitted`` (a :class:`BinnedLogit` or None) is installed in the live reuse model before
    anything happens."""
    p = learned(min_samples=1)
    p.live_model.fitted = fitted
    r = Replay(p, num_blocks=9)
    a, b = _tokens(1, 4), _tokens(2, 2)
    assert r.request(0.0, a[: 3 * BS], "A", 0.5) == 0
    assert r.request(0.1, b[:BS], "B", 0.6) == 0
    assert r.request(1.5, a, "A", 2.0) == 3 * BS
    assert r.request(1.6, b, "B", 2.1) == BS
    assert p.regular and p.gaps.median_s == 1.0
    return r, p, r.blocks_of(1), r.blocks_of(2)


def test_live_tier_evicts_the_furthest_predicted_next_use_with_the_learned_probability():
    # No fit yet (P = 1): the latest release (B) loses its tail block.
    r, p, a_ids, b_ids = _two_live_sessions(None)
    assert len(a_ids) == 4 and len(b_ids) == 2
    assert r.request(2.2, _tokens(3, 4), "C", 2.5) == 0
    assert r.blocks_of(2) == b_ids[:1] and r.blocks_of(1) == a_ids
    # A fit whose probability falls with a leaf's size: log1p(blocks) from 1.3 on (A's 4
    # blocks, not B's 2) adds -6, so A has the smaller P (0.12 vs 0.98) and its expected next
    # use 2.0 + ĝ / P is the furthest.
    flat = ((0.0,),) * 8
    steps = flat[:3] + ((0.0, -6.0),) + flat[4:]
    r, p, a_ids, b_ids = _two_live_sessions(BinnedLogit(((),) * 3 + ((1.3,),) + ((),) * 4,
                                                        steps, 4.0))
    assert r.request(2.2, _tokens(3, 4), "C", 2.5) == 0
    assert r.blocks_of(1) == a_ids[:3] and r.blocks_of(2) == b_ids
    assert p.victims_by_rule == {"overdue": 0, "branch": 0, "latest": 1, "value": 0}
    # A constant probability moves every live key by the same ĝ (1/P - 1): the release order.
    r, p, a_ids, b_ids = _two_live_sessions(BinnedLogit(((),) * 8, flat, -2.0))
    assert r.request(2.2, _tokens(3, 4), "C", 2.5) == 0
    assert r.blocks_of(2) == b_ids[:1] and r.blocks_of(1) == a_ids


def test_live_examples_are_labelled_by_hits_ghost_returns_and_the_window():
    r, p, a_ids, b_ids = _two_live_sessions(None)
    m = p.live_model
    # Opened in the regular regime: A's leaf at its release 2.0, B's at 2.1 (each grew in place:
    # a hit and a release of the same request; the first releases came before any gap sample,
    # when ĝ was unknown).
    assert m.num_labels == 0
    assert sorted(release for release, _ in m._pending.values()) == [2.0, 2.1]
    # C evicts B's tail (B's note names its leaf); B comes back at 3.0, hits its resident block
    # and brings the evicted one back from the ghost list: its example is labelled 1 once (the
    # hit closes it, the ghost return finds it closed).
    assert r.request(2.2, _tokens(3, 4), "C", 2.5) == 0
    assert r.request(3.0, _tokens(2, 3), "B", 3.2) == BS
    assert (m.num_labels, m.num_positive) == (1, 1)
    # A never comes back: at the next eviction after 2.0 + 1.1 x 1.0 its window has closed (a
    # 0). B's new release (3.2) and C's (2.5) stay open until 4.3 and 3.6.
    assert r.request(3.3, _tokens(4, 3), "D", 3.6) == 0
    assert (m.num_labels, m.num_positive) == (2, 1)
    assert sorted(release for release, _ in m._pending.values()) == [2.5, 3.2, 3.6]


def test_overdue_leaf_of_an_ended_session_goes_before_an_active_sessions_branch():
    p = learned(min_samples=1)
    r = Replay(p, num_blocks=10)
    x, e = _tokens(1, 3), _tokens(2, 3)
    assert r.request(0.0, x[: 2 * BS], "S", 0.5) == 0  # crew S, agent X
    assert r.request(0.1, e[: 2 * BS], "E", 0.6) == 0
    assert r.request(1.5, x, "S", 2.0) == 2 * BS
    assert r.request(1.6, e, "E", 2.1) == 2 * BS  # E's last request
    assert p.regular and p.gaps.median_s == 1.0
    # S's next call goes to another agent's branch (Y): S is active at 3.2, E is not.
    assert r.request(3.0, _tokens(3, 2), "S", 3.2) == 0
    x_ids, e_ids = r.blocks_of(1), r.blocks_of(2)
    assert len(x_ids) == len(e_ids) == 3
    # At 3.5 both X (released 2.0) and E (2.1) are overdue (before 3.5 - 1.1). cost's order
    # would take X first (last access 1.5 < 1.6, same hits and depth); X's session is active,
    # so E's tail goes first.
    assert r.request(3.5, _tokens(4, 4), "Z", 3.55) == 0
    assert r.blocks_of(2) == e_ids[:1] and r.blocks_of(1) == x_ids
    assert p.victims_by_rule == {"overdue": 1, "branch": 0, "latest": 0, "value": 0}
    # Three more blocks: E's last, then X's tail (the branch), not Y or Z (live).
    assert r.request(3.6, _tokens(5, 3), "W", 3.65) == 0
    assert r.blocks_of(2) == [] and r.blocks_of(1) == x_ids[:1]
    assert len(r.blocks_of(3)) == 2 and len(r.blocks_of(4)) == 4
    assert p.victims_by_rule == {"overdue": 2, "branch": 1, "latest": 0, "value": 0}


def test_a_branch_joins_the_ended_group_once_its_session_is_quiet_too():
    p = learned(min_samples=1)
    r = Replay(p, num_blocks=10)
    x, e = _tokens(1, 3), _tokens(2, 3)
    assert r.request(0.0, x[: 2 * BS], "S", 0.5) == 0
    assert r.request(0.1, e[: 2 * BS], "E", 0.6) == 0
    assert r.request(1.5, x, "S", 2.0) == 2 * BS
    assert r.request(1.6, e, "E", 2.1) == 2 * BS
    assert r.request(3.0, _tokens(3, 2), "S", 3.2) == 0  # S's other branch (Y)
    x_ids = r.blocks_of(1)
    assert r.request(3.5, _tokens(4, 4), "Z", 3.55) == 0  # E loses 2 blocks; X is a branch
    x_uid = next(uid for uid, n in p._leaves.items() if list(n.block_ids) == x_ids)
    assert p._overdue_key[x_uid][0] == 1 and list(p._branches) == [(3.2, x_uid)]
    # At 5.0 S's latest activity (3.2) is past the horizon (5.0 - 1.1) with none since: X
    # joins the ended group (E's last block goes first, by cost's order).
    assert r.request(5.0, _tokens(6, 1), "V", 5.1) == 0
    assert p._overdue_key[x_uid][0] == 0 and not p._branches
    assert r.blocks_of(2) == [] and r.blocks_of(1) == x_ids
    # Now X (oldest access, least cost key) goes before Y and Z, which a branch would not.
    assert r.request(5.05, _tokens(7, 1), "U", 5.15) == 0
    assert r.blocks_of(1) == x_ids[:2] and len(r.blocks_of(3)) == 2 and len(r.blocks_of(4)) == 4
    assert p.victims_by_rule == {"overdue": 3, "branch": 0, "latest": 0, "value": 0}


def _random_workload(seed: int, n: int) -> list[tuple[float, list[int], str, float]]:
    """Sessions growing turn by turn on a shared prefix, with spread-out return gaps."""
    rng = random.Random(seed)
    shared = [9000 + i for i in range(2 * BS)]
    sessions: dict[str, list[int]] = {}
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0) * rng.choice((0.1, 1.0, 30.0))
        s = f"s{rng.randrange(12)}"
        hist = sessions.setdefault(s, shared + [int(s[1:]) * 1000 + 500])
        hist += [rng.randrange(1, 10**6) for _ in range(rng.randrange(1, 3 * BS))]
        out.append((t, list(hist), s, t + rng.random()))
    return out


def _evictions(policy_name: str | PredictedReusePolicy, workload, num_blocks: int):
    policy = (make_policy(policy_name, model_shape="smollm2-135m")
              if isinstance(policy_name, str) else policy_name)
    r = Replay(policy, num_blocks)
    freed: list[int] = []
    real = r.cache.tree.evict

    def spy(n, evicted=None, freed_ids=None):
        ids = real(n, evicted, freed_ids)
        freed.extend(ids)
        return ids

    r.cache.tree.evict = spy
    hits = [r.request(t, toks[: (len(toks) // BS) * BS], s, e) for t, toks, s, e in workload]
    return freed, hits


def test_prior_twin_makes_exactly_cost_choices():
    work = _random_workload(3, 300)
    cost_freed, cost_hits = _evictions("cost", work, 60)
    prior_freed, prior_hits = _evictions("predicted-reuse-prior", work, 60)
    assert len(cost_freed) > 500
    assert prior_freed == cost_freed and prior_hits == cost_hits


def test_irregular_returns_fall_back_to_cost_choices():
    work = _random_workload(5, 300)
    p = learned()
    p.gaps = ReturnGapModel(min_samples=1, prior_regular=False)
    for g in (0.01, 0.1, 1.0, 10.0, 100.0):
        p.gaps.add(g)  # spread over four decades: never regular
    freed, hits = _evictions(p, work, 60)
    assert not p.regular and p.victims_by_rule["overdue"] == p.victims_by_rule["latest"] == 0
    assert (freed, hits) == _evictions("cost", work, 60)


def test_spread_returns_the_pool_holds_use_the_regular_tiers_with_a_percentile_window():
    work = _random_workload(5, 300)  # gaps 0.1 x / 1 x / 30 x an exponential: not banded
    p = learned()
    p.gaps = ReturnGapModel(min_samples=1, prior_regular=False, victim_idle=lambda: 1e9)
    freed, hits = _evictions(p, work, 60)
    g = p.gaps
    kept = sorted(g._gaps)
    assert g.in_band_share < 0.8 and g.num_samples >= 0.6 * g.num_ends
    assert p.regular and g.bounded and g.window_s == kept[int(0.9 * len(kept))] > g.median_s
    assert p.victims_by_rule == {"overdue": 30, "branch": 0, "latest": 354, "value": 0}
    cost_freed, cost_hits = _evictions("cost", work, 60)
    assert sum(hits) == 7696 and sum(cost_hits) == 7432
    # A pool whose victims idle far less than the median gap keeps cost's choices exactly.
    q = learned()
    q.gaps = ReturnGapModel(min_samples=1, prior_regular=False, victim_idle=lambda: 1e-3)
    assert _evictions(q, work, 60) == (cost_freed, cost_hits) and not q.regular


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


def test_a_session_whose_blocks_were_all_evicted_returns_through_the_ghost_list():
    p = learned()
    r = Replay(p, num_blocks=4)
    assert r.request(0.0, _tokens(1, 2), "A", 0.5) == 0
    assert r.request(0.6, _tokens(2, 4), "B", 1.0) == 0  # evicts all of A
    assert r.blocks_of(1) == [] and p.gaps.num_samples == 0
    # A comes back 1.25 after its end, one block longer: nothing of it is resident, the ghost
    # list knows its two blocks (within the hit cap of the 3-block prompt).
    assert r.request(1.75, _tokens(1, 3), "A", 2.0) == 0
    assert p.gaps.num_samples == 1 and p.gaps.median_s == 1.25


def _agent_sessions(num_sessions: int) -> list[tuple[float, list[int], str, float]]:
    """Sessions of 2-8 turns whose next call comes 1.0 after their previous one ended (regular
    gaps), each turn adding two blocks to the session's history; requests in time order."""
    out = []
    for s in range(num_sessions):
        t, hist = 0.05 * s, []
        for k in range(2 + s % 7):
            hist = hist + [(s + 1) * 10_000 + k * 100 + i for i in range(2 * BS)]
            out.append((t, list(hist), f"s{s}", t + 0.2))
            t += 1.2
    return sorted(out, key=lambda r: r[0])


def _run_sessions(p: PredictedReusePolicy, num_blocks: int) -> tuple[Replay, int]:
    """:func:`_agent_sessions` (60 sessions) through a real cache; returns it and the hits."""
    r = Replay(p, num_blocks)
    return r, sum(r.request(t, toks, s, e) for t, toks, s, e in _agent_sessions(60))


def test_server_mode_fits_the_live_model_in_the_background_worker():
    p = make_policy("predicted-reuse", model_shape="smollm2-135m")  # as the server builds it
    assert p.train_mode == "background"
    r, hits = _run_sessions(p, 48)
    p.close()  # waits for a fit in flight
    m = p.live_model
    assert p.regular and m.num_labels >= 16 and r.cache.evicted_blocks_total >= 512
    assert m.num_fits >= 1 and m.fitted is not None and len(m.fitted.edges) == 8
    assert m.fit_s == 0.0 and m.background_fit_s > 0 and p.background_train_cpu_s > 0
    assert hits > 0


def test_the_live_model_learns_which_leaves_are_not_continued():
    # Sessions of 2-8 turns: a leaf is not continued after its session's last turn, which
    # comes later for longer histories. The binned fit ranks the kept examples accordingly,
    # around the base rate (210 / 265 = 0.79).
    p = learned()
    _run_sessions(p, 48)
    m = p.live_model
    assert m.num_fits == 3 and (m.num_labels, m.num_positive) == (265, 210)
    probs = [m.probability(x) for x in m._X]
    kept = list(m._y)
    mean_pos = sum(q for q, y in zip(probs, kept) if y) / sum(kept)
    mean_neg = sum(q for q, y in zip(probs, kept) if not y) / (len(kept) - sum(kept))
    assert mean_pos == pytest.approx(0.823, abs=1e-3) and mean_neg == pytest.approx(0.758, abs=1e-3)


def test_open_examples_close_without_evictions():
    # A pool that never fills: windows still close as releases come, so open examples stay
    # those of the last window (and labels keep coming for the next fit).
    p = learned()
    r, _ = _run_sessions(p, 4096)
    m = p.live_model
    assert r.cache.evicted_blocks_total == 0 and m.num_fits == 0
    assert (m.num_labels, m.num_positive) == (265, 210) and len(m._pending) == 5

"""Generated sampling parameters straight into the engine: each set is either refused
by ``SamplingParams`` with a ValueError naming the field at fault, or generation finishes
normally and the cache's integrity holds. Seeds cover the whole int range (2**64 - 1 and
negatives included: an ``n = 2`` request at seed 2**64 - 1 once overflowed inside the engine
thread and killed it).

Bounded: ``derandomize=True`` (the same examples every run), 40 examples, tiny model.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams, choice_seed
from tests.factories import make_engine

EDGE_SEEDS = [0, 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1, 2**64, -1, -(2**63), -(2**64)]


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` about nine times in ten, else ``invalid``: most generated sets then reach the
    engine, and every field is still refused now and then."""
    return st.sampled_from([True] * 9 + [False]).flatmap(lambda ok: valid if ok else invalid)


PARAMS = st.fixed_dictionaries({
    "max_tokens": mostly(st.integers(1, 4), st.integers(-1, 0)),
    "temperature": mostly(st.floats(0.0, 2.0) | st.sampled_from([0, 1e-6, 1e-5, 1, 2.0]),
                          st.sampled_from([math.nan, math.inf, -0.1, 2.0001, 3])),
    "top_p": mostly(st.floats(0.0, 1.0, exclude_min=True) | st.sampled_from([1e-9, 1]),
                    st.sampled_from([0.0, math.nan, 1.5, -1])),
    "top_k": mostly(st.integers(-1, 50_000), st.integers(-5, -2)),
    "seed": st.one_of(st.none(), st.sampled_from(EDGE_SEEDS), st.integers(-(2**70), 2**70)),
    "n": mostly(st.integers(1, 4), st.just(0)),
    "stop": mostly(st.lists(st.text(min_size=1, max_size=3), max_size=3),
                   st.sampled_from([[""], ["a", ""]])),
})


def invalid_fields(kw: dict) -> set[str]:
    """The fields ``SamplingParams`` must refuse (its documented ranges)."""
    bad = set()
    if not 1 <= kw["n"] <= 64:
        bad.add("n")
    if kw["max_tokens"] < 1:
        bad.add("max_tokens")
    if not 0.0 <= kw["temperature"] <= 2.0:  # NaN compares False
        bad.add("temperature")
    if not 0.0 < kw["top_p"] <= 1.0:
        bad.add("top_p")
    if kw["top_k"] < -1:
        bad.add("top_k")
    if any(not s for s in kw["stop"]):
        bad.add("stop")
    return bad


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return make_engine(tiny_model, num_blocks=64)


def _kw(**changes) -> dict:
    return {"max_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "n": 1,
            "stop": [], **changes}


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@example(kw=_kw(seed=2**64 - 1, n=2), prompt=[5, 6, 7])  # the per-choice seed once overflowed here
@example(kw=_kw(seed=-(2**63), n=3, top_k=5, top_p=0.5, stop=["e"]), prompt=[9])
@example(kw=_kw(seed=2**70 + 1, n=1, temperature=0.3), prompt=[1, 2])
@given(kw=PARAMS, prompt=st.lists(st.integers(3, 40_000), min_size=1, max_size=10))
def test_sampling_params_are_refused_by_name_or_generate_cleanly(engine, kw, prompt):
    bad = invalid_fields(kw)
    try:
        params = SamplingParams(**kw)
    except ValueError as exc:
        assert str(exc).split(":", 1)[0] in bad, (exc, bad)
        return
    assert not bad, (kw, bad)
    reqs = engine.generate([prompt], params, max_steps=200)
    assert [r.index for r in reqs] == list(range(params.n))
    for req in reqs:
        assert req.finish_reason in ("stop", "length"), req.finish_reason
        assert 1 <= req.num_output_tokens <= params.max_tokens
    engine.cache.check_integrity()
    assert engine.cache.num_in_use_blocks == 0 and engine.cache.num_active_requests == 0
    if params.seed is not None and not params.greedy and params.n > 1:
        # The last choice equals an n = 1 request with its seed, (seed + i) mod 2**64.
        last = params.n - 1
        single = SamplingParams(**{**kw, "n": 1, "seed": choice_seed(params.seed, last)})
        (alone,) = engine.generate([prompt], single, max_steps=200)
        assert alone.output_token_ids == reqs[last].output_token_ids
    assert engine.stats_snapshot()["requests_failed_total"] == 0

"""A waiting request whose uncached prefix a running request is computing waits for that
prefill and reads the blocks from the cache (engine.scheduler)."""

from __future__ import annotations

import pytest

from radixkv.engine.sampling import SamplingParams
from radixkv.model.loader import load_model
from tests.factories import make_engine

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_requests_sharing_an_uncached_prefix_compute_it_once(tiny, policy):
    system = [(13 * i) % 5000 + 20 for i in range(100)]  # 6 full blocks of 16, then 4 tokens
    engine = make_engine(tiny, block_size=16, admission_policy=policy)
    prompts = [system + [7, 8, 9], system + [1, 2], [(29 * i) % 4000 + 11 for i in range(40)]]
    first, second, other = engine.generate(prompts, GREEDY)
    cold = make_engine(tiny, block_size=16, prefix_cache=False).generate(prompts, GREEDY)
    # The first computes the shared 96 tokens; the second waited for its prefill and read
    # them; the unrelated prompt was admitted beside the first, with nothing to wait for.
    assert (first.num_cached_tokens, second.num_cached_tokens, other.num_cached_tokens) == (0, 96, 0)
    assert [r.output_token_ids for r in (first, second, other)] == [r.output_token_ids for r in cold]
    stats = engine.stats_snapshot()
    assert stats["computed_prompt_tokens_total"] == 103 + (102 - 96) + 40
    engine.cache.check_integrity()


def test_a_request_past_the_shared_blocks_is_not_held(tiny):
    # Shared only within the first block's 10 tokens: no full block to wait for.
    engine = make_engine(tiny, block_size=16)
    head = [(17 * i) % 3000 + 5 for i in range(10)]
    a, b = engine.generate([head + list(range(100, 140)), head + list(range(200, 240))], GREEDY)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
    assert engine.stats_snapshot()["computed_prompt_tokens_total"] == 100


def test_the_wait_ends_when_the_shared_chunk_is_published(tiny):
    # With 32-token prefill chunks the first request publishes the shared prefix over several
    # steps; the second is admitted once a chunk it could not read yet is done, and reads
    # every block published by then.
    system = [(13 * i) % 5000 + 20 for i in range(100)]
    engine = make_engine(tiny, block_size=16, prefill_chunk_tokens=32)
    first, second = engine.generate([system + [7, 8, 9], system + [1, 2]], GREEDY)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96
    engine.cache.check_integrity()

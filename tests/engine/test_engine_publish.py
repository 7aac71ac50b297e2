"""When the engine publishes blocks: prompt blocks at once, generated blocks in batches of
``publish_interval_blocks`` and the rest when the request ends (finish, abort, preemption).

Tiny random-init model, B = 4, greedy decoding with ``ignore_eos`` so lengths are exact.
"""

from __future__ import annotations

import pytest

from radixkv.config import CacheConfig
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from radixkv.model.loader import load_model
from tests.factories import make_engine

B = 4
PROMPT = [100 + 7 * i for i in range(10)]  # 10 tokens: 2 full prompt blocks + 2 in the tail


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


def cached_blocks_per_step(engine: LLMEngine, max_tokens: int) -> list[int]:
    req = engine.make_request(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                     ignore_eos=True))
    engine.add_request(req)
    counts = []
    while engine.has_work:
        engine.step()
        counts.append(engine.cache.tree.num_cached_blocks)
    engine.cache.check_integrity()
    return counts


@pytest.mark.parametrize("interval,expected", [
    # Step 1 prefills 10 tokens (2 full blocks) and samples the token at position 10; step
    # k > 1 computes position 8 + k, so block 2 (positions 8..11) is complete after step 3,
    # block 3 after step 7, block 4 after step 11. The request ends in step 13 (13 tokens
    # sampled): 23 tokens, 22 computed, 5 full blocks.
    (1, [2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5]),
    (2, [2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 5]),
    (16, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 5]),
])
def test_generated_blocks_published_in_batches_and_at_finish(tiny, interval, expected):
    engine = make_engine(tiny, block_size=B, num_blocks=64, publish_interval_blocks=interval)
    assert cached_blocks_per_step(engine, max_tokens=13) == expected
    # Whatever the interval, the next turn (prompt + reply + new message) hits every block
    # the first turn computed: 22 computed tokens = 5 full blocks (the hit cap would be 24).
    (first,) = engine.generate([PROMPT], SamplingParams(max_tokens=13, temperature=0.0,
                                                         ignore_eos=True))
    turn2 = first.token_ids + [9, 8, 7]
    (second,) = engine.generate([turn2], SamplingParams(max_tokens=1, temperature=0.0))
    assert second.num_cached_tokens == 20


def test_abort_publishes_computed_generated_blocks(tiny):
    engine = make_engine(tiny, block_size=B, num_blocks=64, publish_interval_blocks=16)
    req = engine.make_request(PROMPT, SamplingParams(max_tokens=50, temperature=0.0,
                                                     ignore_eos=True))
    engine.add_request(req)
    for _ in range(9):  # 9 steps: positions 0..17 computed -> blocks 0..3 complete
        engine.step()
    assert engine.cache.tree.num_cached_blocks == 2
    engine.abort_request(req.request_id)
    assert engine.cache.tree.num_cached_blocks == 4
    assert engine.cache.num_in_use_blocks == 0
    engine.cache.check_integrity()
    probe = engine.make_request(req.token_ids[:17] + [1], SamplingParams(max_tokens=1))
    engine.add_request(probe)
    engine.step()
    assert probe.num_cached_tokens == 16


def test_publish_interval_validated():
    with pytest.raises(ValueError, match="publish_interval_blocks"):
        CacheConfig(publish_interval_blocks=0)

"""The embedded SmolLM2 through the engine: greedy outputs do not depend on the prefix cache."""

from __future__ import annotations

import pytest

from radixkv.engine.sampling import SamplingParams
from tests.factories import make_engine

pytestmark = pytest.mark.smollm2

QUESTIONS = ["Name three prime numbers.", "What is the capital of France?",
             "Write one sentence about the sea."]


def test_greedy_outputs_identical_with_and_without_prefix_cache(smollm2):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    tokenizer = smollm2.tokenizer
    # The template inserts the same default system prompt before every question, so the
    # second and third prompts hit on it; the repeat of the first is a full hit.
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    prompts.append(prompts[0])
    outputs = {}
    for prefix_cache in (True, False):
        engine = make_engine(smollm2, block_size=16, num_blocks=64, prefix_cache=prefix_cache)
        reqs = [engine.generate([p], params)[0] for p in prompts]
        engine.cache.check_integrity()
        outputs[prefix_cache] = [r.output_token_ids for r in reqs]
        if prefix_cache:
            shared = min(len(prompts[0]), len(prompts[1]))
            lcp = next(i for i in range(shared) if prompts[0][i] != prompts[1][i])
            assert lcp >= 16, "the default system prompt should span at least one block"
            # Each later prompt hits the whole blocks of the shared system prompt; the repeat
            # of the first prompt hits all of its full blocks short of the last token.
            assert reqs[0].num_cached_tokens == 0
            assert reqs[1].num_cached_tokens == (lcp // 16) * 16
            assert reqs[3].num_cached_tokens == ((len(prompts[0]) - 1) // 16) * 16
        else:
            assert all(r.num_cached_tokens == 0 for r in reqs)
    assert outputs[True] == outputs[False]
    assert all(len(o) == 32 for o in outputs[True])

"""Prefix hits across the window on the real Gemma 3 270M (window 512, head_dim 256, 15 window
layers to 3 full), through the engine (skipped without the gemma3 extra).

As in ``test_engine_window.py``: a first request prefills exactly ``[0, m)``, a second sends
the whole prompt and must hit at exactly m, with the greedy tokens and logits rows of a cold
run that prefills in chunks of m tokens bit for bit, for m = W - B, W and W + B (blocks of 16:
the hit ends just before the window edge, on it, and past it).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from radixkv.model import shipped
from radixkv.model.loader import LoadedModel
from tests.factories import engine_config

pytestmark = [
    pytest.mark.gemma3,
    pytest.mark.skipif(any(importlib.util.find_spec(module) is None for module, _ in shipped._GEMMA3_270M_PARTS),
                       reason=f"the gemma3 extra is not installed: {shipped.GEMMA3_270M_INSTALL}"),
]

BLOCK_SIZE = 16
WINDOW = 512
SUFFIX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PREFIX_ONLY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _engine(model: LoadedModel, chunk: int, *, prefix_cache: bool = True) -> LLMEngine:
    cfg = engine_config(block_size=BLOCK_SIZE, num_blocks=96, prefill_chunk_tokens=chunk,
                        prefix_cache=prefix_cache)
    return LLMEngine(dataclasses.replace(cfg, attention_backend="torch"), model)


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY
         ) -> tuple[list[int], torch.Tensor, int]:
    rows: list[torch.Tensor] = []
    forward = engine.runner.forward

    def recording(batch, **kwargs):
        logits = forward(batch, **kwargs)
        rows.append(logits[-1].clone())
        return logits

    engine.runner.forward = recording  # type: ignore[method-assign]
    try:
        (req,) = engine.generate([prompt], params)
    finally:
        del engine.runner.forward
    engine.cache.check_integrity()
    return list(req.output_token_ids), torch.stack(rows[-params.max_tokens:]), req.num_cached_tokens


@pytest.mark.parametrize("hit", [WINDOW - BLOCK_SIZE, WINDOW, WINDOW + BLOCK_SIZE])
def test_gemma3_270m_prefix_hit_at_the_window_edge(gemma3: LoadedModel, hit: int) -> None:
    shape = gemma3.shape
    assert (shape.sliding_window, shape.head_dim, shape.layer_window_lefts.count(-1)) == (WINDOW, 256, 3)
    rng = torch.Generator().manual_seed(3)
    prompt = torch.randint(1000, 200_000, (hit + SUFFIX_TOKENS,), generator=rng).tolist()
    cold_tokens, cold_logits, cold_cached = _run(_engine(gemma3, hit, prefix_cache=False), prompt)
    warm = _engine(gemma3, hit)
    _, _, first_cached = _run(warm, prompt[:hit], PREFIX_ONLY)
    tokens, logits, num_cached = _run(warm, prompt)
    assert (cold_cached, first_cached, num_cached) == (0, 0, hit)
    assert tokens == cold_tokens
    assert torch.equal(logits, cold_logits), float((logits - cold_logits).abs().max())


def test_gemma3_270m_window_groups_hit_past_two_windows(gemma3: LoadedModel) -> None:
    """``--sliding-window-kv window``: the window layers' pool holds 63 blocks, the prefix of
    2W + B = 1,040 tokens is prefilled in 13-block chunks (window blocks leave the window and
    are cached or freed as it goes); the hit at 1,040 reads the 32 window blocks before it from
    that pool and gives the cold run's tokens and logits bit for bit."""
    hit, chunk = 2 * WINDOW + BLOCK_SIZE, 13 * BLOCK_SIZE
    rng = torch.Generator().manual_seed(5)
    prompt = torch.randint(1000, 200_000, (hit + SUFFIX_TOKENS,), generator=rng).tolist()
    cold_tokens, cold_logits, _ = _run(_engine(gemma3, chunk, prefix_cache=False), prompt)
    cfg = engine_config(block_size=BLOCK_SIZE, num_blocks=96, prefill_chunk_tokens=chunk,
                        sliding_window_kv="window", window_num_blocks=64)
    warm = LLMEngine(dataclasses.replace(cfg, attention_backend="torch"), gemma3)
    assert warm.runner.kv_groups == {-1: 96, 511: 64}
    _, _, first_cached = _run(warm, prompt[:hit], PREFIX_ONLY)
    tokens, logits, num_cached = _run(warm, prompt)
    assert (first_cached, num_cached) == (0, hit)
    assert tokens == cold_tokens
    assert torch.equal(logits, cold_logits), float((logits - cold_logits).abs().max())

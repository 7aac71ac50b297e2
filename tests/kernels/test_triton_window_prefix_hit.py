"""Prefix hits on a hybrid window model through the engine on the Triton backend (the
interpreter on a CPU-only machine, compiled kernels on CUDA).

The tiny Gemma 3 of ``tests/engine/test_engine_window.py`` (five window-8 layers to one full,
blocks of one token): a hit at W - 1, W and W + 1 tokens must report exactly that many cached
tokens and give the cold run's greedy tokens, with logits within ``ATOL``. Not bit-exact, unlike
the C kernels: the Triton extend kernel takes a cached prefix's keys from the pool in block
tiles and a cold run's same keys as causal tiles of the new tokens, so the online softmax sums
the same terms in another grouping (fp32 rounding: measured 2.5e-7 to 3.6e-7 with the
interpreter, on logits of magnitude up to 0.67); a key outside the window or a wrong position
moves them by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine_window import (
    WINDOW,
    run_recording,
    small_tokenizer,
    window_engine,
    window_model,
    window_prompt,
)

ATOL = 1e-5
SUFFIX_TOKENS = 3


@pytest.mark.parametrize("hit", [WINDOW - 1, WINDOW, WINDOW + 1])
def test_gemma3_prefix_hit_on_triton(hit: int) -> None:
    from radixkv.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    model = window_model("gemma3", small_tokenizer())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompt = window_prompt(hit + SUFFIX_TOKENS)
    cold = window_engine(model, "triton", prefix_cache=False, device=device)
    warm = window_engine(model, "triton", device=device)
    cold_tokens, cold_logits, _ = run_recording(cold, prompt, params)
    run_recording(warm, prompt[:hit], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    tokens, logits, num_cached = run_recording(warm, prompt, params)
    assert num_cached == hit
    assert tokens == cold_tokens
    assert float((logits - cold_logits).abs().max()) <= ATOL

"""Window KV groups through the engine (``--sliding-window-kv window``): window layers keep a
pool of their own and each request only its window there (``radixkv.cache.window_cache``).

On the tiny random-init Mistral / Gemma 2 / Gemma 3 models of ``test_engine_window`` (W = 8):
prefix hits at 1, W - 1, W, W + 1 and 3W give the chunk-aligned cold run's tokens and logits
bit for bit (``torch.equal``), as under keep-all; a hit whose window blocks were evicted falls
back to the deepest boundary that still has them, still exact, the rest counted
``window_evicted``; sessions sharing a system prompt through a full pool keep reusing it; the
pools and their sizes, ``n > 1`` and the stats.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from radixkv.config import CacheConfig
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.window_kv import grouped_pool_sizes, max_window_chunk_tokens
from radixkv.model.config import ModelShape
from radixkv.server.metrics import window_pool_families
from tests.engine.test_engine_window import (
    FAMILIES,
    GREEDY,
    HITS,
    PREFIX_ONLY,
    SUFFIX_TOKENS,
    VOCAB,
    WINDOW,
    round_robin,
    run_recording,
    window_engine,
    window_model,
    window_prompt,
)
from tests.factories import engine_config

WINDOW_BLOCKS = 40  # B = 1: the 3W + 5-token prompt's prefill (one chunk) and the window


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tests.engine.test_engine_window import small_tokenizer

    return small_tokenizer()


def _grouped(model, backend: str = "torch", **config: Any) -> LLMEngine:
    return window_engine(model, backend, sliding_window_kv="window",
                         window_num_blocks=WINDOW_BLOCKS, **config)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_window_groups_hit_across_the_window_is_the_cold_run(family: str, backend: str,
                                                             tokenizer: Any) -> None:
    model = window_model(family, tokenizer)
    for hit in HITS:
        prompt = window_prompt(hit + SUFFIX_TOKENS)
        cold = window_engine(model, backend, prefix_cache=False, prefill_chunk_tokens=hit)
        warm = _grouped(model, backend, prefill_chunk_tokens=hit)
        assert warm.window_kv == "window" and warm.cache.window is not None
        cold_tokens, cold_logits, _ = run_recording(cold, prompt)
        _, _, first_cached = run_recording(warm, prompt[:hit], PREFIX_ONLY)
        tokens, logits, num_cached = run_recording(warm, prompt)
        assert (first_cached, num_cached) == (0, hit)
        assert tokens == cold_tokens and len(tokens) == GREEDY.max_tokens
        assert torch.equal(logits, cold_logits), (hit, float((logits - cold_logits).abs().max()))
        snap = warm.cache.window.snapshot()
        assert snap["num_held_blocks"] == 0 and snap["evicted_blocks_total"] == 0


def test_evicted_window_blocks_move_the_hit_back_to_an_anchor_exactly(tokenizer: Any) -> None:
    """B = 2, W = 8 (4 window blocks before a boundary): a 40-token prompt is cached; its
    window blocks between the first 5 and the last 5 (plain ones) are evicted. A prompt
    sharing 30 tokens then hits at 10 (not 30) with 20 tokens ``window_evicted``, and its
    tokens and logits equal a cold run's that computes the same chunks; the whole prompt
    again still hits all 40 (anchors at the prompt's end)."""
    model = window_model("gemma3", tokenizer)
    first = window_prompt(40)
    second = first[:30] + [(t + 1) % VOCAB for t in first[30:36]]
    cfg = dict(block_size=2, num_blocks=64, prefill_chunk_tokens=10)

    def make(**extra: Any) -> LLMEngine:
        return LLMEngine(dataclasses.replace(engine_config(**cfg, **extra),
                                             attention_backend="torch"), model)

    warm = make(sliding_window_kv="window", window_num_blocks=32)
    run_recording(warm, first, PREFIX_ONLY)
    window = warm.cache.window
    assert window is not None and window.num_cached_blocks == 20
    assert window.num_anchor_blocks == 10 and window.evict(10) == 10
    tokens, logits, num_cached = run_recording(warm, second)
    assert num_cached == 10
    stats = warm.stats_snapshot()
    assert stats["miss_tokens"]["window_evicted"] == 20
    cold_tokens, cold_logits, _ = run_recording(make(prefix_cache=False), second)
    assert tokens == cold_tokens and torch.equal(logits, cold_logits)
    _, _, again = run_recording(warm, first + [5])
    assert again == 40


SYSTEM_TOKENS = 24


def test_cross_session_reuse_holds_when_the_window_pool_runs_full(tokenizer: Any) -> None:
    """The pattern of vLLM #48435 (reuse falling to 0 once freed window tails are recycled)
    with a window pool of 16 blocks, a third of the full pool's: every new session reuses the
    whole shared system prompt at every occupancy, as the same weights with every layer full
    attention do, although window blocks were evicted."""
    hybrid = window_model("gemma3", tokenizer)
    full = dataclasses.replace(hybrid, shape=dataclasses.replace(
        hybrid.shape, sliding_window=None, layer_types=None))
    got, engine = round_robin(hybrid, prefill_chunk_tokens=8, sliding_window_kv="window",
                              window_num_blocks=17)
    want, _ = round_robin(full, prefill_chunk_tokens=8)
    window = engine.cache.window
    assert window is not None and window.evicted_blocks_total > 0
    # The very first session finds nothing; every later one the whole system prompt, at
    # 25-50 %, 50-90 % and over 90 % occupancy of the full pool alike.
    assert [c for _, c in got] == [c for _, c in want] == [0] + [SYSTEM_TOKENS] * 15
    for low, high in ((0.25, 0.5), (0.5, 0.9), (0.9, 1.01)):
        assert [c for o, c in got if low <= o < high], f"no session at {low:.0%}-{high:.0%}"


def test_n_choices_share_the_prompt_through_a_hit(tokenizer: Any) -> None:
    """``n = 2`` under window groups: the second choice starts from a prefix hit on the
    first's prompt (the fork's tail copy declines) and, greedy, gives the same tokens."""
    model = window_model("gemma3", tokenizer)
    engine = _grouped(model, prefill_chunk_tokens=64)
    # 40 window blocks, W = 8, B = 1: chunks capped at 40 - 7 - 4 = 29 tokens.
    assert engine.config.scheduler.prefill_chunk_tokens == 29
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=2)
    first, second = engine.generate([window_prompt(3 * WINDOW + 1)], params)
    assert first.output_token_ids == second.output_token_ids and len(first.output_token_ids) == 5
    assert second.num_cached_tokens == first.num_cached_tokens == 0
    engine.cache.check_integrity()
    assert engine.cache.window.snapshot()["num_held_blocks"] == 0


def test_stats_and_log_say_window(tokenizer: Any) -> None:
    engine = _grouped(window_model("gemma3", tokenizer))
    stats = engine.stats_snapshot()
    assert stats["hit_granularity"]["window_kv"] == "window"
    assert stats["pool"]["window"] == {
        "num_blocks": WINDOW_BLOCKS, "num_free_blocks": WINDOW_BLOCKS - 1, "num_held_blocks": 0,
        "num_cached_blocks": 0, "num_evictable_blocks": 0, "num_anchor_blocks": 0,
        "evicted_blocks_total": 0}
    # One 3W + 5-token request (29 prompt tokens in one chunk, then 4 decode steps): 33
    # window blocks, all cached; anchors are the first need + 1 = 8, the 8 before the
    # prompt's end (21..28) and the 8 before the final end (25..32): 20. /metrics agrees.
    run_recording(engine, window_prompt(3 * WINDOW + 5))
    window = engine.stats_snapshot()["pool"]["window"]
    assert window == {"num_blocks": WINDOW_BLOCKS, "num_free_blocks": WINDOW_BLOCKS - 1 - 33,
                      "num_held_blocks": 0, "num_cached_blocks": 33,
                      "num_evictable_blocks": 33, "num_anchor_blocks": 20,
                      "evicted_blocks_total": 0}
    blocks, evicted = window_pool_families(window)
    assert {s.labels["state"]: s.value for s in blocks.samples} == {
        "free": 6, "held": 0, "plain": 13, "anchor": 20}
    assert [s.value for s in evicted.samples] == [0]
    # The layout is part of the cache identity: a keep-all engine's roots differ.
    keep_all = window_engine(window_model("gemma3", tokenizer), "torch")
    assert engine.cache_root(None) != keep_all.cache_root(None)
    # A full-attention model has nothing to bound: keep-all.
    model = window_model("gemma3", tokenizer)
    full = dataclasses.replace(model, shape=dataclasses.replace(
        model.shape, sliding_window=None, layer_types=None))
    assert _grouped(full).window_kv == "keep-all"


# Gemma 3 270M's layout: 18 layers, every sixth full, window 512.
GEMMA3_270M = ModelShape(
    vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_layers=18, num_q_heads=4,
    num_kv_heads=1, head_dim=256, rope_theta=1e6, rms_norm_eps=1e-6,
    max_position_embeddings=32_768, tie_word_embeddings=True, sliding_window=512,
    layer_types=tuple("full_attention" if i % 6 == 5 else "sliding_attention"
                      for i in range(18)))


def test_pool_sizes_split_the_budget_by_layers() -> None:
    # fp32 K+V of one 16-token block over 18 layers: 16 * 18 * 2 * 256 * 4 = 589,824 bytes;
    # 32,768 per layer. 1 GiB, a quarter to the 15 window layers: 268,435,456 // 491,520 =
    # 546 window blocks; the rest to the 3 full layers: 805,306,368 // 98,304 = 8,192.
    bpb = 589_824
    sizes = grouped_pool_sizes(CacheConfig(sliding_window_kv="window"), GEMMA3_270M, bpb,
                               1 << 30)
    assert sizes == (8192, 546)
    # Keep-all holds 1 GiB // 589,824 = 1,820 blocks: the window layout caches 4.5x the tokens.
    assert (1 << 30) // bpb == 1820
    assert grouped_pool_sizes(CacheConfig(num_blocks=100, sliding_window_kv="window"),
                              GEMMA3_270M, bpb, 1 << 30) == (100, 101)
    # A prefill chunk is capped so one request fits: 546 - 32 (window) - 4 = 510 blocks.
    assert max_window_chunk_tokens(546, 512, 16) == 510 * 16
    # One request's window (32 blocks) + slack + a one-block chunk must fit: 37 blocks.
    with pytest.raises(ValueError, match="window_kv_fraction"):  # 21 blocks
        grouped_pool_sizes(CacheConfig(sliding_window_kv="window", window_kv_fraction=0.01),
                           GEMMA3_270M, bpb, 1 << 30)
    with pytest.raises(ValueError, match="window_num_blocks"):
        grouped_pool_sizes(CacheConfig(num_blocks=100, window_num_blocks=36,
                                       sliding_window_kv="window"), GEMMA3_270M, bpb, 1 << 30)
    assert grouped_pool_sizes(CacheConfig(num_blocks=100, window_num_blocks=37,
                                          sliding_window_kv="window"),
                              GEMMA3_270M, bpb, 1 << 30) == (100, 37)


@pytest.mark.parametrize("fields, name", [
    (dict(sliding_window_kv="tombstones"), "sliding_window_kv"),
    (dict(window_kv_fraction=1.0), "window_kv_fraction"),
    (dict(window_kv_fraction=True), "window_kv_fraction"),
    (dict(window_num_blocks=1), "window_num_blocks"),
    (dict(sliding_window_kv="window", kv_store="host:1"), "sliding_window_kv"),
])
def test_bad_window_settings_name_the_field(fields: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}"):
        CacheConfig(**fields)


def test_prefill_chunks_shrink_to_the_window_room_instead_of_preempting(tokenizer: Any) -> None:
    """Three 40-token prompts at once through a 30-block window pool (B = 1, W = 8: a chunk
    may be 19 tokens, a window holds 9 blocks in decode): the chunks of later requests shrink to
    the window blocks left instead of preempting the first, and every greedy token equals
    keep-all's."""
    model = window_model("gemma3", tokenizer)
    prompts = [window_prompt(40 + i)[i:] for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def make(**extra: Any) -> LLMEngine:  # a full pool that never runs short
        return LLMEngine(dataclasses.replace(engine_config(block_size=1, num_blocks=256, **extra),
                                             attention_backend="torch"), model)

    grouped = make(sliding_window_kv="window", window_num_blocks=30)
    assert grouped.config.scheduler.prefill_chunk_tokens == 19
    got = [r.output_token_ids for r in grouped.generate(prompts, params)]
    want = [r.output_token_ids for r in make().generate(prompts, params)]
    assert got == want
    assert grouped.stats.preemptions_total == 0
    grouped.cache.check_integrity()
    # Chunks that do not shrink: a request is preempted for window blocks (same tokens).
    unshrunk = make(sliding_window_kv="window", window_num_blocks=30)
    unshrunk.scheduler._window_groups = False
    assert [r.output_token_ids for r in unshrunk.generate(prompts, params)] == want
    assert unshrunk.stats.preemptions_total > 0

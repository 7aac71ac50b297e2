"""Prefill cost model (eviction/cost_model.py), its ModelShape adapter, and saved FLOPs in /stats."""

from __future__ import annotations

import pytest

from radixkv.eviction.cost_model import (
    PRESETS,
    CostShape,
    cost_shape_from_model_shape,
    get_shape,
    prefill_flops,
    saved_prefill_flops,
)


def naive_flops(shape: CostShape, start: int, n: int) -> float:
    w = shape.sliding_window
    keys = sum(min(p + 1, w) if w else p + 1 for p in range(start, start + n))
    return 2 * shape.params * n + 4 * shape.num_layers * shape.num_q_heads * shape.head_dim * keys


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("start,n", [(0, 1), (0, 512), (511, 3), (4096, 700), (10, 0)])
def test_closed_form_matches_sum(name: str, start: int, n: int) -> None:
    shape = PRESETS[name]
    assert prefill_flops(shape, start, n) == pytest.approx(naive_flops(shape, start, n), rel=1e-12)


def test_sliding_window_caps_attention() -> None:
    shape = CostShape("w", num_layers=2, hidden_size=8, intermediate_size=16, num_q_heads=2,
                      num_kv_heads=1, head_dim=4, sliding_window=5)
    for start, n in [(0, 3), (0, 9), (3, 6), (7, 4)]:
        assert prefill_flops(shape, start, n) == pytest.approx(naive_flops(shape, start, n))


def test_preset_parameter_counts_match_published_sizes() -> None:
    # Non-embedding parameters (published totals minus embedding / lm_head matrices).
    assert PRESETS["llama3-8b"].params == pytest.approx(6.98e9, rel=0.01)
    assert PRESETS["llama3-70b"].params == pytest.approx(68.45e9, rel=0.01)
    assert PRESETS["qwen2.5-7b"].params == pytest.approx(6.53e9, rel=0.01)
    assert PRESETS["smollm2-135m"].params == pytest.approx(106.2e6, rel=0.01)


def test_deeper_blocks_cost_more_and_additive() -> None:
    s = PRESETS["llama3-8b"]
    assert prefill_flops(s, 100_000, 512) > prefill_flops(s, 12_000, 512) > prefill_flops(s, 0, 512)
    split = prefill_flops(s, 0, 400) + prefill_flops(s, 400, 600)
    assert prefill_flops(s, 0, 1000) == pytest.approx(split)
    assert saved_prefill_flops(s, 0) == 0.0
    assert saved_prefill_flops("llama3-8b", 2048) == prefill_flops(s, 0, 2048)


def test_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="model_shape"):
        get_shape("gpt-5")
    with pytest.raises(ValueError, match="start"):
        prefill_flops("llama3-8b", -1, 4)
    with pytest.raises(ValueError, match="num_tokens"):
        prefill_flops("llama3-8b", 0, -4)
    with pytest.raises(ValueError, match="head_dim"):
        CostShape("bad", 1, 1, 1, 1, 1, 0)


def test_model_shape_adapter_agrees_with_preset() -> None:
    from radixkv.model.config import ModelShape

    shape = ModelShape(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_q_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                       rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True)
    cost = cost_shape_from_model_shape(shape, "SmolLM2")
    assert cost.params == shape.num_non_embedding_params() == PRESETS["smollm2-135m"].params
    assert get_shape(shape).flops(0, 300) == PRESETS["smollm2-135m"].flops(0, 300)
    with pytest.raises(ValueError, match="model_shape"):
        cost_shape_from_model_shape(object())


def test_stats_count_saved_prefill_flops() -> None:
    from radixkv.engine.stats import EngineStats

    stats = EngineStats(PRESETS["smollm2-135m"])
    stats.record_admission(100, 64)
    stats.record_admission(50, 0)
    assert stats.saved_prefill_flops_total == prefill_flops("smollm2-135m", 0, 64)


def test_cache_manager_builds_cost_policy_with_model_shape() -> None:
    from radixkv.cache.manager import CacheManager

    cm = CacheManager(8, 4, eviction_policy="cost", model_shape="llama3-70b")
    assert cm.tree.policy.shape is PRESETS["llama3-70b"]
    assert CacheManager(8, 4, eviction_policy="lru", model_shape="llama3-70b").tree.policy.name == "lru"

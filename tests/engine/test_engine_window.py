"""Prefix caching on sliding-window and hybrid models, through the engine.

Tiny random-init Mistral (every layer windowed), Gemma 2 (local / global alternating, logit
soft-caps) and Gemma 3 (five local layers to one global, q/k norms, separate RoPE bases) are
built from transformers' classes (nothing downloaded), window W = 8 tokens, blocks of one token
so a hit can end at any position. A first request prefills exactly the prefix ``[0, m)`` of a
prompt (one generated token, whose K/V is never computed); a second sends the whole prompt and
must hit at exactly m, for m = 1, W - 1, W, W + 1 and 3W.

Exact (``torch.equal``) against a cold run (prefix caching off) that computes the same steps:
both engines prefill in chunks of m tokens, so the cold run's first step is the first request's
prefill and its second step is the hit's suffix, reading the same K/V from the pool (other
block ids). Every greedy token and logits row must then be bit-identical: a wrong window over
the cached prefix, a wrong block or position, or K/V the cache failed to keep would show.
Against a cold run that prefills the whole prompt in one step the logits are equal to fp32
rounding only (:data:`ROUNDING_ATOL`): a row's rounding in the C few-row GEMM and the attention
kernels depends on the step it is computed in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import pytest
import torch
import transformers

from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.window_kv import hit_granularity
from radixkv.model.config import ModelShape
from radixkv.model.hf_loader import shape_from_hf_config
from radixkv.model.loader import LoadedModel, embedded_tokenizer_dir
from radixkv.model.tokenizer import ChatTokenizer
from tests.factories import engine_config

WINDOW = 8
VOCAB = 300
SUFFIX_TOKENS = 5
DECODE_STEPS = 4
HITS = (1, WINDOW - 1, WINDOW, WINDOW + 1, 3 * WINDOW)
# A prefix computed in a step of its own against the same prefix computed as rows of a longer
# step: the C few-row GEMM and the attention kernels round a row the same only for the same
# step shape (measured on these models: equal, or apart by 2e-8 to 4e-7).
ROUNDING_ATOL = 1e-5

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6)
# family -> (config class, model class, config fields beyond _BASE)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 50000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
}
GREEDY = SamplingParams(max_tokens=1 + DECODE_STEPS, temperature=0.0, ignore_eos=True)
PREFIX_ONLY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@functools.cache
def _weights(family: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """(shape, state dict) of a tiny random-init ``family`` model, every norm weight randomised
    (Gemma's ``1 + w`` norms start at w = 0, which would hide a missing offset)."""
    config_cls, model_cls, fields = FAMILIES[family]
    config = config_cls(**_BASE, **fields)
    torch.manual_seed(0)
    hf_model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    shape = shape_from_hf_config(json.loads(config.to_json_string()))
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    if shape.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return shape, state


def window_model(family: str, tokenizer: Any) -> LoadedModel:
    """The tiny ``family`` model (one of :data:`FAMILIES`, window :data:`WINDOW`) as radixkv
    loads it, with ``tokenizer`` for the detokenizer."""
    shape, state = _weights(family)
    return LoadedModel(shape=shape, state_dict=state, revision=f"{family:0<64}"[:64], name=family,
                       tokenizer=tokenizer, dtype=torch.float32)


def small_tokenizer() -> ChatTokenizer:
    """SmolLM2's tokenizer: only the detokenizer reads it (ids < 300 are valid tokens)."""
    from transformers import AutoTokenizer

    return ChatTokenizer(AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir())),
                         max_model_len=_BASE["max_position_embeddings"])


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return small_tokenizer()


def window_engine(model: LoadedModel, backend: str, *, device: str = "cpu", kv_cache_dtype: str = "auto",
                  **config: Any) -> LLMEngine:
    """An engine over ``model`` with blocks of one token (a hit can end at any position)."""
    cfg = engine_config(block_size=1, num_blocks=64, **config)
    return LLMEngine(dataclasses.replace(cfg, attention_backend=backend, device=device,
                                         kv_cache_dtype=kv_cache_dtype), model)


def window_prompt(num_tokens: int) -> list[int]:
    return torch.randint(0, VOCAB, (num_tokens,), generator=torch.Generator().manual_seed(7)).tolist()


def run_recording(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY
         ) -> tuple[list[int], torch.Tensor, int]:
    """Greedy tokens, the logits row each was sampled from (``[steps, vocab]``) and the cached
    prompt tokens of ``prompt`` run alone (a chunked prefill's earlier chunks sample nothing:
    the sampled rows are the last prompt chunk's and each decode step's, the last ``steps``)."""
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


@pytest.mark.parametrize("backend, kv", [("torch", "auto"), ("reference", "auto"), ("torch", "int8")])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefix_hit_across_the_window_is_the_cold_run(family: str, backend: str, kv: str,
                                                      tokenizer: Any) -> None:
    model = window_model(family, tokenizer)
    unchunked = window_engine(model, backend, prefix_cache=False, kv_cache_dtype=kv)
    for hit in HITS:
        prompt = window_prompt(hit + SUFFIX_TOKENS)
        # Both runs prefill in chunks of `hit` tokens: the cold run computes [0, hit) in its
        # first step, the hit's first request the same; then both compute the rest alike.
        cold = window_engine(model, backend, prefix_cache=False, prefill_chunk_tokens=hit,
                             kv_cache_dtype=kv)
        warm = window_engine(model, backend, prefill_chunk_tokens=hit, kv_cache_dtype=kv)
        cold_tokens, cold_logits, cold_cached = run_recording(cold, prompt)
        _, _, first_cached = run_recording(warm, prompt[:hit], PREFIX_ONLY)
        tokens, logits, num_cached = run_recording(warm, prompt)
        assert (cold_cached, first_cached, num_cached) == (0, 0, hit)
        assert tokens == cold_tokens and len(tokens) == GREEDY.max_tokens
        assert logits.shape == (GREEDY.max_tokens, VOCAB)
        assert torch.equal(logits, cold_logits), (hit, float((logits - cold_logits).abs().max()))
        # Against the prompt prefilled in one step: the same to fp32 rounding.
        whole_tokens, whole_logits, _ = run_recording(unchunked, prompt)
        assert whole_tokens == tokens
        assert float((whole_logits - logits).abs().max()) <= ROUNDING_ATOL


def test_hit_granularity_names_the_layer_groups() -> None:
    # Gemma 3 270M's layout: 18 layers, every sixth full, window 512; no weights needed.
    kinds = tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18))
    shape = ModelShape(vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_layers=18,
                       num_q_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1e6,
                       rms_norm_eps=1e-6, max_position_embeddings=32_768, tie_word_embeddings=True,
                       sliding_window=512, layer_types=kinds)
    assert hit_granularity(shape, 16) == {
        "block_size_tokens": 16, "window_kv": "keep-all",
        "layer_groups": [{"attention": "full", "window_tokens": None, "num_layers": 3},
                         {"attention": "sliding", "window_tokens": 512, "num_layers": 15}]}
    llama = dataclasses.replace(shape, sliding_window=None, layer_types=None)
    assert hit_granularity(llama, 4)["layer_groups"] == [
        {"attention": "full", "window_tokens": None, "num_layers": 18}]


# ------------------------------------------------------------------ cross-session reuse
SYSTEM_TOKENS = 24          # shared by every session: 6 blocks of 4
USER_TOKENS = 8
REPLY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TURNS_PER_SESSION = 4
NEW_SESSIONS_PER_ROUND = 2
ROUNDS = 8
POOL_BLOCKS = 48            # B = 4: 192 tokens, about a third of the sessions' working set
BANDS = ((0.25, 0.5), (0.5, 0.9), (0.9, 1.01))


def round_robin(model: LoadedModel, **config: Any) -> tuple[list[tuple[float, int]], LLMEngine]:
    """Sessions sharing a system prompt, taking turns through a pool that fills up: each round
    two new sessions start and every live session sends its next turn (its history, the model's
    replies and a new user message); a session ends after four turns. Returns, for every
    session's first turn, (pool occupancy before it, its cached prompt tokens): what it reuses
    of other sessions' blocks, since nothing of its own is cached yet; and the engine.
    ``config``: more ``engine_config`` fields."""
    cfg = engine_config(block_size=4, num_blocks=POOL_BLOCKS, **config)
    engine = LLMEngine(dataclasses.replace(cfg, attention_backend="torch"), model)
    rng = torch.Generator().manual_seed(11)
    system = torch.randint(0, VOCAB, (SYSTEM_TOKENS,), generator=rng).tolist()
    live: list[list[int]] = []  # each session's history so far
    turns: list[int] = []
    first_turns: list[tuple[float, int]] = []
    for _ in range(ROUNDS):
        live += [list(system) for _ in range(NEW_SESSIONS_PER_ROUND)]
        turns += [0] * NEW_SESSIONS_PER_ROUND
        for s, history in enumerate(live):
            if turns[s] == TURNS_PER_SESSION:
                continue
            history += torch.randint(0, VOCAB, (USER_TOKENS,), generator=rng).tolist()
            occupancy = 1 - engine.cache.num_free_blocks / POOL_BLOCKS
            (req,) = engine.generate([history], REPLY)
            if turns[s] == 0:
                first_turns.append((occupancy, req.num_cached_tokens))
            history += req.output_token_ids
            turns[s] += 1
        engine.cache.check_integrity()
    return first_turns, engine


def test_cross_session_reuse_holds_as_the_pool_fills(tokenizer: Any) -> None:
    """Reuse across sessions (the shared system prompt) at 25-50 %, 50-90 % and over 90 % pool
    occupancy, hybrid Gemma 3 against the same weights with every layer full attention: never
    0, and the hybrid model reuses exactly what the full-attention one does."""
    hybrid = window_model("gemma3", tokenizer)
    full = dataclasses.replace(hybrid, shape=dataclasses.replace(
        hybrid.shape, sliding_window=None, layer_types=None))
    assert full.shape.layer_window_lefts == (-1,) * 6
    (got, engine), (want, full_engine) = round_robin(hybrid), round_robin(full)
    evicted, full_evicted = engine.cache.evicted_blocks_total, full_engine.cache.evicted_blocks_total
    assert len(got) == ROUNDS * NEW_SESSIONS_PER_ROUND
    assert evicted == full_evicted and evicted > 0  # the pool ran full and evicted
    assert got == want  # same occupancy, same reuse, request by request
    for low, high in BANDS:
        cached = [tokens for occupancy, tokens in got if low <= occupancy < high]
        assert cached, f"no new session started at {low:.0%}-{high:.0%} occupancy"
        assert cached == [SYSTEM_TOKENS] * len(cached), (low, cached)


def test_a_hybrid_prefix_comes_back_from_the_store_tier_exactly(tokenizer: Any) -> None:
    """Gemma 3's blocks (every layer, window ones included) through the host store tier: the
    prefix ``[0, 3W)`` is written, dropped from the device pool and loaded back; the request
    that reuses it gives the chunk-aligned cold run's logits bit for bit."""
    model = window_model("gemma3", tokenizer)
    hit = 3 * WINDOW
    prompt = window_prompt(hit + SUFFIX_TOKENS)
    cold = window_engine(model, "torch", prefix_cache=False, prefill_chunk_tokens=hit)
    cold_tokens, cold_logits, _ = run_recording(cold, prompt)
    engine = window_engine(model, "torch", prefill_chunk_tokens=hit, kv_store="host:0.01")
    try:
        run_recording(engine, prompt[:hit], PREFIX_ONLY)
        assert engine.store.flush()
        engine.cache.evict(engine.num_blocks)
        assert engine.cache.num_cached_blocks == 0
        tokens, logits, num_cached = run_recording(engine, prompt)
        assert num_cached == hit
        assert engine.stats_snapshot()["cached_prompt_tokens_by_tier"] == {"device": 0, "store": hit}
        assert tokens == cold_tokens
        assert torch.equal(logits, cold_logits)
    finally:
        engine.store.close()

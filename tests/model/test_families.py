"""Each supported model family through the paged runner against transformers (fp32, CPU).

Tiny random-init models are built here from each family's transformers class (nothing is
downloaded), with every norm weight randomised (Gemma initialises its ``1 + w`` norms to w = 0,
which would hide a missing offset) and ``attn_implementation="eager"`` as the reference. Every
comparison is against transformers' logits of the whole sequence, so a decode step, a prefix
hit's suffix or a prefill chunk must give what one from-scratch forward gives.

Tolerance: ``ATOL`` = 1e-5 absolute on fp32 logits (of magnitude ~1-10). Both sides are fp32;
they differ only in reduction order (oneDNN / C GEMMs and a flash-style online softmax against
transformers' matmuls and softmax), which left every family within 1.1e-6 here; a wrong window,
scale, norm or RoPE base moves logits by 1e-2 or more.

Windows are 8 tokens with blocks of 4 and sequences of 40: every decode step past position 8
and every chunk after the first reads a window that excludes earlier tokens.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from radixkv import cli
from radixkv.model.config import ModelShape
from radixkv.model.hf_loader import shape_from_hf_config
from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner

ATOL = 1e-5
BLOCK_SIZE = 4
NUM_BLOCKS = 64
WINDOW = 8
VOCAB = 300

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6)

# family -> (config class, model class, config fields beyond _BASE)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_hidden_layers=2)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(num_hidden_layers=2)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(num_hidden_layers=2)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # 5:1 local:global; the global layers' RoPE linearly scaled, the local ones on their own base.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=24,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 50000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
}
# Attention paths of the runner on a CPU: the torch backend with the C decode / extend kernels,
# the torch backend on SDPA alone, and the reference backend.
BACKENDS: dict[str, dict[str, Any]] = {"torch-native": dict(attention_backend="torch"),
            "torch-sdpa": dict(attention_backend="torch", native_kernels=False),
            "reference": dict(attention_backend="reference")}


@functools.cache
def _family(name: str) -> tuple[torch.nn.Module, LoadedModel]:
    """(transformers model, the same weights as radixkv loads them) of a tiny ``name`` model."""
    config_cls, model_cls, fields = FAMILIES[name]
    config = config_cls(**_BASE, **fields)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = model_cls(config).float().eval()
    with torch.no_grad():
        for param_name, param in hf_model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.0, 0.3)
    shape = shape_from_hf_config(json.loads(config.to_json_string()))
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    if shape.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = LoadedModel(shape=shape, state_dict=state, revision="0" * 64, name=name,
                        tokenizer=None, dtype=torch.float32)  # type: ignore[arg-type]
    return hf_model, model


@torch.inference_mode()
def _hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _table(first_block: int, num_tokens: int) -> list[int]:
    # Descending ids: a table that is not the identity catches slot arithmetic mistakes.
    count = -(-num_tokens // BLOCK_SIZE)
    return list(range(first_block + count - 1, first_block - 1, -1))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


def _runner(model: LoadedModel, backend: str) -> ModelRunner:
    return ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, **BACKENDS[backend])


def test_family_shapes() -> None:
    shapes = {name: _family(name)[1].shape for name in FAMILIES}
    assert all(shapes[n].plain_llama for n in ("llama", "qwen2", "mistral"))
    assert not any(shapes[n].plain_llama for n in ("qwen3", "gemma2", "gemma3"))
    assert shapes["mistral"].layer_window_lefts == (7, 7) and shapes["mistral"].layer_types is None
    assert shapes["qwen3"].qk_norm and shapes["qwen3"].layer_window_lefts == (-1, -1)
    g2, g3 = shapes["gemma2"], shapes["gemma3"]
    assert g2.layer_window_lefts == (7, -1, 7, -1)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.attention_scale) == (5.0, 3.0, 24 ** -0.5)
    assert (g2.embedding_multiplier, g2.hidden_act, g2.rms_norm_weight_offset) == (8.0, "gelu_pytorch_tanh", 1.0)
    assert g2.sandwich_norms and not g2.qk_norm and g2.tie_word_embeddings
    assert g3.layer_window_lefts == (7, 7, 7, 7, 7, -1)
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling) == (
        50000.0, 500.0, {"rope_type": "linear", "factor": 2.0})
    assert g3.qk_norm and g3.attn_logit_softcap is None and g3.final_logit_softcap is None
    assert [g3.layer_uses_local_rope(i) for i in range(6)] == [True] * 5 + [False]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_then_16_greedy_decode_steps(family: str, backend: str) -> None:
    hf_model, model = _family(family)
    runner = _runner(model, backend)
    ids = _ids(24, seed=1)
    table = _table(3, 40)
    logits = [runner.forward(runner.build_batch([(ids, 0, table)]), all_logits=True)]
    for _ in range(16):
        ids.append(int(logits[-1][-1].argmax()))
        logits.append(runner.forward(runner.build_batch([(ids[-1:], len(ids) - 1, table)])))
    expected = _hf_logits(hf_model, ids)
    assert _max_diff(torch.cat(logits), expected[:40]) <= ATOL


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefix_hit_packed_with_a_decode(family: str, backend: str) -> None:
    # Request A (30 tokens) is prefilled; request B shares A's first 5 full blocks (20 tokens)
    # and computes only its 10-token suffix, in the same step as A's next decode token.
    hf_model, model = _family(family)
    runner = _runner(model, backend)
    first = _ids(31, seed=2)
    second = first[:20] + _ids(10, seed=3)
    table_a = _table(0, 31)
    table_b = table_a[:5] + _table(20, 10)
    runner.forward(runner.build_batch([(first[:30], 0, table_a)]))
    batch = runner.build_batch([(second[20:], 20, table_b), (first[30:], 30, table_a)])
    logits = runner.forward(batch, all_logits=True)
    assert _max_diff(logits[:10], _hf_logits(hf_model, second)[20:]) <= ATOL
    assert _max_diff(logits[10:], _hf_logits(hf_model, first)[30:]) <= ATOL


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_across_the_window_edge(family: str, backend: str) -> None:
    # Chunks [0, 6), [6, 11), [11, 33): the second holds the window edge (position 8 is the
    # first query whose window drops a key), the third starts past it.
    hf_model, model = _family(family)
    runner = _runner(model, backend)
    ids = _ids(33, seed=4)
    table = _table(7, 33)
    chunks = [runner.forward(runner.build_batch([(ids[start:end], start, table)]), all_logits=True)
              for start, end in ((0, 6), (6, 11), (11, 33))]
    assert _max_diff(torch.cat(chunks), _hf_logits(hf_model, ids)) <= ATOL


def test_family_features_change_the_logits() -> None:
    # The tolerance means something: dropping one Gemma 3 feature (the local RoPE base) moves
    # the logits far beyond ATOL.
    hf_model, model = _family("gemma3")
    ids = _ids(33, seed=4)
    expected = _hf_logits(hf_model, ids)
    shape = model.shape
    fields = {name: getattr(shape, name) for name in shape.__dataclass_fields__}
    altered = LoadedModel(shape=ModelShape(**{**fields, "rope_local_theta": None}),
                          state_dict=model.state_dict, revision=model.revision, name="gemma3",
                          tokenizer=None, dtype=torch.float32)  # type: ignore[arg-type]
    runner = _runner(altered, "torch-native")
    logits = runner.forward(runner.build_batch([(ids, 0, _table(0, 33))]), all_logits=True)
    assert _max_diff(logits, expected) > 1e-2


def test_identity_text_carries_the_family_fields() -> None:
    llama, gemma2 = _family("llama")[1].shape, _family("gemma2")[1].shape
    assert llama.rope_description() == "theta=10000.0;scaling=None"
    assert gemma2.rope_description() == (
        "theta=10000.0;scaling=None;sliding_window=8;layer_types=SFSF;rms_norm_weight_offset=1.0;"
        "sandwich_norms=True;hidden_act=gelu_pytorch_tanh;embedding_multiplier=8.0;"
        "attn_logit_softcap=5.0;final_logit_softcap=3.0;query_pre_attn_scalar=24.0")
    fields = {name: getattr(gemma2, name) for name in gemma2.__dataclass_fields__}
    assert ModelShape(**{**fields, "attn_logit_softcap": 50.0}).rope_description() != gemma2.rope_description()


def test_gemma3_v4_style_config() -> None:
    # Hub config.json files of Gemma 3 predate rope_parameters: rope_theta + rope_scaling are
    # the global layers', rope_local_base_freq the local ones'.
    config = {"model_type": "gemma3_text", **_BASE, "num_hidden_layers": 6, "sliding_window": 512,
              "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256}
    shape = shape_from_hf_config(config)
    assert (shape.rope_theta, shape.rope_local_theta, shape.sliding_window) == (1e6, 1e4, 512)
    assert shape.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert shape.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert shape.attention_scale == 1 / 16 and shape.tie_word_embeddings


def _config(**overrides: Any) -> dict[str, Any]:
    return {"model_type": "gemma2", **_BASE, "num_hidden_layers": 2, "sliding_window": WINDOW, **overrides}


@pytest.mark.parametrize("overrides, message", [
    (dict(model_type="gpt_oss"), "model: unsupported model_type 'gpt_oss'; supported: ('llama', "
                                 "'mistral', 'qwen2', 'qwen3', 'gemma2', 'gemma3_text')"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]),
     "model: layer_types: unsupported entries ['chunked_attention']"),
    (dict(layer_types=["full_attention"]), "model: layer_types: 1 entries for num_layers 2"),
    (dict(hidden_activation="relu"), "model: unsupported gemma2 hidden_activation 'relu'"),
    (dict(use_bidirectional_attention=True), "model: gemma2 use_bidirectional_attention is not supported"),
    (dict(attention_bias=True), "model: gemma2 attention_bias (with o_proj bias) is not supported"),
    (dict(model_type="gemma3_text", rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "model: gemma3_text sliding_attention rope_type 'linear' is not supported"),
])
def test_bad_config_is_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        shape_from_hf_config(_config(**overrides))
    assert str(exc.value).startswith(message)


def test_shape_validation_names_the_field() -> None:
    shape = _family("gemma3")[1].shape
    fields = {name: getattr(shape, name) for name in shape.__dataclass_fields__}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"layer_types": ("full_attention",) * 6}, "sliding_window: set, but no layer_types entry"),
        ({"sliding_window": None}, "sliding_window: layer_types has sliding_attention layers"),
        ({"rms_norm_weight_offset": 0.5}, "rms_norm_weight_offset: must be 0.0 (Llama) or 1.0"),
        ({"hidden_act": "relu"}, "hidden_act: unsupported 'relu'"),
        ({"attn_logit_softcap": 0.0}, "attn_logit_softcap: must be a number > 0 or None"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling: linear scaling lacks ['factor']"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError) as exc:
            ModelShape(**{**fields, **changes})
        assert str(exc.value).startswith(message), changes
    with pytest.raises(ValueError, match="^layer_types: layers differ in attention window"):
        _ = shape.window_left
    # A shape.json round trip (a JSON list of layer types) gives back an equal, hashable shape.
    again = ModelShape(**{**fields, "layer_types": list(shape.layer_types or ())})
    assert again == shape and hash(again) == hash(shape)


def test_cli_unknown_layer_type_exits_2_before_the_pool(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        _config(layer_types=["sliding_attention", "chunked_attention"])))

    def no_pool(*args: object, **kwargs: object) -> None:
        raise AssertionError("pool allocated")

    monkeypatch.setattr("radixkv.engine.llm_engine.ModelRunner", no_pool)
    code = cli.main(["serve", "--port", "0", "--device", "cpu", "--model", str(tmp_path)])
    assert code == 2
    assert "model: layer_types: unsupported entries ['chunked_attention']" in capsys.readouterr().err

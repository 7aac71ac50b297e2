"""The ``gemma3`` GGUF conversion on a tiny Gemma 3 written here (no extra needed): radixkv's
shape, tensors and logits against transformers' own reading of the same file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from radixkv.model.gguf_loader import read_gguf
from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, VOCAB, NUM_LAYERS, HEAD_DIM, WINDOW = 64, 96, 300, 6, 32, 8
BLOCK_SIZE = 4
ATOL = 1e-5  # fp32 on both sides, as tests/model/test_families.py


def _write_tiny_gemma3(path: Path) -> None:
    """Six layers (five windowed, the sixth global, as llama.cpp reads Gemma 3), 2 query heads
    and 1 KV head of 32, Q8_0 / Q5_0 matrices, norm weights stored as llama.cpp does: 1 + w."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(WINDOW)
    writer.add_vocab_size(VOCAB)

    def tensor(name: str, shape: tuple[int, ...], qtype: Q) -> None:
        if len(shape) == 1:  # a norm: 1 + w, w random so that a missed shift shows
            values = (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        else:
            values = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        writer.add_tensor(name, values if qtype == Q.F32 else gguf.quants.quantize(values, qtype),
                          raw_dtype=qtype)

    tensor("token_embd.weight", (VOCAB, HIDDEN), Q.Q8_0)
    tensor("output_norm.weight", (HIDDEN,), Q.F32)
    for i in range(NUM_LAYERS):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", (HIDDEN,), Q.F32)
        tensor(p + "attn_q.weight", (2 * HEAD_DIM, HIDDEN), Q.Q8_0)
        tensor(p + "attn_k.weight", (HEAD_DIM, HIDDEN), Q.Q5_0)
        tensor(p + "attn_v.weight", (HEAD_DIM, HIDDEN), Q.Q8_0)
        tensor(p + "attn_q_norm.weight", (HEAD_DIM,), Q.F32)
        tensor(p + "attn_k_norm.weight", (HEAD_DIM,), Q.F32)
        tensor(p + "attn_output.weight", (HIDDEN, 2 * HEAD_DIM), Q.Q8_0)
        tensor(p + "post_attention_norm.weight", (HIDDEN,), Q.F32)
        tensor(p + "ffn_norm.weight", (HIDDEN,), Q.F32)
        tensor(p + "ffn_gate.weight", (FFN, HIDDEN), Q.Q5_0)
        tensor(p + "ffn_up.weight", (FFN, HIDDEN), Q.Q8_0)
        tensor(p + "ffn_down.weight", (HIDDEN, FFN), Q.Q8_0)
        tensor(p + "post_ffw_norm.weight", (HIDDEN,), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.Gemma3ForCausalLM]:
    """(the GGUF, transformers' Gemma3ForCausalLM of its own config and tensor conversion)."""
    path = tmp_path_factory.mktemp("tiny-gemma3") / "tiny-gemma3.gguf"
    _write_tiny_gemma3(path)
    config = transformers.Gemma3TextConfig(**load_gguf_checkpoint(str(path))["config"])
    # transformers' GGUF reader leaves query_pre_attn_scalar at its default, 256 (the head dim of
    # every released Gemma 3 but 27B); llama.cpp, whose files these are, scales by head_dim^-1/2.
    assert config.query_pre_attn_scalar == 256
    config.query_pre_attn_scalar = HEAD_DIM
    config._attn_implementation = "eager"
    with torch.device("meta"):
        skeleton = transformers.Gemma3ForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    return path, model


def test_shape_and_tensors_equal_transformers_reading(tiny_gemma3) -> None:
    path, hf_model = tiny_gemma3
    shape, state = read_gguf(path)
    assert shape.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert hf_model.config.layer_types == list(shape.layer_types)
    assert (shape.sliding_window, shape.rope_theta, shape.rope_local_theta) == (WINDOW, 1e6, 1e4)
    assert shape.query_pre_attn_scalar == HEAD_DIM
    assert (shape.qk_norm, shape.sandwich_norms, shape.rms_norm_weight_offset) == (True, True, 1.0)
    assert shape.embedding_multiplier == pytest.approx(HIDDEN ** 0.5)
    assert shape.tie_word_embeddings and shape.vocab_size == VOCAB
    theirs = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(state) == sorted(theirs)
    for name, tensor in state.items():
        assert torch.equal(tensor, theirs[name]), name
    # The norm shift: the file's 1 + w is read back as w (mean ~0, not ~1).
    assert abs(float(state["model.layers.0.input_layernorm.weight"].mean())) < 0.2


@pytest.mark.parametrize("prefix_len", [0, 12])
def test_logits_match_transformers_across_the_window(tiny_gemma3, prefix_len: int) -> None:
    path, hf_model = tiny_gemma3
    shape, state = read_gguf(path)
    model = LoadedModel(shape=shape, state_dict=state, revision="0" * 64, name="tiny-gemma3",
                        tokenizer=None, dtype=torch.float32)  # type: ignore[arg-type]
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0].float()
    runner = ModelRunner(model, num_blocks=8, block_size=BLOCK_SIZE)
    table = [7, 2, 5, 0, 6, 1]  # 24 tokens in 6 blocks, not in order
    if prefix_len:  # a cached prefix: the rest prefilled after it, across the window edge
        runner.forward(runner.build_batch([(ids[:prefix_len], 0, table)]))
    got = runner.forward(runner.build_batch([(ids[prefix_len:], prefix_len, table)]), all_logits=True)
    assert float((got - expected[prefix_len:]).abs().max()) <= ATOL

"""The embedded SmolLM2-135M-Instruct: GGUF loading, tokenizer facts, logits vs transformers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from radixkv.model import loader
from radixkv.model.gguf_loader import unpermute_qk
from radixkv.model.loader import LoadedModel, embedded_gguf_path, load_model
from radixkv.model.runner import ModelRunner
from radixkv.model.tool_render import TOOLS_FOOTER, TOOLS_HEADER

pytestmark = pytest.mark.smollm2

ATOL = 1e-3  # fp32; logits are O(30) and transformers' own attention backends differ by ~5e-5
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer with the city name and one fact."}]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2: LoadedModel) -> torch.nn.Module:
    """transformers.LlamaForCausalLM holding exactly our dequantized weights."""
    s = smollm2.shape
    config = transformers.LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_q_heads,
        num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, rope_theta=s.rope_theta,
        rms_norm_eps=s.rms_norm_eps, max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=s.tie_word_embeddings)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    result = model.load_state_dict(smollm2.state_dict, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == ["lm_head.weight"]  # tied: shares embed_tokens
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def test_shape_and_revision(smollm2: LoadedModel) -> None:
    s = smollm2.shape
    assert (s.vocab_size, s.hidden_size, s.intermediate_size, s.num_layers) == (49152, 576, 1536, 30)
    assert (s.num_q_heads, s.num_kv_heads, s.head_dim) == (9, 3, 64)
    assert (s.rope_theta, s.rope_scaling, s.max_position_embeddings) == (100000.0, None, 8192)
    assert s.tie_word_embeddings is True and s.sliding_window is None and s.attention_bias is False
    assert s.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert smollm2.name == "SmolLM2-135M-Instruct"
    assert smollm2.dtype == torch.float32
    assert "lm_head.weight" not in smollm2.state_dict
    assert len(smollm2.state_dict) == 272
    digest = hashlib.sha256(embedded_gguf_path().read_bytes()).hexdigest()
    assert smollm2.revision == digest


def test_tokenizer_facts(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    assert tok.eos_token_ids == frozenset({2})
    assert tok.max_model_len == 8192
    assert tok.encode("hello world") == [28120, 905]  # no BOS added
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids[-3:] == tok.encode("assistant\n") and ids.count(2) == 2
    assert tok.decode(ids, skip_special_tokens=False) == DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with_system = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                          add_generation_prompt=False)
    assert tok.decode(with_system, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    # content None renders as empty text; the ChatML template ignores tools and tool_calls,
    # so they are rendered as text (radixkv.model.tool_render) instead of being dropped.
    none_turn = tok.apply_chat_template(
        [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
         {"role": "tool", "content": "42", "tool_call_id": "c1"}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert tok.decode(none_turn, skip_special_tokens=False) == (
        "<|im_start|>system\n" + TOOLS_HEADER + "\n<tools>\n"
        '{"function":{"name":"f","parameters":{"type":"object"}},"type":"function"}\n</tools>\n'
        + TOOLS_FOOTER + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>{"arguments":{},"name":"f"}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode([28120, 905, 2]) == "hello world"
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([])


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = torch.arange(6 * 8 * 5, dtype=torch.float32).reshape(6 * 8, 5)  # 6 heads, D = 8
    # llama.cpp's converter: per head, rows (i, i + D/2) become adjacent.
    permuted = weight.reshape(6, 2, 4, 5).transpose(1, 2).reshape(48, 5)
    assert torch.equal(unpermute_qk(permuted, 6), weight)


def test_qk_match_transformers_gguf_processing(smollm2: LoadedModel) -> None:
    # transformers' own GGUF conversion of the raw q/k tensors must equal ours bit for bit.
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    wanted = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
              "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
              "blk.29.attn_k.weight": "model.layers.29.self_attn.k_proj.weight"}
    compared = []
    for tensor in reader.tensors:
        if tensor.name in wanted:
            raw = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            theirs = processor.process(np.array(raw, dtype=np.float32), tensor.name).weights
            assert torch.equal(torch.from_numpy(np.ascontiguousarray(theirs)), smollm2.state_dict[wanted[tensor.name]])
            compared.append(tensor.name)
    assert sorted(compared) == sorted(wanted)  # a renamed tensor fails here, not silently


def test_logits_match_transformers_full_and_cached_suffix(smollm2: LoadedModel, hf_smollm2: torch.nn.Module) -> None:
    ids = smollm2.tokenizer.apply_chat_template(PROMPT)
    assert 40 <= len(ids) <= 60
    with torch.inference_mode():
        expected = hf_smollm2(torch.tensor([ids])).logits[0].float()
    runner = ModelRunner(smollm2, num_blocks=16, block_size=16)
    table = [7, 3, 11, 0]
    full = runner.forward(runner.build_batch([(ids, 0, table)]), all_logits=True)
    assert float((full - expected).abs().max()) <= ATOL
    assert full.argmax(-1).tolist() == expected.argmax(-1).tolist()
    runner = ModelRunner(smollm2, num_blocks=16, block_size=16)
    prefix_len = 32  # the hit cap of a block-16 cache
    runner.forward(runner.build_batch([(ids[:prefix_len], 0, table)]))
    suffix = runner.forward(runner.build_batch([(ids[prefix_len:], prefix_len, table)]), all_logits=True)
    assert float((suffix - expected[prefix_len:]).abs().max()) <= ATOL
    assert float((suffix - full[prefix_len:]).abs().max()) <= ATOL


def test_converted_weights_are_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2: LoadedModel) -> None:
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    first = load_model(None)
    converted = tmp_path / f"gguf-v1-{smollm2.revision}"
    assert (converted / "model.safetensors").is_file() and (converted / "shape.json").is_file()
    assert first.shape == smollm2.shape

    def fail(*args, **kwargs):
        raise AssertionError("second load must read the cache, not convert again")

    monkeypatch.setattr(loader, "_convert_gguf", fail)
    second = load_model(None)
    assert second.revision == smollm2.revision
    assert second.tokenizer.eos_token_ids == frozenset({2})
    for name, tensor in smollm2.state_dict.items():
        assert torch.equal(second.state_dict[name], tensor), name

"""Gemma 3 270M from the gemma3 extra's GGUF against transformers: the shape against Google's
published config.json, every dequantized tensor against transformers' own GGUF conversion,
the tokenizer and chat template, and 32 greedy tokens on 10 prompts through the engine against
``Gemma3ForCausalLM`` holding the same fp32 weights.

Skipped, with the install command, when the extra is not installed (``make`` installs it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers

from radixkv.engine.sampling import SamplingParams
from radixkv.model import loader, shipped
from radixkv.model.hf_loader import shape_from_hf_config
from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner
from tests.factories import make_engine

pytestmark = [
    pytest.mark.gemma3,
    pytest.mark.skipif(any(importlib.util.find_spec(module) is None for module, _ in shipped._GEMMA3_270M_PARTS),
                       reason=f"the gemma3 extra is not installed: {shipped.GEMMA3_270M_INSTALL}"),
]

# google/gemma-3-270m's config.json on Hugging Face (the base model the GGUF was converted
# from), the keys that set the forward.
PUBLISHED_CONFIG = {
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
    "query_pre_attn_scalar": 256, "sliding_window": 512, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "attention_bias": False, "tie_word_embeddings": True,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5
                   + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"],
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Photosynthesis is the process by which",
    "SELECT name, email FROM users WHERE",
    "Die Hauptstadt von Deutschland ist",
    "1, 2, 3, 5, 8, 13,",
    "To make a cup of tea, first",
]
NUM_TOKENS = 32
ATOL = 1e-3  # fp32 logits (O(30)); reduction order differs between the two forwards


@pytest.fixture(scope="module")
def hf_gemma3(gemma3: LoadedModel) -> transformers.Gemma3ForCausalLM:
    """transformers' Gemma3ForCausalLM of the published config, holding exactly our weights."""
    config = transformers.Gemma3TextConfig(**PUBLISHED_CONFIG)
    config._attn_implementation = "eager"
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    result = model.load_state_dict(gemma3.state_dict, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == ["lm_head.weight"]  # tied: shares embed_tokens
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def test_shape_name_and_eos(gemma3: LoadedModel) -> None:
    # The GGUF stores eps as float32 (9.99999997e-07); everything else exactly as published.
    assert gemma3.shape.rms_norm_eps == pytest.approx(1e-6, rel=1e-7)
    assert gemma3.shape == dataclasses.replace(shape_from_hf_config(PUBLISHED_CONFIG),
                                               rms_norm_eps=gemma3.shape.rms_norm_eps)
    assert gemma3.shape.layer_window_lefts == tuple(-1 if (i + 1) % 6 == 0 else 511 for i in range(18))
    assert gemma3.name == "gemma3-270m"
    assert gemma3.revision == shipped.GEMMA3_270M_SHA256
    assert gemma3.tokenizer.eos_token_ids == {1, 106}  # <eos>, <end_of_turn>
    assert len(gemma3.state_dict) == 2 + 18 * 13  # embed, final norm; 13 tensors per layer


def test_weights_equal_transformers_gguf_conversion(gemma3: LoadedModel) -> None:
    # transformers' own GGUF reader, name map and norm shift (its Gemma2TensorProcessor) must
    # give exactly our tensors.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**PUBLISHED_CONFIG))
    theirs = load_gguf_checkpoint(str(shipped.gemma3_270m_gguf_path()), return_tensors=True,
                                  model_to_load=skeleton)["tensors"]
    assert sorted(theirs) == sorted(gemma3.state_dict)
    for name, tensor in gemma3.state_dict.items():
        assert torch.equal(tensor, torch.as_tensor(theirs[name]).float()), name


def test_tokenizer_and_chat_template(gemma3: LoadedModel) -> None:
    tok = gemma3.tokenizer
    assert tok.encode("The capital of France is") == [818, 5279, 529, 7001, 563]
    assert tok.decode([2, 9259, 1902]) == "Hello world"
    ids = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert ids[:2] == [2, 105] and ids[-3:] == [105, 4368, 107]


def test_direct_tokenizer_saves_what_auto_tokenizer_saves(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = shipped.gemma3_270m_gguf_path()
    direct = loader._gguf_tokenizer(path, {"general.architecture": "gemma3"})
    auto = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    direct.save_pretrained(tmp_path / "direct")
    auto.save_pretrained(tmp_path / "auto")
    names = sorted(p.name for p in (tmp_path / "auto").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert "tokenizer.json" in names
    for name in names:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "auto" / name).read_bytes(), name


def test_prefill_logits_match_transformers(gemma3: LoadedModel, hf_gemma3) -> None:
    ids = [2, *gemma3.tokenizer.encode(PROMPTS[3])]
    with torch.inference_mode():
        expected = hf_gemma3(torch.tensor([ids])).logits[0].float()
    runner = ModelRunner(gemma3, num_blocks=4, block_size=16)
    got = runner.forward(runner.build_batch([(ids, 0, [3, 1])]), all_logits=True)
    assert float((got - expected).abs().max()) <= ATOL


def test_greedy_tokens_match_transformers(gemma3: LoadedModel, hf_gemma3) -> None:
    prompts = [[2, *gemma3.tokenizer.encode(p)] for p in PROMPTS]
    engine = make_engine(gemma3, block_size=16, num_blocks=64)
    requests = engine.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                                       ignore_eos=True))
    ours = [list(r.output_token_ids) for r in requests]
    theirs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf_gemma3(torch.tensor([ids]), use_cache=True)
            past, generated = out.past_key_values, []
            for _ in range(NUM_TOKENS):
                generated.append(int(out.logits[0, -1].argmax()))
                out = hf_gemma3(torch.tensor([[generated[-1]]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            theirs.append(generated)
    assert ours == theirs
    # Both sides would agree on garbage too: the base model's continuation is coherent.
    assert gemma3.tokenizer.decode(ours[0]).startswith(
        " the capital of the country of France. It is the largest city in France")


def test_plan_gives_bytes_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    from radixkv.cli import main

    assert main(["plan", "--model", "gemma3-270m", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "gemma3-270m"
    # fp32 K and V of 1 KV head x 256: 2,048 bytes per token per layer; 3 full + 15 window layers.
    assert plan["bytes_per_token"] == 18 * 2048

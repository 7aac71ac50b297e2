"""Loader and chat-tokenizer behaviour that needs no SmolLM2 weights (tiny model + its tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixkv.model.config import ModelShape
from radixkv.model.digest import file_sha256
from radixkv.model.hf_loader import shape_from_hf_config
from radixkv.model.loader import LoadedModel, load_model


def test_load_model_rejects_missing_and_unsupported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^model: path does not exist"):
        load_model(str(tmp_path / "nope"))
    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"x")
    with pytest.raises(ValueError, match="^model: expected a Hugging Face directory or a .gguf file"):
        load_model(str(bogus))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="^model: unsupported model_type 'gpt2'"):
        load_model(str(gpt2))
    with pytest.raises(ValueError, match="^dtype"):
        load_model(str(gpt2), dtype=torch.int8)


def test_hf_config_rope_and_window_parsing() -> None:
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32}
    shape = shape_from_hf_config({**base, "rope_theta": 500000.0})
    assert (shape.num_kv_heads, shape.head_dim, shape.rope_theta, shape.rope_scaling) == (2, 4, 500000.0, None)
    scaled = shape_from_hf_config({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 8}})
    assert scaled.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    with pytest.raises(ValueError, match="^model: rope_scaling: unsupported rope_type 'yarn'"):
        shape_from_hf_config({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})
    assert shape_from_hf_config({**base, "model_type": "mistral", "sliding_window": 4}).sliding_window == 4
    assert shape_from_hf_config({**base, "model_type": "qwen2", "sliding_window": 4}).sliding_window is None
    assert shape_from_hf_config({**base, "model_type": "qwen2"}).attention_bias is True
    with pytest.raises(ValueError, match="^model: config.json lacks 'vocab_size'"):
        shape_from_hf_config({k: v for k, v in base.items() if k != "vocab_size"})


def test_model_shape_validation_names_field() -> None:
    kwargs = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1, num_q_heads=3,
                  num_kv_heads=2, head_dim=4, rope_theta=1e4, rms_norm_eps=1e-6,
                  max_position_embeddings=32, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="^num_kv_heads"):
        ModelShape(**kwargs)
    with pytest.raises(ValueError, match="^head_dim"):
        ModelShape(**{**kwargs, "num_q_heads": 2, "head_dim": 3})
    shape = ModelShape(**{**kwargs, "num_q_heads": 2})
    assert shape.rope_description() == "theta=10000.0;scaling=None"
    # per layer: q 8x8 + k,v 2x(8x8) + o 8x8 + mlp 3x8x16 + 2 norms x 8; plus the final norm
    assert shape.num_non_embedding_params() == (64 + 128 + 64 + 384 + 16) + 8


def test_file_digest_is_memoised_and_tracks_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "w.bin"
    path.write_bytes(b"abc")
    expected = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # sha256("abc")
    assert file_sha256(path) == expected
    assert expected in (tmp_path / "cache" / "digests.json").read_text()
    path.write_bytes(b"abcd")
    assert file_sha256(path) == "88d4266fd4e6338d13b845fcf289579d209c897823b9217da3e161936f031589"


def test_chat_tokenizer_normalises_content(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    none = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": None}],
                                   add_generation_prompt=False)
    assert tok.decode(none, skip_special_tokens=False) == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
    parts = tok.apply_chat_template([{"role": "system", "content": "s"},
                                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    # Text parts are joined by newlines, as the server and shared/agent-transcripts do.
    assert tok.decode(parts, skip_special_tokens=False).endswith("<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content"):
        tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": 5}])
    with pytest.raises(ValueError, match=r"^messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])
    assert tok.decode(tok.encode("Hello, wörld!")) == "Hello, wörld!"

"""``radixkv export-hf``: the written directory loads in transformers and in radixkv and gives the
same logits and the same chat token ids as the model it was exported from.

Tolerances are those of the model tests: 1e-5 on the tiny model (logits O(1)), 1e-3 on SmolLM2
(logits O(30); transformers' attention backends differ among themselves by ~5e-5).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from radixkv.cli import main as cli_main
from radixkv.model.export_hf import OutputNotEmptyError, export_hf, hf_config
from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.runner import ModelRunner

TINY_ATOL = 1e-5
SMOLLM2_ATOL = 1e-3
BLOCK_SIZE = 16
FILES = ("chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
         "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France? Answer with the city name."},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}]


def _runner_logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """All-position logits [N, V] of ``ids`` through radixkv's paged runner (cold prefill)."""
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    batch = runner.build_batch([(ids, 0, list(range(num_blocks)))])
    return runner.forward(batch, all_logits=True).float()


@torch.inference_mode()
def _transformers_logits(directory: Path, ids: list[int]) -> tuple[torch.Tensor, torch.nn.Module]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    return hf(torch.tensor([ids])).logits[0].float(), hf


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _check_reload(model: LoadedModel, out: Path, tmp_path: Path) -> LoadedModel:
    """load_model(out) reproduces ``model``'s weights, shape and chat ids; a second load and a
    re-export of the reloaded model give the same revision and byte-identical files."""
    loaded = load_model(str(out))
    assert loaded.shape == model.shape
    _assert_same_state(loaded.state_dict, model.state_dict)
    assert loaded.tokenizer.eos_token_ids == model.tokenizer.eos_token_ids
    assert loaded.tokenizer.max_model_len == model.shape.max_position_embeddings
    assert loaded.tokenizer.chat_template == model.tokenizer.chat_template
    assert loaded.tokenizer.apply_chat_template(CHAT) == model.tokenizer.apply_chat_template(CHAT)
    assert loaded.tokenizer.encode("héllo wörld <|im_end|>") == model.tokenizer.encode("héllo wörld <|im_end|>")
    again = load_model(str(out))
    assert again.revision == loaded.revision
    second = tmp_path / "second"
    export_hf(again, second)
    for name in FILES:
        assert (second / name).read_bytes() == (out / name).read_bytes(), name
    return loaded


def test_tiny_export_files_and_config(tiny_model: LoadedModel, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny-hf"
    result = export_hf(tiny_model, out)
    assert result.files == FILES and tuple(sorted(p.name for p in out.iterdir())) == FILES
    assert result.num_tensors == 2 * 9 + 3  # 9 per layer + embed, final norm, untied lm_head
    config = json.loads((out / "config.json").read_text())
    source = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == source[key], key
    assert (config["rope_theta"], config["rope_scaling"]) == (10000.0, None)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == tiny_model.tokenizer.chat_template
    assert tok_config["model_max_length"] == 2048
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"


def test_tiny_export_matches_transformers_and_reloads(tiny_model: LoadedModel, tmp_path: Path) -> None:
    out = tmp_path / "tiny-hf"
    export_hf(tiny_model, out)
    ids = tiny_model.tokenizer.apply_chat_template(CHAT)
    expected, hf = _transformers_logits(out, ids)
    assert next(hf.parameters()).dtype == torch.float32
    assert _max_diff(_runner_logits(tiny_model, ids), expected) <= TINY_ATOL
    reloaded = _check_reload(tiny_model, out, tmp_path)
    assert _max_diff(_runner_logits(reloaded, ids), expected) <= TINY_ATOL


def test_refuses_non_empty_out_unless_force(tiny_model: LoadedModel, tmp_path: Path) -> None:
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "old-00001-of-00002.safetensors").write_bytes(b"stale")
    with pytest.raises(OutputNotEmptyError, match="not empty"):
        export_hf(tiny_model, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "old-00001-of-00002.safetensors"]
    export_hf(tiny_model, out, force=True)
    # Stale weight shards would be read as weights: removed; other files are kept.
    assert sorted(p.name for p in out.iterdir()) == sorted([*FILES, "notes.txt"])
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(OutputNotEmptyError, match="not a directory"):
        export_hf(tiny_model, a_file, force=True)


def test_refuses_shapes_llama_cannot_express(tiny_model: LoadedModel) -> None:
    for change in ({"sliding_window": 8}, {"attention_bias": True}):
        shape = dataclasses.replace(tiny_model.shape, **change)
        with pytest.raises(ValueError, match="LlamaForCausalLM"):
            hf_config(dataclasses.replace(tiny_model, shape=shape))


def test_cli_export_hf(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli-out"
    assert cli_main(["export-hf", "--model", str(tiny_model_dir), "--out", str(out)]) == 0
    assert f"wrote {out}: " in capsys.readouterr().out
    assert tuple(sorted(p.name for p in out.iterdir())) == FILES
    assert cli_main(["export-hf", "--model", str(tiny_model_dir), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"radixkv export-hf: --out: {out} is not empty (pass --force to write into it)")
    assert cli_main(["export-hf", "--model", str(tiny_model_dir), "--out", str(out), "--force"]) == 0


@pytest.mark.smollm2
def test_smollm2_export_matches_transformers_and_reloads(smollm2: LoadedModel, tmp_path: Path) -> None:
    out = tmp_path / "smollm2-hf"
    result = export_hf(smollm2, out)
    assert result.num_tensors == 272  # tied: no lm_head.weight
    assert result.weights_bytes > 4 * 134_000_000  # fp32, ~134.5M parameters
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (576, 30, 3)
    assert (config["rope_theta"], config["max_position_embeddings"]) == (100000.0, 8192)
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == 2
    ids = smollm2.tokenizer.apply_chat_template(CHAT[:2])
    expected, hf = _transformers_logits(out, ids)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert _max_diff(_runner_logits(smollm2, ids), expected) <= SMOLLM2_ATOL
    # Independent of radixkv's forward: transformers alone, on the exported weights, answers
    # the question (wrongly un-permuted q/k rows would garble it).
    with torch.inference_mode():
        generated = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    assert smollm2.tokenizer.decode(generated[0, len(ids):].tolist()) == "The capital of France is Paris"
    _check_reload(smollm2, out, tmp_path)

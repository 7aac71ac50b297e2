"""PEFT adapter reading: config parsing, scale, validation errors, weight digest, row groups."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from radixkv.errors import LoRAError
from radixkv.model.config import ModelShape
from radixkv.model.lora import LoRABatch, LoRARegistry, check_name, read_adapter
from tests.lora_files import ATTN, peft_key, write_adapter

SHAPE = ModelShape(vocab_size=100, hidden_size=16, intermediate_size=24, num_layers=2,
                   num_q_heads=4, num_kv_heads=2, head_dim=4, rope_theta=10000.0,
                   rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=True)


def _read(path, name="a"):
    return read_adapter(name, str(path), SHAPE)


def test_reads_scale_targets_and_fused_layout(tmp_path):
    plain = _read(write_adapter(tmp_path / "p", SHAPE, r=4, alpha=8, targets=ATTN))
    assert plain.rank == 4 and plain.scale == 2.0 and plain.target_modules == tuple(sorted(ATTN))
    assert plain.identity == ("a", plain.digest) and len(plain.digest) == 64
    a_cat, b_cat = plain.layers[0]["qkv"]
    assert a_cat.shape == (12, 16) and b_cat.shape == (16 + 8 + 8, 12)
    assert set(plain.layers[1]) == {"qkv", "o"}  # no MLP groups: nothing added there
    # Block-diagonal B: k's output rows only see k's rank columns.
    assert torch.count_nonzero(b_cat[16:24, :4]) == 0 and torch.count_nonzero(b_cat[16:24, 4:8]) > 0
    rs = _read(write_adapter(tmp_path / "rs", SHAPE, r=4, alpha=8, use_rslora=True))
    assert rs.scale == pytest.approx(8 / math.sqrt(4))
    every = _read(write_adapter(tmp_path / "all", SHAPE, config={"target_modules": "all-linear"}))
    assert len(every.target_modules) == 7 and set(every.layers[0]) == {"qkv", "o", "gate_up", "down"}
    dotted = _read(write_adapter(tmp_path / "d", SHAPE, targets=("q_proj",),
                                 config={"target_modules": ["self_attn.q_proj"]}))
    assert dotted.target_modules == ("q_proj",)
    half = _read(write_adapter(tmp_path / "h", SHAPE, r=2, dtype=torch.bfloat16))
    assert half.layers[0]["down"][0].dtype == torch.float32


def test_digest_tracks_weights_and_scaling(tmp_path):
    base = _read(write_adapter(tmp_path / "a", SHAPE, seed=1))
    assert _read(write_adapter(tmp_path / "same", SHAPE, seed=1), name="b").digest == base.digest
    assert _read(write_adapter(tmp_path / "seed", SHAPE, seed=2)).digest != base.digest
    tweak = torch.zeros(4, 16)
    one = write_adapter(tmp_path / "one", SHAPE, seed=1,
                        tensors={peft_key(1, "q_proj", "A"): tweak})
    zero = _read(one).digest
    tweak[0, 0] = 1e-7
    write_adapter(one, SHAPE, seed=1, tensors={peft_key(1, "q_proj", "A"): tweak})
    assert _read(one).digest != zero  # one element changed
    assert _read(write_adapter(tmp_path / "alpha", SHAPE, seed=1, alpha=9)).digest != base.digest
    assert _read(write_adapter(tmp_path / "rs", SHAPE, seed=1, use_rslora=True)).digest != base.digest


def _bad(tmp_path, match, **kwargs):
    path = write_adapter(tmp_path / "bad", SHAPE, **kwargs)
    with pytest.raises(LoRAError, match=match):
        _read(path)
    return path


@pytest.mark.parametrize("kwargs,match", [
    (dict(config={"r": 2}), r"rank mismatch: .*_proj.lora_A.weight' has rank 4 but "
                            r"adapter_config.json says r=2"),
    (dict(config={"target_modules": ["q_proj", "lm_head"]}), r"target_modules.*\['lm_head'\]"),
    (dict(config={"target_modules": ["qkv_proj"]}), "cannot adapt"),
    (dict(targets=ATTN, config={"target_modules": ["q_proj"]}),
     r"layers.0.self_attn.k_proj.lora_A.weight' adapts k_proj, which is not in target_modules"),
    (dict(tensors={peft_key(0, "o_proj", "A"): torch.zeros(4, 15)}),
     r"o_proj.lora_A.weight' has shape \(4, 15\), expected \(4, 16\)"),
    (dict(tensors={peft_key(0, "up_proj", "B"): torch.zeros(16, 4)}),
     r"expected \(24, 4\)"),
    (dict(tensors={peft_key(2, "q_proj", "A"): torch.zeros(4, 16)}), "layer 2; the model has 2"),
    (dict(tensors={peft_key(1, "v_proj", "B"): None}), "layer 1 v_proj has no lora_B"),
    (dict(tensors={"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 16)}),
     "unexpected tensor"),
    (dict(tensors={"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                   torch.zeros(16)}), "DoRA"),
    (dict(tensors={"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": torch.zeros(4, 16)}),
     "mlp.q_proj"),
    (dict(tensors={peft_key(0, "q_proj", "A"): torch.zeros(4, 16, dtype=torch.int32)}),
     "2-D floating"),
    (dict(config={"bias": "lora_only"}), "'bias' must be 'none'"),
    (dict(config={"fan_in_fan_out": True}), "fan_in_fan_out"),
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(config={"use_dora": True}), "DoRA"),
    (dict(config={"rank_pattern": {"q_proj": 8}}), "rank_pattern"),
    (dict(config={"layers_to_transform": [0]}), "layers_to_transform"),
    (dict(config={"peft_type": "IA3"}), "only 'LORA'"),
    (dict(config={"r": 0}), "'r' must be a positive integer"),
    (dict(config={"lora_alpha": "8"}), "lora_alpha"),
    (dict(config={"target_modules": []}), "non-empty list"),
    (dict(tensors={peft_key(1, "q_proj", "A"): torch.full((4, 16), float("nan"))}),
     r"layers.1.self_attn.q_proj.lora_A.weight' holds NaN or infinite values"),
    (dict(tensors={peft_key(0, "down_proj", "B"): torch.full((16, 4), float("inf"))}),
     "NaN or infinite"),
    (dict(targets=ATTN, config={"target_modules": "all-linear"}),
     r"holds no weights for \['down_proj', 'gate_proj', 'up_proj'\], which adapter_config.json "
     r"lists in target_modules"),
])
def test_bad_adapters_are_refused_with_a_clear_error(tmp_path, kwargs, match):
    _bad(tmp_path, match, **kwargs)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(LoRAError, match="not a directory"):
        _read(tmp_path / "nowhere")
    path = write_adapter(tmp_path / "a", SHAPE)
    (path / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(LoRAError, match="adapter_model.safetensors: not a readable safetensors"):
        _read(path)
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(LoRAError, match=r"adapter_model.safetensors: missing \(adapter_model.bin"):
        _read(path)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="adapter_config.json: not readable JSON"):
        _read(path)
    (path / "adapter_config.json").unlink()
    with pytest.raises(LoRAError, match="adapter_config.json: missing"):
        _read(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    save_file({}, str(empty / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="holds no LoRA weights"):
        _read(empty)


def test_lora_batch_row_groups(tmp_path):
    a = _read(write_adapter(tmp_path / "a", SHAPE), "a")
    b = _read(write_adapter(tmp_path / "b", SHAPE), "b")
    assert LoRABatch.build(None, [0, 3], "cpu") is None
    assert LoRABatch.build([None, None], [0, 3, 5], "cpu") is None
    whole = LoRABatch.build([a, a], [0, 3, 5], "cpu")
    assert [(ad.name, rows) for ad, rows in whole.groups] == [("a", None)]
    mixed = LoRABatch.build([a, None, b, a], [0, 2, 3, 5, 6], "cpu")
    assert [(ad.name, rows.tolist()) for ad, rows in mixed.groups] == [("a", [0, 1, 5]),
                                                                       ("b", [3, 4])]
    # Rows of other sequences are left untouched; an adapter's rows get x A^T B^T.
    x = torch.randn(6, 16)
    out = torch.zeros(6, 16)
    mixed.add(out, x, 0, "o")
    assert torch.count_nonzero(out[2]) == 0
    a_cat, b_cat = a.layers[0]["o"]
    assert torch.allclose(out[5], (x[5] @ a_cat.T) @ b_cat.T)


def test_registry_and_names(tmp_path):
    reg = LoRARegistry(SHAPE, device="cpu", dtype=torch.float32)
    first = reg.read("x", str(write_adapter(tmp_path / "x", SHAPE, seed=1)))
    reg.add(first)
    second = reg.read("x", str(write_adapter(tmp_path / "y", SHAPE, seed=2)))
    with pytest.raises(LoRAError, match="already loaded"):
        reg.add(second)
    reg.add(second, replace=True)
    assert reg.get("x") is second and "x" in reg and len(reg) == 1 and reg.list() == [second]
    assert reg.remove("x") is second and reg.get("x") is None
    for name in ("", "a b", "x" * 129, 3, "tab\t"):
        with pytest.raises(LoRAError, match="lora_name"):
            check_name(name)
    assert check_name("sql-lora_v2.1") == "sql-lora_v2.1"

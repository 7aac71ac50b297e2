"""Write PEFT-format LoRA adapters from random weights, and the merged-weights reference.

PEFT itself is not a dependency: the files are written here the way PEFT's ``save_pretrained``
writes them (``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``). B is drawn
non-zero (PEFT initialises it to zero), so every adapter really changes the outputs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from radixkv.model.config import ModelShape
from radixkv.model.loader import LoadedModel

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = ATTN + MLP


def module_dims(shape: ModelShape, module: str) -> tuple[int, int]:
    """(out_features, in_features) of a projection in HF layout."""
    q, kv = shape.num_q_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, i = shape.hidden_size, shape.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[module]


def peft_key(layer: int, module: str, which: str) -> str:
    parent = "self_attn" if module in ATTN else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{which}.weight"


def write_adapter(path: str | Path, shape: ModelShape, *, r: int = 4, alpha: float = 8.0,
                  targets: tuple[str, ...] = ALL, seed: int = 0, std: float = 0.05,
                  use_rslora: bool = False, config: dict[str, Any] | None = None,
                  tensors: dict[str, torch.Tensor] | None = None,
                  dtype: torch.dtype = torch.float32) -> Path:
    """Write a random adapter for every layer and target module.

    Args:
        config: keys replacing / adding to the written ``adapter_config.json``.
        tensors: tensors replacing / adding to the random ones (a value None drops the key).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for layer in range(shape.num_layers):
        for module in targets:
            out_f, in_f = module_dims(shape, module)
            weights[peft_key(layer, module, "A")] = (torch.randn(r, in_f, generator=gen) * std).to(dtype)
            weights[peft_key(layer, module, "B")] = (torch.randn(out_f, r, generator=gen) * std).to(dtype)
    for key, value in (tensors or {}).items():
        if value is None:
            weights.pop(key, None)
        else:
            weights[key] = value
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
           "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
           "fan_in_fan_out": False, "use_rslora": use_rslora, "modules_to_save": None,
           "base_model_name_or_path": "tiny", "rank_pattern": {}, "alpha_pattern": {},
           "use_dora": False, "layers_to_transform": None, "init_lora_weights": True}
    cfg.update(config or {})
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(weights, str(out / "adapter_model.safetensors"))
    return out


def merged_model(model: LoadedModel, adapter_dir: str | Path) -> LoadedModel:
    """The base model with ``W + scale · B A`` merged into every adapted projection (fp64 math),
    read straight from the adapter files (independent of ``radixkv.model.lora``)."""
    adapter_dir = Path(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    state = dict(model.state_dict)
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        w = state[name]
        state[name] = (w.double() + scale * (b.double() @ a.double())).to(w.dtype)
    return dataclasses.replace(model, state_dict=state, revision=model.revision + "-merged")

"""Loader for Hugging Face model directories (config.json + *.safetensors + tokenizer files).

Supports the Llama family whose forward is :mod:`radixkv.model.llama`: ``llama``, ``mistral``
and ``qwen2`` model types. The revision is a SHA-256 over the sorted safetensors file names and
each file's own SHA-256, i.e. a digest of all weight bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import load_file

from .config import ModelShape
from .digest import file_sha256

__all__ = ["SUPPORTED_MODEL_TYPES", "read_hf_config", "shape_from_hf_config", "load_hf_weights",
           "hf_revision", "generation_eos_ids"]

log = structlog.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def read_hf_config(directory: Path) -> dict[str, Any]:
    """Parsed ``config.json`` of a model directory.

    Raises:
        ValueError: naming ``model`` if the file is missing or not a JSON object.
    """
    path = directory / "config.json"
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"model: {path} is not a JSON object")
    return config


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, llama3 scaling dict or None) from a v4 (rope_theta/rope_scaling) or v5
    (rope_parameters) style config."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = dict(params)
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = dict(config["rope_scaling"]) if config.get("rope_scaling") else {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    scaling.pop("rope_theta", None)
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    return float(theta), scaling


def _sliding_window(config: dict[str, Any], model_type: str) -> int | None:
    window = config.get("sliding_window")
    if model_type == "llama" or window is None:
        return None
    if model_type == "qwen2":
        if not config.get("use_sliding_window", False):
            return None
        layer_types = config.get("layer_types")
        if layer_types and len(set(layer_types)) > 1:
            raise ValueError("model: qwen2 with mixed sliding/full attention layers is not supported")
    return int(window)


def shape_from_hf_config(config: dict[str, Any]) -> ModelShape:
    """ModelShape of a ``config.json`` dict.

    Raises:
        ValueError: naming ``model`` for an unsupported model type, activation, bias layout or
            RoPE variant, or a shape field out of range.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model: unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: unsupported hidden_act {config.get('hidden_act')!r} (need silu)")
    if config.get("mlp_bias", False):
        raise ValueError("model: mlp_bias is not supported")
    # Qwen2 always has q/k/v bias (no o_proj bias); Llama's attention_bias also adds o_proj bias.
    if model_type == "llama" and config.get("attention_bias", False):
        raise ValueError("model: llama attention_bias (with o_proj bias) is not supported")
    theta, scaling = _rope(config)
    num_q_heads = config["num_attention_heads"]
    try:
        return ModelShape(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_q_heads=num_q_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_q_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_q_heads,
            rope_theta=theta,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=config["max_position_embeddings"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            sliding_window=_sliding_window(config, model_type),
            attention_bias=model_type == "qwen2",
        )
    except KeyError as exc:
        raise ValueError(f"model: config.json lacks {exc.args[0]!r}") from exc
    except ValueError as exc:
        raise ValueError(f"model: {exc}") from exc


def _weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {directory}")
    return files


def hf_revision(directory: Path) -> str:
    """SHA-256 hex over (sorted file name, file SHA-256) of every ``*.safetensors`` file."""
    hasher = hashlib.sha256(b"radixkv-hf-revision/v1\0")
    for path in _weight_files(directory):
        name = path.name.encode()
        hasher.update(len(name).to_bytes(4, "little") + name)
        hasher.update(bytes.fromhex(file_sha256(path)))
    return hasher.hexdigest()


def load_hf_weights(directory: Path, shape: ModelShape, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors of every ``*.safetensors`` file, cast to ``dtype``.

    Buffers that are not weights (``rotary_emb.inv_freq``) and a redundant ``lm_head.weight``
    of a tied model are dropped.
    """
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(directory):
        for name, tensor in load_file(str(path)).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if shape.tie_word_embeddings and name == "lm_head.weight":
                continue
            state[name] = tensor.to(dtype)
    return state


def generation_eos_ids(directory: Path) -> list[int]:
    """EOS ids from ``generation_config.json`` (int or list), or [] when absent."""
    path = directory / "generation_config.json"
    if not path.exists():
        return []
    try:
        with open(path, encoding="utf-8") as handle:
            eos = json.load(handle).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        log.warning("generation_config_unreadable", path=str(path))
        return []
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]

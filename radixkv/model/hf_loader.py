"""Loader for Hugging Face model directories (config.json + *.safetensors + tokenizer files).

Supports the model types whose forward is :mod:`radixkv.model.llama` (``llama``, ``mistral``,
``qwen2``) or :mod:`radixkv.model.family_forward` (``qwen3``: q/k norms; ``gemma2``:
alternating local/global layers, soft-capping, GeGLU, sandwich norms; ``gemma3_text``: five
local layers to one global, q/k norms, separate local RoPE base); see
``docs/model-families.md``. The revision is a SHA-256 over the sorted safetensors file names
and each file's own SHA-256, i.e. a digest of all weight bytes.
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

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
_GEMMA = ("gemma2", "gemma3_text")


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


def _rope_params(params: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) of one v4 ``rope_scaling`` + theta or v5
    ``rope_parameters`` dict."""
    scaling = dict(params)
    theta = scaling.pop("rope_theta", default_theta)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    return float(theta), scaling


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, llama3/linear scaling dict or None) from a v4 (rope_theta/rope_scaling) or
    v5 (rope_parameters) style config, for models with one RoPE for every layer."""
    params = config.get("rope_parameters")
    theta = config.get("rope_theta", 10000.0)
    if not isinstance(params, dict):
        params = dict(config["rope_scaling"]) if config.get("rope_scaling") else {}
    return _rope_params(params, theta)


def _gemma3_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling or None, local theta) of a Gemma 3 config: v5
    ``rope_parameters`` keyed by layer type, or v4 ``rope_theta`` / ``rope_scaling`` (global
    layers) and ``rope_local_base_freq`` (local layers). Defaults as transformers' (1e6, 1e4).

    Raises:
        ValueError: naming ``model`` when the local layers ask for a scaled RoPE.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        theta, scaling = _rope_params(params.get("full_attention") or {}, 1_000_000.0)
        local_theta, local_scaling = _rope_params(params.get("sliding_attention") or {}, 10_000.0)
        if local_scaling is not None:
            raise ValueError(f"model: gemma3_text sliding_attention rope_type "
                             f"{local_scaling['rope_type']!r} is not supported (default only)")
        return theta, scaling, local_theta
    theta, scaling = _rope_params(dict(config.get("rope_scaling") or {}),
                                  config.get("rope_theta", 1_000_000.0))
    return theta, scaling, float(config.get("rope_local_base_freq", 10_000.0))


def _layer_types(config: dict[str, Any], model_type: str) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types or None for uniform layers, sliding_window or None) as transformers builds
    them for each model type (its defaults when ``layer_types`` is absent)."""
    num_layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if model_type == "llama":
        return None, None
    if model_type == "mistral":
        return None, None if window is None else int(window)
    if model_type in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False) or window is None:
            return None, None
        if layer_types is None:
            first = config.get("max_window_layers", 28)  # transformers' default
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    elif layer_types is None:  # Gemma 2 alternates from a local layer; Gemma 3 every 6th global
        period = 2 if model_type == "gemma2" else int(config.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % period else "full_attention"
                       for i in range(num_layers)]
    if not isinstance(layer_types, list) or not layer_types:
        raise ValueError(f"model: layer_types must be a non-empty list, got {layer_types!r}")
    if len(layer_types) != num_layers:
        raise ValueError(f"model: layer_types: {len(layer_types)} entries for num_layers {num_layers}")
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None, None  # every layer full: the Llama layout
    if "sliding_attention" not in kinds:
        return tuple(layer_types), None  # unknown entries reach ModelShape, which names them
    if window is None:
        raise ValueError("model: layer_types has sliding_attention layers but sliding_window is null")
    if model_type in ("qwen2", "qwen3") and kinds == {"sliding_attention"}:
        return None, int(window)  # every layer windowed: the Mistral layout
    return tuple(layer_types), int(window)


def _family_fields(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelShape fields a model type sets beyond the Llama layer (see ModelShape).

    Raises:
        ValueError: naming ``model`` for a Gemma config option radixkv does not implement.
    """
    if model_type == "qwen3":
        return {"qk_norm": True}
    if model_type not in _GEMMA:
        return {}
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"model: {model_type} use_bidirectional_attention is not supported")
    hidden_act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"model: unsupported {model_type} hidden_activation {hidden_act!r} "
                         "(need gelu_pytorch_tanh)")
    fields: dict[str, Any] = {
        "qk_norm": model_type == "gemma3_text", "rms_norm_weight_offset": 1.0, "sandwich_norms": True,
        "hidden_act": hidden_act, "embedding_multiplier": float(config["hidden_size"]) ** 0.5,
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", 256)),
    }
    # Gemma 2's caps default on (50, 30) when the keys are absent; Gemma 3's default off.
    caps = (50.0, 30.0) if model_type == "gemma2" else (None, None)
    for name, key, default in (("attn_logit_softcap", "attn_logit_softcapping", caps[0]),
                               ("final_logit_softcap", "final_logit_softcapping", caps[1])):
        value = config.get(key, default)
        fields[name] = None if value is None else float(value)
    return fields


def shape_from_hf_config(config: dict[str, Any]) -> ModelShape:
    """ModelShape of a ``config.json`` dict.

    Raises:
        ValueError: naming ``model`` for an unsupported model type, activation, bias layout,
            RoPE variant or ``layer_types`` entry, or a shape field out of range.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model: unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if model_type not in _GEMMA and config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"model: unsupported hidden_act {config.get('hidden_act')!r} (need silu)")
    if config.get("mlp_bias", False):
        raise ValueError("model: mlp_bias is not supported")
    # Qwen2 always has q/k/v bias (no o_proj bias); Llama's, Qwen3's and Gemma's attention_bias
    # also add an o_proj bias.
    if model_type != "qwen2" and config.get("attention_bias", False):
        raise ValueError(f"model: {model_type} attention_bias (with o_proj bias) is not supported")
    num_q_heads = config["num_attention_heads"]
    try:
        local_theta = None
        if model_type == "gemma3_text":
            theta, scaling, local_theta = _gemma3_rope(config)
        else:
            theta, scaling = _rope(config)
        layer_types, window = _layer_types(config, model_type)
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
            tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type in _GEMMA)),
            rope_scaling=scaling,
            sliding_window=window,
            attention_bias=model_type == "qwen2",
            layer_types=layer_types,
            rope_local_theta=local_theta,
            **_family_fields(config, model_type),
        )
    except KeyError as exc:
        raise ValueError(f"model: config.json lacks {exc.args[0]!r}") from exc
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("model: ") else f"model: {message}") from exc


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

"""A :class:`KVLayout` from a Hugging Face ``config.json`` (no weights, no torch).

Which layers slide, as the transformers config classes define it (transformers 4.5x / 5.x):

- an explicit ``layer_types`` list (``full_attention`` / ``sliding_attention``) wins;
- Gemma 3 (``gemma3``, ``gemma3_text``): every ``sliding_window_pattern``-th layer (default 6)
  is full, the rest slide (``Gemma3TextConfig``); Gemma 2: every second layer is full;
- Qwen2 / Qwen3 with ``use_sliding_window``: layers from ``max_window_layers`` (default 28)
  on slide;
- Llama ignores ``sliding_window``; any other model with one slides in every layer (Mistral).

MLA (DeepSeek-V2/V3, any config with ``kv_lora_rank``) caches one latent of ``kv_lora_rank +
qk_rope_head_dim`` values per token and layer (DeepSeek-V2 paper, arXiv:2405.04434, sec. 2.1).
A multimodal config's decoder is its ``text_config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .layout import FLOAT_DTYPE_BYTES, FULL, MLA, SLIDING, KVLayout, LayerGroup

__all__ = ["read_config_json", "layout_from_hf_config", "dense_num_params"]

#: Fields transformers' config class fills in when a ``config.json`` leaves them out (the
#: gemma-3-4b/12b/27b ``text_config`` omit the heads): ``Gemma3TextConfig.__init__`` defaults.
_MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "sliding_window": 4096, "sliding_window_pattern": 6,
                    "max_position_embeddings": 131072},
}
_GEMMA3_TYPES = ("gemma3", "gemma3_text")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def read_config_json(path: str | Path) -> tuple[dict[str, Any], Path]:
    """The parsed ``config.json`` at ``path`` (the file, or a directory holding one).

    Returns:
        ``(config, file path)``.

    Raises:
        ValueError: naming ``config`` for a missing or unreadable file, or one that is not a
            JSON object.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"config: cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"config: {path} is not a JSON object")
    return config, path


def _decoder_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's fields: a multimodal config's ``text_config`` over the top level's
    ``torch_dtype``, with the model type's class defaults under what the file states."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ValueError(f"text_config: must be an object, got {text!r:.100}")
    if "num_hidden_layers" not in config and isinstance(text, dict):
        merged: dict[str, Any] = {k: config[k] for k in ("torch_dtype", "dtype") if k in config}
        merged.update(text)
        config = merged
    defaults = _MODEL_TYPE_DEFAULTS.get(str(config.get("model_type")), {})
    return {**defaults, **config}


#: The most layers a config may state: a hundred times today's deepest models, and a bound that
#: keeps a per-layer list of a corrupt config from exhausting memory.
MAX_NUM_LAYERS = 10_000


def _int_field(config: dict[str, Any], name: str, default: Any = None,
               maximum: int | None = None) -> int:
    value = config.get(name, default)
    if value is None:
        raise ValueError(f"{name}: the config lacks it")
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name}: must be a positive int, got {value!r:.100}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: must be at most {maximum:,}, got {value:,}")
    return value


def _layer_kinds(config: dict[str, Any], num_layers: int) -> list[str]:
    """``FULL`` or ``SLIDING`` per layer (the module docstring's rules)."""
    model_type = str(config.get("model_type"))
    if config.get("attention_chunk_size") is not None:  # Llama 4: chunked local attention
        raise ValueError(f"attention_chunk_size: chunked attention is not supported, got "
                         f"{config['attention_chunk_size']!r}")
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ValueError(f"layer_types: must list one type per layer ({num_layers}), "
                             f"got {layer_types!r:.200}")
        kinds = {"full_attention": FULL, "sliding_attention": SLIDING}
        unknown = sorted({str(t) for t in layer_types} - set(kinds))
        if unknown:
            raise ValueError(f"layer_types: unsupported layer type(s) {unknown}; supported: "
                             f"{sorted(kinds)}")
        return [kinds[t] for t in layer_types]
    if model_type in _GEMMA3_TYPES:
        pattern = _int_field(config, "sliding_window_pattern", 6)
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if model_type == "gemma2":
        return [FULL if (i + 1) % 2 == 0 else SLIDING for i in range(num_layers)]
    if "use_sliding_window" in config:
        use = config["use_sliding_window"]
        if type(use) is not bool:  # a string "false" would otherwise read as true
            raise ValueError(f"use_sliding_window: must be true or false, got {use!r:.100}")
        if not use or config.get("sliding_window") is None:
            return [FULL] * num_layers
        # Absent, transformers' Qwen2Config / Qwen3Config default (28) applies, as radixkv
        # serve reads it (model/hf_loader.py): layers 0-27 stay full, not all slide.
        first = config.get("max_window_layers", 28)
        if type(first) is not int or first < 0:
            raise ValueError(f"max_window_layers: must be an int >= 0, got {first!r}")
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    if model_type == "llama" or config.get("sliding_window") is None:
        return [FULL] * num_layers
    return [SLIDING] * num_layers


def _torch_dtype(config: dict[str, Any]) -> tuple[str, str | None]:
    """(dtype name, a note when the config names none)."""
    dtype = config.get("torch_dtype", config.get("dtype"))
    if dtype is None:
        return "float32", "the config names no torch_dtype: auto = float32"
    # A list or dict here is junk, and unhashable: test membership only for a str.
    if not isinstance(dtype, str) or dtype not in FLOAT_DTYPE_BYTES:
        raise ValueError(f"torch_dtype: {dtype!r} is not one of {', '.join(FLOAT_DTYPE_BYTES)}")
    return str(dtype), None


def dense_num_params(config: dict[str, Any]) -> int | None:
    """Parameters of a dense Llama-style decoder (embedding, lm_head unless tied, per layer
    q/k/v/o, a gated MLP and two norms, the final norm), or None when the config is a
    mixture of experts, MLA, or lacks ``hidden_size`` / ``intermediate_size`` /
    ``vocab_size``. Llama-3-8B: 8,030,261,248; SmolLM2-135M: 134,515,008.

    Raises:
        ValueError: naming the field when one of the sizes above is present but not a positive
            int (``num_hidden_layers`` also above :data:`MAX_NUM_LAYERS`), or
            ``tie_word_embeddings`` is not a JSON boolean.

    The config must already be the decoder's (:func:`layout_from_hf_config` passes it so).
    """
    if any(config.get(k) for k in _MOE_KEYS) or config.get("kv_lora_rank"):
        return None
    if any(config.get(k) is None for k in ("hidden_size", "intermediate_size", "vocab_size",
                                           "num_hidden_layers", "num_attention_heads")):
        return None
    # Present but not a positive int: a ValueError naming the field, not "cannot be counted".
    hidden, inter, vocab = (_int_field(config, k) for k in
                            ("hidden_size", "intermediate_size", "vocab_size"))
    num_layers = _int_field(config, "num_hidden_layers", maximum=MAX_NUM_LAYERS)
    num_q_heads = _int_field(config, "num_attention_heads")
    num_kv_heads = _int_field(config, "num_key_value_heads", num_q_heads)
    head_dim = _int_field(config, "head_dim", hidden // num_q_heads)
    q_width, kv_width = num_q_heads * head_dim, num_kv_heads * head_dim
    per_layer = 2 * hidden * q_width + 2 * hidden * kv_width + 3 * hidden * inter + 2 * hidden
    if config.get("model_type") == "qwen2" or config.get("attention_bias"):
        per_layer += q_width + 2 * kv_width  # q/k/v biases (Qwen2 always has them)
    tied = config.get("tie_word_embeddings", False)
    if type(tied) is not bool:  # a string "false" would otherwise read as tied
        raise ValueError(f"tie_word_embeddings: must be true or false, got {tied!r:.100}")
    embed = vocab * hidden
    lm_head = 0 if tied else embed
    return embed + lm_head + num_layers * per_layer + hidden


def layout_from_hf_config(config: dict[str, Any], *, model: str = "", source: str = "") -> KVLayout:
    """The KV layout of a ``config.json`` dict.

    Args:
        config: the parsed file (a multimodal config's ``text_config`` is used).
        model: display name; source: where it was read.

    Raises:
        ValueError: naming the config field that is missing, out of range or unsupported
            (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim``, ``sliding_window``, ``layer_types``, ``kv_lora_rank``, ``torch_dtype``).
    """
    config = _decoder_config(config)
    num_layers = _int_field(config, "num_hidden_layers", maximum=MAX_NUM_LAYERS)
    dtype, dtype_note = _torch_dtype(config)
    notes = [dtype_note] if dtype_note else []
    max_len = config.get("max_position_embeddings")
    if max_len is not None and (type(max_len) is not int or max_len <= 0):
        raise ValueError(f"max_position_embeddings: must be a positive int, got {max_len!r}")
    weight_bytes = FLOAT_DTYPE_BYTES[dtype]
    if config.get("kv_lora_rank") is not None:
        group = LayerGroup(MLA, num_layers, 1, 0, kv_lora_rank=config["kv_lora_rank"],
                           qk_rope_head_dim=config.get("qk_rope_head_dim", 0))
        return KVLayout(model, source, (group,), dtype, max_len, None, weight_bytes, tuple(notes))
    num_q_heads = _int_field(config, "num_attention_heads")
    if "num_key_value_heads" not in config:
        notes.append("the config names no num_key_value_heads: MHA (= num_attention_heads)")
    num_kv_heads = config.get("num_key_value_heads", num_q_heads)
    if type(num_kv_heads) is not int or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_key_value_heads: must be a positive int dividing "
                         f"num_attention_heads {num_q_heads}, got {num_kv_heads!r}")
    if config.get("head_dim") is not None:
        head_dim = _int_field(config, "head_dim")
    else:
        head_dim = _int_field(config, "hidden_size") // num_q_heads
        if head_dim <= 0:
            raise ValueError(f"head_dim: hidden_size / num_attention_heads is {head_dim}")
    kinds = _layer_kinds(config, num_layers)
    window = _int_field(config, "sliding_window") if SLIDING in kinds else None
    groups = tuple(LayerGroup(kind, kinds.count(kind), num_kv_heads, head_dim,
                              window if kind == SLIDING else None)
                   for kind in (FULL, SLIDING) if kind in kinds)
    return KVLayout(model, source, groups, dtype, max_len, dense_num_params(config), weight_bytes,
                    tuple(notes))

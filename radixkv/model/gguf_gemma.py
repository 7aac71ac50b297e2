"""GGUF architecture ``gemma3``: config, tensor names and norm weights in Hugging Face terms.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``Gemma3Model``) writes a Gemma 3 text model
as follows, and this module undoes it:

- every RMSNorm weight (``*norm.weight``, q/k norms included) is stored as ``1 + w``, since
  llama.cpp's RMSNorm multiplies by the weight as is; Gemma's reference multiplies by
  ``1 + w``, so HF's ``w`` is the stored value minus 1 (transformers' GGUF loader subtracts 1
  the same way);
- q/k rows are not permuted: llama.cpp rotates Gemma with its NEOX RoPE, which pairs
  ``(i, i + D/2)`` as HF does (unlike ``llama``, see :func:`gguf_loader.unpermute_qk`);
- the embedding is stored unscaled (the ``sqrt(hidden)`` factor is applied in the forward).

The file does not store everything the forward needs. llama.cpp's ``src/llama-model.cpp``
(``LLM_ARCH_GEMMA3``) supplies the rest, and so does this module, with the same values as
transformers' ``Gemma3TextConfig`` defaults:

- the layer pattern: every 6th layer (1-based) full attention, the others sliding-window
  (``sliding_window_pattern`` 6), unless the file carries a per-layer
  ``gemma3.attention.sliding_window_pattern`` array;
- the local layers' RoPE base, 10,000 (``rope_local_base_freq``);
- the attention scale, ``query_pre_attn_scalar ** -0.5`` with ``query_pre_attn_scalar`` the
  head dim (256), except for the 62-layer 27B model, ``hidden / num_q_heads`` (168).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from .config import FULL_ATTENTION, SLIDING_ATTENTION, ModelShape
from .hf_loader import shape_from_hf_config

__all__ = ["GEMMA3_ARCH", "GEMMA3_END_OF_TURN", "gemma3_hf_config", "gemma3_shape", "gemma3_hf_name",
           "gemma3_hf_tensor"]

GEMMA3_ARCH = "gemma3"
#: The token that closes a turn in Gemma's chat format; generation stops on it (Gemma 3's
#: instruction-tuned ``generation_config.json`` lists it beside ``<eos>``).
GEMMA3_END_OF_TURN = "<end_of_turn>"
_SLIDING_WINDOW_PATTERN = 6
_LOCAL_ROPE_THETA = 10_000.0
_LAYERS_27B = 62

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _layer_types(metadata: dict[str, Any], num_layers: int, path: Path) -> list[str]:
    pattern = metadata.get(f"{GEMMA3_ARCH}.attention.sliding_window_pattern")
    if pattern is None:
        return [SLIDING_ATTENTION if (i + 1) % _SLIDING_WINDOW_PATTERN else FULL_ATTENTION
                for i in range(num_layers)]
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise ValueError(f"model: GGUF {GEMMA3_ARCH}.attention.sliding_window_pattern must list "
                         f"{num_layers} per-layer flags, got {pattern!r:.200}: {path}")
    return [SLIDING_ATTENTION if flag else FULL_ATTENTION for flag in pattern]


def gemma3_hf_config(metadata: dict[str, Any], tensor_names: set[str], path: Path) -> dict[str, Any]:
    """The ``config.json`` (transformers' ``Gemma3TextConfig`` keys, ``model_type``
    ``gemma3_text``) a ``gemma3`` GGUF's metadata describes.

    Args:
        metadata: the GGUF metadata (``read_gguf_header(path).metadata``).
        tensor_names: every tensor name in the file (a missing ``output.weight`` means tied).
        path: the file, for messages.

    Raises:
        ValueError: naming ``model`` and the metadata key that is missing or unsupported
            (a RoPE scaling other than linear, unequal key and value lengths).
    """
    def key(name: str) -> str:
        return f"{GEMMA3_ARCH}.{name}"

    def need(name: str) -> Any:
        value = metadata.get(key(name))
        if value is None:
            raise ValueError(f"model: GGUF metadata lacks {key(name)!r}: {path}")
        return value

    hidden = int(need("embedding_length"))
    num_layers = int(need("block_count"))
    num_q_heads = int(need("attention.head_count"))
    head_dim = int(metadata.get(key("attention.key_length"), hidden // num_q_heads))
    value_dim = int(metadata.get(key("attention.value_length"), head_dim))
    if value_dim != head_dim:
        raise ValueError(f"model: GGUF {key('attention.value_length')} {value_dim} differs from "
                         f"key_length {head_dim} (not supported): {path}")
    rope_dims = int(metadata.get(key("rope.dimension_count"), head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"model: GGUF partial RoPE ({rope_dims} of {head_dim} dims) is not "
                         f"supported: {path}")
    scaling_type = metadata.get(key("rope.scaling.type"), "none")
    factor = float(metadata.get(key("rope.scaling.factor"), 1.0))
    if scaling_type == "linear" and factor != 1.0:
        rope_scaling: dict[str, Any] | None = {"rope_type": "linear", "factor": factor}
    elif scaling_type in ("none", "linear"):
        rope_scaling = None
    else:
        raise ValueError(f"model: GGUF {key('rope.scaling.type')} {scaling_type!r} is not "
                         f"supported (none or linear): {path}")
    vocab = metadata.get(key("vocab_size"))
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise ValueError(f"model: GGUF metadata lacks {key('vocab_size')!r} and "
                             f"'tokenizer.ggml.tokens': {path}")
        vocab = len(tokens)
    config: dict[str, Any] = {
        "model_type": "gemma3_text",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_q_heads,
        "num_key_value_heads": int(metadata.get(key("attention.head_count_kv"), num_q_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(need("context_length")),
        "rope_theta": float(metadata.get(key("rope.freq_base"), 1_000_000.0)),
        "rope_scaling": rope_scaling,
        "rope_local_base_freq": _LOCAL_ROPE_THETA,
        "sliding_window": int(need("attention.sliding_window")),
        "layer_types": _layer_types(metadata, num_layers, path),
        "query_pre_attn_scalar": float(hidden // num_q_heads if num_layers == _LAYERS_27B else head_dim),
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": metadata.get(key("attn_logit_softcapping")) or None,
        "final_logit_softcapping": metadata.get(key("final_logit_softcapping")) or None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id", 2),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id", 1),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id", 0),
    }
    return config


def gemma3_shape(metadata: dict[str, Any], tensor_names: set[str], path: Path) -> ModelShape:
    """The :class:`ModelShape` of a ``gemma3`` GGUF (through :func:`gemma3_hf_config` and the
    HF loader's ``gemma3_text`` rules, so a GGUF and an HF directory of one model agree).

    Raises:
        ValueError: as :func:`gemma3_hf_config`, or naming the shape field out of range.
    """
    return shape_from_hf_config(gemma3_hf_config(metadata, tensor_names, path))


def gemma3_hf_name(gguf_name: str, path: Path) -> str:
    """The HF ``Gemma3ForCausalLM`` name of a ``gemma3`` GGUF tensor.

    Raises:
        ValueError: naming ``model`` and the tensor for a name outside the Gemma 3 text model
            (e.g. a vision tower's).
    """
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    raise ValueError(f"model: unexpected {GEMMA3_ARCH} GGUF tensor {gguf_name!r} in {path}")


def gemma3_hf_tensor(hf_name: str, weight: torch.Tensor) -> torch.Tensor:
    """The HF value of a dequantized fp32 tensor: a norm weight minus the 1 llama.cpp added
    (as transformers' GGUF loader does; exact for stored values in [0.5, 2], by Sterbenz's
    lemma), any other tensor as is."""
    if hf_name.endswith("norm.weight"):
        return weight - 1.0
    return weight

"""Loader for llama.cpp GGUF files (architecture ``llama``), e.g. the embedded SmolLM2.

Tensors are read with :class:`gguf.GGUFReader`, dequantized to fp32 with
:func:`gguf.quants.dequantize`, renamed to Hugging Face Llama names, and the q/k projection rows
are put back in HF order: llama.cpp's converter interleaves the two RoPE halves of every head
(its RoPE rotates adjacent pairs, HF's rotates ``(i, i + D/2)``), so each head's rows are
stored as ``[h0, h_{D/2}, h1, h_{D/2+1}, …]``. Undoing it: view a head's rows as
``[2, D/2]``-transposed, i.e. ``reshape(H, D/2, 2, in).swapaxes(1, 2)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from .config import ModelShape

__all__ = ["read_gguf", "unpermute_qk"]

log = structlog.get_logger(__name__)

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
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Args:
        weight: ``[num_heads * D, in]`` rows in llama.cpp order.
        num_heads: heads of this projection (Hq for q, Hkv for k).

    Returns:
        ``[num_heads * D, in]`` rows in Hugging Face order.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"weight: {rows} rows not divisible by 2 * {num_heads} heads")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _shape(reader: Any, tensor_names: set[str], path: Path) -> ModelShape:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported (need 'llama'): {path}")
    scaling_type = _field(reader, "llama.rope.scaling.type", "none")
    if scaling_type not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"model: GGUF RoPE scaling ({scaling_type!r}, rope_freqs) is not supported: {path}")

    def need(key: str) -> Any:
        value = _field(reader, key)
        if value is None:
            raise ValueError(f"model: GGUF metadata lacks {key!r}: {path}")
        return value

    hidden = int(need("llama.embedding_length"))
    num_q_heads = int(need("llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // num_q_heads))
    rope_dims = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"model: partial RoPE ({rope_dims} of {head_dim} dims) is not supported: {path}")
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(need("tokenizer.ggml.tokens"))
    try:
        return ModelShape(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("llama.feed_forward_length")),
            num_layers=int(need("llama.block_count")),
            num_q_heads=num_q_heads,
            num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", num_q_heads)),
            head_dim=head_dim,
            rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(need("llama.attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(need("llama.context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
        )
    except ValueError as exc:
        raise ValueError(f"model: {exc}") from exc


def read_gguf(path: Path) -> tuple[ModelShape, dict[str, torch.Tensor]]:
    """Shape and fp32 HF-named state dict of a llama-architecture GGUF file.

    Raises:
        ValueError: naming ``model`` for another architecture, unsupported RoPE scaling,
            missing metadata or an unknown tensor name.
    """
    import gguf  # deferred: only GGUF loading needs it

    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    shape = _shape(reader, names, path)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        match = _BLOCK_RE.match(tensor.name)
        if match and match.group(2) in _BLOCK_NAMES:
            hf_name = f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
        elif tensor.name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[tensor.name]
        else:
            raise ValueError(f"model: unexpected GGUF tensor {tensor.name!r} in {path}")
        # dequantize returns numpy in (rows, cols) = HF (out, in) order, fp32.
        # Copy: F32 tensors come back as read-only views of the memory-mapped file.
        array = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, copy=True)
        weight = torch.from_numpy(array)
        if hf_name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, shape.num_q_heads)
        elif hf_name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, shape.num_kv_heads)
        state[hf_name] = weight.contiguous()
    log.info("gguf_dequantized", path=str(path), num_tensors=len(state))
    return shape, state

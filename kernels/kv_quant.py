"""KV cache formats: the pool dtype a block is stored in, and the reference (de)quantizer.

A quantized block holds, per layer, K and V values ``[B, Hkv, D]`` of the storage dtype and one
fp32 scale per (token slot, KV head) ``[B, Hkv]`` beside them: block ``b``'s scales are row ``b``
of the layer's scale pools ``[M, B, Hkv]``, so every copy of a block (store tier, copy-on-write)
carries its scales and a block is self-describing.

Quantization is symmetric, per (token, KV head), computed when the token's K/V is written:

    amax  = max_d |x[d]|                       (fp32; x widened from the model dtype)
    scale = amax / QMAX                        (fp32 division; 0 when amax == 0)
    inv   = QMAX / amax                        (fp32 division; 0 when amax == 0)
    q[d]  = int8:     clamp(round_half_even(x[d] * inv), -127, 127)
            fp8_e4m3: float8_e4m3fn(clamp(x[d] * inv, -448, 448))  (round to nearest even)
    x'[d] = float32(q[d]) * scale              (dequantize; attention reads x', never x)

with QMAX = 127 (int8) or 448 (fp8_e4m3, the largest finite e4m3fn). Every kernel (C, torch,
Triton) computes exactly these fp32 operations in this order, so the stored bytes agree bit for
bit between backends, and a cold prefill attends over the same dequantized K/V a later prefix
hit reads back. Per-token, per-head scales follow vLLM's ``int8/fp8_per_token_head`` KV cache
(PR #38378) and SGLang's int8 KV; the format differs from both (symmetric int8, fp32 scales).

This module is the oracle the kernels are tested against; it imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KV_CACHE_DTYPES", "KVFormat", "resolve_kv_format", "quantize_kv", "dequantize_kv",
           "FP8_E4M3_MAX", "INT8_MAX"]

#: Values ``--kv-cache-dtype`` accepts (vLLM's flag name and, where they exist, its spellings).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3")
INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
#: Version of the quantized block layout; part of the format tag, so a change is a new format.
KV_FORMAT_VERSION = 1


@dataclass(frozen=True)
class KVFormat:
    """How one KV block is stored.

    Attributes:
        name: ``float32``, ``bfloat16``, ``int8`` or ``fp8_e4m3`` (``auto`` already resolved).
        storage_dtype: torch dtype of the value pools.
        quantized: whether blocks carry per-(token, KV head) fp32 scales.
        qmax: QMAX of the module docstring (quantized formats only; 0.0 otherwise).
    """

    name: str
    storage_dtype: torch.dtype
    quantized: bool
    qmax: float

    @property
    def tag(self) -> str:
        """Stable identity of the format (cache identity, store value header and key):
        e.g. ``int8-tokhead-f32-v1`` (one fp32 scale per token and KV head, layout version 1);
        for unquantized formats just the dtype name. No ``:`` or ``.`` (store keys use both)."""
        if not self.quantized:
            return self.name
        return f"{self.name}-tokhead-f32-v{KV_FORMAT_VERSION}"

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K+V bytes of one token over all layers, scales included."""
        itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
        per_head = head_dim * itemsize + (4 if self.quantized else 0)
        return 2 * num_layers * num_kv_heads * per_head


def resolve_kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """The format for ``--kv-cache-dtype`` on a model of ``model_dtype``.

    Raises:
        ValueError: naming ``kv_cache_dtype`` for a value outside :data:`KV_CACHE_DTYPES`, or an
            unquantized dtype other than the model's (the pools and kernels keep unquantized K/V
            in the model dtype; ``auto`` is that).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    model_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(model_dtype, str(model_dtype))
    if kv_cache_dtype == "auto":
        return KVFormat(model_name, model_dtype, False, 0.0)
    if kv_cache_dtype in ("float32", "bfloat16"):
        if kv_cache_dtype != model_name:
            raise ValueError(f"kv_cache_dtype: {kv_cache_dtype} with a {model_name} model is not supported "
                             f"(unquantized K/V are kept in the model dtype; use auto, int8 or fp8_e4m3)")
        return KVFormat(model_name, model_dtype, False, 0.0)
    if kv_cache_dtype == "int8":
        return KVFormat("int8", torch.int8, True, INT8_MAX)
    return KVFormat("fp8_e4m3", torch.float8_e4m3fn, True, FP8_E4M3_MAX)


def quantize_kv(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize K or V rows per (token, KV head) (module docstring).

    Args:
        x: ``[T, Hkv, D]`` fp32 or bf16.
        fmt: a quantized format.

    Returns:
        ``(q, scale)``: ``q`` ``[T, Hkv, D]`` of ``fmt.storage_dtype``, ``scale`` ``[T, Hkv]`` fp32.

    Raises:
        ValueError: naming ``fmt`` when it is not quantized, ``x`` when it is not 3-D.
    """
    if not fmt.quantized:
        raise ValueError(f"fmt: {fmt.name} is not a quantized KV format")
    if x.dim() != 3:
        raise ValueError(f"x: expected [T, Hkv, D], got shape {tuple(x.shape)}")
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    qmax = torch.tensor(fmt.qmax, dtype=torch.float32, device=x.device)
    nonzero = amax > 0
    scale = torch.where(nonzero, amax / qmax, torch.zeros_like(amax))
    safe_amax = torch.where(nonzero, amax, torch.ones_like(amax))
    inv = torch.where(nonzero, qmax / safe_amax, torch.zeros_like(amax))
    scaled = xf * inv.unsqueeze(-1)
    if fmt.name == "int8":
        q = torch.round(scaled).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float32(q) * scale`` broadcast over the last dim, then cast to ``dtype``.

    Args:
        q: ``[..., Hkv, D]`` int8 or float8_e4m3fn.
        scale: ``[..., Hkv]`` fp32.
        dtype: result dtype (the fp32 product is rounded once to it).
    """
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)

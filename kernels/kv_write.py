"""Triton ``paged_kv_write``: scatter the packed tokens' K/V rows into the paged pools.

Shapes (dimension letters as in ``reference.py``): ``k``/``v`` ``[T, Hkv, D]`` with stride 1 on
D (any token / head strides); pools ``[M, B, Hkv, D]`` (any strides); ``slot_mapping`` ``[T]``
int32 or int64, ``slot = block_id * B + offset``.

One program copies ``BLOCK_T`` tokens; the ``Hkv * D`` values of a token are one flattened
row padded to a power of two and masked. Addresses are computed in int64.

Quantized pools (int8 or float8_e4m3fn, with ``[M, B, Hkv]`` fp32 scale pools): one program
quantizes ``BLOCK_T`` tokens of one KV head (grid ``(cdiv(T, BLOCK_T), Hkv)``), a ``[BLOCK_T,
D]`` tile, exactly as ``kv_quant.quantize_kv`` (``_triton_common.quantize_tile``), and stores the
values and the per-(token, head) scales; fp8 pools are written through a uint8 view.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import (
    check_device,
    e4m3_bits,
    interpreting,
    kv_quant_params,
    last_dim_contiguous,
    next_pow2,
    quantize_tile,
)

__all__ = ["paged_kv_write"]


@triton.jit
def _paged_kv_write_kernel(
    K, V, KPool, VPool, SlotMapping,
    num_tokens, num_slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kpm, stride_kpb, stride_kph, stride_kpd,
    stride_vpm, stride_vpb, stride_vph, stride_vpd,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    slot = tl.load(SlotMapping + tok, mask=tok_ok, other=-1).to(tl.int64)
    # Negative slots are padding; slots past the pool are dropped rather than written out of
    # bounds (the reference raises for them; checking here would need a device sync).
    row_ok = tok_ok & (slot >= 0) & (slot < num_slots)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    col = tl.arange(0, BLOCK_HD)
    head = col // HEAD_DIM
    dim = col % HEAD_DIM
    mask = row_ok[:, None] & (col < NUM_KV_HEADS * HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    k = tl.load(K + tok64 * stride_kt + head[None, :] * stride_kh + dim[None, :], mask=mask)
    v = tl.load(V + tok64 * stride_vt + head[None, :] * stride_vh + dim[None, :], mask=mask)
    k_dst = KPool + block[:, None] * stride_kpm + offset[:, None] * stride_kpb \
        + head[None, :] * stride_kph + dim[None, :] * stride_kpd
    v_dst = VPool + block[:, None] * stride_vpm + offset[:, None] * stride_vpb \
        + head[None, :] * stride_vph + dim[None, :] * stride_vpd
    tl.store(k_dst, k.to(KPool.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(VPool.dtype.element_ty), mask=mask)


@triton.jit
def _paged_kv_write_quant_kernel(
    K, V, KPool, VPool, KScale, VScale, SlotMapping,
    num_tokens, num_slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kpm, stride_kpb, stride_kph, stride_vpm, stride_vpb, stride_vph,
    stride_ksm, stride_ksb, stride_ksh, stride_vsm, stride_vsb, stride_vsh,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QMAX: tl.constexpr, IS_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    tok_ok = tok < num_tokens
    slot = tl.load(SlotMapping + tok, mask=tok_ok, other=-1).to(tl.int64)
    row_ok = tok_ok & (slot >= 0) & (slot < num_slots)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    dim = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (dim < HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    k = tl.load(K + tok64 * stride_kt + head * stride_kh + dim[None, :], mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + tok64 * stride_vt + head * stride_vh + dim[None, :], mask=mask, other=0.0).to(tl.float32)
    kq, ks = quantize_tile(k, 1, QMAX, IS_FP8)
    vq, vs = quantize_tile(v, 1, QMAX, IS_FP8)
    if IS_FP8:
        kq = e4m3_bits(kq)
        vq = e4m3_bits(vq)
    k_dst = KPool + head * stride_kph + block[:, None] * stride_kpm + offset[:, None] * stride_kpb \
        + dim[None, :]
    v_dst = VPool + head * stride_vph + block[:, None] * stride_vpm + offset[:, None] * stride_vpb \
        + dim[None, :]
    tl.store(k_dst, kq.to(KPool.dtype.element_ty), mask=mask)
    tl.store(v_dst, vq.to(VPool.dtype.element_ty), mask=mask)
    tl.store(KScale + block * stride_ksm + offset * stride_ksb + head * stride_ksh, ks, mask=row_ok)
    tl.store(VScale + block * stride_vsm + offset * stride_vsb + head * stride_vsh, vs, mask=row_ok)


def paged_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale_pool: torch.Tensor | None = None,
    v_scale_pool: torch.Tensor | None = None,
) -> None:
    """Scatter per-token K/V rows into the paged pools, in place (Triton).

    Same contract as :func:`radixkv.kernels.reference.paged_kv_write`, except that a slot
    ``>= M * B`` is skipped instead of raising (raising would need a device sync).

    Args:
        k: ``[T, Hkv, D]`` keys of the packed tokens (cast to the pool dtype on store).
        v: ``[T, Hkv, D]`` values of the packed tokens.
        k_pool: ``[M, B, Hkv, D]`` key pool of one layer; modified in place.
        v_pool: ``[M, B, Hkv, D]`` value pool of one layer; modified in place.
        slot_mapping: ``[T]`` int32/int64 slots ``block_id * B + offset``; rows with a
            negative slot are skipped (padding).
        k_scale_pool: ``[M, B, Hkv]`` fp32 key scales of a quantized pool (``k_pool`` int8 or
            float8_e4m3fn): each written row is quantized per (token, KV head) exactly as
            ``kv_quant.quantize_kv`` (same bytes and scales) and its scale stored at its slot.
            None for an unquantized pool.
        v_scale_pool: ``[M, B, Hkv]`` fp32 value scales; given exactly when ``k_scale_pool`` is.

    Raises:
        ValueError: if shapes or devices disagree, or a quantized pool comes without its scale
            pools (or an unquantized one with them); the message names the field.

    Example:
        >>> k_pool = torch.zeros(8, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
        >>> v_pool = torch.zeros_like(k_pool)
        >>> k = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
        >>> paged_kv_write(k, k, k_pool, v_pool, torch.tensor([17, -1, 5], device="cuda"))
        >>> bool((k_pool[1, 1] == k[0]).all())
        True
    """
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"v_pool: shape {tuple(v_pool.shape)} differs from k_pool {tuple(k_pool.shape)}")
    if k.dim() != 3 or k_pool.dim() != 4 or k.shape[1:] != k_pool.shape[2:]:
        raise ValueError(f"k: shape {tuple(k.shape)} does not match pool heads/dim {tuple(k_pool.shape[2:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping: shape {tuple(slot_mapping.shape)}, expected [{k.shape[0]}]")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping: dtype {slot_mapping.dtype}, expected int32 or int64")
    quantized, is_fp8, qmax = kv_quant_params(k_pool, v_pool, k_scale_pool, v_scale_pool)
    scale_pools = [t for t in (k_scale_pool, v_scale_pool) if t is not None]
    check_device("paged_kv_write", k, v, k_pool, v_pool, slot_mapping, *scale_pools)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if quantized:
        if k.dtype not in (torch.float32, torch.float16, torch.bfloat16) or v.dtype != k.dtype:
            raise ValueError(f"k: dtype {k.dtype} (v {v.dtype}); a quantized write needs fp32/fp16/bf16")
        _write_quantized(k, v, k_pool, v_pool, scale_pools[0], scale_pools[1], slot_mapping,
                         is_fp8=is_fp8, qmax=qmax)
        return
    if interpreting():
        # The interpreter's own float downcast truncates: let torch convert (a no-op when equal).
        k, v = k.to(k_pool.dtype), v.to(v_pool.dtype)
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    slot_mapping = slot_mapping.contiguous()
    block_hd = next_pow2(num_kv_heads * head_dim)
    block_t = max(1, min(64, 4096 // block_hd, next_pow2(num_tokens)))
    grid = (triton.cdiv(num_tokens, block_t),)
    _paged_kv_write_kernel[grid](
        k, v, k_pool, v_pool, slot_mapping,
        num_tokens, k_pool.shape[0] * k_pool.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_pool.stride(), *v_pool.stride(),
        PAGE_SIZE=k_pool.shape[1], HEAD_DIM=head_dim, NUM_KV_HEADS=num_kv_heads,
        BLOCK_T=block_t, BLOCK_HD=block_hd,
    )


def _write_quantized(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     k_scales: torch.Tensor, v_scales: torch.Tensor, slot_mapping: torch.Tensor, *,
                     is_fp8: bool, qmax: float) -> None:
    """Launch the quantizing write (inputs validated by :func:`paged_kv_write`)."""
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("k_pool/v_pool: the head_dim axis must have stride 1")
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    slot_mapping = slot_mapping.contiguous()
    num_tokens, num_kv_heads, head_dim = k.shape
    # fp8 values are stored as their bit patterns (the interpreter's fp32 -> fp8 cast is wrong).
    k_dst = k_pool.view(torch.uint8) if is_fp8 else k_pool
    v_dst = v_pool.view(torch.uint8) if is_fp8 else v_pool
    block_d = next_pow2(max(head_dim, 16))
    block_t = max(1, min(64, 4096 // block_d, next_pow2(num_tokens)))
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    _paged_kv_write_quant_kernel[grid](
        k, v, k_dst, v_dst, k_scales, v_scales, slot_mapping,
        num_tokens, k_pool.shape[0] * k_pool.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        *k_scales.stride(), *v_scales.stride(),
        PAGE_SIZE=k_pool.shape[1], HEAD_DIM=head_dim, QMAX=qmax, IS_FP8=is_fp8,
        BLOCK_T=block_t, BLOCK_D=block_d,
        **({} if interpreting() else {"enable_fp_fusion": False}),
    )

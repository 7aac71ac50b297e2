"""Triton ``paged_kv_write``: scatter the packed tokens' K/V rows into the paged pools.

Shapes (dimension letters as in ``reference.py``): ``k``/``v`` ``[T, Hkv, D]`` with stride 1 on
D (any token / head strides); pools ``[M, B, Hkv, D]`` (any strides); ``slot_mapping`` ``[T]``
int32 or int64, ``slot = block_id * B + offset``.

One program copies ``BLOCK_T`` tokens; the ``Hkv * D`` values of a token are one flattened
row padded to a power of two and masked. Addresses are computed in int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import check_device, interpreting, last_dim_contiguous, next_pow2

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


def paged_kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
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

    Raises:
        ValueError: if shapes or devices disagree (the message names the field).

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
    check_device("paged_kv_write", k, v, k_pool, v_pool, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
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

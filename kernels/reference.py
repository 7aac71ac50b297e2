"""Torch reference attention backend over a paged KV pool.

This module is the correctness oracle for the Triton kernels (``triton_backend``: same
functions, same signatures) and the CPU attention backend of the model runner. It imports only
torch.

Layout (NHD): each layer's K and V pools are ``[M, B, Hkv, D]`` (M blocks of B token slots).
A token's slot is ``block_id * B + offset``. Sequence ``i`` of a packed batch owns query rows
``qo_indptr[i]:qo_indptr[i+1]`` (its L suffix tokens); its first ``prefix_lens[i]`` tokens (P)
already sit in the pool at the slots named by ``block_tables[i]``.

Masking is explicit and bottom-right aligned: suffix query ``j`` sits at absolute position
``P + j`` and sees keys ``0 … P + j``. SDPA's ``is_causal=True`` aligns top-left and would be
wrong whenever ``P > 0``; it is used only for a sequence with no prefix and no sliding window,
where both alignments coincide. A logits soft cap or a requested LSE take an explicit fp32
path (scores, cap, mask, ``logsumexp``), since SDPA offers neither.

Quantized pools (``radixkv.kernels.kv_quant``): int8 or float8_e4m3fn value pools come with
``[M, B, Hkv]`` fp32 scale pools (``k_scale_pool`` / ``v_scale_pool``). The write quantizes with
:func:`kv_quant.quantize_kv` (the format inferred from the pool dtype); attention dequantizes
every gathered block (:func:`kv_quant.dequantize_kv`, to the queries' dtype) and attends over
the suffix's K/V as they were stored (quantized then dequantized), never the unrounded rows,
so a prefix hit reads exactly the K/V a cold run attended over.
"""

from __future__ import annotations

import math

import torch

from .kv_quant import KVFormat, dequantize_kv, quantize_kv, resolve_kv_format

__all__ = ["paged_kv_write", "extend_attention", "decode_attention", "pool_kv_format",
           "stored_kv"]

#: Quantized pool storage dtype -> ``--kv-cache-dtype`` name.
_QUANT_POOL_DTYPES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3"}


def pool_kv_format(pool: torch.Tensor) -> KVFormat | None:
    """The quantized format a value pool of this dtype stores (int8, float8_e4m3fn), or None
    for an unquantized pool."""
    name = _QUANT_POOL_DTYPES.get(pool.dtype)
    return None if name is None else resolve_kv_format(name, torch.float32)


def _check_scale_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale_pool: torch.Tensor | None,
                       v_scale_pool: torch.Tensor | None) -> KVFormat | None:
    """The pools' quantized format (None: unquantized), the scale pools checked against it.

    Raises:
        ValueError: naming ``k_scale_pool`` / ``v_scale_pool``: given for an unquantized pool,
            missing for a quantized one, or not ``[M, B, Hkv]`` fp32; ``v_pool`` when the two
            value pools differ in dtype.
    """
    if v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool: dtype {v_pool.dtype} differs from k_pool's {k_pool.dtype}")
    fmt = pool_kv_format(k_pool)
    if fmt is None:
        if k_scale_pool is not None or v_scale_pool is not None:
            raise ValueError(f"k_scale_pool: scale pools given for an unquantized {k_pool.dtype} pool")
        return None
    for name, scales in (("k_scale_pool", k_scale_pool), ("v_scale_pool", v_scale_pool)):
        if scales is None:
            raise ValueError(f"{name}: a {k_pool.dtype} pool needs its [M, B, Hkv] fp32 scale pool")
        if scales.dtype != torch.float32 or scales.shape != k_pool.shape[:3]:
            raise ValueError(f"{name}: need float32 {tuple(k_pool.shape[:3])}, got {scales.dtype} "
                             f"{tuple(scales.shape)}")
    return fmt


def stored_kv(x: torch.Tensor, fmt: KVFormat | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[T, Hkv, D]`` as attention reads them back from a pool of format ``fmt``:
    quantized then dequantized to ``dtype`` (quantized formats), else just cast to ``dtype``."""
    if fmt is None:
        return x.to(dtype)
    q, scale = quantize_kv(x, fmt)
    return dequantize_kv(q, scale, dtype)


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
    """Scatter per-token K/V rows into the paged pools, in place.

    Args:
        k: ``[T, Hkv, D]`` keys of the packed tokens (pool dtype or castable to it; fp32 or
            bf16 for a quantized pool).
        v: ``[T, Hkv, D]`` values of the packed tokens.
        k_pool: ``[M, B, Hkv, D]`` key pool of one layer; modified in place. An int8 or
            float8_e4m3fn pool is quantized (``kv_quant.quantize_kv``, format from the dtype).
        v_pool: ``[M, B, Hkv, D]`` value pool of one layer; modified in place.
        slot_mapping: ``[T]`` integer slots ``block_id * B + offset``; rows with a negative
            slot are skipped (padding).
        k_scale_pool / v_scale_pool: ``[M, B, Hkv]`` fp32 scale pools of a quantized pool
            (row ``slot`` gets the token's per-head scales); None for an unquantized one.

    Raises:
        ValueError: if shapes disagree (the message names the field), a slot is
            ``>= M * B``, or the scale pools do not match the pool format.
    """
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"v_pool: shape {tuple(v_pool.shape)} differs from k_pool {tuple(k_pool.shape)}")
    fmt = _check_scale_pools(k_pool, v_pool, k_scale_pool, v_scale_pool)
    if k.dim() != 3 or k.shape[1:] != k_pool.shape[2:]:
        raise ValueError(f"k: shape {tuple(k.shape)} does not match pool heads/dim {tuple(k_pool.shape[2:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping: shape {tuple(slot_mapping.shape)}, expected [{k.shape[0]}]")
    num_slots = k_pool.shape[0] * k_pool.shape[1]
    slots = slot_mapping.to(device=k.device, dtype=torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots = slots[keep]
        k = k[keep]
        v = v[keep]
    if slots.numel() == 0:
        return
    if int(slots.max()) >= num_slots:
        raise ValueError(f"slot_mapping: slot {int(slots.max())} out of range for {num_slots} pool slots")
    # Views over the pool storage: index_copy_ on the flat view writes the pool itself.
    if fmt is None:
        k_pool.view(num_slots, *k_pool.shape[2:]).index_copy_(0, slots, k.to(k_pool.dtype))
        v_pool.view(num_slots, *v_pool.shape[2:]).index_copy_(0, slots, v.to(v_pool.dtype))
        return
    assert k_scale_pool is not None and v_scale_pool is not None  # checked with fmt
    for x, pool, scales in ((k, k_pool, k_scale_pool), (v, v_pool, v_scale_pool)):
        q, scale = quantize_kv(x, fmt)
        _copy_rows(pool.view(num_slots, *pool.shape[2:]), slots, q)
        scales.view(num_slots, scales.shape[2]).index_copy_(0, slots, scale)


def _copy_rows(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``flat[slots] = rows``; float8 (no CPU index_copy_ kernel) through its byte view."""
    if flat.dtype == torch.float8_e4m3fn:
        flat.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, rows)


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """``out`` validated against q (same shape and dtype), or a fresh ``empty_like(q)``."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype} on {out.device}, expected "
                         f"{tuple(q.shape)} {q.dtype} on {q.device}")
    return out


def _gather_prefix(pool: torch.Tensor, block_row: torch.Tensor, prefix_len: int,
                   dtype: torch.dtype, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``[P, Hkv, D]`` rows of one sequence's cached prefix from a pool, as ``dtype``
    (a quantized pool's blocks dequantized with their ``scales`` rows, block by block)."""
    block_size = pool.shape[1]
    num_blocks = -(-prefix_len // block_size)
    blocks = block_row[:num_blocks].to(device=pool.device, dtype=torch.int64)
    if num_blocks and int(blocks.min()) < 0:
        raise ValueError(f"block_tables: negative block id inside the first {num_blocks} entries")
    if scales is None:
        rows = pool.index_select(0, blocks)
    else:
        raw = pool.view(torch.uint8) if pool.dtype == torch.float8_e4m3fn else pool
        gathered = raw.index_select(0, blocks).view(pool.dtype)
        rows = dequantize_kv(gathered, scales.index_select(0, blocks), dtype)
    return rows.reshape(num_blocks * block_size, *pool.shape[2:])[:prefix_len].to(dtype)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefix_len: int,
    sm_scale: float,
    window_left: int,
    logits_soft_cap: float = 0.0,
    want_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked attention of one sequence.

    Args:
        q: ``[L, Hq, D]`` queries at absolute positions ``prefix_len … prefix_len + L - 1``.
        keys: ``[S, Hkv, D]`` keys at positions ``0 … S - 1`` (``S = prefix_len + L``).
        values: ``[S, Hkv, D]``.
        prefix_len: P.
        sm_scale: softmax scale.
        window_left: keys further than this many positions to the left are masked; -1 = none.
        logits_soft_cap: ``> 0`` caps scaled logits to ``cap * tanh(s / cap)``.
        want_lse: also return the natural-log LSE ``[L, Hq]`` fp32.

    Returns:
        ``([L, Hq, D]`` in q's dtype, ``[L, Hq]`` fp32 LSE or None).
    """
    num_q = q.shape[0]
    num_k = keys.shape[0]
    explicit = logits_soft_cap > 0 or want_lse
    if prefix_len == 0 and window_left < 0 and not explicit:
        # No prefix: top-left and bottom-right alignment coincide (L == S), so the fused
        # kernel's own causal masking is exact and skips the masked half of the work.
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            is_causal=True, scale=sm_scale, enable_gqa=True)
        return out[0].transpose(0, 1), None
    q_pos = torch.arange(prefix_len, prefix_len + num_q, device=q.device)[:, None]
    k_pos = torch.arange(num_k, device=q.device)[None, :]
    allowed = k_pos <= q_pos  # bottom-right aligned causal mask, [L, S]
    if window_left >= 0:
        allowed &= k_pos >= q_pos - window_left
    if not explicit:
        # [1, H, L, D] layout with enable_gqa: query head h reads KV head h // G without
        # copying K/V, and this layout takes torch's fused CPU kernel (about 4x faster than
        # the math path).
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=allowed, scale=sm_scale, enable_gqa=True)
        return out[0].transpose(0, 1), None
    # Explicit fp32 math (soft cap and LSE are not SDPA features).
    group = q.shape[1] // keys.shape[1]
    k32 = keys.float().repeat_interleave(group, dim=1)
    v32 = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k32) * sm_scale
    if logits_soft_cap > 0:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, L]
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), v32)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    *,
    max_q_len: int,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    k_scale_pool: torch.Tensor | None = None,
    v_scale_pool: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed suffix queries over (cached prefix from the pool + own suffix).

    The prefix keys of sequence i are read from the pool without a mask (every suffix token
    sees the whole prefix); suffix keys come from ``k``/``v`` with a causal mask. Decode is the
    special case L = 1.

    Args:
        q: ``[T, Hq, D]`` queries of the packed suffix tokens.
        k: ``[T, Hkv, D]`` keys of the packed suffix tokens.
        v: ``[T, Hkv, D]`` values of the packed suffix tokens.
        k_pool: ``[M, B, Hkv, D]`` key pool holding each sequence's prefix.
        v_pool: ``[M, B, Hkv, D]`` value pool.
        block_tables: ``[N, max_blocks]`` int32 block ids per sequence; entries past a
            sequence's prefix blocks are ignored (may be -1).
        prefix_lens: ``[N]`` int32 cached prefix length P of each sequence, tokens.
        qo_indptr: ``[N+1]`` int32 row offsets of each sequence in the packed tensors.
        max_q_len: upper bound on any sequence's L (used by kernels for grid sizing; checked).
        sm_scale: softmax scale; default ``1 / sqrt(D)``.
        window_left: sliding window (keys at most this many positions to the left of the
            query are visible); -1 disables it. HF ``sliding_window = w`` is ``window_left = w - 1``.
        logits_soft_cap: ``> 0`` caps the scaled logits to ``cap * tanh(s / cap)`` before the
            softmax (Gemma-2 / FlashInfer ``logits_soft_cap``); 0 disables it.
        out: optional ``[T, Hq, D]`` tensor of q's dtype to write the result into (returned).
        return_lse: also return the natural-log log-sum-exp of each row's scaled (capped)
            logits, ``[T, Hq]`` fp32 (for merging attention states).
        k_scale_pool / v_scale_pool: ``[M, B, Hkv]`` fp32 scales of an int8 / float8_e4m3fn
            pool (None for an unquantized one): the prefix is dequantized per gathered block
            and the suffix's ``k`` / ``v`` are quantized and dequantized as the write stores
            them.

    Returns:
        ``out`` ``[T, Hq, D]`` in q's dtype, or ``(out, lse)`` when ``return_lse``.

    Raises:
        ValueError: on inconsistent shapes or metadata (the message names the field).
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0]:
        raise ValueError(f"q/k/v: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} disagree")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: {num_q_heads} heads not a multiple of {num_kv_heads} kv heads")
    if k_pool.shape[2:] != k.shape[1:] or v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool: shape {tuple(k_pool.shape)} does not match k {tuple(k.shape)}")
    fmt = _check_scale_pools(k_pool, v_pool, k_scale_pool, v_scale_pool)
    num_seqs = prefix_lens.shape[0]
    if qo_indptr.shape != (num_seqs + 1,):
        raise ValueError(f"qo_indptr: shape {tuple(qo_indptr.shape)}, expected [{num_seqs + 1}]")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: shape {tuple(block_tables.shape)}, expected [{num_seqs}, *]")
    indptr = qo_indptr.tolist()
    if indptr[0] != 0 or indptr[-1] != num_tokens:
        raise ValueError(f"qo_indptr: must run from 0 to {num_tokens}, got {indptr[0]}..{indptr[-1]}")
    if logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap: must be >= 0, got {logits_soft_cap}")
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    out = _check_out(out, q)
    lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device) if return_lse else None
    if fmt is not None:  # the suffix as the pool holds it
        k, v = stored_kv(k, fmt, q.dtype), stored_kv(v, fmt, q.dtype)
    for i, prefix_len in enumerate(prefix_lens.tolist()):
        start, end = indptr[i], indptr[i + 1]
        num_q = end - start
        if num_q < 0:
            raise ValueError(f"qo_indptr: decreases at sequence {i}")
        if num_q > max_q_len:
            raise ValueError(f"max_q_len: sequence {i} has {num_q} query rows > {max_q_len}")
        if num_q == 0:
            continue
        if prefix_len < 0:
            raise ValueError(f"prefix_lens: sequence {i} has negative length {prefix_len}")
        keys, values = k[start:end], v[start:end]
        if prefix_len:
            row = block_tables[i]
            keys = torch.cat([_gather_prefix(k_pool, row, prefix_len, k.dtype, k_scale_pool), keys])
            values = torch.cat([_gather_prefix(v_pool, row, prefix_len, v.dtype, v_scale_pool), values])
        rows, rows_lse = _attend(q[start:end], keys, values, prefix_len, scale, window_left,
                                 logits_soft_cap, return_lse)
        out[start:end] = rows
        if lse is not None and rows_lse is not None:
            lse[start:end] = rows_lse
    return (out, lse) if lse is not None else out


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    num_kv_splits: int | None = None,
    k_scale_pool: torch.Tensor | None = None,
    v_scale_pool: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence attending over its whole KV (already in the pool).

    Args:
        q: ``[N, Hq, D]`` one query per sequence, at position ``kv_lens[i] - 1``.
        k_pool: ``[M, B, Hkv, D]`` key pool (the query token's own K already written).
        v_pool: ``[M, B, Hkv, D]`` value pool.
        block_tables: ``[N, max_blocks]`` int32.
        kv_lens: ``[N]`` int32 number of keys of each sequence (>= 1).
        sm_scale: softmax scale; default ``1 / sqrt(D)``.
        window_left: sliding window as in :func:`extend_attention`; -1 disables it.
        logits_soft_cap: as in :func:`extend_attention`.
        out: optional ``[N, Hq, D]`` tensor of q's dtype to write into (returned).
        return_lse: also return the natural-log LSE ``[N, Hq]`` fp32.
        num_kv_splits: accepted for signature parity with the Triton kernel (which splits
            each sequence's KV into this many chunks); the reference ignores it.
        k_scale_pool / v_scale_pool: ``[M, B, Hkv]`` fp32 scales of an int8 / float8_e4m3fn
            pool (None for an unquantized one); every gathered block is dequantized.

    Returns:
        ``out`` ``[N, Hq, D]`` in q's dtype, or ``(out, lse)`` when ``return_lse``.

    Raises:
        ValueError: if a ``kv_lens`` entry is < 1 or shapes disagree.
    """
    if q.dim() != 3 or kv_lens.shape != (q.shape[0],):
        raise ValueError(f"kv_lens: shape {tuple(kv_lens.shape)} does not match q {tuple(q.shape)}")
    if logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap: must be >= 0, got {logits_soft_cap}")
    _check_scale_pools(k_pool, v_pool, k_scale_pool, v_scale_pool)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    out = _check_out(out, q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    for i, kv_len in enumerate(kv_lens.tolist()):
        if kv_len < 1:
            raise ValueError(f"kv_lens: sequence {i} has {kv_len} keys, need >= 1")
        keys = _gather_prefix(k_pool, block_tables[i], kv_len, q.dtype, k_scale_pool)
        values = _gather_prefix(v_pool, block_tables[i], kv_len, q.dtype, v_scale_pool)
        # The query is the last key's position: a causal mask over all S keys with P = S - 1.
        row, row_lse = _attend(q[i : i + 1], keys, values, kv_len - 1, scale, window_left,
                               logits_soft_cap, return_lse)
        out[i : i + 1] = row
        if lse is not None and row_lse is not None:
            lse[i : i + 1] = row_lse
    return (out, lse) if lse is not None else out

"""Triton ``decode_attention``: one query per sequence over its paged KV, split-KV + LSE merge.

Shapes (letters as in ``reference.py``): ``q`` ``[N, Hq, D]`` (stride 1 on D); pools
``[M, B, Hkv, D]`` (NHD); ``block_tables`` ``[N, max_blocks]`` int32; ``kv_lens`` ``[N]`` int32.
With G = Hq / Hkv, query head h reads KV head ``h // G``.

Stage 1, grid ``(Hkv, S, N)``: program (kv head, split s, sequence i) takes the G query heads
of one KV head as the rows of one ``[BLOCK_H, D]`` tile (``BLOCK_H = max(16, pow2(G))``, the
smallest ``tl.dot`` M), so each K/V tile is loaded once per group. It walks its share of the
visible keys ``[lo, kv_len)`` (``lo = kv_len - 1 - window_left`` with a window, else 0) in
BLOCK_N-token tiles gathered through the block table, and stores the normalised partial output
``o_s`` ``[Hq, D]`` and its base-2 LSE ``lse_s`` (``-inf`` for an empty split).

Stage 2, grid ``(Hq, N)``: ``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with
``M = max_s lse_s``; ``lse = ln 2 * (M + log2 sum_s 2^(lse_s - M))``.

Quantized pools (int8 or float8_e4m3fn with ``[M, B, Hkv]`` fp32 scale pools, constexpr
``QUANT``): each gathered K/V tile is dequantized to ``float32(q) * scale`` per token row
(``_triton_common.load_kv_tile``, kv_quant's formula) before the dot products, then cast to q's
dtype on the GPU branch, as an unquantized pool's tiles are.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._triton_common import (
    check_device,
    dot_precision,
    interpreting,
    kv_quant_params,
    last_dim_contiguous,
    load_kv_tile,
    next_pow2,
    online_softmax_step,
    scores_to_log2,
    staging_output,
    upcast_tiles,
)

__all__ = ["decode_attention", "default_num_kv_splits"]

_MAX_KV_SPLITS = 64
_SM_COUNT: dict[int, int] = {}
# Launch-config override for benchmark sweeps (bench/kernels.py --sweep): keys block_n,
# num_warps, num_stages. None in normal use; process-global, not thread-safe.
LAUNCH_OVERRIDE: dict[str, int] | None = None


@triton.jit
def _decode_split_kernel(
    Q, KPool, VPool, KScale, VScale, BlockTables, KvLens, MidO, MidLse,
    sm_scale, soft_cap, window_left,
    stride_qn, stride_qh,
    stride_kpm, stride_kpb, stride_kph, stride_vpm, stride_vpb, stride_vph,
    stride_ksm, stride_ksb, stride_ksh, stride_vsm, stride_vsb, stride_vsh,
    stride_bt, stride_mo_n, stride_mo_h, stride_mo_s, stride_ml_n, stride_ml_h,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, QUANT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    seq = tl.program_id(2)

    kv_len = tl.load(KvLens + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(kv_len - 1 - window_left, 0)
    # Split s owns keys [start, end); chunk is a multiple of BLOCK_N so tiles stay aligned.
    chunk = tl.cdiv(tl.cdiv(kv_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, kv_len)

    offs_g = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(Q + seq.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    table = BlockTables + seq.to(tl.int64) * stride_bt
    kp_base = KPool + kv_head * stride_kph
    vp_base = VPool + kv_head * stride_vph
    ks_base = KScale + kv_head * stride_ksh
    vs_base = VScale + kv_head * stride_vsh
    for start_n in range(start, end, BLOCK_N):
        pos = start_n + offs_n
        n_ok = pos < end
        block = tl.load(table + pos // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        within = (pos % PAGE_SIZE).to(tl.int64)
        k, v = load_kv_tile(kp_base, vp_base, ks_base, vs_base, block, within, n_ok, offs_d, d_ok,
                            stride_kpm, stride_kpb, stride_vpm, stride_vpb,
                            stride_ksm, stride_ksb, stride_vsm, stride_vsb, QUANT)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = scores_to_log2(tl.dot(q, k, input_precision=DOT_PRECISION), sm_scale, soft_cap, HAS_SOFT_CAP)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, UPCAST, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    seq64 = seq.to(tl.int64)
    tl.store(MidO + seq64 * stride_mo_n + heads[:, None] * stride_mo_h + split * stride_mo_s
             + offs_d[None, :], acc / l_safe[:, None], mask=g_ok[:, None] & d_ok[None, :])
    tl.store(MidLse + seq64 * stride_ml_n + heads * stride_ml_h + split, lse, mask=g_ok)


@triton.jit
def _decode_merge_kernel(
    MidO, MidLse, Out, Lse, num_splits,
    stride_mo_n, stride_mo_h, stride_mo_s, stride_ml_n, stride_ml_h,
    stride_on, stride_oh, stride_lse_n,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse_s = tl.load(MidLse + seq * stride_ml_n + head * stride_ml_h + offs_s, mask=s_ok, other=float("-inf"))
    o_s = tl.load(MidO + seq * stride_mo_n + head * stride_mo_h + offs_s[:, None] * stride_mo_s
                  + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse_s - m_safe)
    total = tl.sum(w, 0)
    total_safe = tl.where(total == 0.0, 1.0, total)
    o = tl.sum(o_s * w[:, None], 0) / total_safe
    tl.store(Out + seq * stride_on + head * stride_oh + offs_d, o.to(Out.dtype.element_ty), mask=d_ok)
    if RETURN_LSE:
        tl.store(Lse + seq * stride_lse_n + head, (m + tl.log2(total_safe)) * 0.6931471805599453)


def default_num_kv_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per sequence so that stage 1 has about four programs per SM (1 on the CPU: 2)."""
    if device.type != "cuda":
        return 2
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(_MAX_KV_SPLITS, triton.cdiv(4 * _SM_COUNT[index], max(num_seqs * num_kv_heads, 1))))


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
    """One query token per sequence attending over its whole KV in the pool (Triton, split-KV).

    Same contract as :func:`radixkv.kernels.reference.decode_attention`. ``kv_lens`` is not
    validated on the device: a sequence with ``kv_len < 1`` gets a zero output row.

    Args:
        q: ``[N, Hq, D]`` one query per sequence, at position ``kv_lens[i] - 1``.
        k_pool: ``[M, B, Hkv, D]`` key pool (the query token's own K already written).
        v_pool: ``[M, B, Hkv, D]`` value pool.
        block_tables: ``[N, max_blocks]`` int32; only the first ``ceil(kv_len / B)`` are read.
        kv_lens: ``[N]`` int32 number of keys of each sequence.
        sm_scale: softmax scale; default ``1 / sqrt(D)``.
        window_left: keys more than this many positions left of the query are hidden; -1: none.
        logits_soft_cap: ``> 0`` caps scaled logits to ``cap * tanh(s / cap)``; 0 disables.
        out: optional ``[N, Hq, D]`` tensor of q's dtype to write into (returned).
        return_lse: also return the natural-log LSE ``[N, Hq]`` fp32.
        num_kv_splits: S, KV splits per sequence (1..64); default from the SM count and
            ``N * Hkv`` (:func:`default_num_kv_splits`).
        k_scale_pool: ``[M, B, Hkv]`` fp32 key scales when ``k_pool`` is int8 or
            float8_e4m3fn (written by ``paged_kv_write`` with scale pools): keys are read as
            ``float32(q) * scale``. None for an unquantized pool. fp8 pools need a GPU with
            native fp8 conversions (sm_89+) or the interpreter.
        v_scale_pool: ``[M, B, Hkv]`` fp32 value scales; given exactly when ``k_scale_pool`` is.

    Returns:
        ``out`` ``[N, Hq, D]`` in q's dtype, or ``(out, lse)``.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices, or a quantized pool without its
            scale pools (the message names the field).

    Example:
        Two sequences with 40 and 3 keys in a block-size-16 pool, 8 query / 2 KV heads::

            pool = torch.randn(5, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
            tables = torch.tensor([[4, 0, 2], [1, -1, -1]], dtype=torch.int32, device="cuda")
            q = torch.randn(2, 8, 128, device="cuda", dtype=torch.bfloat16)
            o, lse = decode_attention(q, pool, pool, tables,
                                      torch.tensor([40, 3], dtype=torch.int32, device="cuda"),
                                      return_lse=True)   # [2, 8, 128] bf16, [2, 8] fp32
    """
    if q.dim() != 3 or kv_lens.shape != (q.shape[0],):
        raise ValueError(f"kv_lens: shape {tuple(kv_lens.shape)} does not match q {tuple(q.shape)}")
    num_seqs, num_q_heads, head_dim = q.shape
    if k_pool.dim() != 4 or v_pool.shape != k_pool.shape or k_pool.shape[3] != head_dim:
        raise ValueError(f"k_pool: shape {tuple(k_pool.shape)} does not match q {tuple(q.shape)}")
    num_kv_heads = k_pool.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: {num_q_heads} heads not a multiple of {num_kv_heads} kv heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: shape {tuple(block_tables.shape)}, expected [{num_seqs}, *]")
    for name, t in (("block_tables", block_tables), ("kv_lens", kv_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: dtype {t.dtype}, expected torch.int32")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q: dtype {q.dtype}; need one of fp32/fp16/bf16")
    if logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap: must be >= 0, got {logits_soft_cap}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out: shape {tuple(out.shape)} {out.dtype}, expected {tuple(q.shape)} {q.dtype}")
    quantized, _, _ = kv_quant_params(k_pool, v_pool, k_scale_pool, v_scale_pool)
    scale_pools = [t for t in (k_scale_pool, v_scale_pool) if t is not None]
    lse = torch.empty(num_seqs, num_q_heads, dtype=torch.float32, device=q.device) if return_lse else None
    check_device("decode_attention", q, k_pool, v_pool, block_tables, kv_lens, out, *scale_pools)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(num_seqs, num_kv_heads, q.device)
    if not 1 <= int(num_kv_splits) <= _MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits: must be in [1, {_MAX_KV_SPLITS}], got {num_kv_splits}")
    if num_seqs == 0:
        return (out, lse) if lse is not None else out
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("k_pool/v_pool: the head_dim axis must have stride 1")
    q = last_dim_contiguous(q)
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    kv_lens = kv_lens.contiguous()

    num_splits = int(num_kv_splits)
    group = num_q_heads // num_kv_heads
    block_d = next_pow2(max(head_dim, 16))
    config = {"block_n": 32 if interpreting() or q.device.type == "cpu" or q.dtype == torch.float32 else 64,
              "num_warps": 4, "num_stages": 2}
    if LAUNCH_OVERRIDE:
        config.update(LAUNCH_OVERRIDE)
    block_n = config["block_n"]
    mid_o = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    launch = {} if interpreting() else {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    # Unquantized: the scale arguments are never read (QUANT is off); pass the pools, strides 0.
    k_scales, v_scales = scale_pools if quantized else (k_pool, v_pool)
    _decode_split_kernel[(num_kv_heads, num_splits, num_seqs)](
        q, k_pool, v_pool, k_scales, v_scales, block_tables, kv_lens, mid_o, mid_lse,
        scale, float(logits_soft_cap), int(window_left),
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        *(k_scales.stride() if quantized else (0, 0, 0)), *(v_scales.stride() if quantized else (0, 0, 0)),
        block_tables.stride(0), *mid_o.stride()[:3], *mid_lse.stride()[:2],
        GROUP=group, PAGE_SIZE=k_pool.shape[1], HEAD_DIM=head_dim,
        BLOCK_H=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_WINDOW=window_left >= 0, HAS_SOFT_CAP=logits_soft_cap > 0, QUANT=quantized,
        UPCAST=upcast_tiles(q.dtype, k_pool.dtype), DOT_PRECISION=dot_precision(q.dtype),
        **launch,
    )
    dst = staging_output(out)
    _decode_merge_kernel[(num_q_heads, num_seqs)](
        mid_o, mid_lse, dst, lse if lse is not None else dst, num_splits,
        *mid_o.stride()[:3], *mid_lse.stride()[:2],
        dst.stride(0), dst.stride(1), lse.stride(0) if lse is not None else 0,
        HEAD_DIM=head_dim, BLOCK_S=max(2, next_pow2(num_splits)), BLOCK_D=block_d, RETURN_LSE=return_lse,
        **({} if interpreting() else {"num_warps": 4}),
    )
    if dst is not out:
        out.copy_(dst)
    return (out, lse) if lse is not None else out

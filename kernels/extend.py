"""Triton ``extend_attention``: packed suffix queries over (paged cached prefix + causal suffix).

Shapes (letters as in ``reference.py``): ``q`` ``[T, Hq, D]``; ``k``/``v`` ``[T, Hkv, D]``
(stride 1 on D, any token / head strides); pools ``[M, B, Hkv, D]`` (NHD); ``block_tables``
``[N, max_blocks]`` int32; ``prefix_lens`` ``[N]`` int32; ``qo_indptr`` ``[N+1]`` int32.

Math, for sequence i with P = prefix_lens[i] cached tokens and L suffix rows, query row r
(absolute position P + r) of query head h, KV head ``h // (Hq / Hkv)``::

    s_j = sm_scale * q_r · k_j            (j over prefix keys 0..P-1, then suffix keys P..P+r)
    s_j = cap * tanh(s_j / cap)           (only when logits_soft_cap > 0)
    o_r = sum_j softmax(s)_j v_j,   lse_r = log sum_j exp(s_j)

Prefix keys are visible to every row (no mask), suffix keys are causal bottom-right aligned;
``window_left >= 0`` additionally hides keys at positions ``< P + r - window_left``.

Grid ``(Hq, cdiv(max_q_len, BLOCK_M), N)``: one program owns BLOCK_M rows of one query head
of one sequence (heaviest row tiles launch first; heads of one KV group sit next to each other
so their K/V tiles are shared through L2). Key tiles are BLOCK_N tokens whatever the block
size: each key row's pool address is ``block_tables[i, n // B] * stride + (n % B) * stride``,
computed in int64. The suffix loop runs unmasked below the diagonal band.

Quantized pools (int8 or float8_e4m3fn with ``[M, B, Hkv]`` fp32 scale pools, constexpr
``QUANT``): attention reads every key as dequantized from the pool, ``float32(q) * scale``
(kv_quant's formula, ``_triton_common.load_kv_tile``), the suffix included: suffix keys are read
back from the pool at positions ``P .. P + L - 1`` through the block table (``paged_kv_write``
with the scale pools has written them first), not from ``k``/``v``. So a cold prefill attends
over exactly the values a later prefix hit reads, and both give the same logits.
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

__all__ = ["extend_attention", "extend_block_sizes", "extend_launch_config"]

# Launch-config override for benchmark sweeps (bench/kernels.py --sweep): keys block_m,
# block_n, num_warps, num_stages. None in normal use; process-global, not thread-safe.
LAUNCH_OVERRIDE: dict[str, int] | None = None


@triton.jit
def _extend_kernel(
    Q, K, V, KPool, VPool, KScale, VScale, BlockTables, PrefixLens, QoIndptr, Out, Lse,
    sm_scale, soft_cap, window_left,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kpm, stride_kpb, stride_kph, stride_vpm, stride_vpb, stride_vph,
    stride_ksm, stride_ksb, stride_ksh, stride_vsm, stride_vsb, stride_vsh,
    stride_bt, stride_lse_t,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, RETURN_LSE: tl.constexpr,
    QUANT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(QoIndptr + seq)
    q_len = tl.load(QoIndptr + seq + 1) - q_start
    m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    if m_start >= q_len:
        return
    prefix_len = tl.load(PrefixLens + seq)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    q_pos = prefix_len + offs_m  # absolute positions of this tile's rows

    # ---- prefix keys 0 .. P-1, from the paged pool ------------------------------------
    table = BlockTables + seq.to(tl.int64) * stride_bt
    kp_base = KPool + kv_head * stride_kph
    vp_base = VPool + kv_head * stride_vph
    ks_base = KScale + kv_head * stride_ksh
    vs_base = VScale + kv_head * stride_vsh
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix_len + m_start - window_left, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, prefix_len, BLOCK_N):
        pos = start_n + offs_n
        n_ok = pos < prefix_len
        block = tl.load(table + pos // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        within = (pos % PAGE_SIZE).to(tl.int64)
        # k as [BLOCK_D, BLOCK_N] (transposed gather), v as [BLOCK_N, BLOCK_D].
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
        visible = n_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] >= q_pos[:, None] - window_left)
        s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, UPCAST, DOT_PRECISION)

    # ---- suffix keys, from the packed k / v (quantized: the pool): unmasked below the band -
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    diag = m_start // BLOCK_N * BLOCK_N  # suffix keys < diag are visible to every row here
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(m_start - window_left, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, diag, BLOCK_N):
        if QUANT:
            # Dequantized from the pool, where paged_kv_write put the suffix (module docstring).
            pos = prefix_len + start_n + offs_n
            n_all = offs_n < BLOCK_N
            block = tl.load(table + pos // PAGE_SIZE).to(tl.int64)
            k, v = load_kv_tile(kp_base, vp_base, ks_base, vs_base, block, (pos % PAGE_SIZE).to(tl.int64),
                                n_all, offs_d, d_ok, stride_kpm, stride_kpb, stride_vpm, stride_vpb,
                                stride_ksm, stride_ksb, stride_vsm, stride_vsb, QUANT)
            if not UPCAST:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
        else:
            cols = (q_start + start_n + offs_n).to(tl.int64)
            k = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None], mask=d_ok[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = scores_to_log2(tl.dot(q, k, input_precision=DOT_PRECISION), sm_scale, soft_cap, HAS_SOFT_CAP)
        if HAS_WINDOW:
            s = tl.where((start_n + offs_n)[None, :] >= offs_m[:, None] - window_left, s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, UPCAST, DOT_PRECISION)

    # ---- the diagonal band: causal + bounds mask ---------------------------------------
    hi = tl.minimum(m_start + BLOCK_M, q_len)
    for start_n in range(tl.maximum(diag, lo), hi, BLOCK_N):
        j = start_n + offs_n
        n_ok = j < q_len
        if QUANT:
            pos = prefix_len + j
            block = tl.load(table + pos // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            k, v = load_kv_tile(kp_base, vp_base, ks_base, vs_base, block, (pos % PAGE_SIZE).to(tl.int64),
                                n_ok, offs_d, d_ok, stride_kpm, stride_kpb, stride_vpm, stride_vpb,
                                stride_ksm, stride_ksb, stride_vsm, stride_vsb, QUANT)
            if not UPCAST:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
        else:
            cols = (q_start + j).to(tl.int64)
            k = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None],
                        mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = scores_to_log2(tl.dot(q, k, input_precision=DOT_PRECISION), sm_scale, soft_cap, HAS_SOFT_CAP)
        visible = n_ok[None, :] & (j[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            visible = visible & (j[None, :] >= offs_m[:, None] - window_left)
        s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, UPCAST, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # ln 2: base-2 -> natural log
        tl.store(Lse + rows * stride_lse_t + head, lse, mask=m_ok)


def extend_launch_config(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> dict[str, int]:
    """Tile sizes and launch options :func:`extend_attention` uses for these inputs.

    The interpreter (and hence CPU) uses BLOCK_M = 16, BLOCK_N = 32 to keep numpy launches
    short; a GPU uses 128 x 64 with 8 warps up to head dim 128 (fp32: BLOCK_N 32), 64 x 32 with
    4 warps above. :data:`LAUNCH_OVERRIDE` replaces any of the keys.

    Returns:
        ``{"block_m", "block_n", "num_warps", "num_stages"}``.
    """
    if interpreting() or torch.device(device).type == "cpu":
        config = {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 1}
    elif head_dim > 128:
        config = {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    else:
        config = {"block_m": 128, "block_n": 32 if dtype == torch.float32 else 64, "num_warps": 8,
                  "num_stages": 2}
    if LAUNCH_OVERRIDE:
        config.update(LAUNCH_OVERRIDE)
    return config


def extend_block_sizes(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of :func:`extend_launch_config` (tests size their cases by it)."""
    config = extend_launch_config(head_dim, dtype, device)
    return config["block_m"], config["block_n"]


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
    """Attention of packed suffix queries over (cached prefix from the pool + own suffix), Triton.

    Same contract as :func:`radixkv.kernels.reference.extend_attention`. Metadata is not
    validated on the device (that would need a sync): ``max_q_len`` must be ``>=`` every L
    (rows past it are not computed), block ids must be valid for the first ``ceil(P / B)``
    entries of each table row (later entries are never read, -1 padding is fine).

    Args:
        q: ``[T, Hq, D]`` queries of the packed suffix tokens (fp32, fp16 or bf16).
        k: ``[T, Hkv, D]`` keys of the suffix tokens (also written to the pool separately).
        v: ``[T, Hkv, D]`` values of the suffix tokens.
        k_pool: ``[M, B, Hkv, D]`` key pool holding each sequence's prefix (cast to q's dtype).
        v_pool: ``[M, B, Hkv, D]`` value pool.
        block_tables: ``[N, max_blocks]`` int32 block ids per sequence.
        prefix_lens: ``[N]`` int32 cached prefix length P of each sequence, tokens.
        qo_indptr: ``[N+1]`` int32 row offsets of the sequences in the packed tensors.
        max_q_len: upper bound on every sequence's L (sizes the grid).
        sm_scale: softmax scale; default ``1 / sqrt(D)``.
        window_left: keys more than this many positions left of the query are hidden; -1: none.
        logits_soft_cap: ``> 0`` caps scaled logits to ``cap * tanh(s / cap)``; 0 disables.
        out: optional ``[T, Hq, D]`` tensor of q's dtype to write into (returned).
        return_lse: also return the natural-log LSE of each row's scaled (capped) logits.
        k_scale_pool: ``[M, B, Hkv]`` fp32 key scales when the pools are int8 or float8_e4m3fn:
            every key, prefix and suffix, is read from the pool as ``float32(q) * scale``, so
            the suffix must already be written there (``paged_kv_write`` with these scale
            pools) and ``block_tables`` must name the blocks of all ``P + L`` positions; ``k``
            and ``v`` are then only shape-checked. None for unquantized pools. fp8 pools need
            a GPU with native fp8 conversions (sm_89+) or the interpreter.
        v_scale_pool: ``[M, B, Hkv]`` fp32 value scales; given exactly when ``k_scale_pool`` is.

    Returns:
        ``out`` ``[T, Hq, D]`` in q's dtype, or ``(out, lse)`` with ``lse`` ``[T, Hq]`` fp32.

    Raises:
        ValueError: on inconsistent shapes, dtypes or devices, or a quantized pool without its
            scale pools (the message names the field).

    Example:
        Two sequences, P = (32, 0), L = (5, 3), block size 16, 8 query / 2 KV heads::

            T = 8; q = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16)
            k = v = torch.randn(T, 2, 128, device="cuda", dtype=torch.bfloat16)
            pool = torch.randn(4, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
            tables = torch.tensor([[3, 1], [2, -1]], dtype=torch.int32, device="cuda")
            o = extend_attention(q, k, v, pool, pool, tables,
                                 torch.tensor([32, 0], dtype=torch.int32, device="cuda"),
                                 torch.tensor([0, 5, 8], dtype=torch.int32, device="cuda"),
                                 max_q_len=5)   # [8, 8, 128] bf16
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2]:
        raise ValueError(f"q/k/v: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} disagree")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: {num_q_heads} heads not a multiple of {num_kv_heads} kv heads")
    if k_pool.dim() != 4 or k_pool.shape[2:] != k.shape[1:] or v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool: shape {tuple(k_pool.shape)} does not match k {tuple(k.shape)}")
    if (q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k.dtype != q.dtype
            or v.dtype != q.dtype):
        raise ValueError(f"q/k/v: dtypes {q.dtype}, {k.dtype}, {v.dtype}; need one of fp32/fp16/bf16")
    num_seqs = prefix_lens.shape[0]
    if prefix_lens.dim() != 1 or qo_indptr.shape != (num_seqs + 1,):
        raise ValueError(f"qo_indptr: shape {tuple(qo_indptr.shape)}, expected [{num_seqs + 1}]")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: shape {tuple(block_tables.shape)}, expected [{num_seqs}, *]")
    for name, t in (("block_tables", block_tables), ("prefix_lens", prefix_lens), ("qo_indptr", qo_indptr)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: dtype {t.dtype}, expected torch.int32")
    if int(max_q_len) < 0:
        raise ValueError(f"max_q_len: must be >= 0, got {max_q_len}")
    if logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap: must be >= 0, got {logits_soft_cap}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out: shape {tuple(out.shape)} {out.dtype}, expected {tuple(q.shape)} {q.dtype}")
    quantized, _, _ = kv_quant_params(k_pool, v_pool, k_scale_pool, v_scale_pool)
    scale_pools = [t for t in (k_scale_pool, v_scale_pool) if t is not None]
    lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device) if return_lse else None
    check_device("extend_attention", q, k, v, k_pool, v_pool, block_tables, prefix_lens, qo_indptr, out,
                 *scale_pools)
    if num_tokens == 0 or num_seqs == 0 or max_q_len == 0:
        return (out, lse) if lse is not None else out
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("k_pool/v_pool: the head_dim axis must have stride 1")
    if out.stride(-1) != 1:
        raise ValueError("out: the head_dim axis must have stride 1")
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    prefix_lens, qo_indptr = prefix_lens.contiguous(), qo_indptr.contiguous()

    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    config = extend_launch_config(head_dim, q.dtype, q.device)
    block_m, block_n = config["block_m"], config["block_n"]
    block_d = next_pow2(max(head_dim, 16))
    grid = (num_q_heads, triton.cdiv(int(max_q_len), block_m), num_seqs)
    launch = {} if interpreting() else {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    dst = staging_output(out)
    # Unquantized: the scale arguments are never read (QUANT is off); pass the pools, strides 0.
    k_scales, v_scales = scale_pools if quantized else (k_pool, v_pool)
    _extend_kernel[grid](
        q, k, v, k_pool, v_pool, k_scales, v_scales, block_tables, prefix_lens, qo_indptr, dst,
        lse if lse is not None else out,
        scale, float(logits_soft_cap), int(window_left),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dst.stride(0), dst.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        *(k_scales.stride() if quantized else (0, 0, 0)), *(v_scales.stride() if quantized else (0, 0, 0)),
        block_tables.stride(0), lse.stride(0) if lse is not None else 0,
        GROUP=num_q_heads // num_kv_heads, PAGE_SIZE=k_pool.shape[1], HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_WINDOW=window_left >= 0, HAS_SOFT_CAP=logits_soft_cap > 0, RETURN_LSE=return_lse,
        QUANT=quantized, UPCAST=upcast_tiles(q.dtype, k_pool.dtype), DOT_PRECISION=dot_precision(q.dtype),
        **launch,
    )
    if dst is not out:
        out.copy_(dst)
    return (out, lse) if lse is not None else out

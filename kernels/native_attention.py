"""Extend / prefill attention over the paged KV pool in C (``csrc/cpu_extend.c``).

:func:`paged_extend` attends every packed query row of N sequences (sequence i: L_i rows at
positions ``P_i … P_i + L_i - 1``) over that sequence's keys ``0 … position``, read from the
pool through its block table after the step's own K/V were written there: a cold prefill
(P = 0), a suffix after a prefix hit, or a chunk of a chunked prefill, with no gather into a
padded batch and no mask tensor. The kernel is FlashAttention-2 (Dao 2023,
https://arxiv.org/abs/2307.08691) on CPU cores: work items of (sequence, KV head, tile of
query tokens) whose rows are the tokens x the query heads sharing the KV head, key tiles
packed once per call, register-blocked ``Q K^T`` and ``P V``, online softmax; see the C file.

Dtypes: q and out are fp32; the pools are fp32 (``rk_paged_extend_f32``), bf16
(``rk_paged_extend_bf16``, widened exactly to fp32 as they are packed), or int8 / float8_e4m3fn
with ``[M, B, Hkv]`` fp32 scale pools (``rk_paged_extend_q``: each key and value dequantized
once as it is packed, ``float32(q) * scale``, exactly ``kernels.kv_quant.dequantize_kv``; the
kernel then runs as for fp32, so a quantized prefill costs the fp32 one plus the narrower
reads). All arithmetic is fp32.

Modules in this package import only torch (see ``__init__``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import native

__all__ = ["paged_extend", "launch", "extend_supported", "rows_packed", "MAX_HEAD_DIM", "KV_QUANT_FORMATS"]

#: Largest head dim the kernel takes (its row buffers).
MAX_HEAD_DIM = 256
#: Quantized KV formats the kernel reads (``kernels/kv_quant.py`` names): as :mod:`native`'s.
KV_QUANT_FORMATS = native.KV_QUANT_FORMATS

_POOL_DTYPES = (torch.float32, torch.bfloat16, *native.KV_QUANT_DTYPES)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_ARGTYPES: list[Any] = [_P, _I64, _P, _P, _I64, _P, _P, _P, _I64, _INT, _INT, _INT, _INT, ctypes.c_float,
                        _I64, _P, _INT]
_Q_ARGTYPES: list[Any] = [*_ARGTYPES, _P, _P, _INT]
_bound: dict[str, tuple[Any, Any, Any]] = {}  # library path -> (f32, bf16, quantized) ctypes functions


def rows_packed(q: torch.Tensor) -> bool:
    """Whether ``q`` ``[T, Hq, D]`` can be read in place: each token's ``[Hq, D]`` contiguous,
    tokens at least ``Hq * D`` elements apart."""
    return (q.dim() == 3 and (q.shape[0] == 0 or q[0].is_contiguous())
            and (q.shape[0] <= 1 or q.stride(0) >= q.shape[1] * q.shape[2]))


def _row_stride(q: torch.Tensor) -> int:
    return q.stride(0) if q.shape[0] > 1 else q.shape[1] * q.shape[2]


def extend_supported(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`paged_extend` takes these heads: Hq a multiple of Hkv (GQA / MQA / MHA),
    D a multiple of 16 in [16, :data:`MAX_HEAD_DIM`]."""
    return (num_kv_heads >= 1 and num_q_heads >= num_kv_heads and num_q_heads % num_kv_heads == 0
            and head_dim >= 16 and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM)


def _entry_points(kernels: native.NativeKernels) -> tuple[Any, Any, Any]:
    key = str(kernels.path)
    fns = _bound.get(key)
    if fns is None:
        f32, bf16 = kernels.lib.rk_paged_extend_f32, kernels.lib.rk_paged_extend_bf16
        quant = kernels.lib.rk_paged_extend_q
        for fn, argtypes in ((f32, _ARGTYPES), (bf16, _ARGTYPES), (quant, _Q_ARGTYPES)):
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        fns = _bound[key] = (f32, bf16, quant)
    return fns


def paged_extend(kernels: native.NativeKernels, q: torch.Tensor, qo_indptr: torch.Tensor,
                 prefix_lens: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 block_tables: torch.Tensor, *, sm_scale: float, window_left: int = -1,
                 out: torch.Tensor | None = None, num_threads: int | None = None,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed suffix rows over their sequences' keys in the paged pool.

    Query j of sequence i sits at position ``P_i + j`` and sees keys ``0 … P_i + j`` (all of
    the prefix, causal within the suffix), or only those ``≥ P_i + j - window_left``.

    Args:
        kernels: the loaded library (:func:`native.load`).
        q: ``[T, Hq, D]`` fp32 with each token's ``[Hq, D]`` contiguous (a row-strided view into
            a fused qkv output is read in place); sequence i owns rows
            ``qo_indptr[i]:qo_indptr[i+1]``.
        qo_indptr: ``[N+1]`` integer row offsets, from 0 to T, every sequence ≥ 1 row.
        prefix_lens: ``[N]`` integer P of each sequence (keys cached before this step).
        k_pool / v_pool: ``[M, B, Hkv, D]`` contiguous, both fp32, bf16, int8 or float8_e4m3fn;
            each sequence's ``P + L`` keys already written at the slots its block table names.
        block_tables: ``[N, max_blocks]`` int32 contiguous, with at least
            ``ceil((P + L) / B)`` columns per sequence. The block ids a sequence reads are
            trusted (:func:`kernels.paged_sdpa.plan_attention` checks them once per step).
        sm_scale: softmax scale (e.g. ``1 / sqrt(D)``).
        window_left: keys more than this many positions left of a query are not seen; -1: none.
        out: ``[T, Hq, D]`` fp32 contiguous to write (every row is written); None = new.
        num_threads: OpenMP threads; None = ``torch.get_num_threads()``.
        k_scales / v_scales: ``[M, B, Hkv]`` fp32 contiguous scale pools (a key is
            ``float32(k_pool value) * scale``): required with int8 / float8_e4m3fn pools, None
            otherwise.

    Returns:
        ``out``, ``[T, Hq, D]`` fp32.

    Raises:
        ValueError: naming the argument, on a dtype, layout or shape the kernel does not take
            (heads: see :func:`extend_supported`), inconsistent ``qo_indptr`` / ``prefix_lens``,
            a block table too narrow for its sequence, or scale pools missing, misshapen or
            given for an unquantized pool.
    """
    if q.dtype != torch.float32 or q.dim() != 3 or not rows_packed(q):
        raise ValueError(f"q: need float32 [T, Hq, D] with contiguous [Hq, D] rows, got {q.dtype} "
                         f"{tuple(q.shape)} strides {q.stride()}")
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool, v_pool: need equal [M, B, Hkv, D] shapes, got {tuple(k_pool.shape)} "
                         f"and {tuple(v_pool.shape)}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dtype not in _POOL_DTYPES or pool.dtype != k_pool.dtype:
            raise ValueError(f"{name}: need float32, bfloat16, int8 or float8_e4m3fn, the same for both "
                             f"pools, got {pool.dtype}")
        if not pool.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    native.check_scales(k_pool, k_scales, v_scales)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, pool_dim = k_pool.shape
    if pool_dim != head_dim:
        raise ValueError(f"k_pool: head dim {pool_dim} differs from q's {head_dim}")
    if not extend_supported(num_q_heads, num_kv_heads, head_dim):
        raise ValueError(f"q: native extend takes Hq % Hkv == 0 and D % 16 == 0 up to {MAX_HEAD_DIM}, "
                         f"got Hq={num_q_heads}, Hkv={num_kv_heads}, D={head_dim}")
    for name, t in (("qo_indptr", qo_indptr), ("prefix_lens", prefix_lens)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dim() != 1:
            raise ValueError(f"{name}: need a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    num_seqs = prefix_lens.shape[0]
    if qo_indptr.shape[0] != num_seqs + 1:
        raise ValueError(f"qo_indptr: need N+1 = {num_seqs + 1} entries, got {qo_indptr.shape[0]}")
    indptr = qo_indptr.to(torch.int64).contiguous()
    prefix = prefix_lens.to(torch.int32).contiguous()
    q_lens = indptr[1:] - indptr[:-1]
    if int(indptr[0]) != 0 or int(indptr[-1]) != num_tokens or (num_seqs and int(q_lens.min()) < 1):
        raise ValueError(f"qo_indptr: must run from 0 to T = {num_tokens} with every sequence ≥ 1 row")
    if num_seqs and int(prefix.min()) < 0:
        raise ValueError("prefix_lens: must be ≥ 0")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or not block_tables.is_contiguous() \
            or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: need contiguous int32 [N={num_seqs}, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if num_seqs and int((prefix + q_lens).max()) > block_tables.shape[1] * block_size:
        raise ValueError("block_tables: fewer columns than the longest sequence's blocks")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.shape != q.shape or not out.is_contiguous():
        raise ValueError(f"out: need contiguous float32 {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    if window_left < -1:
        raise ValueError(f"window_left: must be -1 (none) or ≥ 0, got {window_left}")
    if num_seqs == 0:
        return out
    launch(kernels, q, indptr, prefix, k_pool, v_pool, block_tables, sm_scale=sm_scale,
           window_left=window_left, out=out, num_threads=num_threads, k_scales=k_scales, v_scales=v_scales)
    return out


def launch(kernels: native.NativeKernels, q: torch.Tensor, qo_indptr: torch.Tensor,
           prefix_lens: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           block_tables: torch.Tensor, *, sm_scale: float, window_left: int, out: torch.Tensor,
           num_threads: int | None = None, k_scales: torch.Tensor | None = None,
           v_scales: torch.Tensor | None = None) -> None:
    """:func:`paged_extend` without its checks, for callers that made them once per step
    (``kernels.paged_sdpa``): ``qo_indptr`` int64 and ``prefix_lens`` int32, both contiguous,
    everything else as :func:`paged_extend` requires, N ≥ 1. The pools' dtype picks the
    entry point; int8 / float8_e4m3fn pools need ``k_scales`` / ``v_scales`` (only their
    presence is checked here, not their shape).

    Raises:
        ValueError: when the kernel refuses the heads; MemoryError when it cannot allocate.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    f32, bf16, quant = _entry_points(kernels)
    args = (q.data_ptr(), _row_stride(q), qo_indptr.data_ptr(), prefix_lens.data_ptr(), prefix_lens.shape[0],
            k_pool.data_ptr(), v_pool.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            block_size, num_q_heads, num_kv_heads, head_dim, float(sm_scale), int(window_left),
            out.data_ptr(), num_threads or torch.get_num_threads())
    kind = native.KV_QUANT_DTYPES.get(k_pool.dtype, 0)
    if kind:
        if k_scales is None or v_scales is None:
            raise ValueError(f"k_scales, v_scales: {k_pool.dtype} pools need their scale pools")
        rc = quant(*args, k_scales.data_ptr(), v_scales.data_ptr(), kind)
    else:
        rc = (bf16 if k_pool.dtype == torch.bfloat16 else f32)(*args)
    if rc == 2:
        raise MemoryError("native extend: out of memory for its packed key tiles")
    if rc:
        raise ValueError(f"q: native extend refused Hq={num_q_heads}, Hkv={num_kv_heads}, D={head_dim} "
                         f"(code {rc})")

"""Shared pieces of the Triton kernels: interpreter switch, launch checks, online-softmax step.

Under ``TRITON_INTERPRET=1`` Triton runs kernels on numpy. Triton 3.9's interpreter computes
bf16 arithmetic and bf16 ``tl.dot`` wrong without raising (numpy has no bf16), so every kernel
takes a constexpr ``UPCAST`` that casts loaded tiles to fp32 before any arithmetic
(:func:`upcast_tiles`: interpreter and a bf16 operand). On a GPU the tiles stay in their storage
dtype and ``tl.dot`` accumulates in fp32; fp32 and fp16 take that same branch under the
interpreter (numpy computes them right), so CPU tests also run the GPU code path.

The interpreter's own fp32 -> bf16 conversion truncates instead of rounding (and its rounding
mode is unreliable), so under the interpreter kernels store fp32 into a staging tensor and torch
casts it (:func:`staging_output`); a GPU stores the storage dtype directly.

The interpreter flag is read by ``triton.jit`` when a kernel is *decorated*, i.e. when its
module is imported: set ``TRITON_INTERPRET=1`` before importing any kernel module.

Softmax runs in base 2 (``exp2``): scores are pre-multiplied by ``log2(e) = 1.4426950408889634``,
and every LSE a kernel stores internally is in base-2 units; public ``return_lse`` values are
natural-log (times ``ln 2 = 0.6931471805599453``). The constants are literals inside the kernels:
a plain Python global is not readable from ``@triton.jit`` code.

Quantized KV (int8, fp8_e4m3; ``kv_quant.py`` is the formula): :func:`quantize_tile` reproduces
``kv_quant.quantize_kv`` bit for bit on the GPU and under the interpreter, with no libdevice
(the interpreter has none) and no reliance on Triton's float casts (the interpreter's fp32 ->
fp8 conversion rounds ties away and drops mantissa carries):

- divisions are ``tl.math.div_rn`` (IEEE round to nearest; Triton's ``/`` on fp32 is the
  approximate ``div.full.f32`` on NVIDIA GPUs);
- int8 rounds half to even by adding and subtracting ``1.5 * 2**23`` (exact for ``|x| < 2**22``);
  the value is clamped to ``[-127, 127]`` *before* (equal to clamping after: rounding is monotone
  and the bounds are integers), so the addition never directly follows the ``x * inv`` product
  and cannot be contracted into an FMA (which would round the exact product instead);
- fp8_e4m3 rounds the fp32 bit pattern to 3 mantissa bits (ties to even) for normals
  (``|x| >= 2**-6``) and to multiples of ``2**-9`` for subnormals, giving the e4m3fn value as
  fp32 (:func:`e4m3_round`); :func:`e4m3_bits` encodes it, and pools are written through a
  uint8 view. Reading fp8 pools uses Triton's fp8 -> fp32 cast (exact, interpreter included).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


# Read once, when the kernel modules are imported: that is when triton.jit chose between the
# interpreter and the compiler for every kernel, so later changes to the variable do not apply.
_INTERPRETER_AT_IMPORT = _env_interpret()


def interpreting() -> bool:
    """True when the kernels were decorated for the Triton interpreter (``TRITON_INTERPRET=1``
    set before this package's Triton modules were imported)."""
    return _INTERPRETER_AT_IMPORT


def upcast_tiles(*dtypes: torch.dtype) -> bool:
    """The ``UPCAST`` constexpr: cast tiles to fp32 (interpreter with any bf16 operand)."""
    return interpreting() and torch.bfloat16 in dtypes


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``."""
    return 1 << max(int(n) - 1, 0).bit_length()


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """Raise ValueError unless all tensors share one device that can run Triton now.

    Args:
        name: the calling function, for the message.
        *tensors: the tensors a kernel will read or write.

    Raises:
        ValueError: tensors on different devices, or on the CPU without the interpreter.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on different devices {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type == "cpu" and not interpreting():
        raise ValueError(f"{name}: CPU tensors need TRITON_INTERPRET=1, set before the Triton "
                         "kernels are imported; use the torch reference backend on the CPU")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension has stride 1, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def staging_output(out: torch.Tensor) -> torch.Tensor:
    """Tensor the kernel should store into: ``out``, or an fp32 twin under the interpreter.

    When the returned tensor is not ``out``, the caller copies it into ``out`` after the launch
    (torch rounds to nearest even; the interpreter's own downcast would truncate).
    """
    if interpreting() and out.dtype != torch.float32:
        # A copy, not empty(): rows the kernel does not write keep out's values after copy-back.
        return out.float()
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 (``ieee``) for fp32 storage, else the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def tanh(x):
    """tanh through a sigmoid (no libdevice, so it also runs in the interpreter)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def scores_to_log2(qk, sm_scale, soft_cap, HAS_SOFT_CAP: tl.constexpr):
    """Raw ``q·k`` -> base-2 logits: ``log2(e) * cap * tanh(qk * sm_scale / cap)`` (Gemma-2 capping)."""
    if HAS_SOFT_CAP:
        return (soft_cap * 1.4426950408889634) * tanh(qk * (sm_scale / soft_cap))
    else:
        return qk * (sm_scale * 1.4426950408889634)


@triton.jit
def online_softmax_step(acc, l_i, m_i, s, v, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the running softmax state (FlashAttention-2, base 2).

    Args:
        acc: ``[BM, BD]`` fp32 un-normalised output.
        l_i: ``[BM]`` fp32 running sum of ``2^(s - m_i)``.
        m_i: ``[BM]`` fp32 running row max (``-inf`` before the first visible key).
        s: ``[BM, BN]`` fp32 base-2 logits, ``-inf`` where masked.
        v: ``[BN, BD]`` value tile (fp32 when ``UPCAST``), zero where masked.

    Returns:
        ``(acc, l_i, m_i)`` updated. A row that has seen no visible key keeps ``m_i = -inf``,
        ``l_i = 0`` and ``acc = 0`` (the max is clamped so ``-inf - -inf`` never occurs).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if UPCAST:
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


def kv_quant_params(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale_pool: torch.Tensor | None,
                    v_scale_pool: torch.Tensor | None) -> tuple[bool, bool, float]:
    """``(quantized, is_fp8, qmax)`` of a pool pair, validated against its scale pools.

    The format is inferred from the pool dtype: ``torch.int8`` -> int8 (QMAX 127),
    ``torch.float8_e4m3fn`` -> fp8_e4m3 (QMAX 448); any other dtype is unquantized and takes no
    scale pools.

    Args:
        k_pool: ``[M, B, Hkv, D]`` key pool.
        v_pool: ``[M, B, Hkv, D]`` value pool (same dtype as ``k_pool``).
        k_scale_pool: ``[M, B, Hkv]`` fp32 key scales (quantized pools only), or None.
        v_scale_pool: ``[M, B, Hkv]`` fp32 value scales, or None.

    Raises:
        ValueError: naming the field: pools of different dtypes, a quantized pool without scale
            pools, scale pools with an unquantized pool, only one of the two scale pools, or a
            scale pool of the wrong shape, dtype, device or stride.
    """
    if v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool: dtype {v_pool.dtype} differs from k_pool {k_pool.dtype}")
    quantized = k_pool.dtype in (torch.int8, torch.float8_e4m3fn)
    if (k_scale_pool is None) != (v_scale_pool is None):
        missing = "k_scale_pool" if k_scale_pool is None else "v_scale_pool"
        raise ValueError(f"{missing}: required when the other scale pool is given")
    if not quantized:
        if k_scale_pool is not None:
            raise ValueError(f"k_scale_pool: given for an unquantized {k_pool.dtype} pool "
                             "(scale pools go with int8 or float8_e4m3fn pools)")
        return False, False, 0.0
    if k_scale_pool is None or v_scale_pool is None:
        raise ValueError(f"k_scale_pool: required for a {k_pool.dtype} pool (one fp32 scale per "
                         "token slot and KV head, [M, B, Hkv])")
    for name, scales in (("k_scale_pool", k_scale_pool), ("v_scale_pool", v_scale_pool)):
        if tuple(scales.shape) != tuple(k_pool.shape[:3]):
            raise ValueError(f"{name}: shape {tuple(scales.shape)}, expected {tuple(k_pool.shape[:3])} "
                             "(the pool's [M, B, Hkv])")
        if scales.dtype != torch.float32:
            raise ValueError(f"{name}: dtype {scales.dtype}, expected torch.float32")
        if scales.device != k_pool.device:
            raise ValueError(f"{name}: on {scales.device}, the pools on {k_pool.device}")
    is_fp8 = k_pool.dtype == torch.float8_e4m3fn
    return True, is_fp8, 448.0 if is_fp8 else 127.0


@triton.jit
def round_half_even(x):
    """Round fp32 to the nearest integer, ties to even (exact for ``|x| < 2**22``).

    ``x`` must not be the direct result of a multiply (the add could be contracted into an FMA).
    """
    return (x + 12582912.0) - 12582912.0


@triton.jit
def e4m3_round(s):
    """fp32 ``s`` in ``[-448, 448]`` -> the nearest float8_e4m3fn value (ties to even), as fp32.

    The sign (of -0.0 too) is kept, as torch's cast keeps it.
    """
    bits = s.to(tl.int32, bitcast=True)
    mag_bits = bits & 0x7FFFFFFF
    a = mag_bits.to(tl.float32, bitcast=True)
    # Normals (a >= 2**-6): round the 23-bit mantissa to 3 bits, ties to even; a carry into the
    # exponent is the right result (a <= 448 cannot round past 448).
    normal = ((mag_bits + (0x7FFFF + ((mag_bits >> 20) & 1))) >> 20) << 20
    # Subnormals: multiples of 2**-9 (a * 512 is exact, so a contracted FMA rounds the same).
    sub = round_half_even(a * 512.0) * 0.001953125
    r = tl.where(mag_bits >= 0x3C800000, normal.to(tl.float32, bitcast=True), sub)
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(r):
    """A float8_e4m3fn value held in fp32 (from :func:`e4m3_round`) -> its bit pattern, int32 0..255."""
    bits = r.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag_bits = bits & 0x7FFFFFFF
    exponent = mag_bits >> 23
    normal = ((exponent - 120) << 3) | ((mag_bits >> 20) & 7)
    sub = (mag_bits.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
    return sign | tl.where(exponent >= 121, normal, sub)


@triton.jit
def quantize_tile(x, AXIS: tl.constexpr, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    """Quantize an fp32 tile per row along ``AXIS`` (the head-dim axis), as ``kv_quant.quantize_kv``.

    Args:
        x: 2-D fp32 tile; entries outside the head dim (and masked rows) must be 0.
        AXIS: the head-dim axis of ``x`` (1: rows are tokens; 0: columns are tokens).
        QMAX: 127.0 (int8) or 448.0 (fp8_e4m3).
        IS_FP8: fp8_e4m3 rounding instead of int8.

    Returns:
        ``(q, scale)``: ``q`` the quantized values as fp32 (integers for int8, e4m3fn values for
        fp8), ``scale`` fp32 per token (0 where the token's amax is 0; then q is ±0).
    """
    amax = tl.max(tl.abs(x), AXIS)
    nonzero = amax > 0.0
    qmax = tl.full(amax.shape, QMAX, tl.float32)
    scale = tl.where(nonzero, tl.math.div_rn(amax, qmax), 0.0)
    inv = tl.where(nonzero, tl.math.div_rn(qmax, tl.where(nonzero, amax, 1.0)), 0.0)
    if AXIS == 1:
        s = x * inv[:, None]
    else:
        s = x * inv[None, :]
    s = tl.minimum(tl.maximum(s, -QMAX), QMAX)
    if IS_FP8:
        q = e4m3_round(s)
    else:
        q = round_half_even(s)
    return q, scale


@triton.jit
def load_kv_tile(kp_base, vp_base, ks_base, vs_base, block, within, n_ok, offs_d, d_ok,
                 stride_kpm, stride_kpb, stride_vpm, stride_vpb,
                 stride_ksm, stride_ksb, stride_vsm, stride_vsb, QUANT: tl.constexpr):
    """Gather one key tile ``[BLOCK_D, BLOCK_N]`` (transposed) and value tile ``[BLOCK_N, BLOCK_D]``.

    Args:
        kp_base / vp_base: pool pointers already offset to the KV head.
        ks_base / vs_base: scale-pool pointers offset to the KV head (read only when ``QUANT``).
        block / within: ``[BLOCK_N]`` int64 pool block and slot of each key.
        n_ok: ``[BLOCK_N]`` which keys exist; offs_d / d_ok: the head-dim lanes.
        QUANT: the pools are int8 / fp8 with scales: return ``float32(q) * scale`` (kv_quant's
            dequantization); otherwise the tiles in the pool dtype.

    Returns:
        ``(k, v)``, zero where masked (scales are loaded masked too: unwritten slots may hold NaN).
    """
    k = tl.load(kp_base + block[None, :] * stride_kpm + within[None, :] * stride_kpb + offs_d[:, None],
                mask=d_ok[:, None] & n_ok[None, :], other=0.0)
    v = tl.load(vp_base + block[:, None] * stride_vpm + within[:, None] * stride_vpb + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if QUANT:
        ks = tl.load(ks_base + block * stride_ksm + within * stride_ksb, mask=n_ok, other=0.0)
        vs = tl.load(vs_base + block * stride_vsm + within * stride_vsb, mask=n_ok, other=0.0)
        k = k.to(tl.float32) * ks[None, :]
        v = v.to(tl.float32) * vs[:, None]
    return k, v

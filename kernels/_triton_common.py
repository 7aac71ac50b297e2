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

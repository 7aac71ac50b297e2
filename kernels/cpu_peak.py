"""The CPU's own arithmetic peak, measured: ``csrc/cpu_peak.c`` through :mod:`.native`'s builds.

A floor computed from a GEMM library's speed moves with the library; one computed from the
CPU's FMA rate does not. ``radixkv bench step`` divides a prefill's FLOPs by
:func:`fma_peak_gflops` so a slow GEMM shows as a large "measured ÷ floor" ratio.

- :func:`fma_peak_gflops`: fp32 FMA throughput of one ISA build (AVX-512: 16 lanes, AVX2: 8)
  on ``num_threads`` OpenMP threads, each running independent FMA chains with no memory
  traffic; 2 FLOPs per lane per FMA; the best of 5 timed runs.
- :func:`bf16_dot_peak_gflops`: the same for ``VDPBF16PS`` (AVX512_BF16), 2 FLOPs per bf16
  pair, None where the CPU lacks the instructions.

Both run for about ``seconds`` (plus a calibration run of >= 10 ms) and occupy every thread
they are given: on a shared machine the result is what was left to this process.
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import native

__all__ = ["fma_peak_gflops", "bf16_dot_peak_gflops", "peak_chains"]


def _check(seconds: float, num_threads: int | None) -> int:
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"seconds: must be a finite number > 0, got {seconds!r}")
    threads = torch.get_num_threads() if num_threads is None else num_threads
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"num_threads: must be an integer >= 1, got {num_threads!r}")
    return threads


def _entry(isa: str | None, name: str):
    kernels = native.load(isa)
    if kernels is None:
        return None
    fn = getattr(kernels.lib, name)
    fn.argtypes = [ctypes.c_double, ctypes.c_int]
    fn.restype = ctypes.c_double
    return fn


def fma_peak_gflops(seconds: float = 0.3, num_threads: int | None = None,
                    isa: str | None = None) -> float | None:
    """Peak fp32 FMA rate of ``isa``'s native build on ``num_threads`` threads, GFLOP/s.

    Args:
        seconds: time budget of the timed runs together (> 0).
        num_threads: OpenMP threads; None = ``torch.get_num_threads()``.
        isa: ``"avx512"``, ``"avx2"``, ``"auto"`` or None, as :func:`native.load`.

    Returns:
        GFLOP/s (``2 · lanes · chains · iterations · threads / best time``), or None where the
        build cannot run here (:func:`native.load` returned None: not x86-64, the CPU lacks
        the ISA, no compiler, ``RADIXKV_NATIVE_KERNELS=0``).

    Raises:
        ValueError: naming ``seconds``, ``num_threads`` or ``isa``.
    """
    threads = _check(seconds, num_threads)
    fn = _entry(isa, "rk_fma_peak_gflops")
    if fn is None:
        return None
    return float(fn(float(seconds), threads))


def bf16_dot_peak_gflops(seconds: float = 0.3, num_threads: int | None = None,
                         isa: str | None = None) -> float | None:
    """Peak ``VDPBF16PS`` rate (AVX512_BF16 on zmm) on ``num_threads`` threads, GFLOP/s.

    64 FLOPs per instruction (32 bf16 pairs, a multiply and an add each). Args and errors as
    :func:`fma_peak_gflops`; any ISA build carries the kernel (a function-level target).

    Returns:
        GFLOP/s, or None ("unavailable") where the CPU lacks AVX512_BF16 (nothing is
        executed), the build was made by a compiler without the AVX512_BF16 intrinsics (GCC
        before 10, Clang before 9: the library then omits this kernel), or the build cannot
        run here.
    """
    threads = _check(seconds, num_threads)
    fn = _entry(isa, "rk_bf16_dot_peak_gflops")
    if fn is None:
        return None
    value = float(fn(float(seconds), threads))
    return value if value > 0 else None


def peak_chains(isa: str | None = None) -> int | None:
    """Independent FMA chains per thread in ``isa``'s build (24 AVX-512, 12 AVX2); None as
    :func:`fma_peak_gflops`."""
    kernels = native.load(isa)
    if kernels is None:
        return None
    fn = kernels.lib.rk_fma_peak_chains
    fn.restype = ctypes.c_int
    return int(fn())

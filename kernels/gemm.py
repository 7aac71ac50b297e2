"""Prefill/extend GEMMs (oneDNN, or our C GEMM on AVX2), and the fused elementwise kernels
around them.

A prefill or extend step of a few hundred to several thousand rows is compute-bound: its
projections are ``[M, K] @ [K, N]`` GEMMs. :class:`PackedLinear` runs them through oneDNN
(``torch.ops.mkldnn._linear_pointwise``), with the weight reordered once at load into
oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``; see "Memory"), or,
for fp32 on CPUs without AVX-512, through the C GEMM of ``csrc/cpu_gemm.c`` (see "The C
GEMM"). Where
oneDNN is unavailable (``torch.backends.mkldnn`` off, a non-CPU device, or
``RADIXKV_ONEDNN_GEMM=0``) it is ``F.linear``, and ``radixkv.model.llama`` keeps the whole
prefill on its torch path. bf16 through oneDNN also needs CPU support torch checks (AVX-512
BW/VL/DQ, or AVX-NE-CONVERT: ``torch.ops.mkldnn._is_mkldnn_bf16_supported``); without it
torch raises "bf16 path needs the cpu support ...", so a bf16 :class:`PackedLinear`
there is ``F.linear`` (:func:`onednn_bf16_supported`, ``fallback_reason``).

Measurements (torch 2.13 CPU build, AMD EPYC Zen 4, 2 threads, AVX-512 + avx512_bf16, no AMX;
best of 3-30 calls after two warm-ups, one process; GFLOP/s as ``F.linear`` / oneDNN with the
plain weight / oneDNN with the packed weight; the fp32 FMA peak here is ~225 GFLOP/s, so 200
is 89 %). fp32 ``F.linear`` is MKL sgemm. ``torch.ops.mkl._mkl_linear`` with an MKL-packed
weight ran at 104-182, at or below ``F.linear``, and is not used. The VM was shared, so single
cells are noisy (a few 8192-row cells ran at half speed in one pass and are left out)::

    fp32   (K, N)        M=64          M=256         M=2048        M=8192
    q/k/v  (576, 960)    141/141/204   153/206/211   136/177/209   174/201/209
    gate   (576, 3072)   149/197/210   162/198/208   164/204/210   152/162/178
    down   (1536, 576)   172/186/218   164/190/214   186/199/215   -
    o      (576, 576)    162/164/183   177/199/208   180/200/203   181/206/204

    bf16   (K, N)        M=64          M=256         M=2048        M=8192
    q/k/v  (576, 960)    316/323/394   376/384/430   393/402/409   404/384/393
    gate   (576, 3072)   320/313/368   320/366/402   392/354/411   -
    down   (1536, 576)   351/349/414   402/422/443   -             -/238/419
    o      (576, 576)    280/284/364   371/376/402   389/388/400   384/375/413

Packed and plain oneDNN give bit-identical results, and a weight packed with one batch-size
hint serves any M (the hint only picks the blocking; 64-row and 2048-row hints measured the
same). So both dtypes take oneDNN on the packed weight: fp32 +5-35 % over MKL on the plain
weight and another ~5 % packed on Zen 4; on a Zen 5 EPYC (2 threads, FMA peak ~495 GFLOP/s)
packing took the model's 2,048-row prefill GEMMs from 86-89 % to 94-95 % of the peak and a
2,048-token SmolLM2 prefill from 1.56-1.59 s to 1.45-1.47 s (``bench step``, alternating runs);
bf16 +5-25 % over ``F.linear``, most at small M.

Few rows (decode steps, bf16): packed oneDNN also beats ``F.linear`` at M = 1-32, e.g. 32 vs
58 us at (576, 960) and M = 1, and 2.0 vs 8.0 ms for SmolLM2's (576, 49152) lm_head.

Memory: a packed weight is an opaque oneDNN tensor, a copy of the weight. fp32 needs the
plain one too (the C decode kernels read it), so packing adds +4 N K bytes per projection,
+425 MB for SmolLM2-135M (against a 4 GiB KV pool by default), for 5-9 % on the GEMMs. bf16
packs (+2 N K bytes per projection, 212 MB for SmolLM2-135M, for 5-25 %): ``radixkv.model.llama``
runs every bf16 projection through the packed copy except the few-row ones the C kernels take
where they are on (they read the plain weights, which then stay). Where the C kernels are off,
nothing reads the plain layer weights and the packed copies replace them
(``keep_plain=False``); the lm_head then packs as an extra copy for the few-row logits (the
embedding lookup of a tied head needs the plain table: +2 V H bytes, 56 MB for SmolLM2-135M).

The C GEMM (``csrc/cpu_gemm.c``, :data:`NATIVE_GEMM_ENV`): on AVX2-only CPUs torch's fp32
GEMMs top out near 80 % of the FMA peak (Zen 3 EPYC, 2 threads, SmolLM2's four prefill shapes
at 2,048 rows: oneDNN packed 146-155 GFLOP/s, ``F.linear`` about the same, FMA peak ~186-198);
a BLIS-style blocked GEMM with the weight packed once into 16-column panels and a 6 x 16
register tile measured 164-177 in the same runs (best of 18 calls per shape, interleaved).
``auto`` (the default) takes it for fp32 where the CPU lacks AVX-512; on AVX-512 CPUs oneDNN
already reaches 91-95 % of the peak (Zen 4/5) and stays, whichever native build is forced.
Its packed copy replaces oneDNN's (N rounded up to the panel width: the same bytes for the
model's shapes). Results agree with ``F.linear`` to fp32 rounding (another summation order),
not bit for bit.

Elementwise kernels (``csrc/cpu_prefill.c``, one row-parallel pass each, fp32 or bf16 in and
out, fp32 maths): :func:`add_rms_norm` (optional residual add fused with RMSNorm),
:func:`rope_inplace` (half-split RoPE on the q and k heads of the fused q/k/v output, in
place) and :func:`silu_mul` (SwiGLU from the fused gate/up output). They bind through
``native.load().lib`` (:func:`prefill_kernels`).

This module imports only torch and its sibling :mod:`.native`.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

from . import native

__all__ = ["PackedLinear", "gemm_backend", "gflops", "onednn_available", "onednn_bf16_supported",
           "native_gemm", "NativeGemm", "NATIVE_GEMM_ENV",
           "BF16_UNSUPPORTED", "PrefillKernels",
           "prefill_kernels", "add_rms_norm", "rope_inplace", "silu_mul", "BF16_DOT_FLAGS",
           "bf16_dot_flags", "cpu_bf16_native", "DISABLE_ENV"]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
# The batch-size hint for the bf16 reorder: the blocking it picks served every M measured.
_PACK_HINT_ROWS = 2048


#: Set to ``0`` to keep prefill on ``F.linear`` and torch elementwise ops (A/B runs).
DISABLE_ENV = "RADIXKV_ONEDNN_GEMM"
#: ``auto`` (default), ``1`` or ``0``: fp32 :class:`PackedLinear` on the C GEMM
#: (``csrc/cpu_gemm.c``) where the CPU lacks AVX-512 (``auto``), wherever the native kernels
#: load (``1``, e.g. to measure the AVX-512 build), or never (``0``: oneDNN).
NATIVE_GEMM_ENV = "RADIXKV_NATIVE_GEMM"
#: /proc/cpuinfo flags of native bf16 dot products (AVX512-BF16's vdpbf16ps, AMX tiles); with
#: neither, oneDNN emulates bf16 GEMMs in fp32 and bf16 buys no prefill speed.
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")
_cpu_bf16: list[bool] = []


def bf16_dot_flags(cpuinfo: str) -> tuple[str, ...]:
    """The :data:`BF16_DOT_FLAGS` present in the ``flags`` lines of a ``/proc/cpuinfo`` text
    (pure: tests pass fake text)."""
    present: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            present.update(value.split())
    return tuple(flag for flag in BF16_DOT_FLAGS if flag in present)


def cpu_bf16_native() -> bool:
    """Whether this CPU has native bf16 dot products (:func:`bf16_dot_flags` of
    ``/proc/cpuinfo``; False where it cannot be read). Read once per process."""
    if not _cpu_bf16:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        _cpu_bf16.append(bool(bf16_dot_flags(text)))
    return _cpu_bf16[0]


def onednn_available(device: torch.device | str = "cpu") -> bool:
    """Whether oneDNN linear runs here: a CPU device, torch built with mkldnn, and not turned
    off by ``RADIXKV_ONEDNN_GEMM=0`` (:data:`DISABLE_ENV`, read at each call)."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


#: Why bf16 stays on ``F.linear`` where oneDNN runs but not its bf16 path (logs, ``bench step``).
BF16_UNSUPPORTED = ("oneDNN bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks "
                    "(torch.ops.mkldnn._is_mkldnn_bf16_supported() is False)")


def onednn_bf16_supported() -> bool:
    """Whether torch's oneDNN runs bf16 linear on this CPU (``_is_mkldnn_bf16_supported``;
    False where torch lacks the check). Where it is False, the bf16 reorder and linear raise
    ``RuntimeError: bf16 path needs the cpu support ...``."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is None:
        return False
    try:
        return bool(check())
    except RuntimeError:
        return False


class NativeGemm:
    """Typed entry points of ``csrc/cpu_gemm.c`` in one loaded native build.

    Attributes:
        isa: the build's ISA (``"avx2"`` or ``"avx512"``).
        panel_columns: output columns per packed panel (16 on AVX2, 32 on AVX-512).
    """

    def __init__(self, lib: Any, isa: str) -> None:
        self.isa = isa
        self.pack = lib.rk_gemm_pack_weight
        self.pack.argtypes = [_P, _I64, _I64, _I64, _P]
        self.pack.restype = ctypes.c_int
        self.packed_floats = lib.rk_gemm_packed_floats
        self.packed_floats.argtypes = [_I64, _I64]
        self.packed_floats.restype = _I64
        self.run = lib.rk_gemm_f32
        self.run.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, ctypes.c_int]
        self.run.restype = ctypes.c_int
        nr = lib.rk_gemm_nr
        nr.restype = ctypes.c_int
        self.panel_columns = int(nr())


_native_gemms: dict[str, NativeGemm] = {}


def native_gemm(dtype: torch.dtype = torch.float32) -> NativeGemm | None:
    """The C GEMM :class:`PackedLinear` uses for ``dtype`` here, or None (oneDNN or
    ``F.linear`` then): fp32 only, where the native kernels load (``native.load()``), and per
    :data:`NATIVE_GEMM_ENV` (read at each call): ``auto`` where the CPU lacks AVX-512 (the
    build is then ``avx2``), ``1`` for any build, ``0`` never.

    Raises:
        ValueError: naming ``RADIXKV_NATIVE_GEMM`` on a value other than auto, 1 or 0.
    """
    mode = os.environ.get(NATIVE_GEMM_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "1", "0"):
        raise ValueError(f"{NATIVE_GEMM_ENV}: auto, 1 or 0, got {mode!r}")
    if mode == "0" or dtype != torch.float32:
        return None
    kernels = native.load()
    # auto: where the CPU has no AVX-512 (oneDNN's fp32 GEMM is then AVX2 too, ~80 % of the
    # peak), not where the AVX2 build merely was forced (RADIXKV_NATIVE_ISA=avx2) on a CPU
    # whose oneDNN runs AVX-512
    if kernels is None or (mode == "auto" and (kernels.isa != "avx2" or "avx512" in native.cpu_isas())):
        return None
    bound = _native_gemms.get(kernels.isa)
    if bound is None:
        try:
            bound = NativeGemm(kernels.lib, kernels.isa)
        except AttributeError:  # a build without cpu_gemm.c
            return None
        _native_gemms[kernels.isa] = bound
    return bound


def gemm_backend(dtype: torch.dtype | None = None, *, c_gemm_allowed: bool = True) -> str:
    """What :class:`PackedLinear` (with the same ``c_gemm_allowed``) uses on a CPU here, for
    logs and ``bench step``: ``"native avx2 (packed weights)"`` (:func:`native_gemm`),
    ``"onednn (packed weights)"``, ``"torch F.linear"``, or for ``dtype=torch.bfloat16`` where
    oneDNN lacks bf16 support, ``"torch F.linear (<reason>)"`` (:data:`BF16_UNSUPPORTED`)."""
    if not onednn_available("cpu"):
        return "torch F.linear"
    if dtype == torch.bfloat16 and not onednn_bf16_supported():
        return f"torch F.linear ({BF16_UNSUPPORTED})"
    c_gemm = native_gemm(dtype or torch.float32) if c_gemm_allowed else None
    if c_gemm is not None:
        return f"native {c_gemm.isa} (packed weights)"
    return "onednn (packed weights)"


def _reorder(weight: torch.Tensor, rows: int) -> torch.Tensor:
    # One indirection, so tests can make the reorder fail as it does on a CPU torch refuses.
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


class PackedLinear:
    """``y = x @ weight.T (+ bias)`` for many rows, weight prepared once (see the module doc).

    Args:
        weight: ``[N, K]`` fp32 or bf16 (kept by reference; made contiguous if it is not).
        bias: ``[N]`` of the weight's dtype, or None.
        pack: reorder the weight into oneDNN's layout, or for fp32 where :func:`native_gemm`
            is on, into the C GEMM's panels (a second copy, ``N K`` elements, N rounded up to
            the panel width for the C GEMM); None = the measured default (pack, both dtypes).
            Unpacked fp32 stays on oneDNN.
        keep_plain: keep a reference to the plain weight once packed (False lets the caller
            free it; ``weight`` is then None).
        c_gemm_allowed: False keeps fp32 on oneDNN (a model whose C kernels are off).

    Attributes:
        backend: ``"native"`` (the C GEMM), ``"onednn"`` or ``"torch"`` (``F.linear``).
        onednn: whether calls go through oneDNN.
        fallback_reason: why a bf16 weight is on ``F.linear`` although oneDNN runs here (this
            CPU lacks oneDNN's bf16 support, or the reorder raised), else None.

    Raises:
        ValueError: naming ``weight`` or ``bias`` on a wrong rank, dtype or shape.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 pack: bool | None = None, keep_plain: bool = True, c_gemm_allowed: bool = True) -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight: need [N, K], got shape {tuple(weight.shape)}")
        if weight.dtype not in _DTYPE_CODE:
            raise ValueError(f"weight: float32 or bfloat16, got {weight.dtype}")
        if bias is not None and (bias.dtype != weight.dtype or tuple(bias.shape) != (weight.shape[0],)):
            raise ValueError(f"bias: need {weight.dtype} [{weight.shape[0]}], got {bias.dtype} "
                             f"{tuple(bias.shape)}")
        plain = weight.contiguous()
        self.weight: torch.Tensor | None = plain
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.onednn = onednn_available(weight.device)
        self.fallback_reason: str | None = None
        if self.onednn and weight.dtype == torch.bfloat16 and not onednn_bf16_supported():
            self.onednn, self.fallback_reason = False, BF16_UNSUPPORTED
        if pack is None:
            pack = True
        self.packed: torch.Tensor | None = None
        self._native = native_gemm(weight.dtype) if self.onednn and pack and c_gemm_allowed else None
        if self._native is not None:
            self.onednn = False
            self.packed = torch.empty(int(self._native.packed_floats(*plain.shape)), dtype=torch.float32)
            if self._native.pack(plain.data_ptr(), *plain.shape, plain.stride(0), self.packed.data_ptr()):
                raise ValueError(f"weight: the C GEMM cannot pack shape {tuple(plain.shape)}")
            if bias is not None:
                self.bias = bias.contiguous()
            if not keep_plain:
                self.weight = None
        elif self.onednn and pack:
            try:
                self.packed = _reorder(plain, _PACK_HINT_ROWS)
            except RuntimeError as exc:  # a CPU torch's support check let through
                if weight.dtype != torch.bfloat16:
                    raise
                self.onednn, self.fallback_reason = False, f"oneDNN bf16 reorder failed: {exc}"
            if self.packed is not None and not keep_plain:
                self.weight = None
        self.backend = "native" if self._native is not None else "onednn" if self.onednn else "torch"
        self.packed_bytes = 0 if self.packed is None else (
            self.packed.numel() * self.packed.element_size() if self._native is not None
            else plain.numel() * plain.element_size())
        """Bytes of the packed copy (0 when unpacked)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` of the weight's dtype -> ``[M, N]`` (torch raises on a mismatch;
        the C GEMM checks the dtype and K and raises ValueError naming ``x``)."""
        if self._native is not None:
            return self._native_call(x)
        w = self.packed if self.packed is not None else self.weight
        assert w is not None  # the plain weight is dropped only once packed
        if not self.onednn:
            return F.linear(x, w, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")

    def _native_call(self, x: torch.Tensor) -> torch.Tensor:
        assert self._native is not None and self.packed is not None
        if (x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features
                or x.device.type != "cpu"):
            raise ValueError(f"x: need a CPU float32 [M, {self.in_features}], got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        if x.stride(1) != 1 or x.stride(0) < self.in_features:
            x = x.contiguous()
        rows = x.shape[0]
        # One row: torch calls any stride of a size-1 dim contiguous, so the row stride is moot.
        lda = self.in_features if rows == 1 else x.stride(0)
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        if rows:
            rc = self._native.run(x.data_ptr(), rows, self.in_features, lda, self.packed.data_ptr(),
                                  self.out_features, None if self.bias is None else self.bias.data_ptr(),
                                  out.data_ptr(), self.out_features, torch.get_num_threads())
            if rc == -2:
                raise MemoryError(f"C GEMM of {tuple(x.shape)} x {self.in_features}->{self.out_features}: "
                                  "a thread's buffer could not be allocated")
            if rc:
                raise ValueError(f"x: the C GEMM refused {tuple(x.shape)} with strides {x.stride()} "
                                 f"(code {rc})")
        return out


def gflops(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """GFLOP/s (``2 m k n`` per call / best wall time of ``repeats`` calls after two warm-ups)
    of the engine's own prefill GEMM (:class:`PackedLinear`) on random data: ``F.linear``
    where the PackedLinear falls back (bf16 without oneDNN bf16 support; ``gemm_backend(dtype)``
    names it).

    Raises:
        ValueError: naming the argument on a non-positive size or repeats, or another dtype.
    """
    for name, value in (("m", m), ("k", k), ("n", n), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive int, got {value!r}")
    if dtype not in _DTYPE_CODE:
        raise ValueError(f"dtype: float32 or bfloat16, got {dtype}")
    gen = torch.Generator().manual_seed(0)
    lin = PackedLinear((torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype))
    x = torch.randn(m, k, generator=gen).to(dtype)
    lin(x)
    lin(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        lin(x)
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best / 1e9


class PrefillKernels:
    """Typed entry points of ``csrc/cpu_prefill.c`` in a loaded library (see
    :func:`prefill_kernels`)."""

    def __init__(self, lib: Any) -> None:
        self.norm = lib.rk_add_rms_norm
        self.norm.argtypes = [_P, _P, _P, _P, _I64, _I64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        self.norm.restype = ctypes.c_int
        self.rope = lib.rk_rope_inplace
        self.rope.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int, ctypes.c_int]
        self.rope.restype = ctypes.c_int
        self.silu = lib.rk_silu_mul
        self.silu.argtypes = [_P, _P, _I64, _I64, ctypes.c_int, ctypes.c_int]
        self.silu.restype = ctypes.c_int


def prefill_kernels(native_kernels: Any) -> PrefillKernels | None:
    """The elementwise kernels from a loaded native library (``native.load()``), or None where
    it is None or lacks them (a build without ``cpu_prefill.c``)."""
    lib = getattr(native_kernels, "lib", None)
    if lib is None:
        return None
    try:
        return PrefillKernels(lib)
    except AttributeError:
        return None


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, dims: int) -> None:
    if t.dtype != dtype or t.dim() != dims or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: need a contiguous {dims}-d CPU {dtype} tensor, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def _code(t: torch.Tensor) -> int:
    if t.dtype not in _DTYPE_CODE:
        raise ValueError(f"x: float32 or bfloat16, got {t.dtype}")
    return _DTYPE_CODE[t.dtype]


def add_rms_norm(kernels: PrefillKernels, hidden: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, *, num_threads: int | None = None) -> torch.Tensor:
    """RMSNorm of each row, after ``hidden += residual`` (in place) when ``residual`` is given.

    ``out = weight * (h / sqrt(mean(h^2) + eps))`` with the sum of squares in fp32 and the
    normalised row rounded to the dtype before the weight multiply (as the torch reference);
    Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019.

    Args:
        hidden: ``[T, H]`` fp32 or bf16, contiguous (updated in place when ``residual``).
        weight: ``[H]`` same dtype; residual ``[T, H]`` same dtype, contiguous, or None.
        eps: added to the mean square.

    Returns:
        ``[T, H]`` new tensor of the dtype.

    Raises:
        ValueError: naming the argument on a dtype, shape or layout mismatch.
    """
    code = _code(hidden)
    _check("hidden", hidden, hidden.dtype, 2)
    _check("weight", weight, hidden.dtype, 1)
    if weight.shape[0] != hidden.shape[1]:
        raise ValueError(f"weight: need [{hidden.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None:
        _check("residual", residual, hidden.dtype, 2)
        if residual.shape != hidden.shape:
            raise ValueError(f"residual: shape {tuple(residual.shape)} != hidden {tuple(hidden.shape)}")
    out = torch.empty_like(hidden)
    rows, size = hidden.shape
    rc = kernels.norm(hidden.data_ptr(), residual.data_ptr() if residual is not None else None,
                      weight.data_ptr(), out.data_ptr(), rows, size, float(eps), code,
                      num_threads or torch.get_num_threads())
    if rc:
        raise ValueError(f"hidden: rms norm refused shape {tuple(hidden.shape)} (code {rc})")
    return out


def rope_inplace(kernels: PrefillKernels, qkv: torch.Tensor, heads: int, head_dim: int,
                 positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 num_threads: int | None = None) -> None:
    """Half-split RoPE (Hugging Face layout: pair i is ``(x[i], x[i + D/2])``) applied in place
    to the first ``heads`` heads of every row of ``qkv`` (the q heads then the k heads of the
    fused projection output): ``x * cos + rotate_half(x) * sin``, in fp32.

    Args:
        qkv: ``[T, W]`` fp32 or bf16 contiguous, ``W >= heads * head_dim``.
        positions: ``[T]`` int64 contiguous, rows of the tables (trusted: checked where they
            enter the engine).
        cos / sin: ``[max_pos, head_dim]`` fp32 contiguous tables.

    Raises:
        ValueError: naming the argument on a dtype, shape or layout mismatch.
    """
    code = _code(qkv)
    _check("qkv", qkv, qkv.dtype, 2)
    _check("positions", positions, torch.int64, 1)
    _check("cos", cos, torch.float32, 2)
    _check("sin", sin, torch.float32, 2)
    if positions.shape[0] != qkv.shape[0]:
        raise ValueError(f"positions: need [{qkv.shape[0]}], got {tuple(positions.shape)}")
    if cos.shape != sin.shape or cos.shape[1] != head_dim:
        raise ValueError(f"cos, sin: need [max_pos, {head_dim}], got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if heads * head_dim > qkv.shape[1] or head_dim % 2:
        raise ValueError(f"heads, head_dim: {heads} x {head_dim} does not fit rows of {qkv.shape[1]}")
    rc = kernels.rope(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], heads, head_dim, positions.data_ptr(),
                      cos.data_ptr(), sin.data_ptr(), code, num_threads or torch.get_num_threads())
    if rc:
        raise ValueError(f"qkv: rope refused shape {tuple(qkv.shape)} (code {rc})")


def silu_mul(kernels: PrefillKernels, gate_up: torch.Tensor, *,
             num_threads: int | None = None) -> torch.Tensor:
    """SwiGLU activation ``silu(gate) * up`` from the fused ``[T, 2 I]`` gate/up output
    (gate first), fp32 maths; Shazeer, "GLU Variants Improve Transformer", 2020.

    Args:
        gate_up: ``[T, 2 I]`` fp32 or bf16 contiguous.

    Returns:
        ``[T, I]`` of the dtype.

    Raises:
        ValueError: naming ``gate_up`` on a dtype, shape or layout mismatch.
    """
    code = _code(gate_up)
    _check("gate_up", gate_up, gate_up.dtype, 2)
    if gate_up.shape[1] % 2 or gate_up.shape[1] == 0:
        raise ValueError(f"gate_up: need an even, non-zero width, got {tuple(gate_up.shape)}")
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    rc = kernels.silu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, code,
                      num_threads or torch.get_num_threads())
    if rc:
        raise ValueError(f"gate_up: silu_mul refused shape {tuple(gate_up.shape)} (code {rc})")
    return out

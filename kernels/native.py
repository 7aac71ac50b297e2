"""C kernels (``csrc/*.c``), built per instruction set with the system C compiler at first use.

Every ``kernels/csrc/*.c`` file is compiled, in sorted order with ``-I kernels/csrc``, into one
shared library per ISA from the same source (``csrc/rk_vec.h`` gives each build its vector
width: 16 fp32 lanes for ``avx512``, 8 for ``avx2``):

- ``avx512``: ``-O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c``
- ``avx2``: ``-O3 -mavx2 -mfma -mf16c``

(both with ``-fopenmp -shared -fPIC -std=c11``). :func:`load` picks the build: the ``isa``
argument, else ``RADIXKV_NATIVE_ISA`` (``auto``, ``avx512`` or ``avx2``; default ``auto``);
``auto`` takes the first of :func:`cpu_isas` (AVX-512 where the CPU has F, BW, VL and DQ) whose
build succeeds: where the AVX-512 build fails (an old compiler or assembler), ``auto`` falls back
to the AVX2 build (logged once). An ISA named explicitly gets that build or None.

The decode kernels this module wraps (``csrc/cpu_decode.c``), for the memory-bound part of a CPU
decode step, each with fp32 or bf16 weights and KV pool (bf16 read as bf16, half the bytes, and
widened to fp32 in registers: activations and arithmetic stay fp32):

- :func:`linear`: ``y = x @ w.T (+ b)`` for a few rows (``x`` of at most
  :data:`MAX_LINEAR_ROWS` rows): each weight row is read once per step and reused from L1 by
  every row of the batch. MKL's small-M sgemm in torch's CPU build ran at about a third of the
  copy bandwidth here (AMD EPYC), so a batch-1 decode spent ~75 ms on 538 MB of weights.
- :func:`paged_decode`: attention of one query row per sequence over its keys in the paged
  pool, read in place through the block table (no gather), split into chunks of keys that run
  in parallel and are merged (flash-decoding).
- :func:`decode_layer`: a whole decoder layer of a decode step in one call.
- :func:`paged_kv_write`: K/V rows quantized into their pool slots (kernels/kv_quant.py).

Quantized KV (:data:`KV_QUANT_FORMATS`, ``kernels/kv_quant.py``): :func:`paged_decode`,
:func:`decode_layer` and ``native_attention.paged_extend`` also take int8 and float8_e4m3fn
pools with their ``[M, B, Hkv]`` fp32 scale pools (``k_scales=``, ``v_scales=``). Decode reads
the stored bytes (a quarter of fp32's) and widens them in registers, with each key's scale
folded into its score and each value's into its softmax weight; the extend kernel dequantizes
keys and values once as it packs its tiles; the decode layer quantizes the new tokens' K/V
(the same fp32 operations as ``kv_quant.quantize_kv``, so the bytes and scales agree bit for
bit) before attending over them.

Other modules bind their own entry points on :attr:`NativeKernels.lib` (the ctypes library).

Build: into ``$RADIXKV_CACHE_DIR/native`` (default ``~/.cache/radixkv/native``), named by the
ISA and the SHA-256 of every ``csrc`` source and header and the flags, written to a temporary
name and renamed (concurrent processes may race harmlessly). :func:`load` returns None, once
logged, when the kernels cannot run here: not x86-64, the CPU lacks the ISA's features (named in
the log), no compiler, a failed build, or ``RADIXKV_NATIVE_KERNELS=0``; callers then stay on
torch.

Modules in this package import only torch (see ``__init__``): logging is the stdlib's.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = ["load", "linear", "paged_decode", "decode_layer", "DecodeStep", "decode_supported",
           "paged_kv_write", "check_scales", "NativeKernels", "DTYPES", "KV_QUANT_FORMATS", "KV_QUANT_DTYPES",
           "MAX_LINEAR_ROWS", "DISABLE_ENV", "ISA_ENV", "ISAS", "cpu_isas"]

log = logging.getLogger(__name__)

#: Set to ``0`` to keep every step on torch (A/B runs, or a machine where the build misbehaves).
DISABLE_ENV = "RADIXKV_NATIVE_KERNELS"
#: ``auto`` (default), ``avx512`` or ``avx2``: which build :func:`load` returns.
ISA_ENV = "RADIXKV_NATIVE_ISA"
#: The builds, best first.
ISAS = ("avx512", "avx2")
#: Rows up to which :func:`linear` beats MKL here (decode batches); larger GEMMs stay on torch.
MAX_LINEAR_ROWS = 32
_CSRC = Path(__file__).with_name("csrc")
_COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
}
#: /proc/cpuinfo flags each build's code needs (-mavx512f implies AVX2 code generation).
_CPU_FLAGS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
}
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
#: Weight / KV dtypes of the decode kernels and their entry points' suffixes.
_DTYPES = ((torch.float32, "f32"), (torch.bfloat16, "bf16"))
#: The weight / KV dtypes :func:`linear`, :func:`paged_decode` and :func:`decode_layer` take.
DTYPES = tuple(dtype for dtype, _ in _DTYPES)
#: Quantized KV formats (``kernels/kv_quant.py`` names) the decode and extend kernels read, with
#: one fp32 scale per (token, KV head) in ``[M, B, Hkv]`` scale pools.
KV_QUANT_FORMATS = ("int8", "fp8_e4m3")
#: Their pool dtypes and the C kernels' kind codes (``csrc/rk_vec.h``: RK_KV_I8, RK_KV_FP8).
KV_QUANT_DTYPES = {torch.int8: 2, torch.float8_e4m3fn: 3}


def _bind(lib: ctypes.CDLL, name: str, argtypes: list) -> Any:
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


class NativeKernels:
    """The loaded library of one ISA's build with typed entry points (see :func:`load`).

    Attributes:
        isa: ``"avx512"`` or ``"avx2"``, as the library's ``rk_isa()`` reports it.
        lib: the ``ctypes.CDLL``, for other modules to bind their own ``rk_*`` entry points.
        path: the shared library's file.
    """

    def __init__(self, lib: ctypes.CDLL, path: Path, isa: str) -> None:
        self.path = path
        self.lib = lib
        self.isa = isa
        linear_args = [_P, _I64, _I64, _P, _I64, _P, _P, ctypes.c_int]
        decode_args = [_P, _P, _I64, _P, _P, _P, _I64, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_float, _I64, _I64, _P, ctypes.c_int]
        layer_args = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, ctypes.c_float, _P, _P, _P, _P,
                      _P, _P, _I64, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_float, _I64, _I64, ctypes.c_int]
        # one entry point per weight / pool dtype: fp32, or bf16 widened to fp32 in registers
        self._linear = {dt: _bind(lib, f"rk_linear_{suffix}", linear_args) for dt, suffix in _DTYPES}
        self._decode = {dt: _bind(lib, f"rk_paged_decode_{suffix}", decode_args) for dt, suffix in _DTYPES}
        self._layer = {dt: _bind(lib, f"rk_decode_layer_{suffix}", layer_args) for dt, suffix in _DTYPES}
        # quantized pools: one entry point each, the pool kind (and the weights' dtype) an argument
        self._decode_q = _bind(lib, "rk_paged_decode_q", [
            _P, _P, _I64, _P, _P, _P, _P, _P, _I64, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_float, _I64, _I64, _P, ctypes.c_int, ctypes.c_int])
        self._layer_q = _bind(lib, "rk_decode_layer_q", [*layer_args, ctypes.c_int, _P, _P, ctypes.c_int])
        self._kv_write_q = _bind(lib, "rk_paged_kv_write_q", [
            _P, _P, ctypes.c_int, _P, _I64, ctypes.c_int, ctypes.c_int, _P, _P, _P, _P, ctypes.c_int,
            ctypes.c_int])

        self._take_attention_s = lib.rk_take_attention_seconds
        self._take_attention_s.argtypes = []
        self._take_attention_s.restype = ctypes.c_double

    def take_attention_seconds(self) -> float:
        """Wall seconds :func:`decode_layer` calls spent in their paged attention since the
        last call (then reset to 0): the fused layer has no boundary a caller could time.
        One caller thread at a time (the engine thread)."""
        return float(self._take_attention_s())

    def __repr__(self) -> str:
        return f"NativeKernels(isa={self.isa!r}, path={str(self.path)!r})"


_lock = threading.Lock()
_state: dict[str, NativeKernels | None] = {}
_logged: set[str] = set()
_probe_lock = threading.Lock()
_probe: dict[str, NativeKernels | None] = {}  # the AVX2 build loaded only for its cpuid probes


def _cache_dir() -> Path:
    root = os.environ.get("RADIXKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixkv")
    return Path(root) / "native"


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux: the kernel drops AVX-512 there when
    the OS does not save its registers); None where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def _missing_features(isa: str) -> list[str]:
    """CPU features ``isa``'s build needs that this CPU lacks (all of them off x86-64)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["x86-64"]
    flags = _cpu_flags()
    if flags is None:  # no /proc/cpuinfo: trust the AVX2 build's cpuid probes
        return _missing_by_probe(isa)
    return [f for f in _CPU_FLAGS[isa] if f not in flags]


def _missing_by_probe(isa: str) -> list[str]:
    with _probe_lock:
        if "avx2" not in _probe:
            _probe["avx2"] = _build("avx2", check_cpu=False)
    lib = _probe["avx2"]
    if lib is None:
        return list(_CPU_FLAGS[isa])
    probe = lib.lib.rk_cpu_has_avx512 if isa == "avx512" else lib.lib.rk_cpu_supported
    probe.restype = ctypes.c_int
    return [] if probe() else list(_CPU_FLAGS[isa])


def cpu_isas() -> list[str]:
    """The builds this CPU can run, best first (``["avx512", "avx2"]``, ``["avx2"]`` or ``[]``)."""
    return [isa for isa in ISAS if not _missing_features(isa)]


def _requested_isa(isa: str | None) -> list[str]:
    """The builds to try, in order: the named one, or for ``auto`` every one this CPU runs."""
    if isa is None:
        value = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
        if value not in ("auto", *ISAS):
            raise ValueError(f"{ISA_ENV}: must be auto, avx512 or avx2, got {value!r}")
    else:
        value = isa
        if value not in ("auto", *ISAS):
            raise ValueError(f"isa: must be None, 'auto', 'avx512' or 'avx2', got {isa!r}")
    if value == "auto":
        return cpu_isas() or ["avx2"]
    return [value]


def _log_once(key: str, level: int, msg: str, *args: object) -> None:
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


def _build(isa: str, *, check_cpu: bool = True) -> NativeKernels | None:
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        _log_once("off", logging.INFO, "native kernels off (%s=0)", DISABLE_ENV)
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _log_once("arch", logging.INFO, "native kernels need x86-64 (AVX2); staying on torch")
        return None
    if check_cpu:
        missing = _missing_features(isa)
        if missing:
            _log_once(f"cpu-{isa}", logging.INFO,
                      "native kernels: this CPU lacks %s for the %s build; staying on torch",
                      ", ".join(missing), isa)
            return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _log_once("cc", logging.WARNING, "native kernels: no C compiler found; staying on torch")
        return None
    flags = (*_COMMON_FLAGS, *_ISA_FLAGS[isa])
    try:
        sources = sorted(_CSRC.glob("*.c"))
        digest = hashlib.sha256()
        for src in sorted([*sources, *_CSRC.glob("*.h")]):
            digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
        digest.update(" ".join(flags).encode())
        path = _cache_dir() / f"radixkv-{isa}-{digest.hexdigest()[:16]}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
            try:
                subprocess.run([compiler, *flags, "-I", str(_CSRC), "-o", tmp, *map(str, sources), "-lm"],
                               check=True, capture_output=True, timeout=300)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        # torch is imported (this module imports it): libgomp.so.1 resolves to torch's runtime.
        # Loading an AVX-512 build on a CPU without it is harmless; only calling into it is not.
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:  # no source, unwritable cache, cc error
        detail = getattr(exc, "stderr", b"") or b""
        _log_once(f"build-{isa}", logging.WARNING,
                  "native kernels: %s build or load failed (%s %s); staying on torch", isa, exc,
                  detail.decode(errors="replace")[-2000:])
        return None
    lib.rk_isa.restype = ctypes.c_char_p
    built = lib.rk_isa().decode()
    if built != isa:
        _log_once(f"isa-{isa}", logging.WARNING,
                  "native kernels: %s reports ISA %s, not %s; staying on torch", path, built, isa)
        return None
    if check_cpu:
        _log_once(f"ok-{isa}", logging.INFO, "native kernels: %s build (%s)", isa, path)
    return NativeKernels(lib, path, isa)


def load(isa: str | None = None) -> NativeKernels | None:
    """The kernels of one ISA's build, built and loaded once per process per ISA.

    Args:
        isa: ``"avx512"``, ``"avx2"`` or ``"auto"`` (the best of :func:`cpu_isas` that builds:
            a failed AVX-512 build falls back to AVX2, logged once); None = the
            ``RADIXKV_NATIVE_ISA`` environment variable (default ``auto``).

    Returns:
        The kernels, or None where they cannot run (logged once, naming the CPU features an
        ISA needs and this CPU lacks, or the build's error).

    Raises:
        ValueError: naming ``isa`` or ``RADIXKV_NATIVE_ISA`` on a value other than the above.
    """
    candidates = _requested_isa(isa)
    with _lock:
        for i, chosen in enumerate(candidates):
            if chosen not in _state:
                _state[chosen] = _build(chosen)
            kernels = _state[chosen]
            if kernels is not None:
                if i:
                    _log_once(f"fallback-{chosen}", logging.WARNING,
                              "native kernels: the %s build is unavailable here; using the %s build",
                              ", ".join(candidates[:i]), chosen)
                return kernels
        return None


def decode_supported(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`paged_decode` takes these heads: D a multiple of 32 up to 256, at most 64
    query heads and 16 per KV head (the kernel's register tiles and stack buffers)."""
    return (num_kv_heads >= 1 and num_q_heads % num_kv_heads == 0 and num_q_heads <= 64
            and num_q_heads // num_kv_heads <= 16 and head_dim % 32 == 0 and head_dim <= 256)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def linear(kernels: NativeKernels, x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None, *, num_threads: int | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` on the CPU with fp32 or bf16 weights, fp32 arithmetic.

    Args:
        x: ``[M, K]`` (made contiguous); K a multiple of 8. fp32, or (with bf16 weights) bf16
            too, widened to fp32.
        weight: ``[N, K]`` fp32 or bf16, contiguous (bf16 is read as bf16: half the bytes).
        bias: ``[N]`` (fp32, or the weight's dtype: widened) or None.
        num_threads: OpenMP threads; None = ``torch.get_num_threads()``.

    Returns:
        ``[M, N]`` in x's dtype (accumulated in fp32, rounded once for a bf16 x).

    Raises:
        ValueError: naming the argument, on a dtype, shape or layout the kernel does not take.
    """
    if weight.dtype not in DTYPES or x.dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"x, weight: native linear takes float32 or bfloat16 weights and float32 (or the "
                         f"weight's dtype) x, got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[1] % 8:
        raise ValueError(f"x, weight: need [M, K] and [N, K] with K % 8 == 0, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight: must be contiguous")
    if bias is not None:
        if bias.dtype not in (torch.float32, weight.dtype) or bias.shape != (weight.shape[0],):
            raise ValueError(f"bias: need float32 [{weight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
        bias = bias.float().contiguous()
    out_dtype = x.dtype
    x = x.float().contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    rc = kernels._linear[weight.dtype](_ptr(x), m, k, _ptr(weight), n,
                                       _ptr(bias) if bias is not None else None, _ptr(out),
                                       num_threads or torch.get_num_threads())
    if rc:
        raise ValueError(f"x: native linear refused shape {tuple(x.shape)} (code {rc})")
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def _pool_dtype(k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.dtype:
    if (k_pool.dtype not in DTYPES and k_pool.dtype not in KV_QUANT_DTYPES) or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"k_pool, v_pool: need both float32, bfloat16, int8 or float8_e4m3fn (the same), "
                         f"got {k_pool.dtype} and {v_pool.dtype}")
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not t.is_contiguous() or t.dim() != 4:
            raise ValueError(f"{name}: must be a contiguous [M, B, Hkv, D] tensor")
    return k_pool.dtype


def check_scales(k_pool: torch.Tensor, k_scales: torch.Tensor | None,
                 v_scales: torch.Tensor | None) -> int:
    """The C kind code of ``k_pool``'s dtype (0 for fp32 / bf16 pools), with the scale pools
    checked against it: required, ``[M, B, Hkv]`` fp32 contiguous, for int8 / float8_e4m3fn
    pools; absent for the others.

    Raises:
        ValueError: naming ``k_scales`` or ``v_scales``.
    """
    kind = KV_QUANT_DTYPES.get(k_pool.dtype, 0)
    if not kind:
        for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
            if t is not None:
                raise ValueError(f"{name}: scale pools go with int8 or float8_e4m3fn pools, "
                                 f"not {k_pool.dtype}")
        return 0
    want = tuple(k_pool.shape[:3])
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if t is None:
            raise ValueError(f"{name}: {k_pool.dtype} pools need their [M, B, Hkv] = {list(want)} "
                             f"fp32 scales")
        if t.dtype != torch.float32 or tuple(t.shape) != want or not t.is_contiguous():
            raise ValueError(f"{name}: need a contiguous float32 {list(want)} (the pool's [M, B, Hkv]), "
                             f"got {t.dtype} {list(t.shape)}")
    return kind


def paged_decode(kernels: NativeKernels, q: torch.Tensor, q_rows: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, *,
                 sm_scale: float, window_left: int = -1, out: torch.Tensor | None = None,
                 chunk_tokens: int = 256, num_threads: int | None = None,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of one query row per sequence over the paged pool, in place.

    Args:
        q: ``[T, Hq, D]`` contiguous queries, fp32 or bf16 (widened to fp32); sequence i's row
            is ``q_rows[i]``.
        q_rows: ``[N]`` int64 contiguous.
        k_pool / v_pool: ``[M, B, Hkv, D]`` contiguous, both fp32, bf16 (read as bf16 and
            widened in registers), int8 or float8_e4m3fn (quantized: read as stored, widened in
            registers, scaled by ``k_scales`` / ``v_scales``); the step's K/V already written.
        k_scales / v_scales: ``[M, B, Hkv]`` fp32 contiguous scale pools (one per token slot
            and KV head; a key is ``float32(k_pool value) * scale``, ``kernels/kv_quant.py``):
            required with int8 / float8_e4m3fn pools, None otherwise.
        block_tables: ``[N, max_blocks]`` int32 contiguous (only the blocks each sequence reads
            are looked at; they are trusted: :func:`kernels.paged_sdpa.plan_attention` checks
            them once per step).
        (heads and D as :func:`decode_supported` allows)
        kv_lens: ``[N]`` int32 keys of each sequence (≥ 1).
        sm_scale: softmax scale.
        window_left: a query at position p sees keys ``≥ p - window_left``; -1: all.
        out: ``[T, Hq, D]`` of q's dtype to write rows ``q_rows`` of (others untouched); None = new.
        chunk_tokens: keys per parallel task.
        num_threads: OpenMP threads; None = ``torch.get_num_threads()``.

    Returns:
        ``out``. Softmax and accumulation are fp32; a bf16 ``out`` is rounded once.

    Raises:
        ValueError: naming the argument, on a dtype, layout or head configuration the kernel
            does not take, a head dim other than the pool's, ``q_rows`` values outside
            ``[0, T)``, ``kv_lens`` / ``block_tables`` without one row per ``q_rows`` entry, or
            scale pools missing, misshapen or given for an unquantized pool.
    """
    pool_dtype = _pool_dtype(k_pool, v_pool)
    kind = check_scales(k_pool, k_scales, v_scales)
    if q.dtype not in DTYPES or not q.is_contiguous() or q.dim() != 3:
        raise ValueError(f"q: native decode takes a contiguous float32 or bfloat16 [T, Hq, D], got {q.dtype}")
    for name, t, dtype in (("q_rows", q_rows, torch.int64), ("block_tables", block_tables, torch.int32),
                           ("kv_lens", kv_lens, torch.int32)):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous {dtype}")
    if out is not None and (out.dtype != q.dtype or out.shape != q.shape or not out.is_contiguous()):
        raise ValueError(f"out: must be a contiguous {q.dtype} {tuple(q.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
    if q.shape[2] != head_dim or v_pool.shape != k_pool.shape:
        raise ValueError(f"q: head dim {q.shape[2]} must equal the pool's {head_dim} (k_pool "
                         f"{tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)})")
    # q_rows index q and out in C: rows outside [0, T) would read and write out of bounds
    num_seqs = q_rows.shape[0] if q_rows.dim() == 1 else -1
    low, high = (int(v) for v in torch.aminmax(q_rows)) if num_seqs > 0 else (0, 0)  # ~2 us
    if num_seqs < 0 or (num_seqs > 0 and (low < 0 or high >= q.shape[0])):
        raise ValueError(f"q_rows: need a [N] tensor of rows in [0, {q.shape[0]}), got shape "
                         f"{tuple(q_rows.shape)}" + (f" with values {low}..{high}" if num_seqs > 0 else ""))
    if kv_lens.dim() != 1 or kv_lens.shape[0] != num_seqs:
        raise ValueError(f"kv_lens: need [{num_seqs}] (one per q_rows entry), got {tuple(kv_lens.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: need [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    num_q_heads = q.shape[1]
    if out is None:
        out = torch.empty_like(q)
    q32 = q.float()
    out32 = out if out.dtype == torch.float32 else torch.empty_like(q32)
    threads = num_threads or torch.get_num_threads()
    if kind:
        assert k_scales is not None and v_scales is not None  # check_scales
        rc = kernels._decode_q(
            _ptr(q32), _ptr(q_rows), q_rows.shape[0], _ptr(k_pool), _ptr(v_pool), _ptr(k_scales),
            _ptr(v_scales), _ptr(block_tables), block_tables.shape[1], _ptr(kv_lens), block_size,
            num_q_heads, num_kv_heads, head_dim, sm_scale, window_left, chunk_tokens, _ptr(out32), threads,
            kind)
    else:
        rc = kernels._decode[pool_dtype](
            _ptr(q32), _ptr(q_rows), q_rows.shape[0], _ptr(k_pool), _ptr(v_pool), _ptr(block_tables),
            block_tables.shape[1], _ptr(kv_lens), block_size, num_q_heads, num_kv_heads, head_dim, sm_scale,
            window_left, chunk_tokens, _ptr(out32), threads)
    if rc:
        raise ValueError(f"q: native decode refused Hq={num_q_heads}, Hkv={num_kv_heads}, "
                         f"D={head_dim} (code {rc})")
    if out32 is not out:
        out.index_copy_(0, q_rows, out32.index_select(0, q_rows).to(out.dtype))
    return out


class DecodeStep(NamedTuple):
    """A decode step's metadata for :func:`decode_layer` (one row per sequence, row i =
    sequence i), shared by every layer.

    Attributes:
        slots: ``[N]`` int64 flat pool slot of each new token's K/V.
        block_tables: ``[N, max_blocks]`` int32 (checked by the caller).
        kv_lens: ``[N]`` int32 keys of each sequence, its new token included.
        q_rows: ``[N]`` int64, ``arange(N)``.
        cos / sin: ``[N, D]`` fp32 RoPE rows of the tokens' positions.
        sm_scale, window_left, chunk_tokens: as :func:`paged_decode`.
    """

    slots: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    q_rows: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    sm_scale: float
    window_left: int
    chunk_tokens: int


def decode_layer(kernels: NativeKernels, hidden: torch.Tensor, step: DecodeStep, *,
                 input_norm: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
                 o_weight: torch.Tensor, post_norm: torch.Tensor, gate_up_weight: torch.Tensor,
                 down_weight: torch.Tensor, rms_norm_eps: float, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, num_q_heads: int, num_threads: int | None = None,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
    """One Llama decoder layer of a decode step in one C call, ``hidden`` updated in place.

    RMSNorm, fused q/k/v (+ bias), RoPE, K/V written to ``step.slots``, paged decode attention
    (as :func:`paged_decode`), output projection + residual, RMSNorm, fused gate/up, SiLU(gate) ·
    up, down projection + residual: the same maths as ``radixkv.model.llama.LlamaForward``, with
    no Python between the pieces (a step of 30 small layers spent ~16 ms in torch op dispatch).
    With bf16 weights and pools, every weight and K/V element is read as bf16 and widened to
    fp32 in registers; the residual stream and all arithmetic stay fp32, K/V are rounded to
    bf16 (nearest even) when written. With int8 / float8_e4m3fn pools (fp32 or bf16 weights)
    the new tokens' fp32 K/V rows are quantized per KV head into the pools and ``k_scales`` /
    ``v_scales`` exactly as ``kernels.kv_quant.quantize_kv`` does (same fp32 operations, same
    order: the bytes and scales agree bit for bit), then attention reads every key, the new
    ones included, dequantized (as :func:`paged_decode`).

    Only what a per-layer check can afford is checked here (dtypes, contiguity): this runs 30
    times per step, and the shapes come from :class:`radixkv.model.llama.LlamaForward`.

    Args:
        hidden: ``[N, hidden]`` fp32 contiguous residual stream (updated in place).
        step: the step's metadata.
        input_norm / post_norm: ``[hidden]`` fp32; qkv_bias ``[(Hq + 2 Hkv) D]`` fp32 or None.
        qkv_weight ``[(Hq + 2 Hkv) D, hidden]``, o_weight ``[hidden, Hq D]``, gate_up_weight
            ``[2 I, hidden]``, down_weight ``[hidden, I]``: contiguous, all fp32 or all bf16.
        k_pool / v_pool: ``[M, B, Hkv, D]`` contiguous, the weights' dtype, or both int8 or both
            float8_e4m3fn (quantized; written at ``step.slots``).
        num_q_heads: Hq.
        k_scales / v_scales: ``[M, B, Hkv]`` fp32 contiguous scale pools of quantized pools
            (written at ``step.slots``); None otherwise.

    Raises:
        ValueError: naming the argument on a dtype or layout it does not take, or when the
            kernel refuses the shapes (see :func:`decode_supported`).
    """
    dtype = qkv_weight.dtype
    if dtype not in DTYPES:
        raise ValueError(f"qkv_weight: native decode layer takes float32 or bfloat16, got {dtype}")
    kind = KV_QUANT_DTYPES.get(k_pool.dtype, 0)
    pools = () if kind else (("k_pool", k_pool), ("v_pool", v_pool))
    for name, t in (("o_weight", o_weight), ("gate_up_weight", gate_up_weight), ("down_weight", down_weight),
                    *pools):
        if t.dtype != dtype:
            raise ValueError(f"{name}: must be {dtype} like qkv_weight, got {t.dtype}")
    if kind and v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool: must be {k_pool.dtype} like k_pool, got {v_pool.dtype}")
    if kind or k_scales is not None or v_scales is not None:
        check_scales(k_pool, k_scales, v_scales)
    for name, t in (("hidden", hidden), ("qkv_weight", qkv_weight), ("o_weight", o_weight),
                    ("gate_up_weight", gate_up_weight), ("down_weight", down_weight), ("k_pool", k_pool),
                    ("v_pool", v_pool)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    vectors: tuple[tuple[str, torch.Tensor | None], ...] = (
        ("hidden", hidden), ("input_norm", input_norm), ("post_norm", post_norm), ("qkv_bias", qkv_bias),
        ("cos", step.cos), ("sin", step.sin))
    for name, vec in vectors:
        if vec is not None and vec.dtype != torch.float32:
            raise ValueError(f"{name}: must be float32, got {vec.dtype}")
    num_seqs, hidden_size = hidden.shape
    _, block_size, num_kv_heads, head_dim = k_pool.shape
    inter = down_weight.shape[1]
    args = (
        _ptr(hidden), num_seqs, hidden_size, inter, _ptr(input_norm), _ptr(qkv_weight),
        _ptr(qkv_bias) if qkv_bias is not None else None, _ptr(o_weight), _ptr(post_norm),
        _ptr(gate_up_weight), _ptr(down_weight), rms_norm_eps, _ptr(step.cos), _ptr(step.sin),
        _ptr(step.slots), _ptr(k_pool), _ptr(v_pool), _ptr(step.block_tables),
        step.block_tables.shape[1], _ptr(step.kv_lens), _ptr(step.q_rows), block_size, num_q_heads,
        num_kv_heads, head_dim, step.sm_scale, step.window_left, step.chunk_tokens,
        num_threads or torch.get_num_threads())
    if kind:
        assert k_scales is not None and v_scales is not None  # check_scales
        rc = kernels._layer_q(*args, int(dtype == torch.bfloat16), _ptr(k_scales), _ptr(v_scales), kind)
    else:
        rc = kernels._layer[dtype](*args)
    if rc:
        raise ValueError(f"hidden: native decode layer refused hidden={hidden_size}, I={inter}, "
                         f"Hq={num_q_heads}, Hkv={num_kv_heads}, D={head_dim} (code {rc})")


def paged_kv_write(kernels: NativeKernels, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor, slot_mapping: torch.Tensor, *, k_scales: torch.Tensor,
                   v_scales: torch.Tensor, num_threads: int | None = None) -> None:
    """Quantize K/V rows into their pool slots: ``kernels.kv_quant.quantize_kv`` in C, the same
    fp32 operations in the same order (bytes and scales equal torch's bit for bit), tokens in
    parallel, no temporaries.

    Args:
        k / v: ``[T, Hkv, D]`` fp32 or bf16 (widened exactly), the same dtype.
        k_pool / v_pool: ``[M, B, Hkv, D]`` contiguous, both int8 or both float8_e4m3fn.
        slot_mapping: ``[T]`` integer flat slot (``block * B + offset``) of each row, in
            ``[0, M * B)``.
        k_scales / v_scales: ``[M, B, Hkv]`` fp32 contiguous scale pools (written at the slots).
        num_threads: OpenMP threads; None = ``torch.get_num_threads()``.

    Raises:
        ValueError: naming the argument, on a dtype, shape or layout it does not take, or a
            slot outside the pool.
    """
    if k_pool.dtype not in KV_QUANT_DTYPES:
        raise ValueError(f"k_pool: need int8 or float8_e4m3fn, got {k_pool.dtype}")
    _pool_dtype(k_pool, v_pool)
    kind = check_scales(k_pool, k_scales, v_scales)
    num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
    if k.dtype not in DTYPES or v.dtype != k.dtype:
        raise ValueError(f"k, v: need both float32 or both bfloat16, got {k.dtype} and {v.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name}: need [T, Hkv={num_kv_heads}, D={head_dim}], got {list(t.shape)}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v: need {k.shape[0]} rows like k, got {v.shape[0]}")
    num_tokens = k.shape[0]
    if (slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens or slot_mapping.dtype.is_floating_point
            or slot_mapping.dtype.is_complex):
        raise ValueError(f"slot_mapping: need a [{num_tokens}] integer tensor, got {slot_mapping.dtype} "
                         f"{list(slot_mapping.shape)}")
    slots = slot_mapping.to(torch.int64).contiguous()
    if num_tokens == 0:
        return
    low, high = (int(x) for x in torch.aminmax(slots))
    if low < 0 or high >= num_blocks * block_size:
        raise ValueError(f"slot_mapping: slots must be in [0, {num_blocks * block_size}), got {low}..{high}")
    k, v = k.contiguous(), v.contiguous()
    rc = kernels._kv_write_q(_ptr(k), _ptr(v), int(k.dtype == torch.bfloat16), _ptr(slots), num_tokens,
                             num_kv_heads, head_dim, _ptr(k_pool), _ptr(v_pool), _ptr(k_scales),
                             _ptr(v_scales), kind, num_threads or torch.get_num_threads())
    if rc:
        raise ValueError(f"k: native KV write refused Hkv={num_kv_heads}, D={head_dim} (code {rc})")

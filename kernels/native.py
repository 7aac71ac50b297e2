"""CPU decode kernels in C (``csrc/cpu_decode.c``), built with the system C compiler at first use.

Two kernels for the memory-bound part of a CPU decode step, fp32 only:

- :func:`linear`: ``y = x @ w.T (+ b)`` for a few rows (``x`` of at most
  :data:`MAX_LINEAR_ROWS` rows): each weight row is read once per step and reused from L1 by
  every row of the batch. MKL's small-M sgemm in torch's CPU build ran at about a third of the
  copy bandwidth here (AMD EPYC), so a batch-1 decode spent ~75 ms on 538 MB of weights.
- :func:`paged_decode`: attention of one query row per sequence over its keys in the paged
  pool, read in place through the block table (no gather), split into chunks of keys that run
  in parallel and are merged (flash-decoding).

Build: ``cc -O3 -mavx2 -mfma -fopenmp -shared`` into ``$RADIXKV_CACHE_DIR/native`` (default
``~/.cache/radixkv/native``), named by the SHA-256 of the source and the flags, written to a
temporary name and renamed (concurrent processes may race harmlessly). :func:`load` returns
None, once logged, when the kernels cannot run here: not x86-64, no AVX2/FMA, no compiler, a
failed build, or ``RADIXKV_NATIVE_KERNELS=0``; callers then stay on torch.

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
from typing import NamedTuple

import torch

__all__ = ["load", "linear", "paged_decode", "decode_layer", "DecodeStep", "decode_supported",
           "NativeKernels", "MAX_LINEAR_ROWS", "DISABLE_ENV"]

log = logging.getLogger(__name__)

#: Set to ``0`` to keep every step on torch (A/B runs, or a machine where the build misbehaves).
DISABLE_ENV = "RADIXKV_NATIVE_KERNELS"
#: Rows up to which :func:`linear` beats MKL here (decode batches); larger GEMMs stay on torch.
MAX_LINEAR_ROWS = 32
_SOURCE = Path(__file__).with_name("csrc") / "cpu_decode.c"
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class NativeKernels:
    """The loaded library with typed entry points (see :func:`load`)."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._linear = lib.rk_linear_f32
        self._linear.argtypes = [_P, _I64, _I64, _P, _I64, _P, _P, ctypes.c_int]
        self._linear.restype = ctypes.c_int
        self._decode = lib.rk_paged_decode_f32
        self._decode.argtypes = [_P, _P, _I64, _P, _P, _P, _I64, _P, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_float, _I64, _I64, _P,
                                 ctypes.c_int]
        self._decode.restype = ctypes.c_int
        self._layer = lib.rk_decode_layer_f32
        self._layer.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, ctypes.c_float, _P, _P,
                                _P, _P, _P, _P, _I64, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                ctypes.c_int, ctypes.c_float, _I64, _I64, ctypes.c_int]
        self._layer.restype = ctypes.c_int


_lock = threading.Lock()
_state: dict[str, NativeKernels | None] = {}


def _cache_dir() -> Path:
    root = os.environ.get("RADIXKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "radixkv")
    return Path(root) / "native"


def _build() -> NativeKernels | None:
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("native kernels off (%s=0)", DISABLE_ENV)
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.info("native kernels need x86-64 (AVX2); staying on torch")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("native kernels: no C compiler found; staying on torch")
        return None
    try:
        source = _SOURCE.read_bytes()
        digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
        path = _cache_dir() / f"cpu_decode-{digest}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
            try:
                subprocess.run([compiler, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"], check=True,
                               capture_output=True, timeout=120)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        # torch is imported (this module imports it): libgomp.so.1 resolves to torch's runtime.
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:  # no source, unwritable cache, cc error
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("native kernels: build or load failed (%s %s); staying on torch", exc,
                    detail.decode(errors="replace")[-500:])
        return None
    lib.rk_cpu_supported.restype = ctypes.c_int
    if not lib.rk_cpu_supported():
        log.info("native kernels: this CPU lacks AVX2/FMA; staying on torch")
        return None
    return NativeKernels(lib, path)


def load() -> NativeKernels | None:
    """The kernels, built and loaded once per process; None where they cannot run (logged)."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _build()
        return _state["lib"]


def decode_supported(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`paged_decode` takes these heads: D a multiple of 32 up to 256, at most 64
    query heads and 16 per KV head (the kernel's register tiles and stack buffers)."""
    return (num_kv_heads >= 1 and num_q_heads % num_kv_heads == 0 and num_q_heads <= 64
            and num_q_heads // num_kv_heads <= 16 and head_dim % 32 == 0 and head_dim <= 256)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def linear(kernels: NativeKernels, x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None, *, num_threads: int | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for fp32 CPU tensors.

    Args:
        x: ``[M, K]`` fp32 (made contiguous); K a multiple of 8.
        weight: ``[N, K]`` fp32, contiguous.
        bias: ``[N]`` fp32 or None.
        num_threads: OpenMP threads; None = ``torch.get_num_threads()``.

    Returns:
        ``[M, N]`` fp32.

    Raises:
        ValueError: naming the argument, on a dtype, shape or layout the kernel does not take.
    """
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"x, weight: native linear takes float32, got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[1] % 8:
        raise ValueError(f"x, weight: need [M, K] and [N, K] with K % 8 == 0, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight: must be contiguous")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.shape[0],)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias: need contiguous float32 [{weight.shape[0]}]")
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    rc = kernels._linear(_ptr(x), m, k, _ptr(weight), n, _ptr(bias) if bias is not None else None,
                         _ptr(out), num_threads or torch.get_num_threads())
    if rc:
        raise ValueError(f"x: native linear refused shape {tuple(x.shape)} (code {rc})")
    return out


def paged_decode(kernels: NativeKernels, q: torch.Tensor, q_rows: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, *,
                 sm_scale: float, window_left: int = -1, out: torch.Tensor | None = None,
                 chunk_tokens: int = 256, num_threads: int | None = None) -> torch.Tensor:
    """Decode attention of one query row per sequence over the paged pool, in place.

    Args:
        q: ``[T, Hq, D]`` fp32 contiguous queries; sequence i's row is ``q_rows[i]``.
        q_rows: ``[N]`` int64 contiguous.
        k_pool / v_pool: ``[M, B, Hkv, D]`` fp32 contiguous; the step's K/V already written.
        block_tables: ``[N, max_blocks]`` int32 contiguous (only the blocks each sequence reads
            are looked at; they are trusted: :func:`kernels.paged_sdpa.plan_attention` checks
            them once per step).
        (heads and D as :func:`decode_supported` allows)
        kv_lens: ``[N]`` int32 keys of each sequence (≥ 1).
        sm_scale: softmax scale.
        window_left: a query at position p sees keys ``≥ p - window_left``; -1: all.
        out: ``[T, Hq, D]`` fp32 to write rows ``q_rows`` of (others untouched); None = new.
        chunk_tokens: keys per parallel task.
        num_threads: OpenMP threads; None = ``torch.get_num_threads()``.

    Returns:
        ``out``.

    Raises:
        ValueError: on a dtype, layout or head configuration the kernel does not take.
    """
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name}: native decode takes contiguous float32")
    for name, t, dtype in (("q_rows", q_rows, torch.int64), ("block_tables", block_tables, torch.int32),
                           ("kv_lens", kv_lens, torch.int32)):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous {dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
    num_q_heads = q.shape[1]
    if out is None:
        out = torch.empty_like(q)
    rc = kernels._decode(_ptr(q), _ptr(q_rows), q_rows.shape[0], _ptr(k_pool), _ptr(v_pool),
                         _ptr(block_tables), block_tables.shape[1], _ptr(kv_lens), block_size,
                         num_q_heads, num_kv_heads, head_dim, sm_scale, window_left, chunk_tokens,
                         _ptr(out), num_threads or torch.get_num_threads())
    if rc:
        raise ValueError(f"q: native decode refused Hq={num_q_heads}, Hkv={num_kv_heads}, "
                         f"D={head_dim} (code {rc})")
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
                 v_pool: torch.Tensor, num_q_heads: int, num_threads: int | None = None) -> None:
    """One Llama decoder layer of a decode step in one C call, ``hidden`` updated in place.

    RMSNorm, fused q/k/v (+ bias), RoPE, K/V written to ``step.slots``, paged decode attention
    (as :func:`paged_decode`), output projection + residual, RMSNorm, fused gate/up, SiLU(gate) ·
    up, down projection + residual: the same maths as ``radixkv.model.llama.LlamaForward``, with
    no Python between the pieces (a step of 30 small layers spent ~16 ms in torch op dispatch).

    Args:
        hidden: ``[N, hidden]`` fp32 contiguous residual stream (updated in place).
        step: the step's metadata.
        input_norm / post_norm: ``[hidden]``; qkv_weight ``[(Hq + 2 Hkv) D, hidden]``; qkv_bias
            ``[(Hq + 2 Hkv) D]`` or None; o_weight ``[hidden, Hq D]``; gate_up_weight
            ``[2 I, hidden]``; down_weight ``[hidden, I]``: fp32 contiguous.
        k_pool / v_pool: ``[M, B, Hkv, D]`` fp32 contiguous (written at ``step.slots``).
        num_q_heads: Hq.

    Raises:
        ValueError: when the kernel refuses the shapes (see :func:`decode_supported`).
    """
    num_seqs, hidden_size = hidden.shape
    _, block_size, num_kv_heads, head_dim = k_pool.shape
    inter = down_weight.shape[1]
    rc = kernels._layer(
        _ptr(hidden), num_seqs, hidden_size, inter, _ptr(input_norm), _ptr(qkv_weight),
        _ptr(qkv_bias) if qkv_bias is not None else None, _ptr(o_weight), _ptr(post_norm),
        _ptr(gate_up_weight), _ptr(down_weight), rms_norm_eps, _ptr(step.cos), _ptr(step.sin),
        _ptr(step.slots), _ptr(k_pool), _ptr(v_pool), _ptr(step.block_tables),
        step.block_tables.shape[1], _ptr(step.kv_lens), _ptr(step.q_rows), block_size, num_q_heads,
        num_kv_heads, head_dim, step.sm_scale, step.window_left, step.chunk_tokens,
        num_threads or torch.get_num_threads())
    if rc:
        raise ValueError(f"hidden: native decode layer refused hidden={hidden_size}, I={inter}, "
                         f"Hq={num_q_heads}, Hkv={num_kv_heads}, D={head_dim} (code {rc})")

"""Host allocator settings for CPU steps: keep a step's activation buffers mapped between steps.

A prefill step allocates and frees tens of MB of activations per layer (the fused q/k/v and
gate/up outputs: ``tokens × width × 4`` bytes, 25 MB for SmolLM2's gate/up at 2,048 tokens).
glibc's malloc serves a request at or above its mmap threshold (dynamic, starting at 128 KiB)
with a fresh ``mmap`` and returns it with ``munmap`` on free, so every layer of every step
faults its output pages in again: measured on a 2-core EPYC VM, a 2,048-token SmolLM2 prefill
took 80,000–126,000 minor page faults (1.83–1.98 s); with the settings below, 0–4,000
(1.65 s).

:func:`keep_step_buffers_mapped` raises the threshold to glibc's maximum (32 MiB on 64-bit) and
the trim threshold, so freed buffers stay in the heap for the next layer. Requests above
32 MiB are still mapped per call: the model keeps its per-call activations under it by
running the MLP in row chunks (``radixkv.model.llama``). The cost is that the process keeps
its peak activation memory (tens to a few hundred MB) instead of returning it after a step.
The tunables are documented in ``mallopt(3)``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading

#: ``mallopt`` parameter numbers (glibc ``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: glibc's upper bound for M_MMAP_THRESHOLD on 64-bit (``HEAP_MAX_SIZE / 2``).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Freed memory at the heap's top above this is returned to the kernel.
TRIM_THRESHOLD_BYTES = 1 << 30
#: The largest buffer a step should allocate per call to stay off per-call mmap.
MAX_STEP_BUFFER_BYTES = MMAP_THRESHOLD_BYTES // 2

#: Set to ``0`` to leave glibc's defaults (for A/B runs).
DISABLE_ENV = "RADIXKV_KEEP_STEP_BUFFERS"

_lock = threading.Lock()
_applied: bool | None = None


def keep_step_buffers_mapped() -> bool:
    """Set glibc's mmap and trim thresholds once per process (see the module doc).

    The arena limit (one malloc arena for every thread) matters as much as the thresholds:
    a thread's own arena frees whole 64 MiB sub-heaps back to the kernel when they empty, so a
    step run on the engine thread would fault its buffers in again regardless. Call it before
    the process starts its threads (``radixkv serve`` does, first thing); threads that already
    allocated keep their arenas.

    Returns:
        True when the settings are in effect (glibc on Linux accepted them), False where they
        do not apply (another C library or OS, or ``RADIXKV_KEEP_STEP_BUFFERS=0``) or glibc
        refused them.
    """
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        _applied = False
        if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
            return False
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        # mallopt returns 1 on success, 0 on error.
        _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
                        and mallopt(_M_ARENA_MAX, 1))
        return _applied


def max_rows_per_buffer(width: int, itemsize: int) -> int:
    """Rows of a ``[rows, width]`` buffer of ``itemsize``-byte elements that stay within
    :data:`MAX_STEP_BUFFER_BYTES` (at least 1).

    Raises:
        ValueError: naming ``width`` or ``itemsize`` when not positive.
    """
    if width <= 0:
        raise ValueError(f"width: must be > 0, got {width}")
    if itemsize <= 0:
        raise ValueError(f"itemsize: must be > 0, got {itemsize}")
    return max(1, MAX_STEP_BUFFER_BYTES // (width * itemsize))

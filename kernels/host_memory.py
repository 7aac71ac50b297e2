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
import time

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


# ---- committing the KV pool's pages ahead of the requests that write them ------------------
#
# A CPU pool is allocated lazily (``radixkv.model.runner``: calloc'd pages the kernel maps on
# first write) so that start-up stays fast. But the first write of every 4 KiB page then costs a
# page fault inside a request: measured on a 2-core Firecracker VM, 0.6–12 µs per page (the
# hypervisor backs guest memory on first touch), i.e. 0.1–0.96 s for the 324 MB of a 7k-token
# SmolLM2 (fp32) prefix — the whole of a disk-tier hit's TTFT — and ~0.1–0.3 s of a 2k-token
# cold prefill. vLLM and SGLang pay it at start (their pools are ``torch.zeros``). radixkv
# pays it on a low-priority background thread right after start, in block order (the order a
# fresh pool hands blocks out), with ``madvise(MADV_POPULATE_WRITE)`` (Linux ≥ 5.14): the
# kernel maps the pages without writing them, so it is safe while steps write the same blocks.
# Where the call is missing nothing is touched (a user-space write could race a step's write).

#: Set to ``0`` to leave the pool lazily mapped (tests that start many servers do).
POPULATE_ENV = "RADIXKV_POPULATE_KV_POOL"
_MADV_POPULATE_WRITE = 23
_EINVAL = 22
#: Blocks per populate round (each round is one madvise per pool tensor).
POPULATE_CHUNK_BYTES = 8 << 20
#: ``nice`` of the populate thread: it yields to the engine's steps and the HTTP loop.
POPULATE_NICE = 19
#: Heap the populate thread commits first (malloc'd, touched, freed: with the trim threshold of
#: :func:`keep_step_buffers_mapped` it stays mapped for the first long prefill's activations).
HEAP_RESERVE_BYTES = 256 << 20

_populate_enabled = False


def enable_pool_populate() -> bool:
    """Let runners created from now on populate their CPU pools in the background (``radixkv
    serve`` and the benchmarks call it; the Python API leaves pools lazy). Returns whether it
    is on (``RADIXKV_POPULATE_KV_POOL=0`` keeps it off)."""
    global _populate_enabled
    _populate_enabled = os.environ.get(POPULATE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    return _populate_enabled


def pool_populate_enabled() -> bool:
    """Whether :func:`enable_pool_populate` turned background population on."""
    return _populate_enabled


def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    return libc


class PoolPopulator:
    """Maps the pages of block-indexed pool tensors in the background (see the comment above).

    Args:
        regions: per pool tensor ``(base address, bytes per block)``; block ``b`` of region
            ``i`` is at ``base_i + b * bytes_i`` (contiguous ``[M, ...]`` tensors).
        num_blocks: M.
        reserve_heap_bytes: heap committed before the pools (0: none).

    The thread is a daemon; :meth:`snapshot` reports progress (``/stats`` ``pool.populate``).
    The caller keeps the tensors alive for the populator's lifetime (the runner owns both).
    """

    def __init__(self, regions: list[tuple[int, int]], num_blocks: int, *,
                 reserve_heap_bytes: int = HEAP_RESERVE_BYTES) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self._regions = list(regions)
        self.num_blocks = num_blocks
        self.total_bytes = sum(per_block for _, per_block in self._regions) * num_blocks
        self._reserve = reserve_heap_bytes
        self._populated_blocks = 0
        self._state = "pending"
        self._error: str | None = None
        self._started = 0.0
        self._seconds: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-pool-populate", daemon=True)

    def start(self) -> PoolPopulator:
        self._thread.start()
        return self

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until population finished (or stopped); False on timeout."""
        return self._done.wait(timeout_s)

    def snapshot(self) -> dict:
        """``state`` (pending, running, done, unsupported, skipped, failed), ``populated_bytes``,
        ``total_bytes``, ``seconds`` (wall time taken, when done) and ``error``."""
        per_block = self.total_bytes // self.num_blocks
        out = {"state": self._state, "populated_bytes": self._populated_blocks * per_block,
               "total_bytes": self.total_bytes, "seconds": self._seconds}
        if self._error is not None:
            out["error"] = self._error
        return out

    def _run(self) -> None:
        self._started = time.perf_counter()
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), POPULATE_NICE)
        except (OSError, AttributeError):
            pass
        libc = _libc()
        try:
            if libc is None:
                self._state = "unsupported"
                return
            available = mem_available_bytes()
            if available is not None and self.total_bytes > available * MAX_POPULATE_SHARE:
                # Committing it all would push the machine into the OOM killer; the pool stays
                # lazy, as before (pages are mapped as blocks are first written).
                self._state = "skipped"
                self._error = (f"pool of {self.total_bytes} bytes > {MAX_POPULATE_SHARE:.0%} of "
                               f"MemAvailable ({available} bytes)")
                return
            self._state = "running"
            if self._reserve > 0 and _applied:
                _reserve_heap(libc, self._reserve)
            page = os.sysconf("SC_PAGE_SIZE")
            per_block_max = max(per_block for _, per_block in self._regions)
            step = max(1, POPULATE_CHUNK_BYTES // per_block_max)
            for first in range(0, self.num_blocks, step):
                last = min(self.num_blocks, first + step)
                for base, per_block in self._regions:
                    start = base + first * per_block
                    end = base + last * per_block
                    aligned = start - start % page
                    if libc.madvise(aligned, end - aligned, _MADV_POPULATE_WRITE) != 0:
                        err = ctypes.get_errno()
                        if err == _EINVAL and first == 0:
                            self._state = "unsupported"  # kernel older than 5.14
                            return
                        raise OSError(err, os.strerror(err))
                self._populated_blocks = last
            self._state = "done"
        except Exception as exc:  # a daemon's failure only leaves pages lazy
            self._state, self._error = "failed", repr(exc)
        finally:
            self._seconds = round(time.perf_counter() - self._started, 3)
            self._done.set()


#: Populate only a pool at most this share of the memory available at start.
MAX_POPULATE_SHARE = 0.8


def mem_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reserve_heap(libc: ctypes.CDLL, nbytes: int) -> None:
    """malloc ``nbytes`` in sub-threshold pieces, touch them, free them: the heap keeps them."""
    piece = MAX_STEP_BUFFER_BYTES
    ptrs = []
    try:
        for _ in range(max(1, nbytes // piece)):
            ptr = libc.malloc(piece)
            if not ptr:
                break
            ctypes.memset(ptr, 0, piece)
            ptrs.append(ptr)
    finally:
        for ptr in reversed(ptrs):
            libc.free(ptr)

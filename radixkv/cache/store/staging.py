"""Staging memory of the store tier: fixed-size value slots in one anonymous mapping.

A slot holds one block value (header + payload). Fetches land in slots (the loader thread), are
checked there and only then copied into the pool's blocks (the engine thread); writes are
gathered from the pool into slots (the engine thread) and stored from there (the writer thread),
so a block may be evicted and reused as soon as it is gathered. The mapping is registered with
the backend once (Mooncake transfers only from registered memory).

The pool side is described by *segments* ``(base, bytes per block)``: for every layer its K
and its V pool tensor (K0, V0, K1, …), then for a quantized KV format every layer's K and V
scale pool (Ks0, Vs0, Ks1, …; ``runner.kv_segments()``); block ``b`` of segment ``i`` is the
``size_i`` bytes at ``base_i + b * size_i``, and a block's payload is its segments back to back.
The runner supplies them; this module only moves bytes.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Sequence

_memmove = ctypes.memmove


class StagingArena:
    """``num_slots`` slots of ``slot_bytes`` each, handed out and returned under a lock.

    Args:
        slot_bytes: Bytes per slot (one block value).
        num_slots: Slots (≥ 1).

    Attributes:
        base_ptr: Address of slot 0; slot ``s`` is at ``base_ptr + s * slot_bytes``.
        nbytes: Size of the mapping.

    Raises:
        ValueError: naming ``slot_bytes`` or ``num_slots`` if not ≥ 1.
    """

    def __init__(self, slot_bytes: int, num_slots: int) -> None:
        for name, value in (("slot_bytes", slot_bytes), ("num_slots", num_slots)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.nbytes = slot_bytes * num_slots
        self._map = mmap.mmap(-1, self.nbytes)
        self._anchor = ctypes.c_char.from_buffer(self._map)  # keeps the address valid
        self.base_ptr = ctypes.addressof(self._anchor)
        self.view = memoryview(self._map)
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def take(self, num: int) -> list[int]:
        """Up to ``num`` free slots (fewer when short, possibly none)."""
        with self._lock:
            n = min(num, len(self._free))
            if n <= 0:
                return []
            taken = self._free[-n:]
            del self._free[-n:]
        return taken

    def give(self, slots: Sequence[int]) -> None:
        """Return slots taken earlier."""
        if slots:
            with self._lock:
                self._free.extend(slots)

    def ptr(self, slot: int) -> int:
        """Address of ``slot``."""
        return self.base_ptr + slot * self.slot_bytes

    def slot_view(self, slot: int, nbytes: int | None = None) -> memoryview:
        """The first ``nbytes`` (default all) of ``slot`` as a writable memoryview."""
        start = slot * self.slot_bytes
        return self.view[start : start + (self.slot_bytes if nbytes is None else nbytes)]


def gather_block(dst_ptr: int, segments: Sequence[tuple[int, int]], block_id: int) -> None:
    """Copy block ``block_id`` of every pool segment ``(base, bytes per block)``, in order, to
    ``dst_ptr`` (contiguous: the payload)."""
    for base, size in segments:
        _memmove(dst_ptr, base + block_id * size, size)
        dst_ptr += size


def scatter_block(src_ptr: int, segments: Sequence[tuple[int, int]], block_id: int) -> None:
    """Copy a contiguous payload at ``src_ptr`` into block ``block_id`` of every pool segment
    ``(base, bytes per block)``, in order."""
    for base, size in segments:
        _memmove(base + block_id * size, src_ptr, size)
        src_ptr += size

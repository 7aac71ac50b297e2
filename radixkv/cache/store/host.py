"""``host`` store backend: a bounded tier of process (CPU) memory under the device cache.

:class:`HostStore` keeps block values (header + payload, opaque bytes) under their store keys,
copied out of the caller's memory on ``put`` and into it on ``get_into`` (``ctypes`` memcpy).
Its size is the sum of the stored values' sizes (``capacity_bytes``); when a put needs room it
evicts stored blocks in the order of its own policy from :mod:`radixkv.eviction` (``lru``,
``lfu``, ``fifo``, ``gdsf``, ``s3fifo``, ``cost``). On a GPU this is the pinned-host L2 tier.

**Prefix-closed per chain.** Every entry names its chain parent (``PutEntry.parent_key``). An
entry is evictable only while no stored entry names it as parent (a per-key child count), so
eviction always trims the tail of a chain: a parent goes only after its last stored child. An
orphan (its parent not stored) is accepted: with ``--kv-store-write evict`` the device pool may
hand over a chain's deeper blocks before their parent. While a put makes room, the new entry's
parent is already counted as having a child, so a chain is never cut under the block that
extends it. When nothing evictable is left the put is refused (False), never forced.

Entries are seen by the policy through the :class:`radixkv.eviction.NodeView` fields as one-
block nodes (``num_blocks`` 1, ``num_tokens`` = block size, ``lock_ref`` 0, ``hashes`` =
``(key.encode(),)``) and kept in a :class:`radixkv.cache.tree.leaves.LeafIndex`, with the hooks
called as the radix tree calls them (``on_insert`` / ``on_hit`` for victim-naming policies,
re-keying for priority policies, ``on_evict(entry, 1)`` once the entry holds 0 blocks).

**KV events.** Keys evicted by pressure (not by :meth:`HostStore.remove`) are queued and
returned by :meth:`HostStore.drain_evicted`, for the engine to publish ``BlockRemoved`` with
medium ``"CPU"``; the queue keeps the latest ``max_pending_evicted`` keys (older ones are
dropped and counted in ``evicted_dropped_total``). No callback: the engine drains after a step.

**Thread safety and cost.** One ``threading.Lock`` guards the index; the loader and writer
threads call concurrently. Value copies run outside the lock (stored values are immutable
``bytes``, so a reader's copy survives a concurrent eviction). Each put / get / evict is
O(log n) in the stored blocks (sorted-list or heap updates in the leaf index).
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import threading
import time
from typing import Callable, Sequence

from radixkv.cache.store.backend import PutEntry, StoreBackend
from radixkv.cache.tree.leaves import LeafIndex
from radixkv.eviction import make_policy

#: ``get_into`` results besides a byte count.
MISSING = -1
TOO_SMALL = -2


class _Entry:
    """One stored block value, with the :class:`radixkv.eviction.NodeView` fields."""

    __slots__ = (
        "key", "parent_key", "value", "uid", "last_access_s", "hit_count", "created_s",
        "depth_tokens", "num_blocks", "num_tokens", "lock_ref", "hashes", "leaf_entry",
    )

    def __init__(self, key: str, parent_key: str | None, value: bytes, uid: int,
                 depth_tokens: int, block_size: int, now: float) -> None:
        self.key = key
        self.parent_key = parent_key
        self.value = value
        self.uid = uid
        self.last_access_s = now
        self.hit_count = 0
        self.created_s = now
        self.depth_tokens = depth_tokens
        self.num_blocks = 1
        self.num_tokens = block_size
        self.lock_ref = 0
        self.hashes = (key.encode(),)
        self.leaf_entry: object = None

    def __repr__(self) -> str:
        return f"_Entry({self.key!r}, {len(self.value)} bytes)"


class HostStore(StoreBackend):
    """A bounded in-process key → value store, prefix-closed per chain (thread-safe).

    Args:
        capacity_bytes: Most value bytes held at once (> 0).
        block_size: Tokens per block (the policies' ``num_tokens`` of an entry).
        eviction_policy: A :func:`radixkv.eviction.available_policies` name (not an oracle).
        model_shape: Cost-model shape for ``gdsf`` / ``cost`` (None: the policy's default).
        clock: Returns the current time (seconds); inject a counter in tests.
        max_pending_evicted: Keys :meth:`drain_evicted` can return at most (oldest dropped).

    Raises:
        ValueError: naming ``kv_store`` for a non-positive capacity or block size, or an
            unknown policy (or an offline oracle, which needs a trace).
    """

    name = "host"
    kv_event_medium = "CPU"
    too_small_result = TOO_SMALL

    def __init__(self, capacity_bytes: int, *, block_size: int, eviction_policy: str = "lru",
                 model_shape: object = None, clock: Callable[[], float] = time.monotonic,
                 max_pending_evicted: int = 65536) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"kv_store: host capacity must be a positive number of bytes, "
                             f"got {capacity_bytes!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"kv_store: block_size must be positive, got {block_size!r}")
        try:
            policy = make_policy(eviction_policy, model_shape=model_shape)
        except ValueError as exc:
            raise ValueError(f"kv_store: host tier policy {eviction_policy!r}: {exc}") from None
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.policy = policy
        self._clock = clock
        policy.bind_clock(clock)
        self._lock = threading.Lock()
        self._leaves: LeafIndex[_Entry] = LeafIndex(policy)
        self._notify_policy = not self._leaves.by_priority
        self._uids = itertools.count(1)
        self._entries: dict[str, _Entry] = {}
        # Stored children per parent key, kept for parents not (yet) stored too: an orphan's
        # parent arriving later must not become evictable under it.
        self._child_count: dict[str, int] = {}
        self._used_bytes = 0
        self._evicted_total = 0
        self._refused_total = 0
        self._evicted_dropped_total = 0
        self._pending_evicted: collections.deque[str] = collections.deque()
        self._max_pending = max_pending_evicted

    # ---- reads --------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a value now (no hit is recorded)."""
        with self._lock:
            entries = self._entries
            return [k in entries for k in keys]

    def get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                 sizes: Sequence[int]) -> list[int]:
        """Copy each key's value into ``ptrs[i]`` (room for ``sizes[i]`` bytes).

        A value found counts as a hit (``hit_count`` + 1, ``last_access_s`` = now) even when it
        does not fit.

        Returns:
            Per key the bytes written, ``-1`` (:data:`MISSING`) or ``-2`` (:data:`TOO_SMALL`:
            nothing written).

        Raises:
            ValueError: naming ``ptrs`` / ``sizes`` when their lengths differ from ``keys``.
        """
        if len(ptrs) != len(keys) or len(sizes) != len(keys):
            raise ValueError(f"ptrs, sizes: {len(ptrs)} and {len(sizes)} for {len(keys)} keys")
        values: list[bytes | None] = []
        with self._lock:
            now = self._clock()
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    values.append(None)
                    continue
                self._leaves.record_hit(entry, now)
                values.append(entry.value)
        out: list[int] = []
        for value, ptr, size in zip(values, ptrs, sizes):
            if value is None:
                out.append(MISSING)
            elif len(value) > size:
                out.append(TOO_SMALL)
            else:
                ctypes.memmove(ptr, value, len(value))
                out.append(len(value))
        return out

    # ---- writes -------------------------------------------------------------------------
    def put(self, entries: Sequence[PutEntry]) -> list[bool]:
        """Store each entry's value (copied out of ``ptr`` before returning).

        A key already stored is left as it is (True, nothing counted again). A value larger
        than ``capacity_bytes``, or one that cannot be made room for because nothing stored
        is evictable, is refused (False; blocks evicted before that stay evicted).

        Returns:
            Per entry, whether the key holds a value now.
        """
        with self._lock:
            wanted = [e.key not in self._entries and 0 < e.nbytes <= self.capacity_bytes
                      for e in entries]
        # Copy outside the lock: the caller owns ``ptr`` until we return.
        values = [ctypes.string_at(e.ptr, e.nbytes) if w else b""
                  for e, w in zip(entries, wanted)]
        out: list[bool] = []
        with self._lock:
            for e, value in zip(entries, values):
                if e.key in self._entries:
                    out.append(True)
                elif not 0 < e.nbytes <= self.capacity_bytes:
                    self._refused_total += 1
                    out.append(False)
                else:  # (copied now if it was removed since the first look: rare)
                    out.append(self._insert(e, value or ctypes.string_at(e.ptr, e.nbytes)))
        return out

    def _insert(self, e: PutEntry, value: bytes) -> bool:
        """Add one absent entry, evicting for room; False (nothing changed) when refused."""
        parent = e.parent_key
        if parent is not None:  # pin the parent first: making room must not cut this chain
            self._add_child(parent)
        need = self._used_bytes + len(value) - self.capacity_bytes
        while need > 0:
            victim = self._leaves.first()
            if victim is None:
                if parent is not None:
                    self._drop_child(parent)
                self._refused_total += 1
                return False
            need -= len(victim.value)
            self._delete(victim)
            self._evicted_total += 1
            self._queue_evicted(victim.key)
        entry = _Entry(e.key, parent, value, next(self._uids), e.depth_tokens,
                       self.block_size, self._clock())
        self._entries[e.key] = entry
        self._used_bytes += len(value)
        if self._notify_policy:
            self.policy.on_insert(entry, 1)
        if not self._child_count.get(e.key):
            self._leaves.add(entry)
        return True

    def _add_child(self, parent: str) -> None:
        count = self._child_count.get(parent, 0)
        self._child_count[parent] = count + 1
        if count == 0:
            stored = self._entries.get(parent)
            if stored is not None and stored.leaf_entry is not None:
                self._leaves.remove(stored)

    def _drop_child(self, parent: str) -> None:
        count = self._child_count[parent] - 1
        if count:
            self._child_count[parent] = count
            return
        del self._child_count[parent]
        stored = self._entries.get(parent)
        if stored is not None and stored.leaf_entry is None:
            self._leaves.add(stored)

    def _delete(self, entry: _Entry) -> None:
        """Drop a stored entry (evicted or removed) and tell the policy, as a full trim."""
        if entry.leaf_entry is not None:
            self._leaves.remove(entry)
        del self._entries[entry.key]
        self._used_bytes -= len(entry.value)
        entry.num_blocks = 0  # the policies forget a node once it holds no block
        entry.num_tokens = 0
        self.policy.on_evict(entry, 1)
        if entry.parent_key is not None:
            self._drop_child(entry.parent_key)

    def remove(self, keys: Sequence[str]) -> int:
        """Drop keys (tests, ``reset``), children or not; returns how many were present.

        Removed keys are not reported by :meth:`drain_evicted` (only pressure evictions are).
        """
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._delete(entry)
                    removed += 1
        return removed

    def on_rejected(self, key: str, reason: str) -> None:
        """The tier refused the value read under ``key`` (``reason``: ``size``, ``header``,
        ``format``, ``checksum``): drop it, so that the block, computed again, is written
        afresh instead of being read and refused on every load (a stack promotes a disk value
        into this tier before the tier checks it). The key is reported by
        :meth:`drain_evicted` (its ``BlockRemoved`` event: it was announced when written), not
        counted as a pressure eviction. A key not held is ignored."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            self._delete(entry)
            self._queue_evicted(key)

    def _queue_evicted(self, key: str) -> None:
        """(Under the lock.) Report ``key`` at the next :meth:`drain_evicted`."""
        if len(self._pending_evicted) >= self._max_pending:
            self._pending_evicted.popleft()
            self._evicted_dropped_total += 1
        self._pending_evicted.append(key)

    def clear(self) -> int:
        """Drop every value (``reset_prefix_cache``), each through the policy as a removal,
        and forget the evictions not drained yet (the reset's ``AllBlocksCleared`` covers
        them); returns how many values were held."""
        with self._lock:
            entries = list(self._entries.values())
            for entry in entries:
                self._delete(entry)
            self._pending_evicted.clear()
        return len(entries)

    # ---- events, gauges, lifecycle ------------------------------------------------------
    def drain_evicted(self) -> list[str]:
        """Keys evicted by pressure since the last call (oldest first), for ``BlockRemoved``
        KV events with medium ``"CPU"``; at most ``max_pending_evicted`` are kept between
        calls (older ones are dropped and counted in ``evicted_dropped_total``)."""
        with self._lock:
            keys = list(self._pending_evicted)
            self._pending_evicted.clear()
        return keys

    def stats(self) -> dict:
        """Gauges: ``capacity_bytes``, ``used_bytes`` (sum of stored value sizes),
        ``num_blocks`` (stored values), ``evicted_blocks_total`` (pressure evictions),
        ``refused_puts_total`` (entries refused: too large or no room),
        ``evicted_dropped_total`` (evicted keys dropped from the :meth:`drain_evicted` queue)."""
        with self._lock:
            return {
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": self._used_bytes,
                "num_blocks": len(self._entries),
                "evicted_blocks_total": self._evicted_total,
                "refused_puts_total": self._refused_total,
                "evicted_dropped_total": self._evicted_dropped_total,
            }

    def close(self) -> None:
        """Drop every value (frees the memory); no call may follow."""
        with self._lock:
            self._entries.clear()
            self._child_count.clear()
            self._pending_evicted.clear()
            self._leaves = LeafIndex(self.policy)
            self._used_bytes = 0

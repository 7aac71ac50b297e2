"""A stack of store backends: memory in front of disk (``--kv-store host:GIB,disk:PATH``).

:class:`StackStore` is one backend to the tier above, made of tiers front first (``host``,
then ``disk``):

* **Write-through.** ``put`` writes every value to every tier (front first), so whatever was
  written survives a restart in the disk tier, and the memory tier serves the next reads.
  A put counts as stored when any tier holds the key afterwards.
* **Read front first, promote.** ``get_into`` asks the front tier; keys it does not hold are
  read from the next tier, and each value found there is put into the tiers in front of it
  (from the caller's buffer it was just read into: its chain parent from the value's header,
  its depth from the disk tier's index), so the next read of it is a memory copy.
* ``exists`` is true when any tier holds the key; ``remove`` and ``clear`` act on every tier;
  ``mark_retained`` and ``on_rejected`` reach every tier.
* **KV events** use the front tier's medium (``CPU``): a block is announced once, when it is
  written; a key evicted from one tier is reported removed (:meth:`drain_evicted`) only when no
  tier holds it any more.

Thread-safe as its tiers are; it adds no lock.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

from radixkv.cache.store.backend import PutEntry, StoreBackend
from radixkv.cache.store.value import read_header


class StackStore(StoreBackend):
    """Backends front first, written through, read front first with promotion.

    Args:
        tiers: At least two backends, fastest first (``HostStore``, then ``DiskStore``).

    Raises:
        ValueError: naming ``kv_store`` for fewer than two tiers.
    """

    def __init__(self, tiers: Sequence[StoreBackend]) -> None:
        if len(tiers) < 2:
            raise ValueError(f"kv_store: a stack needs at least two tiers, got {len(tiers)}")
        self.tiers = list(tiers)
        self.name = "+".join(t.name for t in self.tiers)
        self.kv_event_medium = self.tiers[0].kv_event_medium
        self.promoted_blocks_total = 0

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        for tier in self.tiers:
            tier.register_buffer(ptr, nbytes)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether any tier holds each key (the front tier is asked first)."""
        present = self.tiers[0].exists(keys)
        for tier in self.tiers[1:]:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            for i, p in zip(todo, tier.exists([keys[i] for i in todo])):
                present[i] = p
        return present

    def get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                 sizes: Sequence[int]) -> list[int]:
        """Copy each key's value from the first tier that holds it; a value read from a later
        tier is put into the tiers in front of it.

        Returns:
            Per key the bytes written, or the last tier's negative result.
        """
        out = self.tiers[0].get_into(keys, ptrs, sizes)
        for depth, tier in enumerate(self.tiers[1:], start=1):
            todo = [i for i, n in enumerate(out) if n < 0]
            if not todo:
                break
            got = tier.get_into([keys[i] for i in todo], [ptrs[i] for i in todo],
                                [sizes[i] for i in todo])
            promote: list[PutEntry] = []
            for i, n in zip(todo, got):
                out[i] = n
                if n >= 0:
                    promote.append(self._entry(tier, keys[i], ptrs[i], n))
            if promote:
                for front in self.tiers[:depth]:
                    front.put(promote)
                self.promoted_blocks_total += len(promote)
        return out

    @staticmethod
    def _entry(tier: StoreBackend, key: str, ptr: int, nbytes: int) -> PutEntry:
        """A put of the value just read into ``ptr``: its chain parent from its header, its
        depth from the tier it came from (0 when that tier does not know)."""
        view = memoryview((ctypes.c_char * max(nbytes, 1)).from_address(ptr)).cast("B")
        header = read_header(view[:nbytes])
        parent = None if isinstance(header, str) else header.parent_key
        depth_of = getattr(tier, "depth_tokens", None)
        depth = depth_of(key) if depth_of is not None else 0
        return PutEntry(key, parent, depth, ptr, nbytes)

    def put(self, entries: Sequence[PutEntry]) -> list[bool]:
        """Write every entry to every tier (front first).

        Returns:
            Per entry, whether some tier holds the key now.
        """
        stored = [False] * len(entries)
        for tier in self.tiers:
            for i, ok in enumerate(tier.put(entries)):
                stored[i] = stored[i] or ok
        return stored

    def remove(self, keys: Sequence[str]) -> int:
        """Drop keys from every tier; returns how many some tier held."""
        held = sum(self.exists(keys))
        for tier in self.tiers:
            tier.remove(keys)
        return held

    def clear(self) -> int:
        """Drop every value of every tier; returns the most any one tier held (the back tier,
        written through, holds every value)."""
        return max(tier.clear() for tier in self.tiers)

    def mark_retained(self, keys: Sequence[str], until_s: float) -> None:
        for tier in self.tiers:
            tier.mark_retained(keys, until_s)

    def on_rejected(self, key: str, reason: str) -> None:
        for tier in self.tiers:
            tier.on_rejected(key, reason)

    def drain_evicted(self) -> list[str]:
        """Keys evicted from a tier since the last call that no tier holds any more."""
        evicted: list[str] = []
        for tier in self.tiers:
            drain = getattr(tier, "drain_evicted", None)
            if drain is not None:
                evicted.extend(drain())
        if not evicted:
            return []
        unique = list(dict.fromkeys(evicted))
        return [k for k, held in zip(unique, self.exists(unique)) if not held]

    def healthy(self) -> bool:
        return all(tier.healthy() for tier in self.tiers)

    def reconnect(self) -> bool:
        return all(tier.reconnect() for tier in self.tiers)

    def stats(self) -> dict:
        """Every tier's gauges (the host tier's unprefixed, the disk tier's ``disk_*``),
        ``tiers`` (their names, front first) and ``promoted_blocks_total`` (values read from a
        back tier and copied to the front)."""
        out: dict = {}
        for tier in self.tiers:
            out.update(tier.stats())
        out["tiers"] = [tier.name for tier in self.tiers]
        out["promoted_blocks_total"] = self.promoted_blocks_total
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

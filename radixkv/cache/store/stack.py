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
* **A failing back tier degrades the stack to its front tier, per call.** A ``StoreError``
  from a tier behind the front one (a disk write error) is counted
  (``<tier>_errors_total``, e.g. ``disk_errors_total``; logged when a tier starts failing)
  and that call goes on without it: a put is stored when the front tier holds the key, a read
  is a miss there. ``healthy`` is the front tier's. So the tier above (``StoreTier``, which
  marks itself down on a ``StoreError`` or an unhealthy backend) keeps serving from memory
  while the disk fails; only a front-tier failure is raised.

Thread-safe as its tiers are (a lock guards its own counters only).
"""

from __future__ import annotations

import ctypes
import threading
from functools import partial
from typing import Callable, Sequence, TypeVar

from radixkv.cache.store.backend import PutEntry, StoreBackend
from radixkv.cache.store.value import read_header
from radixkv.errors import StoreError
from radixkv.log import get_logger

log = get_logger(__name__)
T = TypeVar("T")


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
        answers = {tier.too_small_result for tier in self.tiers}
        self.too_small_result = answers.pop() if len(answers) == 1 else None
        self.promoted_blocks_total = 0
        self._lock = threading.Lock()
        self.errors_total = {tier.name: 0 for tier in self.tiers[1:]}
        self._failing: set[str] = set()

    def _back(self, tier: StoreBackend, what: str, call: Callable[[], T], fallback: T) -> T:
        """``call()`` on a tier behind the front one; its ``StoreError`` is counted and logged
        (once per failing spell) and ``fallback`` returned instead."""
        try:
            result = call()
        except StoreError as exc:
            with self._lock:
                self.errors_total[tier.name] += 1
                first = tier.name not in self._failing
                self._failing.add(tier.name)
            if first:
                log.warning("kv_store_stack_tier_failing", tier=tier.name, during=what,
                            error=str(exc), serving_from=self.tiers[0].name)
            return fallback
        if tier.name in self._failing:
            with self._lock:
                recovered = tier.name in self._failing
                self._failing.discard(tier.name)
            if recovered:
                log.info("kv_store_stack_tier_recovered", tier=tier.name, during=what)
        return result

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        for tier in self.tiers:
            tier.register_buffer(ptr, nbytes)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether any tier holds each key (the front tier is asked first; a failing back
        tier holds nothing for this call)."""
        present = self.tiers[0].exists(keys)
        for tier in self.tiers[1:]:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            sub = [keys[i] for i in todo]
            for i, p in zip(todo, self._back(tier, "exists", partial(tier.exists, sub),
                                             [False] * len(todo))):
                present[i] = p
        return present

    def get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                 sizes: Sequence[int]) -> list[int]:
        """Copy each key's value from the first tier that holds it; a value read from a later
        tier is put into the tiers in front of it.

        Returns:
            Per key the bytes written, or the last tier's negative result (a failing back
            tier's keys stay misses).
        """
        out = self.tiers[0].get_into(keys, ptrs, sizes)
        for depth, tier in enumerate(self.tiers[1:], start=1):
            todo = [i for i, n in enumerate(out) if n < 0]
            if not todo:
                break
            sub = ([keys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo])
            got = self._back(tier, "get_into", partial(tier.get_into, *sub),
                             [out[i] for i in todo])
            promote: list[PutEntry] = []
            for i, n in zip(todo, got):
                out[i] = n
                if n >= 0:
                    promote.append(self._entry(tier, keys[i], ptrs[i], n))
            if promote:
                for k, front in enumerate(self.tiers[:depth]):
                    if k == 0:
                        front.put(promote)
                    else:
                        self._back(front, "put", partial(front.put, promote), [False] * len(promote))
                with self._lock:
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
            Per entry, whether some tier holds the key now (a failing back tier holds none:
            counted in ``<tier>_errors_total``, not raised).

        Raises:
            StoreError: the front tier failed.
        """
        stored = list(self.tiers[0].put(entries))
        for tier in self.tiers[1:]:
            for i, ok in enumerate(self._back(tier, "put", partial(tier.put, entries),
                                              [False] * len(entries))):
                stored[i] = stored[i] or ok
        return stored

    def remove(self, keys: Sequence[str]) -> int:
        """Drop keys from every tier; returns how many some tier held."""
        held = sum(self.exists(keys))
        self.tiers[0].remove(keys)
        for tier in self.tiers[1:]:
            self._back(tier, "remove", partial(tier.remove, keys), 0)
        return held

    def clear(self) -> int:
        """Drop every value of every tier; returns the most any one tier held (the back tier,
        written through, holds every value)."""
        cleared = [self.tiers[0].clear()]
        cleared += [self._back(tier, "clear", tier.clear, 0) for tier in self.tiers[1:]]
        return max(cleared)

    def mark_retained(self, keys: Sequence[str], until_s: float) -> None:
        self.tiers[0].mark_retained(keys, until_s)
        for tier in self.tiers[1:]:
            self._back(tier, "mark_retained", partial(tier.mark_retained, keys, until_s),
                       None)

    def on_rejected(self, key: str, reason: str) -> None:
        """Every tier drops the refused value (the front one may hold a promoted copy of a
        back tier's bad value, which would otherwise be read and refused on every load)."""
        self.tiers[0].on_rejected(key, reason)
        for tier in self.tiers[1:]:
            self._back(tier, "on_rejected", partial(tier.on_rejected, key, reason), None)

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
        """The front tier's health: a failing back tier only degrades the stack (see the
        module doc), it does not take the front tier down with it."""
        return self.tiers[0].healthy()

    def reconnect(self) -> bool:
        """Reconnect every tier; usable again when the front tier is."""
        for tier in self.tiers[1:]:
            self._back(tier, "reconnect", tier.reconnect, False)
        return self.tiers[0].reconnect()

    def stats(self) -> dict:
        """Every tier's gauges (the host tier's unprefixed, the disk tier's ``disk_*``),
        ``tiers`` (their names, front first), ``promoted_blocks_total`` (values read from a
        back tier and copied to the front) and per back tier ``<name>_errors_total`` (its
        calls that raised ``StoreError`` and were gone on without)."""
        out: dict = {}
        for tier in self.tiers:
            out.update(tier.stats())
        out["tiers"] = [tier.name for tier in self.tiers]
        with self._lock:
            out["promoted_blocks_total"] = self.promoted_blocks_total
            out.update({f"{name}_errors_total": n for name, n in self.errors_total.items()})
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

"""What a store backend does, and the ``--kv-store`` spec that picks one.

A backend moves whole block values (``radixkv.cache.store.value``) between memory the caller
owns (a registered staging buffer: pointer + size) and its own storage, under string keys. It
never interprets a value: the tier above builds and checks headers. Backends:

* ``host`` (``radixkv.cache.store.host``): bounded process memory with its own eviction policy
  from ``radixkv.eviction``, prefix-closed per chain (a block is evicted only when no stored
  block names it as parent). On a GPU this is the pinned-host L2 tier.
* ``disk`` (``radixkv.cache.store.disk``): one file per value in a private directory, written
  atomically, found again after a restart (the file names are the index), bounded by its own
  capacity, oldest-accessed evicted first (retained blocks last).
* ``mooncake`` (``radixkv.cache.store.mooncake``): a Mooncake Store client
  (``mooncake.store.MooncakeDistributedStore``) talking to a ``mooncake_master``; shared by
  every replica on the same master.
* a stack (``radixkv.cache.store.stack``): ``host`` in front of ``disk``, written through to
  both, read from the first that holds a value (a disk hit is promoted to memory).

Backend calls run in the tier's loader and writer threads, never in the engine's step loop, and
may run concurrently with each other: a backend is thread-safe. A failed call raises
:class:`radixkv.errors.StoreError`; the tier counts it and carries on (a recompute, never a crash).
"""

from __future__ import annotations

import abc
import dataclasses
import os
import urllib.parse
from typing import Sequence

#: ``--kv-store-write`` modes: every published block once, or only what the device pool evicts.
WRITE_MODES = ("all", "evict")


@dataclasses.dataclass(frozen=True)
class PutEntry:
    """One value to write.

    Attributes:
        key: The block's store key (``value.store_key``).
        parent_key: The previous block's key, None for a block at an identity root (the host
            tier keeps chains prefix-closed with it; Mooncake ignores it).
        depth_tokens: Tokens before the block (its position in the sequence).
        ptr: Address of the value (header + payload) in registered memory.
        nbytes: Value size in bytes.
    """

    key: str
    parent_key: str | None
    depth_tokens: int
    ptr: int
    nbytes: int


class StoreBackend(abc.ABC):
    """A key → block-value store (thread-safe).

    Attributes:
        name: ``"host"`` or ``"mooncake"``.
        kv_event_medium: The ``medium`` its blocks are published with in KV events, or None
            when they are not published (a shared pool has no single owner).
        too_small_result: What ``get_into`` answers for a value larger than the room given
            (None: it does not tell that from a miss). The tier refuses such a value
            (``"size"``: a value of another layout or KV format under the key) instead of
            taking it for a miss, so the block computed again replaces it where the backend
            drops refused values (``on_rejected``).
    """

    name = ""
    kv_event_medium: str | None = None
    too_small_result: int | None = None

    def register_buffer(self, ptr: int, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Memory the tier will pass as ``ptr`` to ``put`` / ``get_into`` (its staging
        buffers); a backend that transfers from registered memory only registers it here.

        Raises:
            StoreError: the backend refused the registration.
        """

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a value now.

        Raises:
            StoreError: the store could not answer.
        """

    @abc.abstractmethod
    def put(self, entries: Sequence[PutEntry]) -> list[bool]:
        """Store each entry's value (copied out of ``ptr`` before returning); a key that
        already holds a value is left as it is (values are immutable).

        Returns:
            Per entry, whether the key holds a value now (False: refused, e.g. no space).

        Raises:
            StoreError: the store could not be reached.
        """

    @abc.abstractmethod
    def get_into(self, keys: Sequence[str], ptrs: Sequence[int],
                 sizes: Sequence[int]) -> list[int]:
        """Copy each key's value into ``ptrs[i]`` (room for ``sizes[i]`` bytes).

        Returns:
            Per key the bytes written, or a negative number when the key is missing or its
            value does not fit (nothing usable was written then).

        Raises:
            StoreError: the store could not be reached.
        """

    @abc.abstractmethod
    def remove(self, keys: Sequence[str]) -> int:
        """Drop keys (tests, ``reset``); returns how many were present.

        Raises:
            StoreError: the store could not be reached.
        """

    def clear(self) -> int:
        """Drop every value (``reset_prefix_cache``) and every eviction not yet drained; only
        a per-replica backend (``kv_event_medium`` set) implements it: a shared one holds
        other replicas' cache too, which one replica's reset must not drop.

        Returns:
            How many values were held.

        Raises:
            NotImplementedError: a shared backend.
        """
        raise NotImplementedError(f"{self.name}: a shared store is not cleared by one replica")

    def healthy(self) -> bool:
        """Whether the backend can serve now (cheap; no exception)."""
        return True

    def reconnect(self) -> bool:
        """Try to re-establish a lost connection; True when usable again."""
        return self.healthy()

    def stats(self) -> dict:
        """Backend gauges for ``/stats`` (units in the names)."""
        return {}

    def mark_retained(self, keys: Sequence[str], until_s: float) -> None:  # noqa: B027 - optional hook
        """Keep ``keys`` longest under pressure until ``until_s`` (seconds on the engine's
        monotonic clock, ``time.monotonic``): a backend with its own capacity evicts them
        only after every block not retained. Keys not stored yet are remembered for when they
        are. ``until_s`` at or before the backend's now (``-inf`` from
        ``StoreTier.unmark_retained``) clears the keys' marks: no retention holds them any
        more, they rank as ordinary blocks again. A no-op where the backend has no such notion
        (``host``: the device tier's policy decides; ``mooncake``: a shared pool).
        """

    def on_rejected(self, key: str, reason: str) -> None:  # noqa: B027 - optional hook
        """The tier refused the value it read under ``key`` (``value.check_value``'s
        ``reason``): a backend that keeps values across calls may drop it, so that the block,
        computed again, is written afresh instead of failing every later load. No-op default.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the backend's resources; no call may follow."""


@dataclasses.dataclass(frozen=True)
class KVStoreSpec:
    """A parsed ``--kv-store`` value.

    ``host:GIB[?policy=NAME]`` — an in-process tier of GIB GiB (a positive number).
    ``disk:PATH[?gib=N]`` — one file per block value under the directory PATH (created 0700;
    an existing one must be private to the service user), at most N GiB (default: what it
    holds at start plus 90 % of its file system's free space then). PATH holds no ``,``.
    ``host:GIB,disk:PATH`` — memory in front of disk (a stack: written through to both, read
    from memory first, a disk hit copied into memory).
    ``mooncake://MASTER_HOST:PORT?metadata=URL[&local=HOST[:PORT]][&segment_gib=G]
    [&buffer_mib=M][&protocol=tcp]`` — a Mooncake Store client: ``metadata`` is the master's
    HTTP metadata server (``http://HOST:PORT/metadata``), ``local`` this replica's
    transfer-engine address (default ``127.0.0.1``; two replicas on one host need distinct
    ports), ``segment_gib`` the memory it contributes to the shared pool (default 1),
    ``buffer_mib`` its transfer buffer (default 64).

    Attributes:
        kind: ``"host"``, ``"disk"``, ``"mooncake"`` or ``"stack"``.
        capacity_bytes: Host tier size (host), disk tier size (disk; 0: the default).
        policy: Host tier eviction policy name, None: the device cache's policy (a stack: its
            host tier's).
        path: The disk tier's directory (absolute).
        tiers: A stack's tiers, front first (``host`` then ``disk``); empty otherwise.
        master: ``HOST:PORT`` of ``mooncake_master``.
        metadata_url: Mooncake metadata server URL.
        local_hostname: This client's transfer-engine address.
        segment_bytes: Memory contributed to the Mooncake pool.
        buffer_bytes: Mooncake client transfer buffer.
        protocol: Mooncake transport (``tcp`` here; ``rdma`` where the NICs have it).
    """

    kind: str
    capacity_bytes: int = 0
    policy: str | None = None
    master: str = ""
    metadata_url: str = ""
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 1 << 30
    buffer_bytes: int = 64 << 20
    protocol: str = "tcp"
    path: str = ""
    tiers: tuple[KVStoreSpec, ...] = ()

    def describe(self) -> str:
        """The spec without anything secret, for logs and ``/stats``."""
        if self.kind == "host":
            return f"host:{self.capacity_bytes / (1 << 30):g}"
        if self.kind == "disk":
            gib = f"?gib={self.capacity_bytes / (1 << 30):g}" if self.capacity_bytes else ""
            return f"disk:{self.path}{gib}"
        if self.kind == "stack":
            return ",".join(t.describe() for t in self.tiers)
        return f"mooncake://{self.master}"


def _positive_number(field: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{field}: must be a positive number, got {text!r}")
    return value


_EXPECTED = ("expected host:GIB or mooncake://HOST:PORT?metadata=URL or disk:PATH[?gib=N] "
             "(host:GIB,disk:PATH stacks memory in front of disk)")


def parse_kv_store(text: str) -> KVStoreSpec:
    """Parse a ``--kv-store`` value (see :class:`KVStoreSpec`).

    Raises:
        ValueError: naming ``kv_store`` (and the part at fault) for anything malformed.
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"kv_store: {_EXPECTED}, got {text!r}")
    if "," in text and not text.startswith("mooncake://"):
        parts = text.split(",")
        if not all(parts):
            raise ValueError(f"kv_store: an empty tier in {text!r} (a stack is "
                             f"host:GIB,disk:PATH; a disk PATH holds no ',')")
        tiers = tuple(_parse_tier(part) for part in parts)
        kinds = [t.kind for t in tiers]
        if kinds != ["host", "disk"]:
            raise ValueError(f"kv_store: a stack of tiers is host:GIB,disk:PATH (memory in front "
                             f"of disk; mooncake:// stands alone), got {text!r}")
        return KVStoreSpec("stack", policy=tiers[0].policy, tiers=tiers)
    return _parse_tier(text)


def _parse_tier(text: str) -> KVStoreSpec:
    if text.startswith("host:"):
        body, _, query = text[5:].partition("?")
        params = _query(query, {"policy"})
        gib = _positive_number("kv_store (host capacity in GiB)", body)
        return KVStoreSpec("host", capacity_bytes=int(gib * (1 << 30)),
                           policy=params.get("policy"))
    if text.startswith("disk:"):
        body, _, query = text[5:].partition("?")
        params = _query(query, {"gib"})
        if not body.strip():
            raise ValueError(f"kv_store: disk needs a directory, disk:PATH[?gib=N], got {text!r}")
        capacity = 0
        if "gib" in params:
            capacity = int(_positive_number("kv_store (disk capacity gib)", params["gib"])
                           * (1 << 30))
            if capacity < 1:
                raise ValueError(f"kv_store (disk capacity gib): must be at least one byte, "
                                 f"got {params['gib']!r}")
        return KVStoreSpec("disk", capacity_bytes=capacity,
                           path=os.path.abspath(os.path.expanduser(body)))
    if text.startswith("mooncake://"):
        parsed = urllib.parse.urlsplit(text)
        try:
            port = parsed.port
        except ValueError:
            port = None
        if not parsed.hostname or port is None:
            raise ValueError(f"kv_store: mooncake master must be HOST:PORT, got "
                             f"{parsed.netloc!r}")
        params = _query(parsed.query, {"metadata", "local", "segment_gib", "buffer_mib",
                                       "protocol"})
        metadata = params.get("metadata", "")
        if not metadata.startswith(("http://", "https://", "etcd://", "P2PHANDSHAKE")):
            raise ValueError("kv_store: mooncake needs metadata=URL (the master's HTTP metadata "
                             "server, e.g. http://127.0.0.1:8080/metadata)")
        host = "[" + parsed.hostname + "]" if ":" in parsed.hostname else parsed.hostname
        return KVStoreSpec(
            "mooncake", master=f"{host}:{port}", metadata_url=metadata,
            local_hostname=params.get("local", "127.0.0.1"),
            segment_bytes=int(_positive_number("kv_store segment_gib",
                                               params.get("segment_gib", "1")) * (1 << 30)),
            buffer_bytes=int(_positive_number("kv_store buffer_mib",
                                              params.get("buffer_mib", "64")) * (1 << 20)),
            protocol=params.get("protocol", "tcp"))
    raise ValueError(f"kv_store: {_EXPECTED}, got {text!r}")


def _query(query: str, known: set[str]) -> dict[str, str]:
    params: dict[str, str] = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in known:
            raise ValueError(f"kv_store: unknown option {name!r} (known: {', '.join(sorted(known))})")
        params[name] = value
    return params

"""What a store backend does, and the ``--kv-store`` spec that picks one.

A backend moves whole block values (``radixkv.cache.store.value``) between memory the caller
owns (a registered staging buffer: pointer + size) and its own storage, under string keys. It
never interprets a value: the tier above builds and checks headers. Backends:

* ``host`` (``radixkv.cache.store.host``): bounded process memory with its own eviction policy
  from ``radixkv.eviction``, prefix-closed per chain (a block is evicted only when no stored
  block names it as parent). On a GPU this is the pinned-host L2 tier.
* ``mooncake`` (``radixkv.cache.store.mooncake``): a Mooncake Store client
  (``mooncake.store.MooncakeDistributedStore``) talking to a ``mooncake_master``; shared by
  every replica on the same master.

Backend calls run in the tier's loader and writer threads, never in the engine's step loop, and
may run concurrently with each other: a backend is thread-safe. A failed call raises
:class:`radixkv.errors.StoreError`; the tier counts it and carries on (a recompute, never a crash).
"""

from __future__ import annotations

import abc
import dataclasses
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
    """

    name = ""
    kv_event_medium: str | None = None

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

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the backend's resources; no call may follow."""


@dataclasses.dataclass(frozen=True)
class KVStoreSpec:
    """A parsed ``--kv-store`` value.

    ``host:GIB[?policy=NAME]`` — an in-process tier of GIB GiB (a positive number).
    ``mooncake://MASTER_HOST:PORT?metadata=URL[&local=HOST[:PORT]][&segment_gib=G]
    [&buffer_mib=M][&protocol=tcp]`` — a Mooncake Store client: ``metadata`` is the master's
    HTTP metadata server (``http://HOST:PORT/metadata``), ``local`` this replica's
    transfer-engine address (default ``127.0.0.1``; two replicas on one host need distinct
    ports), ``segment_gib`` the memory it contributes to the shared pool (default 1),
    ``buffer_mib`` its transfer buffer (default 64).

    Attributes:
        kind: ``"host"`` or ``"mooncake"``.
        capacity_bytes: Host tier size (host only).
        policy: Host tier eviction policy name, None: the device cache's policy.
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

    def describe(self) -> str:
        """The spec without anything secret, for logs and ``/stats``."""
        if self.kind == "host":
            return f"host:{self.capacity_bytes / (1 << 30):g}"
        return f"mooncake://{self.master}"


def _positive_number(field: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{field}: must be a positive number, got {text!r}")
    return value


def parse_kv_store(text: str) -> KVStoreSpec:
    """Parse a ``--kv-store`` value (see :class:`KVStoreSpec`).

    Raises:
        ValueError: naming ``kv_store`` (and the part at fault) for anything malformed.
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"kv_store: expected host:GIB or mooncake://HOST:PORT?metadata=URL, "
                         f"got {text!r}")
    if text.startswith("host:"):
        body, _, query = text[5:].partition("?")
        params = _query(query, {"policy"})
        gib = _positive_number("kv_store (host capacity in GiB)", body)
        return KVStoreSpec("host", capacity_bytes=int(gib * (1 << 30)),
                           policy=params.get("policy"))
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
    raise ValueError(f"kv_store: expected host:GIB or mooncake://HOST:PORT?metadata=URL, got "
                     f"{text!r}")


def _query(query: str, known: set[str]) -> dict[str, str]:
    params: dict[str, str] = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in known:
            raise ValueError(f"kv_store: unknown option {name!r} (known: {', '.join(sorted(known))})")
        params[name] = value
    return params

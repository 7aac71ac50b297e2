"""The ``mooncake`` store backend against a real ``mooncake_master`` (one per module) on loopback.

Values are SmolLM2-sized (a fp32 block: 60 segments of 12288 B plus the header) random bytes,
moved through registered ctypes buffers; two ``MooncakeStore`` objects with their own local
transfer-engine ports stand for two replicas. The master-failure test runs its own master and
kills it by PID. Nothing is mocked.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixkv.cache.store.backend import PutEntry, parse_kv_store
from radixkv.cache.store.mooncake import INVALID_PARAMS, OBJECT_NOT_FOUND, MooncakeStore
from radixkv.cache.store.value import BlockLayout
from radixkv.errors import StoreError
from tests.mooncake_harness import MooncakeMaster, local_hostname, run_master

SMOLLM2 = BlockLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", itemsize=4,
                      block_size=16)
VALUE_BYTES = SMOLLM2.value_bytes(16)  # 737472: 60 x 12288 payload + 192 header
SLOTS = 8


class Buffer:
    """``SLOTS`` value-sized slots of ctypes memory (what the tier's staging buffer is)."""

    def __init__(self, slots: int = SLOTS, slot_bytes: int = VALUE_BYTES) -> None:
        self.slot_bytes = slot_bytes
        self.nbytes = slots * slot_bytes
        self.mem = ctypes.create_string_buffer(self.nbytes)
        self.ptr = ctypes.addressof(self.mem)

    def at(self, slot: int) -> int:
        return self.ptr + slot * self.slot_bytes

    def write(self, slot: int, data: bytes) -> PutEntry:
        ctypes.memmove(self.at(slot), data, len(data))
        return PutEntry(key="", parent_key=None, depth_tokens=0, ptr=self.at(slot), nbytes=len(data))

    def read(self, slot: int, nbytes: int) -> bytes:
        return ctypes.string_at(self.at(slot), nbytes)


def entry(buf: Buffer, slot: int, key: str, data: bytes) -> PutEntry:
    written = buf.write(slot, data)
    return PutEntry(key=key, parent_key=None, depth_tokens=16 * slot, ptr=written.ptr,
                    nbytes=written.nbytes)


def keys(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"rkv1:{SMOLLM2.tag}:test:{tag}:{i}" for i in range(n)]


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    with run_master(tmp_path_factory.mktemp("mooncake")) as proc:
        yield proc


def connect(master: MooncakeMaster, *buffers: Buffer) -> MooncakeStore:
    store = MooncakeStore(parse_kv_store(master.kv_store_url(local=local_hostname())))
    for buf in buffers:
        store.register_buffer(buf.ptr, buf.nbytes)
    return store


@pytest.fixture(scope="module")
def buffers() -> tuple[Buffer, Buffer]:
    return Buffer(), Buffer()


@pytest.fixture(scope="module")
def replicas(master: MooncakeMaster, buffers: tuple[Buffer, Buffer]) -> Iterator[tuple[MooncakeStore, ...]]:
    """Two clients (replicas A and B), each with both buffers registered."""
    a = connect(master, *buffers)
    b = connect(master, *buffers)
    yield a, b
    a.close()
    b.close()


def test_spec_and_identity(master: MooncakeMaster, replicas: tuple[MooncakeStore, ...]) -> None:
    spec = parse_kv_store(master.kv_store_url(local="127.0.0.1:40001", segment_gib=0.5))
    assert (spec.kind, spec.master, spec.metadata_url, spec.local_hostname, spec.segment_bytes) == (
        "mooncake", master.master_addr, master.metadata_url, "127.0.0.1:40001", 1 << 29)
    a, _ = replicas
    assert (a.name, a.kv_event_medium, a.healthy()) == ("mooncake", None, True)
    stats = a.stats()
    assert stats == {"master": master.master_addr, "healthy": True, "clients_replaced_total": 0,
                     "unreachable_errors_total": 0, "registered_buffer_bytes": 2 * SLOTS * VALUE_BYTES,
                     "segment_bytes": 1 << 28, "last_put_error": None}


def test_roundtrip_exact_bytes(replicas, buffers) -> None:
    a, _ = replicas
    src, dst = buffers
    names = keys(3)
    values = [os.urandom(VALUE_BYTES) for _ in names]
    assert a.exists(names) == [False, False, False]
    assert a.put([entry(src, i, k, v) for i, (k, v) in enumerate(zip(names, values))]) == [True] * 3
    assert a.exists(names) == [True, True, True]
    assert a.get_into(names, [dst.at(i) for i in range(3)], [VALUE_BYTES] * 3) == [VALUE_BYTES] * 3
    assert [dst.read(i, VALUE_BYTES) for i in range(3)] == values
    # Empty batches never reach the client.
    assert (a.exists([]), a.put([]), a.get_into([], [], []), a.remove([])) == ([], [], [], 0)


def test_put_existing_key_keeps_first_value(replicas, buffers) -> None:
    a, b = replicas
    src, dst = buffers
    (key,) = keys(1)
    first, second = os.urandom(VALUE_BYTES), os.urandom(VALUE_BYTES)
    assert a.put([entry(src, 0, key, first)]) == [True]
    assert a.put([entry(src, 1, key, second)]) == [True]  # already there: stored, unchanged
    assert b.put([entry(src, 1, key, second)]) == [True]
    assert b.get_into([key], [dst.at(0)], [VALUE_BYTES]) == [VALUE_BYTES]
    assert dst.read(0, VALUE_BYTES) == first


def test_get_missing_or_too_small_is_negative(replicas, buffers) -> None:
    a, _ = replicas
    src, dst = buffers
    missing, present = keys(2)
    assert a.get_into([missing], [dst.at(0)], [VALUE_BYTES]) == [OBJECT_NOT_FOUND]
    data = os.urandom(VALUE_BYTES)
    assert a.put([entry(src, 0, present, data)]) == [True]
    marker = b"\xa5" * VALUE_BYTES
    ctypes.memmove(dst.at(1), marker, VALUE_BYTES)
    got = a.get_into([present, missing], [dst.at(1), dst.at(2)], [VALUE_BYTES - 1, VALUE_BYTES])
    assert got == [INVALID_PARAMS, OBJECT_NOT_FOUND]
    assert dst.read(1, VALUE_BYTES) == marker  # nothing copied into a buffer that is too small
    # A larger buffer is fine: the value's own size comes back.
    assert a.get_into([present], [dst.at(1)], [2 * VALUE_BYTES]) == [VALUE_BYTES]
    assert dst.read(1, VALUE_BYTES) == data


def test_two_replicas_share_values_and_remove(replicas, buffers) -> None:
    a, b = replicas
    src, dst = buffers
    names = keys(4)
    values = [os.urandom(VALUE_BYTES) for _ in names]
    assert a.put([entry(src, i, k, v) for i, (k, v) in enumerate(zip(names, values))]) == [True] * 4
    assert b.exists(names) == [True] * 4
    assert b.get_into(names, [dst.at(i) for i in range(4)], [VALUE_BYTES] * 4) == [VALUE_BYTES] * 4
    assert [dst.read(i, VALUE_BYTES) for i in range(4)] == values
    # Just read (a lease is held): remove still works, it forces.
    assert b.remove(names[:2] + keys(1)) == 2
    assert a.exists(names) == [False, False, True, True]
    assert a.get_into(names[:1], [dst.at(0)], [VALUE_BYTES]) == [OBJECT_NOT_FOUND]
    assert a.remove(names) == 2


def test_concurrent_calls_from_threads(replicas) -> None:
    """A 64-value put in one thread, gets in others, on one client: every byte right."""
    a, _ = replicas
    big, out = Buffer(64), Buffer(16)
    a.register_buffer(big.ptr, big.nbytes)
    a.register_buffer(out.ptr, out.nbytes)
    base = keys(8)
    values = [os.urandom(VALUE_BYTES) for _ in base]
    assert a.put([entry(big, i, k, v) for i, (k, v) in enumerate(zip(base, values))]) == [True] * 8
    errors: list[object] = []

    def writer() -> None:
        for _ in range(3):
            batch = keys(64)
            if a.put([PutEntry(k, None, 0, big.at(i), VALUE_BYTES) for i, k in enumerate(batch)]) != [True] * 64:
                errors.append("put")

    def reader(first_slot: int) -> None:
        for _ in range(10):
            got = a.get_into(base, [out.at(first_slot + i) for i in range(8)], [VALUE_BYTES] * 8)
            if got != [VALUE_BYTES] * 8 or [out.read(first_slot + i, VALUE_BYTES) for i in range(8)] != values:
                errors.append(("get", got))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader, args=(0,)),
               threading.Thread(target=reader, args=(8,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


def test_master_killed_then_restarted(tmp_path: Path) -> None:
    """Calls raise StoreError within a bound while the master is dead, reconnect() is False at
    once; after a restart on the same ports reconnect() is True, earlier objects are gone and
    new ones round-trip."""
    buf = Buffer(8)
    with run_master(tmp_path) as master:
        store = connect(master, buf)
        try:
            (old,) = keys(1)
            assert store.put([entry(buf, 0, old, os.urandom(VALUE_BYTES))]) == [True]
            master.kill()
            # The first call may spend the client's own reconnect attempt (~4.4 s measured).
            started = time.monotonic()
            with pytest.raises(StoreError, match="unreachable"):
                store.exists([old])
            first_s = time.monotonic() - started
            assert first_s < 10.0, first_s
            assert store.healthy() is False
            # Then calls fail at once (fail-fast window, then a refused TCP probe).
            for call in (lambda: store.get_into([old], [buf.at(1)], [VALUE_BYTES]),
                         lambda: store.put([entry(buf, 1, old, b"x" * 64)]),
                         lambda: store.remove([old])):
                started = time.monotonic()
                with pytest.raises(StoreError, match="unreachable"):
                    call()
                assert time.monotonic() - started < 1.0
            started = time.monotonic()
            assert store.reconnect() is False
            assert time.monotonic() - started < 1.0
            master.restart()
            assert store.reconnect() is True
            assert store.healthy() is True
            stats = store.stats()
            assert (stats["clients_replaced_total"], stats["healthy"]) == (1, True)
            assert stats["unreachable_errors_total"] >= 1
            assert store.exists([old]) == [False]  # gone with the master's metadata
            new = keys(3)
            values = [os.urandom(VALUE_BYTES) for _ in new]
            # The new client mounted its segment in setup: puts work at once.
            assert store.put([entry(buf, i, k, v) for i, (k, v) in enumerate(zip(new, values))]) == [True] * 3
            ctypes.memset(buf.at(4), 0, 3 * VALUE_BYTES)
            assert store.get_into(new, [buf.at(4 + i) for i in range(3)], [VALUE_BYTES] * 3) == [VALUE_BYTES] * 3
            assert [buf.read(4 + i, VALUE_BYTES) for i in range(3)] == values
        finally:
            store.close()
    assert store.reconnect() is False  # closed for good

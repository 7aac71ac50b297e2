"""The ``disk`` store backend and the ``host:…,disk:…`` stack: byte-exact values through real
ctypes buffers, atomic files found again by a new store on the same directory, every corrupt,
truncated or foreign file refused and counted (deleted, written afresh later), ``kill -9``
in the middle of writes, the capacity bound in access order with retained blocks last,
private permissions, the directory lock, and the tier under a real engine (tiny model) across
a store reopen."""

from __future__ import annotations

import ctypes
import glob
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixkv.cache.store.backend import KVStoreSpec, PutEntry, parse_kv_store
from radixkv.cache.store.disk import MISSING, TOO_SMALL, DiskStore, header_digest
from radixkv.cache.store.factory import make_backend
from radixkv.cache.store.host import HostStore
from radixkv.cache.store.stack import StackStore
from radixkv.cache.store.value import (
    BlockLayout,
    check_stored_value,
    encode_header,
    payload_checksum,
    read_header,
    store_key,
)
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import StoreError
from radixkv.model.loader import load_model
from tests.conftest import make_tiny_model_dir
from tests.factories import make_engine

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", itemsize=4,
                     block_size=4)
DIGEST = 16
VB = LAYOUT.value_bytes(DIGEST)  # 2048-byte payload + header
ROOT = bytes(range(16))
TOKENS = bytes(16)


class Clock:
    """An injected clock: every reading is the next integer (1, 2, 3, ...) unless ``frozen``."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start
        self.frozen = False

    def __call__(self) -> float:
        if not self.frozen:
            self.t += 1.0
        return self.t


def chain_hashes(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def make_value(block_hash: bytes, parent: bytes = ROOT, root: bytes = ROOT,
               layout: BlockLayout = LAYOUT, tokens: bytes = TOKENS) -> bytes:
    """A well-formed value whose payload is derived from its hash (a mix-up shows)."""
    payload = random.Random(block_hash).randbytes(layout.payload_bytes)
    return encode_header(layout, root, block_hash, parent, tokens,
                         payload_checksum(payload)) + payload


class Buffers:
    """Real memory the store copies from and into (kept alive for the test's duration)."""

    def __init__(self) -> None:
        self.keep: list[bytearray] = []

    def addr(self, data: bytes | bytearray) -> int:
        ba = data if isinstance(data, bytearray) else bytearray(data)
        self.keep.append(ba)
        return ctypes.addressof(ctypes.c_char.from_buffer(ba))


def entries_for(hashes: list[bytes], bufs: Buffers, start_depth: int = 0,
                parent: bytes = ROOT) -> tuple[list[PutEntry], dict[str, bytes]]:
    entries, values = [], {}
    for i, h in enumerate(hashes):
        value = make_value(h, parent)
        key = store_key(LAYOUT, ROOT, h)
        parent_key = None if parent == ROOT else store_key(LAYOUT, ROOT, parent)
        entries.append(PutEntry(key, parent_key, (start_depth + i) * 4, bufs.addr(value),
                                len(value)))
        values[key] = value
        parent = h
    return entries, values


def read(store, key: str, room: int = VB) -> bytes | int:
    dst = bytearray(room)
    n = store.get_into([key], [ctypes.addressof(ctypes.c_char.from_buffer(dst))], [room])[0]
    return bytes(dst[:n]) if n >= 0 else n


def file_of(path: Path, key: str) -> Path:
    (name,) = glob.glob(str(path / key[-2:] / (glob.escape(key) + ".d*")))
    return Path(name)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_values_roundtrip_exactly_and_files_are_private(tmp_path):
    path = tmp_path / "kv"
    store, bufs = DiskStore(str(path), 100 * VB, fsync=True), Buffers()
    try:
        entries, values = entries_for(chain_hashes(3), bufs)
        assert store.put(entries) == [True, True, True]
        for e in entries:  # the store copied: the source may change now
            ctypes.memset(e.ptr, 0xAB, e.nbytes)
        assert store.exists(list(values) + ["rkv1:x:00:00"]) == [True, True, True, False]
        for key, value in values.items():
            assert read(store, key) == value
        assert read(store, "rkv1:x:00:00") == MISSING
        assert read(store, next(iter(values)), room=VB - 1) == TOO_SMALL
        assert mode(path) == 0o700 and mode(path / ".lock") == 0o600
        for key in values:
            f = file_of(path, key)
            assert (mode(f), mode(f.parent), f.stat().st_size) == (0o600, 0o700, VB)
            depth = list(values).index(key) * 4
            assert f.name == f"{key}.d{depth}.h{header_digest(values[key][:read_header(values[key]).header_bytes])}"
        assert not list(path.glob("*/.tmp-*"))
        stats = store.stats()
        assert (stats["disk_num_blocks"], stats["disk_used_bytes"], stats["disk_written_blocks_total"],
                stats["disk_hit_blocks_total"]) == (3, 3 * VB, 3, 3)
        assert store.put(entries[:1]) == [True]  # already stored: left as it is
        assert store.stats()["disk_written_blocks_total"] == 3
    finally:
        store.close()


def test_a_new_store_on_the_directory_finds_every_value(tmp_path):
    path, bufs = tmp_path / "kv", Buffers()
    store = DiskStore(str(path), 100 * VB, fsync=False)
    entries, values = entries_for(chain_hashes(5), bufs)
    assert store.put(entries) == [True] * 5
    store.close()
    (path / "ab").mkdir(mode=0o700)
    (path / "ab" / ".tmp-0123456789abcdef").write_bytes(b"half a value")  # a killed write
    (path / "ab" / "notes.txt").write_text("not a value")  # not ours: left alone, not counted
    again = DiskStore(str(path), 100 * VB)
    try:
        stats = again.stats()
        assert (stats["disk_found_blocks_at_start"], stats["disk_num_blocks"],
                stats["disk_used_bytes"], stats["disk_removed_temp_files_at_start"]) == (5, 5, 5 * VB, 1)
        assert not (path / "ab" / ".tmp-0123456789abcdef").exists()
        assert (path / "ab" / "notes.txt").exists()
        assert again.exists(list(values)) == [True] * 5
        assert [read(again, k) for k in values] == list(values.values())
        assert again.depth_tokens(entries[3].key) == 12
    finally:
        again.close()


def test_a_second_store_on_the_same_directory_is_refused(tmp_path):
    store = DiskStore(str(tmp_path / "kv"), VB)
    try:
        with pytest.raises(StoreError, match=r"kv_store disk: .*kv is in use by another store "
                                             rf"\(pid {os.getpid()} holds"):
            DiskStore(str(tmp_path / "kv"), VB)
    finally:
        store.close()
    DiskStore(str(tmp_path / "kv"), VB).close()  # released on close (and by the kernel on exit)


def test_a_directory_open_to_others_or_not_a_directory_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with pytest.raises(ValueError, match=rf"kv_store: disk directory {shared} is open to other "
                                         rf"users \(mode 0755\); .* chmod 700 {shared}"):
        DiskStore(str(shared), VB)
    assert list(shared.iterdir()) == []  # nothing written into it
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=f"kv_store: disk path {a_file} is not a directory"):
        DiskStore(str(a_file), VB)
    nested = tmp_path / "new" / "deeper"
    DiskStore(str(nested), VB).close()
    assert mode(nested) == 0o700


def _corrupt_and_read(tmp_path: Path, damage) -> tuple[DiskStore, str, bytes, Path]:
    path, bufs = tmp_path / "kv", Buffers()
    store = DiskStore(str(path), 100 * VB, fsync=False)
    entries, values = entries_for(chain_hashes(4, seed=9), bufs)
    assert store.put(entries) == [True] * 4
    key = entries[2].key
    f = file_of(path, key)
    damage(f, values, entries)
    return store, key, values[key], f


@pytest.mark.parametrize("damage,reason", [
    (lambda f, v, e: f.write_bytes(f.read_bytes()[:-100]), "size"),  # truncated payload
    (lambda f, v, e: f.write_bytes(f.read_bytes()[:40]), "size"),  # truncated header
    (lambda f, v, e: f.write_bytes(f.read_bytes() + b"\0"), "size"),  # extended
    (lambda f, v, e: _flip(f, -7), "checksum"),  # one payload bit
    (lambda f, v, e: _flip(f, 80), "header"),  # a token/parent-hash bit: the name's digest
    (lambda f, v, e: _flip(f, 0), "header"),  # the magic
    (lambda f, v, e: f.write_bytes(v[e[0].key]), "foreign"),  # another block's whole value
    (lambda f, v, e: f.write_bytes(make_value(read_header(v[e[2].key]).block_hash,
                                              root=bytes(16))), "foreign"),  # another identity
])
def test_a_damaged_file_is_refused_deleted_counted_and_written_afresh(tmp_path, damage, reason):
    store, key, value, f = _corrupt_and_read(tmp_path, damage)
    try:
        assert read(store, key, room=VB + 64) == MISSING
        assert not f.exists() and store.exists([key]) == [False]
        stats = store.stats()
        assert stats["disk_rejected_blocks_total"] == 1
        assert stats["disk_rejected_blocks_by_reason"] == {
            r: int(r == reason) for r in ("size", "header", "foreign", "checksum", "io", "format")}
        assert (stats["disk_num_blocks"], stats["disk_used_bytes"]) == (3, 3 * VB)
        bufs = Buffers()
        parent = store_key(LAYOUT, ROOT, read_header(value).parent_hash)
        assert store.put([PutEntry(key, parent, 8, bufs.addr(value), VB)]) == [True]
        assert read(store, key) == value
    finally:
        store.close()


def _flip(f: Path, offset: int) -> None:
    data = bytearray(f.read_bytes())
    data[offset] ^= 0x10
    f.write_bytes(bytes(data))


def test_a_value_removed_behind_the_stores_back_is_a_miss(tmp_path):
    store, key, _, f = _corrupt_and_read(tmp_path, lambda f, v, e: f.unlink())
    try:
        assert read(store, key) == MISSING and store.exists([key]) == [False]
        assert store.stats()["disk_missing_files_total"] == 1
        assert store.stats()["disk_rejected_blocks_total"] == 0
    finally:
        store.close()


def test_the_tiers_rejection_deletes_the_file(tmp_path):
    store, key, _, f = _corrupt_and_read(tmp_path, lambda f, v, e: None)
    try:
        store.on_rejected(key, "header")
        assert not f.exists() and store.exists([key]) == [False]
        assert store.stats()["disk_rejected_blocks_by_reason"]["header"] == 1
    finally:
        store.close()


def test_invalid_puts_are_refused(tmp_path):
    store, bufs = DiskStore(str(tmp_path / "kv"), 100 * VB), Buffers()
    try:
        (h,) = chain_hashes(1)
        value = make_value(h)
        key = store_key(LAYOUT, ROOT, h)
        other = store_key(LAYOUT, ROOT, b"\1" * 16)
        assert store.put([PutEntry(other, None, 0, bufs.addr(value), VB),  # not its key
                          PutEntry(key, None, 0, bufs.addr(value[:-1]), VB - 1),  # short
                          PutEntry(key, None, 0, bufs.addr(b"x" * VB), VB),  # no header
                          PutEntry("../../etc/passwd", None, 0, bufs.addr(value), VB)]) \
            == [False] * 4
        assert store.stats()["disk_invalid_puts_total"] == 4
        assert list((tmp_path / "kv").iterdir()) == [tmp_path / "kv" / ".lock"]
    finally:
        store.close()


def test_capacity_evicts_the_oldest_access_first_chain_tail_first(tmp_path):
    clock, bufs = Clock(), Buffers()
    store = DiskStore(str(tmp_path / "kv"), 4 * VB, clock=clock, fsync=False)
    try:
        a, va = entries_for(chain_hashes(2, seed=1), bufs)  # access 1 (one put batch: one time)
        clock.frozen = True
        assert store.put(a) == [True, True]
        clock.frozen = False
        b, vb = entries_for(chain_hashes(2, seed=2), bufs)
        assert store.put(b[:1]) == [True]
        assert store.put(b[1:]) == [True]
        assert read(store, a[0].key) == va[a[0].key]  # a[0] is now the newest access
        c, _ = entries_for(chain_hashes(2, seed=3), bufs)
        assert store.put(c[:1]) == [True]
        # Full at 4: the oldest access goes first: a[1] (a's tail; a[0] was read since).
        assert store.exists([e.key for e in a + b + c]) == [True, False, True, True, True, False]
        assert store.put(c[1:]) == [True]  # then b[0]
        assert store.exists([e.key for e in a + b + c]) == [True, False, False, True, True, True]
        assert store.drain_evicted() == [a[1].key, b[0].key] and store.drain_evicted() == []
        stats = store.stats()
        assert (stats["disk_evicted_blocks_total"], stats["disk_num_blocks"],
                stats["disk_used_bytes"]) == (2, 4, 4 * VB)
        assert len(list((tmp_path / "kv").glob("*/rkv*"))) == 4
    finally:
        store.close()


def test_a_chain_written_at_once_is_trimmed_from_its_tail(tmp_path):
    clock, bufs = Clock(), Buffers()
    clock.frozen = True
    store = DiskStore(str(tmp_path / "kv"), 3 * VB, clock=clock, fsync=False)
    try:
        chain, _ = entries_for(chain_hashes(3, seed=4), bufs)
        assert store.put(chain) == [True] * 3
        clock.frozen = False
        other, _ = entries_for(chain_hashes(2, seed=5), bufs)
        assert store.put(other) == [True, True]
        assert store.exists([e.key for e in chain]) == [True, False, False]
    finally:
        store.close()


def test_a_value_larger_than_the_capacity_is_refused(tmp_path):
    store, bufs = DiskStore(str(tmp_path / "kv"), VB - 1, fsync=False), Buffers()
    try:
        entries, _ = entries_for(chain_hashes(1), bufs)
        assert store.put(entries) == [False]
        assert store.stats()["disk_refused_puts_total"] == 1
    finally:
        store.close()


def test_the_access_order_and_a_smaller_capacity_hold_across_a_restart(tmp_path):
    clock, bufs = Clock(), Buffers()
    store = DiskStore(str(tmp_path / "kv"), 10 * VB, clock=clock, fsync=False)
    entries, values = entries_for(chain_hashes(4, seed=6), bufs)
    for e in entries:
        assert store.put([e]) == [True]
    read(store, entries[0].key)  # newest access now: the file's mtime says so
    store.close()
    again = DiskStore(str(tmp_path / "kv"), 2 * VB, fsync=False)  # trimmed at open
    try:
        assert again.exists([e.key for e in entries]) == [True, False, False, True]
        stats = again.stats()
        assert (stats["disk_found_blocks_at_start"], stats["disk_num_blocks"],
                stats["disk_evicted_blocks_total"]) == (4, 2, 2)
    finally:
        again.close()


def test_retained_blocks_are_evicted_last_until_their_retention_ends(tmp_path):
    clock, mono, bufs = Clock(), Clock(0.0), Buffers()
    mono.frozen = True
    store = DiskStore(str(tmp_path / "kv"), 3 * VB, clock=clock, monotonic=mono, fsync=False)
    try:
        entries, _ = entries_for(chain_hashes(6, seed=7), bufs)
        keys = [e.key for e in entries]
        store.mark_retained(keys[2:3], until_s=100.0)  # not stored yet: remembered
        for e in entries[:3]:
            assert store.put([e]) == [True]
        store.mark_retained(keys[0:1], until_s=50.0)
        assert store.stats()["disk_retained_blocks"] == 2
        assert store.put([entries[3]]) == [True]  # the oldest not retained: keys[1]
        assert store.exists(keys[:4]) == [True, False, True, True]
        assert store.put([entries[4]]) == [True]  # then keys[3]; both retained stay
        assert store.exists(keys[:5]) == [True, False, True, False, True]
        mono.t = 60.0  # keys[0]'s retention ended: it is the oldest access again
        assert store.put([entries[5]]) == [True]
        assert store.exists(keys) == [False, False, True, False, True, True]
        assert store.stats()["disk_retained_blocks"] == 1
        store.mark_retained(keys[4:6], until_s=200.0)  # the whole store is retained: still
        store.put(entries[:1])  # bounded, the oldest retained goes first (keys[2])
        assert store.exists(keys) == [True, False, False, False, True, True]
    finally:
        store.close()


def test_a_retention_end_at_or_before_now_clears_the_marks(tmp_path):
    clock, mono, bufs = Clock(), Clock(0.0), Buffers()
    mono.frozen = True
    store = DiskStore(str(tmp_path / "kv"), 3 * VB, clock=clock, monotonic=mono, fsync=False)
    try:
        entries, _ = entries_for(chain_hashes(5, seed=9), bufs)
        keys = [e.key for e in entries]
        for e in entries[:3]:
            assert store.put([e]) == [True]
        store.mark_retained(keys[0:2], until_s=100.0)
        store.mark_retained(keys[3:4], until_s=100.0)  # not stored yet: remembered
        assert store.stats()["disk_retained_blocks"] == 2
        # Released: no retention holds keys[0] or keys[3] any more (StoreTier.unmark_retained).
        store.mark_retained([keys[0], keys[3]], until_s=float("-inf"))
        assert store.stats()["disk_retained_blocks"] == 1
        assert store.put([entries[3]]) == [True]  # keys[3] arrives unretained; the oldest
        assert store.exists(keys[:4]) == [False, True, True, True]  # (keys[0]) went first
        store.mark_retained(keys[1:2], until_s=0.0)  # an end at now clears too
        assert store.stats()["disk_retained_blocks"] == 0
        assert store.put([entries[4]]) == [True]
        assert store.exists(keys) == [False, False, True, True, True]
    finally:
        store.close()


def test_clear_and_remove_delete_the_files(tmp_path):
    store, bufs = DiskStore(str(tmp_path / "kv"), 100 * VB, fsync=False), Buffers()
    try:
        entries, _ = entries_for(chain_hashes(4, seed=8), bufs)
        store.put(entries)
        assert store.remove([entries[0].key, "rkv1:x:00:00"]) == 1
        assert store.clear() == 3
        assert list((tmp_path / "kv").glob("*/rkv*")) == []
        assert store.drain_evicted() == [] and store.stats()["disk_used_bytes"] == 0
    finally:
        store.close()


# ---- kill -9 during writes ------------------------------------------------------------------

WRITER = r"""
import ctypes, os, random, sys, time
sys.path.insert(0, {repo!r})
from radixkv.cache.store.backend import PutEntry
from radixkv.cache.store.disk import DiskStore
from radixkv.cache.store.value import BlockLayout, encode_header, payload_checksum, store_key
layout = BlockLayout(16, 8, 128, "float32", 4, 4)  # 512 KiB payloads: writes take a while
store = DiskStore({path!r}, 1 << 40, fsync=True)
root = bytes(16)
stall_at = {stall_at}  # >= 0: the value written then stops half-way (the parent kills it)
writes = 0
real_write = os.write
def write(fd, data):
    global writes
    writes += 1
    if writes - 1 == stall_at:
        real_write(fd, bytes(data)[: len(data) // 2])
        print("stalled", flush=True)
        time.sleep(120)
    return real_write(fd, data)
os.write = write
print("ready", flush=True)
for i in range(100000):
    h = i.to_bytes(16, "big")
    payload = random.Random(i).randbytes(layout.payload_bytes)
    value = bytearray(encode_header(layout, root, h, root, bytes(16), payload_checksum(payload))
                      + payload)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(value))
    store.put([PutEntry(store_key(layout, root, h), None, 0, ptr, len(value))])
"""


def _writer(path: Path, stall_at: int = -1) -> subprocess.Popen:
    repo = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(repo=repo, path=str(path),
                                                                 stall_at=stall_at)],
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    while (line := proc.stdout.readline()) != b"ready\n":  # (the store logs its opening)
        assert line, "the writer exited before it was ready"
    return proc


def test_kill_9_during_writes_never_leaves_a_value_that_verifies_but_is_wrong(tmp_path):
    path = tmp_path / "kv"
    layout = BlockLayout(16, 8, 128, "float32", 4, 4)
    for round_ in range(2):  # killed wherever it is (often mid-file: the timing decides)
        proc = _writer(path)
        deadline = time.monotonic() + 60
        while len(list(path.glob("*/rkv*"))) < 5 * (round_ + 1):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        time.sleep(random.Random(round_).uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    # Then surely mid-file: the writer stops half-way through a value's bytes.
    found = len(list(path.glob("*/rkv*")))
    proc = _writer(path, stall_at=2)  # two more values, then half of the third
    assert proc.stdout is not None and proc.stdout.readline() == b"stalled\n"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    half = list(path.glob("*/.tmp-*"))
    assert [f.stat().st_size for f in half] == [layout.value_bytes(16) // 2]  # the only one
    store = DiskStore(str(path), 1 << 40)
    try:
        stats = store.stats()
        n = stats["disk_num_blocks"]
        assert n == found + 2 and stats["disk_found_blocks_at_start"] == n
        assert stats["disk_removed_temp_files_at_start"] == 1
        assert list(path.glob("*/.tmp-*")) == []  # unfinished writes cleaned at open
        vb = layout.value_bytes(16)
        for f in path.glob("*/rkv*"):
            key = f.name.split(".d")[0]
            got = read(store, key, room=vb)
            assert isinstance(got, bytes), (f, got)  # a renamed file is always whole
            i = int.from_bytes(read_header(got).block_hash, "big")
            payload = random.Random(i).randbytes(layout.payload_bytes)
            assert got[-len(payload):] == payload and check_stored_value(key, got) is None
        assert store.stats()["disk_rejected_blocks_total"] == 0
    finally:
        store.close()


# ---- the stack: host in front of disk -------------------------------------------------------

def test_parse_and_build_a_stack(tmp_path):
    spec = parse_kv_store(f"host:0.25?policy=lfu,disk:{tmp_path}/kv?gib=0.5")
    assert spec == KVStoreSpec("stack", policy="lfu", tiers=(
        KVStoreSpec("host", capacity_bytes=1 << 28, policy="lfu"),
        KVStoreSpec("disk", capacity_bytes=1 << 29, path=f"{tmp_path}/kv")))
    assert spec.describe() == f"host:0.25,disk:{tmp_path}/kv?gib=0.5"
    store = make_backend(spec, block_size=4, default_policy="lru")
    try:
        assert isinstance(store, StackStore) and store.name == "host+disk"
        assert store.kv_event_medium == "CPU"
        assert [type(t) for t in store.tiers] == [HostStore, DiskStore]
        assert store.tiers[0].policy.name == "lfu"
        assert store.stats()["tiers"] == ["host", "disk"]
    finally:
        store.close()
    disk = make_backend(parse_kv_store(f"disk:{tmp_path}/kv"), block_size=4, default_policy="lru")
    try:
        assert isinstance(disk, DiskStore) and disk.kv_event_medium == "DISK"
        assert disk.capacity_bytes > 0  # the default: free space at open
    finally:
        disk.close()


@pytest.mark.parametrize("text,message", [
    ("disk:", "kv_store: disk needs a directory"),
    ("disk:/x?gib=0", r"kv_store \(disk capacity gib\): must be a positive number"),
    ("disk:/x?gib=abc", r"kv_store \(disk capacity gib\): must be a positive number"),
    ("disk:/x?size=1", "kv_store: unknown option 'size' \\(known: gib\\)"),
    ("disk:/a,host:1", "kv_store: a stack of tiers is host:GIB,disk:PATH"),
    ("host:1,disk:/a,disk:/b", "kv_store: a stack of tiers is host:GIB,disk:PATH"),
    ("host:1,", "kv_store: an empty tier in 'host:1,'"),
    ("host:1,disk:", "kv_store: disk needs a directory"),
])
def test_bad_disk_and_stack_specs_name_kv_store(text, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_store(text)


def independent(n: int, seed: int, bufs: Buffers) -> tuple[list[PutEntry], dict[str, bytes]]:
    """``n`` first blocks of ``n`` chains (no parents: evictable in any order)."""
    entries, values = [], {}
    for h in chain_hashes(n, seed):
        one, value = entries_for([h], bufs)
        entries += one
        values.update(value)
    return entries, values


def test_the_stack_writes_through_reads_front_first_and_promotes(tmp_path):
    bufs = Buffers()
    host = HostStore(2 * VB, block_size=4)
    disk = DiskStore(str(tmp_path / "kv"), 100 * VB, fsync=False)
    stack = StackStore([host, disk])
    try:
        entries, values = independent(3, 11, bufs)
        keys = list(values)
        assert stack.put(entries) == [True] * 3
        # Host holds 2 (its policy evicted the oldest), disk all 3 (written through).
        assert host.exists(keys) == [False, True, True]
        assert disk.exists(keys) == [True, True, True]
        assert stack.exists(keys) == [True, True, True]
        assert stack.drain_evicted() == []  # evicted from host, still on disk
        assert read(stack, keys[0]) == values[keys[0]]  # from disk, promoted
        assert host.exists(keys[:1]) == [True]
        assert stack.stats()["promoted_blocks_total"] == 1
        assert disk.stats()["disk_hit_blocks_total"] == 1
        assert read(stack, keys[0]) == values[keys[0]]  # now from host
        assert (stack.stats()["promoted_blocks_total"], disk.stats()["disk_hit_blocks_total"]) \
            == (1, 1)
        assert disk.remove(keys[2:]) == 1  # gone from disk; host still holds it
        stats = stack.stats()
        assert (stats["num_blocks"], stats["disk_num_blocks"]) == (2, 2)
        assert stack.remove(keys) == 3 and stack.exists(keys) == [False] * 3
    finally:
        stack.close()


def test_the_stack_reports_a_key_removed_only_when_no_tier_holds_it(tmp_path):
    bufs = Buffers()
    host = HostStore(VB, block_size=4)
    disk = DiskStore(str(tmp_path / "kv"), 2 * VB, fsync=False)
    stack = StackStore([host, disk])
    try:
        entries, values = independent(3, 12, bufs)
        keys = list(values)
        assert stack.put(entries[:1]) == [True]
        assert stack.put(entries[1:2]) == [True]  # host drops keys[0]: still on disk
        assert stack.drain_evicted() == []
        assert stack.put(entries[2:]) == [True]  # host drops keys[1], disk keys[0]
        assert (host.exists(keys), disk.exists(keys)) == ([False, False, True],
                                                          [False, True, True])
        assert stack.drain_evicted() == [keys[0]]
    finally:
        stack.close()


def test_a_new_stack_serves_from_disk_after_a_restart(tmp_path):
    bufs = Buffers()
    first = make_backend(parse_kv_store(f"host:0.001,disk:{tmp_path}/kv"), block_size=4,
                         default_policy="lru")
    entries, values = entries_for(chain_hashes(4, seed=13), bufs)
    assert first.put(entries) == [True] * 4
    first.close()
    second = make_backend(parse_kv_store(f"host:0.001,disk:{tmp_path}/kv"), block_size=4,
                          default_policy="lru")
    try:
        assert isinstance(second, StackStore)
        host, disk = second.tiers
        assert host.exists(list(values)) == [False] * 4 and second.exists(list(values)) == [True] * 4
        assert [read(second, k) for k in values] == list(values.values())
        assert host.exists(list(values)) == [True] * 4
        assert second.stats()["promoted_blocks_total"] == 4
        assert second.clear() == 4 and second.exists(list(values)) == [False] * 4
    finally:
        second.close()


# ---- under a real engine (tiny model, B = 4) -------------------------------------------------

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(37 * i) % 400 + 5 for i in range(41)]  # hit cap 40 tokens = 10 blocks


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def cold(tiny):
    return make_engine(tiny, prefix_cache=False).generate([PROMPT], GREEDY)[0].output_token_ids


def run_on(engine, prompt=PROMPT):
    (req,) = engine.generate([prompt], GREEDY)
    engine.cache.check_integrity()
    return req


def session(model, path: Path, prompt=PROMPT, spec: str | None = None):
    """One engine's life on the disk tier at ``path``: run ``prompt``, wait for its writes,
    close the tier (as a stopped server does); returns the output and the store's stats."""
    engine = make_engine(model, num_blocks=24, kv_store=spec or f"disk:{path}")
    try:
        out = run_on(engine, prompt)
        assert engine.store.flush()
        stats = engine.stats_snapshot()["store"]
    finally:
        engine.store.close()
    return out, stats


def block_file(path: Path, engine_like, block: int) -> Path:
    root = engine_like.cache_root(None)
    block_hash = engine_like.cache.hasher.chain(root, PROMPT[: 4 * (block + 1)], 4)[block]
    return file_of(path, store_key(engine_like.store.layout, root, block_hash))


def test_a_new_engine_on_the_directory_reads_the_prompt_from_disk(tiny, cold, tmp_path):
    first, stats = session(tiny, tmp_path / "kv")
    assert first.num_cached_tokens == 0 and first.output_token_ids == cold
    # 41 + 6 tokens, 46 with KV: 11 full blocks written.
    assert (stats["written_blocks_total"], stats["disk_num_blocks"]) == (11, 11)
    second, stats = session(tiny, tmp_path / "kv")
    assert (second.num_cached_tokens, second.num_store_tokens) == (40, 40)
    assert second.output_token_ids == cold
    assert (stats["backend"], stats["disk_found_blocks_at_start"], stats["hit_blocks_total"]) \
        == ("disk", 11, 10)
    assert stats["written_blocks_total"] == 0  # everything was there already


def test_a_stack_engine_reads_from_disk_after_a_restart(tiny, cold, tmp_path):
    spec = f"host:0.01,disk:{tmp_path}/kv"
    first, _ = session(tiny, tmp_path / "kv", spec=spec)
    second, stats = session(tiny, tmp_path / "kv", spec=spec)
    assert (second.num_cached_tokens, second.num_store_tokens) == (40, 40)
    assert second.output_token_ids == first.output_token_ids == cold
    assert (stats["backend"], stats["promoted_blocks_total"], stats["disk_hit_blocks_total"]) \
        == ("host+disk", 10, 10)


@pytest.mark.parametrize("damage,reason", [
    (lambda f: f.write_bytes(f.read_bytes()[:-1]), "size"),
    (lambda f: _flip(f, -3), "checksum"),
    (lambda f: _flip(f, 85), "header"),  # inside the tokens: only the name's digest sees it
])
def test_a_damaged_file_costs_a_recompute_with_the_same_output(tiny, cold, tmp_path, damage,
                                                               reason):
    path = tmp_path / "kv"
    session(tiny, path)
    probe = make_engine(tiny, num_blocks=24, kv_store=f"disk:{tmp_path}/probe")
    try:
        damage(block_file(path, probe, 3))
    finally:
        probe.store.close()
    again, stats = session(tiny, path)
    assert (again.num_cached_tokens, again.num_store_tokens) == (12, 12)  # blocks 0..2
    assert again.output_token_ids == cold
    assert stats["disk_rejected_blocks_by_reason"][reason] == 1
    assert stats["disk_rejected_blocks_total"] == 1
    assert stats["written_blocks_total"] == 1  # block 3, computed, written afresh
    third, _ = session(tiny, path)
    assert (third.num_cached_tokens, third.output_token_ids) == (40, cold)


def test_a_foreign_file_under_a_blocks_name_is_refused(tiny, cold, tmp_path):
    path = tmp_path / "kv"
    session(tiny, path)
    probe = make_engine(tiny, num_blocks=24, kv_store=f"disk:{tmp_path}/probe")
    try:
        victim, other = block_file(path, probe, 2), block_file(path, probe, 5)
        victim.write_bytes(other.read_bytes())  # a whole, valid value of another block
    finally:
        probe.store.close()
    again, stats = session(tiny, path)
    assert (again.num_cached_tokens, again.output_token_ids) == (8, cold)
    assert stats["disk_rejected_blocks_by_reason"]["foreign"] == 1


def test_another_model_revision_on_the_same_directory_reads_nothing(tiny, tmp_path):
    path = tmp_path / "kv"
    session(tiny, path)
    other_model = load_model(str(make_tiny_model_dir(tmp_path / "other", seed=7)))
    other_cold = make_engine(other_model, prefix_cache=False).generate([PROMPT], GREEDY)[0]
    out, stats = session(other_model, path)
    assert out.num_cached_tokens == 0 and out.output_token_ids == other_cold.output_token_ids
    assert (stats["hit_blocks_total"], stats["disk_rejected_blocks_total"]) == (0, 0)
    assert (stats["disk_found_blocks_at_start"], stats["disk_num_blocks"]) == (11, 22)


def test_a_full_file_system_refuses_the_put_and_an_io_error_raises_store_error(tmp_path,
                                                                               monkeypatch):
    import errno

    store, bufs = DiskStore(str(tmp_path / "kv"), 100 * VB, fsync=False), Buffers()
    try:
        entries, _ = entries_for(chain_hashes(3, seed=14), bufs)
        failure = OSError(errno.ENOSPC, "No space left on device")

        def failing(*args):
            raise failure

        monkeypatch.setattr(store, "_write_file", failing)
        assert store.put(entries[:1]) == [False]
        stats = store.stats()
        assert (stats["disk_refused_puts_total"], stats["disk_num_blocks"],
                stats["disk_used_bytes"]) == (1, 0, 0)
        failure = OSError(errno.EIO, "Input/output error")
        with pytest.raises(StoreError, match="kv_store disk: cannot write .*: Input/output error"):
            store.put(entries[1:2])
        monkeypatch.undo()
        assert store.put(entries) == [True] * 3  # the reservations were given back
        assert store.stats()["disk_used_bytes"] == 3 * VB
        assert store.healthy()
    finally:
        store.close()
    (tmp_path / "kv").rename(tmp_path / "gone")
    assert not store.healthy()

"""The ``host:…,disk:…`` stack and the host tier when the store tier refuses a value or the
disk fails: a refused value leaves memory as well as disk (so the block is written afresh
instead of being refused on every load), and a failing disk degrades the stack to memory for
that call (counted in ``disk_errors_total``) instead of taking the memory tier down with it.
Byte-exact values through real ctypes buffers, then under a real engine (tiny model, B = 4)."""

from __future__ import annotations

import ctypes
import random
from pathlib import Path

import pytest

from radixkv.cache.store.backend import PutEntry
from radixkv.cache.store.disk import DiskStore
from radixkv.cache.store.host import MISSING, HostStore
from radixkv.cache.store.stack import StackStore
from radixkv.cache.store.tier import StoreTier
from radixkv.cache.store.value import BlockLayout, encode_header, payload_checksum, store_key
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import StoreError
from radixkv.model.loader import load_model
from tests.factories import make_engine

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", itemsize=4,
                     block_size=4)
DIGEST = 16
VB = LAYOUT.value_bytes(DIGEST)
ROOT = bytes(range(16))


class Buffers:
    """Real memory the stores copy from and into (kept alive for the test's duration)."""

    def __init__(self) -> None:
        self.keep: list[bytearray] = []

    def addr(self, data: bytes) -> int:
        ba = bytearray(data)
        self.keep.append(ba)
        return ctypes.addressof(ctypes.c_char.from_buffer(ba))


def values(n: int, seed: int, bufs: Buffers) -> tuple[list[PutEntry], dict[str, bytes]]:
    """``n`` independent well-formed values (each at an identity root)."""
    rng = random.Random(seed)
    entries, out = [], {}
    for _ in range(n):
        block_hash = rng.randbytes(16)
        payload = random.Random(block_hash).randbytes(LAYOUT.payload_bytes)
        value = encode_header(LAYOUT, ROOT, block_hash, ROOT, bytes(16),
                              payload_checksum(payload)) + payload
        key = store_key(LAYOUT, ROOT, block_hash)
        entries.append(PutEntry(key, None, 0, bufs.addr(value), len(value)))
        out[key] = value
    return entries, out


def read(store, key: str) -> bytes | int:
    dst = bytearray(VB)
    n = store.get_into([key], [ctypes.addressof(ctypes.c_char.from_buffer(dst))], [VB])[0]
    return bytes(dst[:n]) if n >= 0 else n


def stack_at(path: Path, host_bytes: int = 100 * VB) -> tuple[StackStore, HostStore, DiskStore]:
    host = HostStore(host_bytes, block_size=4)
    disk = DiskStore(str(path), 100 * VB, fsync=False)
    return StackStore([host, disk]), host, disk


# ---- a refused value ------------------------------------------------------------------------

def test_the_host_tier_drops_a_value_the_tier_refused():
    store, bufs = HostStore(10 * VB, block_size=4), Buffers()
    entries, vals = values(2, 1, bufs)
    keys = list(vals)
    assert store.put(entries) == [True, True]
    store.on_rejected(keys[0], "checksum")
    assert store.exists(keys) == [False, True]
    assert read(store, keys[0]) == MISSING and read(store, keys[1]) == vals[keys[1]]
    stats = store.stats()
    assert (stats["num_blocks"], stats["used_bytes"], stats["evicted_blocks_total"]) == (1, VB, 0)
    assert store.drain_evicted() == [keys[0]]  # its BlockRemoved (not a pressure eviction)
    store.on_rejected("no-such-key", "header")  # a key it does not hold: nothing happens
    assert store.stats()["num_blocks"] == 1
    assert store.put(entries[:1]) == [True]  # written afresh
    assert read(store, keys[0]) == vals[keys[0]]


def test_a_refused_value_promoted_from_disk_leaves_both_tiers(tmp_path):
    stack, host, disk = stack_at(tmp_path / "kv", host_bytes=VB)
    bufs = Buffers()
    try:
        entries, vals = values(2, 2, bufs)
        keys = list(vals)
        assert stack.put(entries) == [True, True]
        assert host.exists(keys) == [False, True]  # one value of room: the first went
        assert read(stack, keys[0]) == vals[keys[0]]  # from disk, promoted into memory
        assert host.exists(keys) == [True, False]
        stack.on_rejected(keys[0], "header")  # the tier's check refused what it read
        assert (host.exists(keys[:1]), disk.exists(keys[:1]), stack.exists(keys[:1])) == (
            [False], [False], [False])
        assert disk.stats()["disk_rejected_blocks_by_reason"]["header"] == 1
        # Reported removed now that no tier holds it (keys[1], evicted from memory, is on disk).
        assert stack.drain_evicted() == [keys[0]]
        assert read(stack, keys[0]) == MISSING  # computed again by the caller ...
        assert stack.put(entries[:1]) == [True]  # ... and written afresh to both tiers
        assert (host.exists(keys[:1]), disk.exists(keys[:1])) == ([True], [True])
    finally:
        stack.close()


# ---- a failing disk -------------------------------------------------------------------------

class Failures:
    """Wraps a tier's methods to raise ``StoreError`` while ``on``; counts the raises."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tier, names: tuple[str, ...]) -> None:
        self.on = True
        self.raised = 0
        for name in names:
            real = getattr(tier, name)
            monkeypatch.setattr(tier, name, self._wrap(real))

    def _wrap(self, real):
        def call(*args, **kwargs):
            if self.on:
                self.raised += 1
                raise StoreError("kv_store disk: cannot write: Input/output error")
            return real(*args, **kwargs)
        return call


def test_a_failing_disk_degrades_the_stack_to_memory(tmp_path, monkeypatch):
    stack, host, disk = stack_at(tmp_path / "kv")
    bufs = Buffers()
    try:
        entries, vals = values(3, 3, bufs)
        keys = list(vals)
        assert stack.put(entries[:1]) == [True]  # both tiers hold keys[0]
        host.remove(keys[:1])  # ... now only the disk does
        failing = Failures(monkeypatch, disk, ("put", "exists", "get_into", "remove",
                                               "mark_retained", "on_rejected"))
        assert stack.put(entries[1:]) == [True, True]  # stored in memory, not raised
        assert host.exists(keys) == [False, True, True]
        assert stack.exists(keys) == [False, True, True]  # the disk's answer is lost
        assert [read(stack, k) for k in keys] == [MISSING, vals[keys[1]], vals[keys[2]]]
        stack.mark_retained(keys, 1e12)
        stack.on_rejected(keys[2], "checksum")
        assert host.exists(keys[2:]) == [False]
        assert stack.remove(keys[1:2]) == 1
        # put, exists, get_into (keys[0] missed memory), mark_retained, on_rejected, remove
        # (its exists found keys[1] in memory: no disk call)
        assert failing.raised == 6
        assert stack.stats()["disk_errors_total"] == 6
        assert stack.healthy()
        failing.on = False  # the disk answers again: what it held is served again
        assert read(stack, keys[0]) == vals[keys[0]]
        assert stack.stats()["disk_errors_total"] == 6
    finally:
        monkeypatch.undo()
        stack.close()


def test_a_vanished_disk_directory_leaves_the_stack_healthy(tmp_path):
    stack, host, disk = stack_at(tmp_path / "kv")
    bufs = Buffers()
    try:
        (tmp_path / "kv").rename(tmp_path / "gone")
        assert not disk.healthy()
        assert stack.healthy()
        entries, vals = values(1, 4, bufs)
        assert stack.put(entries) == [True]  # the disk write fails: memory holds it
        (key,) = vals
        assert read(stack, key) == vals[key]
        assert stack.stats()["disk_errors_total"] == 1
    finally:
        stack.close()


def test_the_front_tier_failing_is_still_raised(tmp_path, monkeypatch):
    stack, host, _ = stack_at(tmp_path / "kv")
    bufs = Buffers()
    try:
        Failures(monkeypatch, host, ("put",))
        entries, _ = values(1, 5, bufs)
        with pytest.raises(StoreError):
            stack.put(entries)
    finally:
        monkeypatch.undo()
        stack.close()


# ---- under a real engine (tiny model, B = 4) -------------------------------------------------

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(37 * i) % 400 + 5 for i in range(41)]  # hit cap 40 tokens = 10 blocks


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def cold(tiny):
    return make_engine(tiny, prefix_cache=False).generate([PROMPT], GREEDY)[0].output_token_ids


def store_of(engine) -> StoreTier:
    assert engine.store is not None
    return engine.store


def run(engine):
    (req,) = engine.generate([PROMPT], GREEDY)
    engine.cache.check_integrity()
    return req


def warm_then_evict(engine):
    first = run(engine)
    assert store_of(engine).flush()
    engine.cache.evict(engine.num_blocks)
    assert engine.cache.num_cached_blocks == 0
    return first


def test_a_refused_host_value_is_dropped_and_not_refused_again(tiny, cold):
    engine = make_engine(tiny, num_blocks=24, kv_store="host:0.01")
    backend = store_of(engine).backend
    try:
        warm_then_evict(engine)
        # Block 3 of the prompt: flip one payload byte of the stored value.
        root = engine.cache_root(None)
        tier = store_of(engine)
        key = store_key(tier.layout, root, engine.cache.hasher.chain(root, PROMPT[:16], 4)[3])
        parent = store_key(tier.layout, root, engine.cache.hasher.chain(root, PROMPT[:12], 4)[2])
        size = tier.value_bytes
        buf = ctypes.create_string_buffer(size)
        assert backend.get_into([key], [ctypes.addressof(buf)], [size]) == [size]
        good = buf.raw
        buf[size - 5] = bytes([buf.raw[size - 5] ^ 0x01])
        flipped = buf.raw
        assert backend.remove([key]) == 1
        assert backend.put([PutEntry(key, parent, 12, ctypes.addressof(buf), size)]) == [True]
        again = run(engine)
        assert (again.num_cached_tokens, again.num_store_tokens) == (12, 12)
        assert store_of(engine).flush()
        # The refused value left memory, and the tier forgot it had stored the key: the
        # block, computed again, was written afresh (its K/V from the recompute, equal to
        # the first within rounding) and is read back at the next load below.
        dst = ctypes.create_string_buffer(size)
        got = backend.get_into([key], [ctypes.addressof(dst)], [size])[0]
        assert got == size and dst.raw != flipped and len(good) == size
        engine.cache.evict(engine.num_blocks)
        third = run(engine)
        assert (third.num_cached_tokens, third.num_store_tokens) == (40, 40)
        assert again.output_token_ids == third.output_token_ids == cold
        store = engine.stats_snapshot()["store"]
        assert (store["rejected_blocks_total"], store["rejected_blocks_by_reason"]["checksum"]) \
            == (1, 1)
    finally:
        store_of(engine).close()


def test_a_failing_disk_leaves_the_host_tier_serving(tiny, cold, tmp_path, monkeypatch):
    engine = make_engine(tiny, num_blocks=24, kv_store=f"host:0.01,disk:{tmp_path}/kv")
    stack = store_of(engine).backend
    assert isinstance(stack, StackStore)
    failing = Failures(monkeypatch, stack.tiers[1], ("put",))
    try:
        first = warm_then_evict(engine)
        second = run(engine)
        assert (first.num_cached_tokens, second.num_cached_tokens,
                second.num_store_tokens) == (0, 40, 40)
        assert second.output_token_ids == cold
        store = engine.stats_snapshot()["store"]
        assert store["down"] is False and store["errors_total"] == 0
        assert (store["written_blocks_total"], store["num_blocks"], store["disk_num_blocks"]) \
            == (11, 11, 0)
        assert store["disk_errors_total"] == failing.raised >= 1
    finally:
        monkeypatch.undo()
        store_of(engine).close()

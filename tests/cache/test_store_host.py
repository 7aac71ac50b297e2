"""The ``host`` store backend: byte-exact copies through real ctypes buffers, capacity
accounting, eviction under pressure in policy order, prefix-closed chains, orphans, every
registered policy, concurrent callers, stats and the evicted-key queue."""

from __future__ import annotations

import ctypes
import itertools
import random
import threading

import pytest

from radixkv.cache.store.backend import PutEntry, parse_kv_store
from radixkv.cache.store.factory import make_backend
from radixkv.cache.store.host import MISSING, TOO_SMALL, HostStore
from radixkv.eviction import available_policies

B = 16  # tokens per block


class Clock:
    """An injected clock: every reading is the next integer (1, 2, 3, ...)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


class Buffers:
    """Real memory the store copies from and into (kept alive for the test's duration)."""

    def __init__(self) -> None:
        self.keep: list[bytearray] = []

    def addr(self, data: bytes | bytearray) -> int:
        ba = data if isinstance(data, bytearray) else bytearray(data)
        self.keep.append(ba)
        return ctypes.addressof(ctypes.c_char.from_buffer(ba))


def value_of(key: str, nbytes: int) -> bytes:
    """Deterministic, key-specific bytes (so a wrong copy or a mixed-up key shows)."""
    rng = random.Random(key)
    return bytes(rng.getrandbits(8) for _ in range(nbytes))


def put(store: HostStore, bufs: Buffers, key: str, nbytes: int = 100,
        parent: str | None = None, depth: int = 0, data: bytes | None = None) -> bool:
    data = value_of(key, nbytes) if data is None else data
    return store.put([PutEntry(key, parent, depth, bufs.addr(data), len(data))])[0]


def get(store: HostStore, key: str, room: int = 4096) -> bytes | int:
    """The stored value (through a real destination buffer), or the negative result."""
    dst = bytearray(room)
    n = store.get_into([key], [ctypes.addressof(ctypes.c_char.from_buffer(dst))], [room])[0]
    return bytes(dst[:n]) if n >= 0 else n


def stored(store: HostStore, keys: list[str]) -> list[str]:
    return [k for k, ok in zip(keys, store.exists(keys)) if ok]


def test_roundtrip_exact_bytes_through_ctypes_buffers():
    store, bufs = HostStore(10_000, block_size=B), Buffers()
    vals = {"k1": value_of("k1", 1), "k2": value_of("k2", 777), "k3": bytes(range(256)) * 3}
    src = {k: bufs.addr(v) for k, v in vals.items()}
    entries = [PutEntry(k, None, 0, src[k], len(v)) for k, v in vals.items()]
    assert store.put(entries) == [True, True, True]
    # The store copied: overwriting the source does not change what it serves.
    for k in vals:
        ctypes.memset(src[k], 0xAB, len(vals[k]))
    dsts = [bytearray(1000) for _ in vals]
    ptrs = [ctypes.addressof(ctypes.c_char.from_buffer(d)) for d in dsts]
    assert store.get_into(list(vals), ptrs, [1000] * 3) == [1, 777, 768]
    for d, v in zip(dsts, vals.values()):
        assert bytes(d[: len(v)]) == v
        assert d[len(v):] == bytearray(1000 - len(v))  # nothing written past the value


def test_exists_missing_and_too_small():
    store, bufs = HostStore(10_000, block_size=B), Buffers()
    assert put(store, bufs, "a", 100)
    assert store.exists(["a", "b", "a"]) == [True, False, True]
    assert get(store, "b") == MISSING == -1
    dst = bytearray(b"\x07" * 99)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    assert store.get_into(["a"], [ptr], [99]) == [TOO_SMALL] == [-2]
    assert dst == bytearray(b"\x07" * 99)  # nothing written
    assert get(store, "a", room=100) == value_of("a", 100)
    with pytest.raises(ValueError, match="ptrs, sizes"):
        store.get_into(["a", "b"], [ptr], [99])


def test_put_skips_existing_keys():
    store, bufs = HostStore(10_000, block_size=B), Buffers()
    assert put(store, bufs, "a", data=b"first value")
    assert put(store, bufs, "a", data=b"a second, longer value")
    assert get(store, "a") == b"first value"
    assert store.stats()["used_bytes"] == 11
    assert store.stats()["num_blocks"] == 1
    # The same key twice in one batch: stored once.
    e = PutEntry("b", None, 0, bufs.addr(b"xyz"), 3)
    assert store.put([e, e]) == [True, True]
    assert store.stats()["used_bytes"] == 14


def test_capacity_accounting_is_exact():
    store, bufs = HostStore(1000, block_size=B), Buffers()
    for k, n in (("a", 100), ("b", 200), ("c", 300)):
        assert put(store, bufs, k, n)
    assert store.stats()["used_bytes"] == 600
    assert store.remove(["b", "zz", "b"]) == 1
    assert store.stats()["used_bytes"] == 400
    assert put(store, bufs, "d", 600)  # exactly fills it, nothing evicted
    assert store.stats() == {"capacity_bytes": 1000, "used_bytes": 1000, "num_blocks": 3,
                             "evicted_blocks_total": 0, "refused_puts_total": 0,
                             "evicted_dropped_total": 0}
    assert put(store, bufs, "e", 1)  # one byte over: the LRU block ("a", 100 bytes) goes
    assert stored(store, ["a", "c", "d", "e"]) == ["c", "d", "e"]
    assert store.stats()["used_bytes"] == 901
    assert store.drain_evicted() == ["a"]
    assert store.drain_evicted() == []
    assert store.remove(["c"]) == 1
    assert store.drain_evicted() == []  # removals are not pressure evictions


def test_value_larger_than_capacity_is_refused():
    store, bufs = HostStore(100, block_size=B), Buffers()
    assert put(store, bufs, "small", 40)
    assert not put(store, bufs, "big", 101)
    assert store.exists(["big", "small"]) == [False, True]
    assert store.stats()["used_bytes"] == 40
    assert store.stats()["evicted_blocks_total"] == 0  # nothing was evicted for it
    assert store.stats()["refused_puts_total"] == 1
    assert put(store, bufs, "full", 100)  # exactly the capacity: fits after evicting "small"
    assert store.exists(["small", "full"]) == [False, True]
    assert store.stats()["used_bytes"] == 100


def test_lru_eviction_order_with_injected_clock():
    store, bufs = HostStore(300, block_size=B, eviction_policy="lru", clock=Clock()), Buffers()
    for k in ("k1", "k2", "k3"):  # stored at t = 1, 2, 3
        assert put(store, bufs, k)
    assert get(store, "k1") == value_of("k1", 100)  # t = 4: k1 is now the most recent
    assert put(store, bufs, "k4")  # evicts k2 (t = 2)
    assert stored(store, ["k1", "k2", "k3", "k4"]) == ["k1", "k3", "k4"]
    assert put(store, bufs, "k5")  # evicts k3 (t = 3)
    assert put(store, bufs, "k6")  # evicts k1 (t = 4)
    assert stored(store, ["k1", "k3", "k4", "k5", "k6"]) == ["k4", "k5", "k6"]
    assert store.drain_evicted() == ["k2", "k3", "k1"]
    assert store.stats()["evicted_blocks_total"] == 3


def test_lfu_counts_get_as_hit():
    store, bufs = HostStore(200, block_size=B, eviction_policy="lfu", clock=Clock()), Buffers()
    assert put(store, bufs, "a") and put(store, bufs, "b")
    assert get(store, "a") == value_of("a", 100)
    assert get(store, "a", room=10) == TOO_SMALL  # found: still a hit
    assert get(store, "b") == value_of("b", 100)  # b: 1 hit, newer than a's hits
    assert put(store, bufs, "c")
    assert store.exists(["a", "b", "c"]) == [True, False, True]


def test_prefix_closed_chain_evicts_tail_first():
    # Capacity for 3 values: the chain A <- B <- C fills it.
    store, bufs = HostStore(300, block_size=B, eviction_policy="lru", clock=Clock()), Buffers()
    assert put(store, bufs, "A", depth=0)
    assert put(store, bufs, "B", parent="A", depth=B)
    assert put(store, bufs, "C", parent="B", depth=2 * B)
    assert get(store, "C") == value_of("C", 100)  # C is the most recently used, A the least
    assert put(store, bufs, "D")  # C is the only evictable block: it goes, not A or B
    assert stored(store, ["A", "B", "C", "D"]) == ["A", "B", "D"]
    assert put(store, bufs, "E")  # now B is a leaf (t = 2 < D's t = 5)
    assert stored(store, ["A", "B", "C", "D", "E"]) == ["A", "D", "E"]
    assert put(store, bufs, "F")  # A last
    assert stored(store, ["A", "D", "E", "F"]) == ["D", "E", "F"]
    assert store.drain_evicted() == ["C", "B", "A"]


def test_chain_is_not_cut_under_the_block_extending_it():
    # Capacity for 2: A <- B fills it; C extends B. B is pinned as C's parent and A holds B,
    # so nothing is evictable: C is refused and A, B stay.
    store, bufs = HostStore(200, block_size=B, clock=Clock()), Buffers()
    assert put(store, bufs, "A") and put(store, bufs, "B", parent="A", depth=B)
    assert not put(store, bufs, "C", parent="B", depth=2 * B)
    assert stored(store, ["A", "B", "C"]) == ["A", "B"]
    assert store.stats()["evicted_blocks_total"] == 0
    assert store.stats()["refused_puts_total"] == 1
    # The refused put left B evictable again: a new root evicts it (the chain's tail).
    assert put(store, bufs, "X")
    assert stored(store, ["A", "B", "X"]) == ["A", "X"]


def test_orphan_insert_allowed_and_its_late_parent_is_held():
    store, bufs = HostStore(200, block_size=B, eviction_policy="lru", clock=Clock()), Buffers()
    assert put(store, bufs, "B", parent="A", depth=B)  # t = 1, its parent not stored
    assert put(store, bufs, "A")  # t = 2
    assert get(store, "B") == value_of("B", 100)  # t = 3: A is least recently used...
    assert put(store, bufs, "X")  # ...but B names it: B (the leaf) goes
    assert stored(store, ["A", "B", "X"]) == ["A", "X"]
    assert put(store, bufs, "Y")  # A is a leaf now and older than X
    assert stored(store, ["A", "X", "Y"]) == ["X", "Y"]
    assert store.drain_evicted() == ["B", "A"]


def test_remove_parent_keeps_child_and_child_count():
    store, bufs = HostStore(200, block_size=B, clock=Clock()), Buffers()
    assert put(store, bufs, "A") and put(store, bufs, "B", parent="A", depth=B)
    assert store.remove(["A"]) == 1  # B stays, an orphan
    assert put(store, bufs, "A")  # A back: held by B
    assert put(store, bufs, "X")  # evicts B, the only leaf, not A
    assert stored(store, ["A", "B", "X"]) == ["A", "X"]


@pytest.mark.parametrize("policy", [p for p in available_policies()
                                    if not p.startswith("belady")])
def test_every_policy_keeps_chains_prefix_closed(policy):
    size, cap_blocks = 64, 4
    store = HostStore(size * cap_blocks, block_size=B, eviction_policy=policy,
                      model_shape="llama3-8b" if policy in ("gdsf", "cost") else None,
                      clock=Clock())
    bufs = Buffers()
    rng = random.Random(7)
    parent_of: dict[str, str | None] = {}
    accepted, evicted = 0, []
    # Six chains of three blocks, written depth by depth across chains (a parent may be gone
    # before its child arrives: an orphan), with reads between.
    for depth in range(3):
        for c in range(6):
            key = f"c{c}/{depth}"
            parent = f"c{c}/{depth - 1}" if depth else None
            parent_held = parent is not None and store.exists([parent])[0]
            parent_of[key] = parent
            accepted += put(store, bufs, key, size, parent, depth * B)
            assert store.exists([parent])[0] if parent_held else True  # never cut under it
            for k in rng.sample(sorted(parent_of), min(2, len(parent_of))):
                got = get(store, k)
                assert got == MISSING or got == value_of(k, size)
            held = stored(store, sorted(parent_of))
            gone = store.drain_evicted()
            for k in held:  # prefix-closed: no block evicted while a child of it is stored
                assert parent_of[k] not in gone
            evicted += gone
            assert store.stats()["used_bytes"] == size * len(held) <= size * cap_blocks
    assert accepted == 18  # a leaf outside the new block's chain is always evictable
    assert store.stats() == {"capacity_bytes": 256, "used_bytes": 256, "num_blocks": 4,
                             "evicted_blocks_total": 14, "refused_puts_total": 0,
                             "evicted_dropped_total": 0}
    assert len(evicted) == len(set(evicted)) == 14
    assert sorted(evicted + stored(store, sorted(parent_of))) == sorted(parent_of)


def test_concurrent_puts_and_gets_keep_accounting_exact():
    sizes = [32, 64, 96, 128]
    store = HostStore(40 * 64, block_size=B, eviction_policy="lru")
    errors: list[str] = []
    per_thread = 400

    def work(t: int) -> None:
        bufs = Buffers()
        rng = random.Random(t)
        for i in range(per_thread):
            key = f"t{t}/{i}"
            if not put(store, bufs, key, sizes[i % 4], f"t{t}/{i - 1}" if i % 5 else None):
                errors.append(f"refused {key}")
            for _ in range(2):
                k = f"t{rng.randrange(4)}/{rng.randrange(i + 1)}"
                got = get(store, k)
                if got != MISSING and got != value_of(k, sizes[int(k.split('/')[1]) % 4]):
                    errors.append(f"wrong bytes for {k}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    keys = [f"t{t}/{i}" for t, i in itertools.product(range(4), range(per_thread))]
    held = stored(store, keys)
    st = store.stats()
    assert st["used_bytes"] == sum(sizes[int(k.split("/")[1]) % 4] for k in held)
    assert st["used_bytes"] <= 40 * 64
    assert st["num_blocks"] == len(held)
    assert st["evicted_blocks_total"] == 4 * per_thread - len(held)
    assert len(store.drain_evicted()) == 4 * per_thread - len(held)


def test_drain_queue_is_bounded():
    store = HostStore(100, block_size=B, clock=Clock(), max_pending_evicted=2)
    bufs = Buffers()
    for k in ("a", "b", "c", "d"):
        assert put(store, bufs, k)
    assert store.drain_evicted() == ["b", "c"]
    st = store.stats()
    assert (st["evicted_blocks_total"], st["evicted_dropped_total"]) == (3, 1)


def test_stats_values_and_close():
    store, bufs = HostStore(1 << 20, block_size=B), Buffers()
    assert store.name == "host" and store.kv_event_medium == "CPU"
    assert store.stats() == {"capacity_bytes": 1 << 20, "used_bytes": 0, "num_blocks": 0,
                             "evicted_blocks_total": 0, "refused_puts_total": 0,
                             "evicted_dropped_total": 0}
    assert put(store, bufs, "a", 1000) and put(store, bufs, "b", 24, parent="a")
    assert store.stats()["used_bytes"] == 1024
    assert store.stats()["num_blocks"] == 2
    store.close()
    assert store.stats()["used_bytes"] == 0
    assert store.stats()["num_blocks"] == 0


def test_bad_arguments_name_kv_store():
    with pytest.raises(ValueError, match="kv_store: .*nope"):
        HostStore(100, block_size=B, eviction_policy="nope")
    with pytest.raises(ValueError, match="kv_store: .*belady"):
        HostStore(100, block_size=B, eviction_policy="belady")
    with pytest.raises(ValueError, match="kv_store: host capacity"):
        HostStore(0, block_size=B)
    with pytest.raises(ValueError, match="kv_store: block_size"):
        HostStore(100, block_size=0)


def test_make_backend_builds_a_host_store():
    store = make_backend(parse_kv_store("host:0.5?policy=lfu"), block_size=B,
                         default_policy="lru")
    assert isinstance(store, HostStore)
    assert store.capacity_bytes == 1 << 29
    assert store.policy.name == "lfu"
    store = make_backend(parse_kv_store("host:1"), block_size=B, default_policy="s3fifo")
    assert store.policy.name == "s3fifo" and store.capacity_bytes == 1 << 30


@pytest.mark.parametrize("policy", [p for p in available_policies()
                                    if not p.startswith("belady")])
def test_clear_drops_everything_and_the_store_works_on(policy):
    store = HostStore(300, block_size=B, eviction_policy=policy,
                      model_shape="llama3-8b" if policy in ("gdsf", "cost") else None,
                      clock=Clock())
    bufs = Buffers()
    assert put(store, bufs, "a") and put(store, bufs, "b", parent="a", depth=B)
    assert put(store, bufs, "c", parent="b", depth=2 * B)
    assert put(store, bufs, "x")  # full: c, the only evictable leaf of a→b→c, goes
    assert store.drain_evicted() == ["c"]
    assert put(store, bufs, "y") and put(store, bufs, "z")  # two evictions, not drained...
    held = store.stats()["num_blocks"]
    assert held == 3
    assert store.clear() == held
    # ... and forgotten: the reset's AllBlocksCleared covers it.
    assert store.drain_evicted() == []
    stats = store.stats()
    assert (stats["num_blocks"], stats["used_bytes"]) == (0, 0)
    assert [get(store, k) for k in "abcxyz"] == [MISSING] * 6
    assert store.exists(list("abcxyz")) == [False] * 6
    # The policy forgot the cleared entries too: refilling evicts only what is stored now.
    for key in ("p", "q", "r"):
        assert put(store, bufs, key)
    assert put(store, bufs, "s")
    (victim,) = store.drain_evicted()
    assert victim in ("p", "q", "r")
    assert store.stats()["num_blocks"] == 3
    assert get(store, "s") == value_of("s", 100)

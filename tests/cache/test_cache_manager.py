"""CacheManager facade: hit cap, exact block ids, eviction (never of blocks in use), publish
rules (stored tokens compared on a hash collision, output tokens cached)."""

from __future__ import annotations

import itertools

import pytest

from radixkv.cache.hashing import CacheIdentity
from radixkv.cache.manager import CacheManager

B = 4
ROPE = "theta=100000.0;scaling=None"


def make(num_blocks: int = 16, **kwargs) -> tuple[CacheManager, bytes]:
    ticks = itertools.count()
    cm = CacheManager(num_blocks, B, clock=lambda: float(next(ticks)), **kwargs)
    return cm, cm.identity_root(CacheIdentity("r1", B, "float32", ROPE))


def warm(cm: CacheManager, root: bytes, rid: str, tokens: list[int]) -> int:
    """Run a request to completion with no generated tokens; return its cached tokens."""
    m = cm.begin(rid, root, tokens)
    assert cm.allocate(rid, len(tokens))
    cm.publish(rid, tokens, len(tokens))
    cm.check_integrity()
    cm.release(rid)
    cm.check_integrity()
    return m


def gauges(cm: CacheManager) -> tuple[int, int, int, int, int]:
    return (cm.num_free_blocks, cm.num_cached_evictable_blocks, cm.num_in_use_blocks,
            cm.num_cached_blocks, cm.num_tree_nodes)


def test_c07_hit_cap_exact_multiples() -> None:
    cm, root = make(64)
    got = []
    for length in (1, 4, 8, 12, 13, 16, 17):
        prompt = [1000 * length + i for i in range(length)]
        assert warm(cm, root, f"w{length}", prompt) == 0
        got.append(warm(cm, root, f"r{length}", prompt))
    assert got == [0, 0, 4, 8, 12, 12, 16]


def test_exact_block_ids_and_released_blocks_stay_matchable() -> None:
    cm, root = make(8)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + a partial tail
    assert cm.begin("a", root, prompt) == 0
    assert cm.allocate("a", 10) and cm.block_table("a") == [0, 1, 2]
    cm.publish("a", prompt, 10)
    assert gauges(cm) == (5, 0, 3, 2, 1)
    cm.release("a")
    cm.check_integrity()
    assert gauges(cm) == (6, 2, 0, 2, 1)  # in-use back to 0, cached blocks kept
    assert cm.block_states() == ["cached_evictable"] * 2 + ["free"] * 6
    assert cm.begin("b", root, prompt + [11]) == 8
    assert cm.block_table("b") == [0, 1]
    assert cm.allocate("b", 11) and cm.block_table("b") == [0, 1, 3]
    assert cm.block_states()[:4] == ["cached_locked", "cached_locked", "free", "private"]
    cm.check_integrity()
    cm.release("b")
    assert cm.evicted_blocks_total == 0


def test_lru_eviction_order_exact() -> None:
    cm, root = make(7)
    x, y, z = [1] * 8, [2] * 8, [3] * 8
    for rid, prompt in (("x", x), ("y", y), ("z", z)):
        warm(cm, root, rid, prompt)
    assert [cm.begin("x2", root, x + [9]), cm.block_table("x2")] == [8, [0, 1]]  # hit: x newest
    assert cm.allocate("x2", 9) and cm.block_table("x2") == [0, 1, 6]
    cm.release("x2")
    assert gauges(cm) == (1, 6, 0, 6, 3)
    assert cm.begin("w", root, [50, 51, 52, 53, 54, 55, 56, 57, 58]) == 0
    assert cm.allocate("w", 9) and cm.block_table("w") == [6, 3, 2]  # y evicted, tail first
    assert cm.evicted_blocks_total == 2
    assert cm.allocate("w", 20) and cm.block_table("w") == [6, 3, 2, 5, 4]  # then z
    assert cm.allocate("w", 24) and cm.block_table("w") == [6, 3, 2, 5, 4, 1]  # x's tail
    assert cm.evicted_blocks_total == 5
    cm.check_integrity()
    assert cm.begin("x3", root, x + [9]) == 4 and cm.block_table("x3") == [0]
    assert cm.begin("y2", root, y + [9]) == 0
    cm.check_integrity()


def test_allocate_all_or_nothing() -> None:
    cm, root = make(4)
    warm(cm, root, "a", [1] * 8)
    assert cm.begin("b", root, [2] * 6) == 0
    before = (gauges(cm), cm.block_states(), cm.evicted_blocks_total)
    assert not cm.allocate("b", 20)  # 5 blocks > 2 free + 2 evictable
    assert (gauges(cm), cm.block_states(), cm.evicted_blocks_total) == before
    assert cm.block_table("b") == []
    assert cm.allocate("b", 16) and cm.block_table("b") == [2, 3, 1, 0]
    assert cm.evicted_blocks_total == 2 and cm.num_cached_blocks == 0
    cm.check_integrity()


def test_c09_eviction_never_frees_held_blocks() -> None:
    cm, root = make(4)
    r1 = list(range(1, 9))
    assert cm.begin("r1", root, r1) == 0
    assert cm.allocate("r1", 8)
    cm.publish("r1", r1, 8)
    assert cm.allocate("r1", 9) and cm.block_table("r1") == [0, 1, 2]  # + one decode block
    assert cm.begin("r2", root, [7] * 12) == 0
    assert not cm.allocate("r2", 12)  # 1 free, 0 evictable: R2 must wait
    assert cm.block_states() == ["cached_locked", "cached_locked", "private", "free"]
    assert gauges(cm) == (1, 0, 3, 2, 1)
    assert all(n.lock_ref >= 1 for n in cm.tree.iter_nodes())
    assert cm.num_cached_evictable_blocks + cm.tree.num_locked_blocks == cm.num_cached_blocks
    cm.check_integrity()
    cm.release("r1")
    assert cm.allocate("r2", 12) and cm.block_table("r2") == [3, 2, 1]
    cm.check_integrity()


def test_c09_split_under_lock_at_manager_level() -> None:
    cm, root = make(16)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    cm.begin("a", root, a + [0])
    cm.allocate("a", 9)
    cm.publish("a", a, 8)
    b = [1, 2, 3, 4, 9, 9, 9, 9, 0]
    assert cm.begin("b", root, b) == 4  # match ends inside a's node: it is split
    assert cm.num_tree_nodes == 2
    cm.check_integrity()
    cm.allocate("b", 9)
    cm.publish("b", b, 8)
    locks = sorted((n.depth_tokens, n.lock_ref) for n in cm.tree.iter_nodes())
    assert locks == [(0, 2), (4, 1), (4, 1)]
    assert cm.num_cached_evictable_blocks + cm.tree.num_locked_blocks == cm.num_cached_blocks == 3
    cm.release("a")
    assert (cm.num_cached_evictable_blocks, cm.tree.num_locked_blocks) == (1, 2)
    cm.check_integrity()
    with pytest.raises(KeyError):
        cm.release("a")


def test_concurrent_duplicate_publish() -> None:
    cm, root = make(16)
    p = list(range(1, 10))
    for rid in ("r1", "r2"):
        assert cm.begin(rid, root, p) == 0
        assert cm.allocate(rid, 9)
    assert cm.block_table("r1") == [0, 1, 2] and cm.block_table("r2") == [3, 4, 5]
    cm.publish("r1", p, 9)
    hashes_before = cm.hasher.num_block_hashes
    cm.publish("r2", p, 9)
    assert cm.hasher.num_block_hashes == hashes_before  # followed the tree, hashed nothing
    assert cm.block_table("r2") == [3, 4, 5]  # r2 keeps computing on its own copies
    assert cm.num_cached_blocks == 2 and cm.num_tree_nodes == 1
    assert cm.num_in_use_blocks == 6  # r1: 2 locked + 1 private; r2: 3 private
    node = next(iter(cm.tree.iter_nodes()))
    assert node.lock_ref == 2 and list(node.block_ids) == [0, 1]
    cm.check_integrity()
    # Both continue decoding: neither may grow the shared node in place.
    for rid in ("r1", "r2"):
        seq = p + [50, 51, 52]
        assert cm.allocate(rid, 12)
        cm.publish(rid, seq, 12)
        cm.check_integrity()
    assert cm.num_tree_nodes == 2 and cm.num_cached_blocks == 3
    cm.release("r2")
    assert cm.num_free_blocks == 16 - 3 and cm.block_states()[3:6] == ["free"] * 3
    assert cm.begin("r3", root, p + [50, 51, 52, 53]) == 12
    assert cm.block_table("r3") == [0, 1, 2]
    cm.release("r1")
    cm.release("r3")
    cm.check_integrity()
    assert cm.num_in_use_blocks == 0


def test_partial_duplicate_then_divergence() -> None:
    cm, root = make(16)
    p1, p2 = [1, 2, 3, 4, 5, 6, 7, 8, 0], [1, 2, 3, 4, 7, 7, 7, 7, 0]
    for rid, p in (("r1", p1), ("r2", p2)):
        cm.begin(rid, root, p)
        cm.allocate(rid, 9)
    cm.publish("r1", p1, 9)
    before = cm.hasher.num_block_hashes
    cm.publish("r2", p2, 9)
    assert cm.hasher.num_block_hashes == before + 1  # only the diverging block is new
    assert cm.num_tree_nodes == 3 and cm.num_cached_blocks == 3
    cm.check_integrity()


def test_c16_generated_tokens_are_published() -> None:
    cm, root = make(128)
    prompt = [(7 * i) % 97 + 1 for i in range(100)]
    assert cm.begin("t1", root, prompt) == 0
    assert cm.allocate("t1", 100)
    cm.publish("t1", prompt, 100)
    seq = list(prompt)
    for step in range(50):
        seq.append(200 + step)  # sampled token; its K/V is computed on the next step
        if step < 49:
            assert cm.allocate("t1", len(seq))
            cm.publish("t1", seq, len(seq))
    assert cm.hasher.num_block_hashes == 37  # each block hashed exactly once
    cm.check_integrity()
    cm.release("t1")
    assert cm.num_cached_blocks == 37 and cm.num_tree_nodes == 1
    assert cm.num_in_use_blocks == 0
    t2 = seq + [300 + i for i in range(50)]
    assert cm.begin("t2", root, t2) == 148
    cm.check_integrity()


def test_chunked_publish_hashes_each_block_once() -> None:
    calls: list[int] = []

    def counting(data: bytes) -> bytes:
        calls.append(len(data))
        return __import__("xxhash").xxh3_128_digest(data)

    cm, root = make(600, hash_fn=counting)
    calls.clear()
    prompt = list(range(2048))
    cm.begin("a", root, prompt)
    for end in range(256, 2049, 256):  # chunked prefill
        assert cm.allocate("a", end)
        cm.publish("a", prompt, end)
    assert len(calls) == 512 and sum(calls) == 512 * (16 + 4 * B)
    cm.release("a")
    assert cm.begin("b", root, prompt + [5] * 9) == 2048
    cm.allocate("b", 2057)
    cm.publish("b", prompt + [5] * 9, 2057)
    assert len(calls) == 514  # matched blocks are never re-hashed


def test_c01_collision_never_returns_foreign_kv() -> None:
    cm, root = make(16, hash_fn=lambda data: bytes([sum(data) % 7]))
    a = [1, 2, 3, 4, 9, 9, 9, 9]
    warm(cm, root, "a", a)
    assert cm.hasher.block_hash(root, [4, 3, 2, 1]) == cm.hasher.block_hash(root, [1, 2, 3, 4])
    assert warm(cm, root, "c", [4, 3, 2, 1, 9, 9, 9, 9]) == 0
    assert warm(cm, root, "a2", a) == 4  # positive control
    d = [5, 5, 5, 5, 5, 5, 5, 5, 1]
    warm(cm, root, "d", d)
    node = next(n for n in cm.tree.iter_nodes() if n.blocks[0] == (5, 5, 5, 5))
    assert node.blocks == [(5, 5, 5, 5), (5, 5, 5, 5)] and node.hashes[0] != node.hashes[1]
    assert warm(cm, root, "d2", d) == 8


def test_identities_are_isolated() -> None:
    cm, root = make(16)
    other = cm.identity_root(CacheIdentity("r1", B, "float32", ROPE, cache_salt="t2"))
    warm(cm, root, "a", [1] * 9)
    assert warm(cm, other, "b", [1] * 9) == 0
    assert warm(cm, root, "c", [1] * 9) == 8
    with pytest.raises(ValueError, match="block_size"):
        cm.identity_root(CacheIdentity("r1", 8, "float32", ROPE))


def test_prefix_caching_disabled() -> None:
    cm, root = make(8, enable_prefix_caching=False)
    p = list(range(1, 10))
    for rid in ("a", "b"):
        assert cm.begin(rid, root, p) == 0
        assert cm.allocate(rid, 9)
        cm.publish(rid, p, 9)
        cm.check_integrity()
    assert cm.block_table("b") == [3, 4, 5] and cm.num_cached_blocks == 0
    cm.release("a")
    cm.release("b")
    assert gauges(cm) == (8, 0, 0, 0, 0)
    cm.check_integrity()


def test_bad_input() -> None:
    cm, root = make(8)
    cm.begin("a", root, [1, 2])
    with pytest.raises(ValueError, match="request_id"):
        cm.begin("a", root, [1, 2])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        cm.begin("z", root, [])
    with pytest.raises(ValueError, match="num_tokens"):
        cm.allocate("a", -1)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        cm.publish("a", [1, 2, 3, 4], 4)  # no block allocated yet
    with pytest.raises(KeyError):
        cm.allocate("nope", 4)
    with pytest.raises(ValueError, match="eviction_policy"):
        CacheManager(8, B, eviction_policy="nope")
    with pytest.raises(ValueError, match="num_blocks"):
        CacheManager(0, B)
    with pytest.raises(ValueError, match="hash_algo"):
        CacheManager(8, B, hash_algo="md5")


def test_one_off_identities_keep_no_state() -> None:
    """A client may send a new cache salt per request: nothing may grow per salt."""
    from radixkv.cache.manager import IDENTITY_MEMO_SIZE
    assert IDENTITY_MEMO_SIZE == 4096
    cm, _ = make(8)
    first = cm.identity_root(CacheIdentity("r1", B, "float32", ROPE, cache_salt="s0"))
    for i in range(IDENTITY_MEMO_SIZE + 50):
        root = cm.identity_root(CacheIdentity("r1", B, "float32", ROPE, cache_salt=f"s{i}"))
        cm.begin(f"q{i}", root, [1, 2, 3])  # a miss: the lookup locks the bare root
        cm.release(f"q{i}")
    # 4146 identities seen: the one memo holds the last 4096 (with their tenants), the tree none.
    assert (len(cm.tree.roots), len(cm.identities), cm.identities.capacity) == (0, 4096, 4096)
    assert len(cm.identities._tenants) == 4096
    assert cm.identities.tenant(first) is None  # s0 was dropped first
    # An identity dropped from the memo still gets the same root hash (and its cached blocks).
    assert cm.identity_root(CacheIdentity("r1", B, "float32", ROPE, cache_salt="s0")) == first
    assert warm(cm, first, "w1", [1, 2, 3, 4, 5]) == 0
    assert warm(cm, first, "w2", [1, 2, 3, 4, 5]) == 4
    assert len(cm.tree.roots) == 1
    cm.evict(8)
    assert cm.tree.roots == {}
    cm.check_integrity()


def test_count_arguments_are_ints() -> None:
    cm, root = make(8)
    cm.begin("a", root, [1, 2, 3, 4, 5])
    for bad in (True, 4.0, "4", -1):
        with pytest.raises(ValueError, match="num_tokens: must be an int >= 0"):
            cm.allocate("a", bad)
        with pytest.raises(ValueError, match="num_blocks: must be an int >= 0"):
            cm.evict(bad)
    assert cm.allocate("a", 5)
    for bad in (True, 4.0, -1):
        with pytest.raises(ValueError, match="num_computed_tokens: must be an int >= 0"):
            cm.publish("a", [1, 2, 3, 4, 5], bad)
        with pytest.raises(ValueError, match="num_computed_tokens: must be an int >= 0"):
            cm.fork("a", "child", num_computed_tokens=bad)
    assert cm._requests["a"].num_computed_tokens == 0  # failed calls changed nothing
    with pytest.raises(ValueError, match="token_ids: packed tokens need a multiple of 4 bytes"):
        cm.publish("a", b"\x01" * 35, 8)
    with pytest.raises(ValueError, match="mm_items"):
        cm.publish("a", [1, 2, 3, 4, 5], 4, mm_items=[(9, 1, b"d")])
    assert cm._requests["a"].num_computed_tokens == 0 and cm.num_cached_blocks == 0
    with pytest.raises(ValueError, match="root: must be the 16 bytes identity_root"):
        cm.begin("b", b"", [1, 2])
    with pytest.raises(ValueError, match="enable_prefix_caching: must be a bool"):
        CacheManager(8, B, enable_prefix_caching="no")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="ghost_capacity: must be an int >= 1"):
            CacheManager(8, B, ghost_capacity=bad)
    cm.check_integrity()


def test_recovered_hashes_are_reused_only_for_the_compared_tokens() -> None:
    """A lookup recovers evicted blocks' hashes from the ghost list; publishing other tokens
    than the prompt's must hash them afresh (the stored chain stays the tokens' hashes)."""
    prompt = list(range(1, 10))
    for published, reused in ((prompt, 2), ([50] * 9, 0)):
        cm, root = make(8)
        warm(cm, root, "a", prompt)
        assert cm.evict(10) == 2
        hashed = cm.hasher.num_block_hashes
        assert cm.begin("b", root, prompt) == 0
        assert cm.miss_breakdown("b") == {"cold": 0, "evicted": 8, "isolated": 0,
                                          "unaligned_tail": 1, "store_timeout": 0,
                                          "store_rejected": 0, "window_evicted": 0}
        assert cm.allocate("b", 9)
        cm.publish("b", published, 8)
        assert cm.hasher.num_block_hashes - hashed == 2 - reused
        cm.check_integrity(verify_hashes=True)

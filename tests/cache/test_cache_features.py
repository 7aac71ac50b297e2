"""CacheManager features: multimodal identity, miss causes, fork, deferred free, lookup
side effects, and linear hashing of long prompts."""

from __future__ import annotations

import itertools

import pytest
import xxhash

from radixkv.cache.hashing import CacheIdentity, pack_tokens
from radixkv.cache.manager import CacheManager

B = 4
ROPE = "theta=100000.0;scaling=None"


def make(num_blocks: int = 32, **kwargs) -> tuple[CacheManager, bytes]:
    ticks = itertools.count()
    cm = CacheManager(num_blocks, B, clock=lambda: float(next(ticks)), **kwargs)
    return cm, cm.identity_root(CacheIdentity("r1", B, "float32", ROPE))


def warm(cm: CacheManager, root: bytes, rid: str, tokens, mm_items=None) -> int:
    """Run a request to completion (no generated tokens); return its cached tokens."""
    m = cm.begin(rid, root, tokens, mm_items=mm_items)
    assert cm.allocate(rid, len(tokens))
    cm.record_admission(rid)
    cm.publish(rid, tokens, len(tokens))
    cm.check_integrity(verify_hashes=True)
    cm.release(rid)
    cm.check_integrity(verify_hashes=True)
    return m


# ---- same placeholder tokens, different images ------------------------------------------
def test_c04_images_keyed_by_digest_and_offset() -> None:
    cm, root = make()
    h1 = cm.hasher.media_digest("rgb8", (2, 2, 3), b"image one...")
    h2 = cm.hasher.media_digest("rgb8", (2, 2, 3), b"image two...")
    r = [1, 2, 999, 999, 999, 999, 3, 4, 5]
    assert warm(cm, root, "R1", r, [(2, 4, h1)]) == 0
    assert warm(cm, root, "R2", r, [(2, 4, h2)]) == 0  # block 0 already covers the image
    assert warm(cm, root, "R3", r, [(2, 4, h1)]) == 8
    assert warm(cm, root, "R3-text", r) == 0  # no image: never matches image blocks
    r5 = [1, 2, 3, 4, 999, 999, 999, 999, 5]
    assert warm(cm, root, "R5-h1", r5, [(4, 4, h1)]) == 0
    assert warm(cm, root, "R5-h2", r5, [(4, 4, h2)]) == 4  # the pure-text block is shared
    assert cm.peek(root, r5, mm_items=[(4, 4, h1)]) == 8
    assert cm.peek(root, r5, mm_items=[(5, 3, h1)]) == 4  # same image, other offset


def test_mm_runs_grow_and_split() -> None:
    cm, root = make(64)
    d = cm.hasher.media_digest("rgb8", (1,), b"x")
    long_prompt = list(range(1, 30))
    warm(cm, root, "a", long_prompt, [(9, 6, d)])  # blocks 2 and 3 carry extras
    assert cm.peek(root, long_prompt, mm_items=[(9, 6, d)]) == 28
    assert cm.peek(root, long_prompt) == 8  # text prompt stops before the image blocks
    assert warm(cm, root, "b", long_prompt) == 8  # splits the run, inserts a text branch
    assert warm(cm, root, "c", long_prompt, [(9, 6, d)]) == 28
    cm.check_integrity(verify_hashes=True)


# ---- miss causes ---------------------------------------------------------------------------
def test_miss_causes_cold_evicted_isolated_unaligned() -> None:
    cm, root = make(16)
    other = cm.identity_root(CacheIdentity("r1", B, "float32", ROPE, cache_salt="t2"))
    a = list(range(1, 11))  # 10 tokens: cap 8, tail 2
    warm(cm, root, "a", a)
    assert cm.miss_tokens == {"cold": 8, "evicted": 0, "isolated": 0, "unaligned_tail": 2, "store_timeout": 0, "store_rejected": 0, "window_evicted": 0}
    warm(cm, other, "iso", a)  # same tokens, other identity
    assert cm.miss_tokens["isolated"] == 8
    assert cm.evict(100) == 4  # a's 2 blocks and iso's 2 blocks
    m = cm.begin("ev", root, a + [77, 78, 79])  # 13 tokens: cap 12
    assert m == 0 and cm.miss_breakdown("ev") == {
        "cold": 4, "evicted": 8, "isolated": 0, "unaligned_tail": 1, "store_timeout": 0, "store_rejected": 0, "window_evicted": 0}
    cm.record_admission("ev")
    cm.record_admission("ev")  # counted once
    assert cm.miss_tokens == {"cold": 12, "evicted": 8, "isolated": 8, "unaligned_tail": 5, "store_timeout": 0, "store_rejected": 0, "window_evicted": 0}
    # Publishing the evicted blocks re-uses the hashes found in the ghost list.
    before = cm.hasher.num_block_hashes
    assert cm.allocate("ev", 13)
    cm.publish("ev", a + [77, 78, 79], 13)
    assert cm.hasher.num_block_hashes == before + 1  # only block 2 ([9,10,77,78]) is new
    cm.check_integrity(verify_hashes=True)
    cm.release("ev")
    # A partial hit followed by a miss: m = 4, never "isolated".
    assert cm.begin("p", root, a[:4] + [50] * 9) == 4
    assert cm.miss_breakdown("p") == {"cold": 8, "evicted": 0, "isolated": 0, "unaligned_tail": 1, "store_timeout": 0, "store_rejected": 0, "window_evicted": 0}
    cm.release("p")
    assert cm.miss_tokens["cold"] == 12  # never admitted: not counted


def test_lookups_count_once_per_request_across_churn() -> None:
    cm, root = make(4)
    prompt = list(range(1, 14))
    for _ in range(5):  # the scheduler's begin / release while waiting
        cm.begin("w", root, prompt)
        cm.release("w")
    assert cm.miss_tokens == {"cold": 0, "evicted": 0, "isolated": 0, "unaligned_tail": 0, "store_timeout": 0, "store_rejected": 0, "window_evicted": 0}
    cm.begin("w", root, prompt)
    assert cm.allocate("w", 13)
    cm.record_admission("w")
    assert sum(cm.miss_tokens.values()) == 13


def test_failed_admission_leaves_policy_fields_alone() -> None:
    cm, root = make(8)
    warm(cm, root, "a", [1] * 9)
    node = next(iter(cm.tree.iter_nodes()))
    fields = (node.hit_count, node.last_access_s)
    assert cm.begin("b", root, [1] * 9) == 8
    cm.release("b")  # released unadmitted, as the scheduler does when blocks are short
    assert (node.hit_count, node.last_access_s) == fields
    assert cm.peek(root, [1] * 9) == 8 and (node.hit_count, node.last_access_s) == fields
    assert cm.begin("c", root, [1] * 9) == 8 and cm.allocate("c", 9)
    assert node.hit_count == fields[0] + 1
    cm.release("c")
    cm.check_integrity()


def test_peek_changes_nothing() -> None:
    cm, root = make(16)
    warm(cm, root, "a", list(range(1, 14)))
    assert cm.num_tree_nodes == 1
    assert cm.peek(root, [1, 2, 3, 4, 5, 6, 0, 0, 9]) == 4  # would split the node
    assert cm.num_tree_nodes == 1 and cm.num_in_use_blocks == 0
    assert cm.peek(b"\x00" * 16, [1, 2, 3]) == 0  # unknown identity


# ---- fork (n > 1) --------------------------------------------------------------------------
def test_fork_shares_full_blocks_and_copies_the_partial_tail() -> None:
    cm, root = make(8)
    p = [1, 2, 3, 4, 5, 6]
    assert cm.begin("a", root, p) == 0
    assert cm.allocate("a", 6) and cm.block_table("a") == [0, 1]
    cm.publish("a", p, 6)
    assert cm.fork("a", "b") == [(1, 2)]  # engine copies K/V of block 1 into block 2
    assert cm.fork("a", "c") == [(1, 3)]
    assert cm.block_table("b") == [0, 2] and cm.block_table("c") == [0, 3]
    node = next(iter(cm.tree.iter_nodes()))
    assert node.lock_ref == 3 and list(node.block_ids) == [0]  # block 0 held by three
    assert cm.block_states()[:4] == ["cached_locked", "private", "private", "private"]
    cm.check_integrity()
    # Each continues on its own tail; publishing diverging blocks branches the tree.
    for rid, g in (("a", 7), ("b", 8), ("c", 9)):
        seq = p + [g, g]
        assert cm.allocate(rid, 8)
        cm.publish(rid, seq, 8)
    assert cm.num_cached_blocks == 4 and cm.num_tree_nodes == 4
    cm.release("a")
    cm.check_integrity()
    cm.record_admission("b")  # a child's lookup is the parent's: nothing counted
    assert sum(cm.miss_tokens.values()) == 0
    for rid in ("b", "c"):
        cm.release(rid)
    assert cm.num_in_use_blocks == 0 and cm.num_free_blocks == 4
    cm.check_integrity()


def test_fork_on_block_boundary_and_without_prefix_caching() -> None:
    cm, root = make(8)
    p = list(range(1, 9))
    cm.begin("a", root, p)
    cm.allocate("a", 8)
    cm.publish("a", p, 8)
    assert cm.fork("a", "b") == [] and cm.block_table("b") == [0, 1]
    cm.release("a")
    cm.release("b")
    off, root2 = make(8, enable_prefix_caching=False)
    off.begin("a", root2, p[:6])
    off.allocate("a", 6)
    off.publish("a", p[:6], 6)
    assert off.fork("a", "b") == [(1, 2)] and off.block_table("b") == [0, 2]
    assert off.pool.ref_count(0) == 2  # the full block is shared by reference count
    off.check_integrity()
    off.release("a")
    assert off.pool.ref_count(0) == 1
    off.release("b")
    assert off.num_free_blocks == 8
    off.check_integrity()


def test_fork_errors_and_all_or_nothing() -> None:
    cm, root = make(2)
    p = [1, 2, 3, 4, 5, 6]
    cm.begin("a", root, p)
    cm.allocate("a", 6)
    with pytest.raises(ValueError, match="parent_request_id"):
        cm.fork("a", "b", num_computed_tokens=6)  # block 0 computed but not published yet
    cm.publish("a", p, 6)
    before = (cm.block_states(), cm.num_tree_nodes)
    assert cm.fork("a", "b") is None  # no block for the tail copy: nothing changed
    assert (cm.block_states(), cm.num_tree_nodes) == before and not cm.is_active("b")
    with pytest.raises(ValueError, match="child_request_id"):
        cm.fork("a", "a")
    with pytest.raises(ValueError, match="num_computed_tokens"):
        cm.fork("a", "b", num_computed_tokens=9)
    cm.check_integrity()


# ---- deferred free -------------------------------------------------------------------------
def test_release_during_a_step_defers_private_blocks() -> None:
    cm, root = make(4)
    cm.begin("a", root, list(range(1, 10)))
    assert cm.allocate("a", 9) and cm.block_table("a") == [0, 1, 2]
    cm.begin_step()
    cm.release("a")  # aborted while the step may still write blocks 0-2
    assert (cm.num_free_blocks, cm.num_deferred_blocks, cm.num_in_use_blocks) == (1, 3, 3)
    cm.check_integrity()
    cm.begin("b", root, [7] * 8)
    assert not cm.allocate("b", 8)  # deferred blocks are not free yet
    assert cm.allocate("b", 4) and cm.block_table("b") == [3]
    with pytest.raises(RuntimeError, match="in flight"):
        cm.begin_step()
    assert cm.end_step() == 3
    assert (cm.num_free_blocks, cm.num_deferred_blocks) == (3, 0)
    assert cm.allocate("b", 8) and cm.block_table("b") == [3, 0]
    cm.check_integrity()
    with pytest.raises(RuntimeError, match="no step"):
        cm.end_step()


def test_published_blocks_are_not_deferred() -> None:
    cm, root = make(8)
    p = list(range(1, 10))
    cm.begin("a", root, p)
    cm.allocate("a", 9)
    cm.publish("a", p, 8)
    cm.begin_step()
    cm.release("a")
    # Blocks 0, 1 are published (never written again): cached-evictable at once.
    assert (cm.num_cached_evictable_blocks, cm.num_deferred_blocks) == (2, 1)
    assert cm.end_step() == 1
    cm.check_integrity()


# ---- hashing is linear in the prompt -----------------------------------------------------
@pytest.mark.parametrize("num_tokens", [65536, 131072])
def test_c19_hashed_bytes_linear(num_tokens: int) -> None:
    fed: list[int] = []

    def counting(data: bytes) -> bytes:
        fed.append(len(data))
        return xxhash.xxh3_128_digest(data)

    bs = 16
    cm = CacheManager(num_tokens // bs + 8, bs, hash_fn=counting)
    root = cm.identity_root(CacheIdentity("r1", bs, "float32", ROPE))
    prompt = [(i * 7919) % 50000 for i in range(num_tokens)]
    fed.clear()
    assert cm.begin("a", root, prompt + [1]) == 0
    assert sum(fed) == 0  # a lookup hashes nothing
    for end in range(4096, num_tokens + 1, 4096):  # inserted in 4k-token chunks
        assert cm.allocate("a", end)
        cm.publish("a", prompt, end)
    num_blocks = num_tokens // bs
    assert len(fed) == num_blocks and sum(fed) == num_blocks * (16 + 4 * bs)  # c = 80 B/block
    cm.release("a")
    fed.clear()
    assert cm.begin("b", root, pack_tokens(prompt + [1])) == num_tokens  # packed input too
    assert sum(fed) == 0
    cm.release("b")

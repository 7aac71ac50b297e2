"""The cache's KV metrics: tail-block waste and token occupancy, allocation and free counters,
fork and copy-on-write counters — exact values on hand-worked pools."""

from __future__ import annotations

import itertools

from radixkv.cache.hashing import CacheIdentity
from radixkv.cache.manager import CacheManager

ROPE = "theta=100000.0;scaling=None"


def make(num_blocks: int, block_size: int, **kwargs) -> tuple[CacheManager, bytes]:
    ticks = itertools.count()
    cm = CacheManager(num_blocks, block_size, clock=lambda: float(next(ticks)), **kwargs)
    return cm, cm.identity_root(CacheIdentity("r1", block_size, "float32", ROPE))


def used_token_slots(cm: CacheManager) -> int:
    """Token slots holding a token: used blocks x B less the live tail waste."""
    used_blocks = cm.num_blocks - cm.num_free_blocks
    return used_blocks * cm.block_size - cm.num_live_tail_waste_tokens


def test_tail_waste_is_exact_for_17_token_prompts_at_block_16() -> None:
    cm, root = make(16, 16)
    prompts = {f"r{i}": [100 * i + t for t in range(17)] for i in range(3)}
    for rid, prompt in prompts.items():
        assert cm.begin(rid, root, prompt) == 0
        assert cm.allocate(rid, 17)  # the prefill chunk: 2 blocks, 15 empty slots in the 2nd
    assert cm.num_live_tail_waste_tokens == 3 * 15
    assert cm.num_in_use_blocks == 6 and used_token_slots(cm) == 3 * 17
    for rid, prompt in prompts.items():
        cm.publish(rid, prompt, 17)  # block 0 (full) moves to the tree; the tail stays private
    assert cm.num_live_tail_waste_tokens == 45 and cm.num_cached_blocks == 3
    assert cm.allocate("r0", 18)  # r0 decodes one token: 14 empty slots left in its tail
    assert cm.num_live_tail_waste_tokens == 14 + 15 + 15
    # A hit: the same prompt again matches block 0 (m = 16) and allocates one tail block.
    assert cm.begin("again", root, prompts["r1"]) == 16
    assert cm.num_live_tail_waste_tokens == 44  # a matched prefix has no empty slot
    assert cm.allocate("again", 17)
    assert cm.num_live_tail_waste_tokens == 44 + 15
    assert used_token_slots(cm) == 18 + 17 + 17 + 1  # "again" reads r1's block 0
    for rid in [*prompts, "again"]:
        cm.release(rid)
    # Released: tails freed, full blocks cached; cached blocks are full, no waste is left.
    assert cm.num_live_tail_waste_tokens == 0
    assert used_token_slots(cm) == cm.num_cached_blocks * 16 == 3 * 16
    cm.check_integrity()


def test_tail_waste_is_zero_on_a_block_boundary_and_for_loaded_prefixes() -> None:
    cm, root = make(8, 16)
    prompt = list(range(1, 33))  # 32 tokens: 2 full blocks
    cm.begin("a", root, prompt)
    assert cm.allocate("a", 32)
    assert cm.num_live_tail_waste_tokens == 0
    cm.publish("a", prompt, 32)
    cm.release("a")
    assert cm.begin("b", root, prompt) == 16  # hit cap: the last token is always computed
    assert cm.num_live_tail_waste_tokens == 0
    assert cm.allocate("b", 32)  # its own copy of block 1 (a duplicate of the cached one)
    assert cm.num_live_tail_waste_tokens == 0
    cm.release("b")


def test_allocated_and_freed_block_counters() -> None:
    cm, root = make(4, 4)
    cm.begin("a", root, [1, 2, 3, 4, 5, 6])
    assert cm.allocate("a", 6)  # 2 blocks
    cm.publish("a", [1, 2, 3, 4, 5, 6], 6)  # block 0 cached
    assert (cm.allocated_blocks_total, cm.freed_blocks_total) == (2, 0)
    cm.release("a")  # the private tail goes back
    assert (cm.allocated_blocks_total, cm.freed_blocks_total) == (2, 1)
    cm.begin("b", root, [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9])
    assert cm.allocate("b", 13)  # 4 blocks: 3 free + block 0 evicted
    assert (cm.allocated_blocks_total, cm.freed_blocks_total) == (6, 2)
    assert cm.evicted_blocks_total == 1
    cm.begin_step()
    cm.release("b")  # deferred while the step is in flight: not freed yet
    assert cm.freed_blocks_total == 2
    assert cm.end_step() == 4
    assert (cm.allocated_blocks_total, cm.freed_blocks_total) == (6, 6)
    # allocated - freed is the number of owned blocks at any time.
    assert cm.num_free_blocks == 4
    cm.check_integrity()


def test_fork_counters_equal_what_the_forks_create() -> None:
    # The scenario of test_cache_features' fork tests: a 6-token prompt at B = 4 forked twice
    # (block 0 shared, the partial block 1 copied each time), then one on a block boundary.
    cm, root = make(8, 4)
    p = [1, 2, 3, 4, 5, 6]
    cm.begin("a", root, p)
    assert cm.allocate("a", 6)
    cm.publish("a", p, 6)
    assert cm.fork("a", "b") == [(1, 2)]
    assert cm.fork("a", "c") == [(1, 3)]
    assert (cm.forks_total, cm.fork_shared_blocks_total, cm.cow_copied_blocks_total) == (2, 2, 2)
    assert cm.num_live_tail_waste_tokens == 3 * 2  # each choice's own tail: 2 of 4 slots empty
    for rid in ("a", "b", "c"):
        cm.release(rid)
    boundary, root2 = make(8, 4)
    q = list(range(1, 9))
    boundary.begin("a", root2, q)
    boundary.allocate("a", 8)
    boundary.publish("a", q, 8)
    assert boundary.fork("a", "b") == []
    assert (boundary.forks_total, boundary.fork_shared_blocks_total,
            boundary.cow_copied_blocks_total) == (1, 2, 0)
    tight, root3 = make(2, 4)
    tight.begin("a", root3, p)
    tight.allocate("a", 6)
    tight.publish("a", p, 6)
    assert tight.fork("a", "b") is None  # no block for the tail copy: nothing counted
    assert (tight.forks_total, tight.cow_copied_blocks_total) == (0, 0)

"""The ghost list of evicted runs: runs of one leaf evicted tail first (one block per
allocation, as during decode) join into one entry, which a lookup walks with one probe and one
compare, recovering every chained hash exactly; capacity counts blocks."""

from __future__ import annotations

import itertools

from radixkv.cache.ghost import GhostList
from radixkv.cache.hashing import CacheIdentity
from radixkv.cache.manager import CacheManager

B = 4


def make(num_blocks: int, **kwargs) -> tuple[CacheManager, bytes]:
    ticks = itertools.count()
    cm = CacheManager(num_blocks, B, clock=lambda: float(next(ticks)), **kwargs)
    return cm, cm.identity_root(CacheIdentity("r1", B, "float32", "rope"))


def warm(cm: CacheManager, root: bytes, rid: str, tokens: list[int]) -> None:
    cm.begin(rid, root, tokens)
    assert cm.allocate(rid, len(tokens))
    cm.record_admission(rid)
    cm.publish(rid, tokens, len(tokens))
    cm.release(rid)


def test_one_block_evictions_of_a_leaf_form_one_entry() -> None:
    cm, root = make(16)
    prompt = list(range(1, 26))  # 25 tokens: 6 full blocks
    warm(cm, root, "a", prompt)
    node = next(iter(cm.tree.iter_nodes()))
    hashes = list(node.hashes)
    assert len(hashes) == 6
    for _ in range(6):  # tail first, one block at a time
        assert cm.evict(1) == 1
    assert cm.tree.num_cached_blocks == 0
    assert len(cm.ghost) == 1 and cm.ghost.num_blocks == 6
    # The lookup finds all six blocks evicted and recovers their hashes without hashing.
    before = cm.hasher.num_block_hashes
    assert cm.begin("b", root, prompt) == 0
    assert cm.miss_breakdown("b") == {"cold": 0, "evicted": 24, "isolated": 0,
                                      "unaligned_tail": 1, "store_timeout": 0,
                                          "store_rejected": 0}
    assert cm.hasher.num_block_hashes == before
    assert cm.allocate("b", len(prompt))
    cm.publish("b", prompt, len(prompt))
    assert cm.hasher.num_block_hashes == before  # all six hashes came from the ghost entry
    cm.check_integrity(verify_hashes=True)
    assert list(next(iter(cm.tree.iter_nodes())).hashes) == hashes
    cm.release("b")


def test_partially_evicted_leaf_and_prompt_diverging_inside_the_entry() -> None:
    cm, root = make(16)
    prompt = list(range(1, 26))
    warm(cm, root, "a", prompt)
    for _ in range(4):
        cm.evict(1)  # blocks 5, 4, 3, 2 go; blocks 0, 1 stay cached
    assert cm.tree.num_cached_blocks == 2 and len(cm.ghost) == 1
    other = prompt[:14] + [99] * 11  # agrees with the ghost entry for block 2 only
    assert cm.begin("c", root, other) == 8
    assert cm.miss_breakdown("c") == {"cold": 12, "evicted": 4, "isolated": 0,
                                      "unaligned_tail": 1, "store_timeout": 0,
                                          "store_rejected": 0}
    cm.release("c")


def test_capacity_counts_blocks_and_forgets_oldest_entries() -> None:
    cm, root = make(32, ghost_capacity=8)
    first = list(range(1, 22))    # 5 full blocks
    second = list(range(100, 121))  # 5 full blocks, another branch
    warm(cm, root, "a", first)
    for _ in range(5):
        cm.evict(1)
    assert cm.ghost.num_blocks == 5
    warm(cm, root, "b", second)
    for _ in range(5):
        cm.evict(1)
    # 10 blocks > 8: the whole older entry (first's 5 blocks) is forgotten.
    assert len(cm.ghost) == 1 and cm.ghost.num_blocks == 5
    assert cm.begin("x", root, first) == 0
    assert cm.miss_breakdown("x")["evicted"] == 0
    cm.release("x")
    assert cm.begin("y", root, second) == 0
    assert cm.miss_breakdown("y")["evicted"] == 20
    cm.release("y")


def test_ghost_list_add_extends_entries_in_front() -> None:
    ghost = GhostList(100)
    h = [bytes([i]) * 2 for i in range(6)]  # two-byte "hashes": h[0] is the parent of block 1
    tok = [bytes([10 + i]) * 8 for i in range(6)]
    ghost.add([(h[2] + tok[3], (tok[3] + tok[4], [h[3], h[4]], None))])
    ghost.add([(h[1] + tok[2], (tok[2], [h[2]], None))])  # ends where the entry begins
    assert len(ghost) == 1 and ghost.num_blocks == 3
    run = ghost.get(h[1] + tok[2])
    assert run.tokens == tok[2] + tok[3] + tok[4] and run.hashes == [h[2], h[3], h[4]]
    assert run.extras is None
    assert ghost.get(h[2] + tok[3]) is None  # the old key now lives inside the entry
    # A run that does not end where an entry begins is an entry of its own.
    ghost.add([(h[4] + tok[5], (tok[5], [h[5]], [b"img"]))])
    assert len(ghost) == 2 and ghost.num_blocks == 4
    assert ghost.get(h[4] + tok[5]).extras == [b"img"]

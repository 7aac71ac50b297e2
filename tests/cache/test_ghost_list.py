"""The ghost list of evicted runs: runs of one leaf evicted tail first (one block per
allocation, as during decode) join into one entry, which a lookup walks with one probe and one
compare, recovering every chained hash exactly; capacity counts blocks."""

from __future__ import annotations

import itertools

from radixkv.cache.ghost import GhostList, as_ghost_run
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
                                          "store_rejected": 0, "window_evicted": 0}
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
                                          "store_rejected": 0, "window_evicted": 0}
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


def link_add(ghost: GhostList, key: bytes, run: tuple) -> None:
    """The reference: enter one run at once through ``_link`` (never deferred)."""
    run = as_ghost_run(run)
    w = run.hash_size
    num = len(run.hash_bytes) // w
    ghost._grew(num, ghost._link(key, run, key[:w], bytes(run.hash_bytes[-w:]), num))


def _chain(n: int) -> tuple[list[bytes], list[bytearray]]:
    """``n + 1`` 16-byte chained "hashes" (h[0] the parent of block 1) and n+1 blocks' tokens."""
    h = [bytes([i]) * 16 for i in range(n + 1)]
    tok = [bytearray([100 + i]) * (4 * B) for i in range(n + 1)]
    return h, tok


def test_open_entry_equals_block_by_block_adds() -> None:
    """A leaf evicted one block at a time through ``add_block`` (its entry open: nothing entered
    until a read) answers every read exactly as entering each block at once (``_link``) does:
    one entry, the same tokens, hashes, key, parent link and block count; the open blocks settle
    as one run."""
    h, tok = _chain(8)
    one, ref = GhostList(100), GhostList(100)
    for i in range(8, 0, -1):  # blocks 8, 7, ..., 1: tail first
        one.add_block(h[i - 1], tok[i], h[i])
        link_add(ref, h[i - 1] + tok[i], (tok[i], [h[i]], None))
    assert one._open_hashes and not one._runs  # nothing entered yet
    assert len(one) == len(ref) == 1 and one.num_blocks == ref.num_blocks == 8
    key = h[0] + tok[1]
    assert one.keys() == ref.keys() == [key]
    got, want = one.get(key), ref.get(key)
    assert (bytes(got.tokens), got.hashes) == (bytes(want.tokens), want.hashes) == (
        b"".join(tok[1:]), h[1:])
    assert len(one.parts(key)) == 1 and len(ref.parts(key)) == 8  # one run vs one per block
    # add() of the same runs defers the same way.
    other = GhostList(100)
    for i in range(8, 0, -1):
        other.add([(h[i - 1] + tok[i], (tok[i], [h[i]], None))])
    assert other.keys() == [key] and len(other.parts(key)) == 1
    assert other.get(key).hashes == h[1:] and other._by_parent == ref._by_parent
    assert one._by_parent == ref._by_parent == {h[0]: key}


def test_open_entry_enters_at_once_where_deferring_would_differ() -> None:
    """While blocks 4, 3 of a leaf are open, block 2 arrives and an entry already begins at it
    (it was evicted, came back, and goes again) or another entry hangs off its parent (a
    sibling branch): ``_link`` would re-key or re-link those, so the open entry is entered at
    once and both lists stay equal, read after every step."""
    h, tok = _chain(4)
    sibling = bytearray([7]) * (4 * B)
    for earlier in ([(h[1] + tok[2], (tok[2], [h[2]], None))],  # the same block 2
                    [(h[1] + sibling, (sibling, [b"s" * 16], None))]):  # block 2's sibling
        one, ref = GhostList(100), GhostList(100)
        one.add(earlier)
        link_add(ref, *earlier[0])
        for block in (4, 3, 2, 1):  # no read in between: the open entry is not settled by one
            one.add_block(h[block - 1], tok[block], h[block])
            link_add(ref, h[block - 1] + tok[block], (tok[block], [h[block]], None))
            # Blocks 4, 3 stay open; block 2 enters them and goes through _link, block 1 opens
            # the entry again.
            assert bool(one._open_hashes) == (block != 2)
        keys = one.keys()
        assert keys == ref.keys() and one.num_blocks == ref.num_blocks
        assert [(one.get(k).hashes, bytes(one.get(k).tokens)) for k in keys] == [
            (ref.get(k).hashes, bytes(ref.get(k).tokens)) for k in keys]
        assert one._by_parent == ref._by_parent


def test_open_entry_is_forgotten_last_for_capacity() -> None:
    """Capacity 3: an older entry goes first; when only the open entry is left over capacity,
    it is entered and forgotten like any other (oldest first)."""
    h, tok = _chain(6)
    ghost = GhostList(3)
    ghost.add([(h[5] + tok[6], (tok[6], [h[6]], None))])  # an older, separate entry
    for i in (4, 3, 2):
        ghost.add_block(h[i - 1], tok[i], h[i])
    assert ghost.keys() == [h[1] + tok[2]] and ghost.num_blocks == 3  # the older one went
    ghost.add_block(h[0], tok[1], h[1])  # 4 blocks in one entry > 3: it goes too
    assert len(ghost) == 0 and ghost.num_blocks == 0 and ghost.keys() == []


def test_longer_runs_join_the_open_entry_and_noted_runs_do_not() -> None:
    """An allocation's 4-block run (blocks 5-8) opens the entry and decode steps' blocks 4..2
    extend it, all entered as one run at the read; a run with a policy note (block 1) goes
    through ``_link`` at once, entering the open entry first. Reads equal the reference."""
    h, tok = _chain(8)
    one, ref = GhostList(100), GhostList(100)
    tail = (b"".join(tok[5:]), h[5:], None)
    one.add([(h[4] + tok[5], tail)])
    link_add(ref, h[4] + tok[5], tail)
    assert one._open_hashes and not one._runs and one.num_blocks == 4
    for i in (4, 3, 2):
        one.add_block(h[i - 1], tok[i], h[i])
        link_add(ref, h[i - 1] + tok[i], (tok[i], [h[i]], None))
    assert one._open_num_blocks == 7 and not one._runs
    noted = (tok[1], [h[1]], None, "note")
    one.add([(h[0] + tok[1], noted)])
    link_add(ref, h[0] + tok[1], noted)
    assert not one._open_hashes and one.num_blocks == ref.num_blocks == 8
    key = h[0] + tok[1]
    assert one.keys() == ref.keys() == [key] and one._by_parent == ref._by_parent
    assert [(r.hashes, bytes(r.tokens), r.note) for r in one.parts(key)] == [
        ([h[1]], bytes(tok[1]), "note"), (h[2:], b"".join(tok[2:]), None)]
    assert one.get(key).hashes == ref.get(key).hashes == h[1:]

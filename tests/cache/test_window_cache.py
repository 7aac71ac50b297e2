"""Window-bounded residency in the cache manager (``radixkv.cache.window_cache``), no model:
the window-aware hit against the rule on block indices, the ``window_evicted`` miss cause,
what a running request holds, what stays cached and in which eviction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache.manager import CacheManager
from radixkv.cache.window_cache import WindowBlocks, path_hashes_backward
from radixkv.cache.window_rules import deepest_window_hit

B = 2
W = 8  # need = ceil(7 / 2) = 4 blocks before a hit boundary
ROOT = b"\x01" * 16


def _manager(window_num_blocks: int = 64, num_blocks: int = 64) -> CacheManager:
    return CacheManager(num_blocks, B, window_num_blocks=window_num_blocks, window_tokens=W)


def _compute(cm: CacheManager, rid: str, prompt: list[int], num_tokens: int | None = None,
             chunk: int = 4) -> None:
    """Run ``prompt``'s prefill through the cache in chunks, as the engine does: allocate,
    publish, release the window blocks that left the window; then release the request."""
    n = len(prompt) if num_tokens is None else num_tokens
    done = cm.begin(rid, ROOT, prompt)
    while done < n:
        step = min(chunk, n - done)
        assert cm.allocate(rid, done + step)
        done += step
        cm.publish(rid, prompt, done)
        cm.release_window_blocks(rid, done)
        live = [i for i in cm.window_table(rid) if i]
        # The window (W - 1 = 7 tokens), one block of slack and the chunk: never more.
        assert len(live) <= 4 + 1 + 2 + 1, live
    cm.check_integrity()
    cm.release(rid)
    cm.check_integrity()


def test_a_request_holds_only_its_window_and_leaves_anchors_cached() -> None:
    cm = _manager()
    prompt = list(range(100, 140))  # 40 tokens, 20 blocks
    _compute(cm, "a", prompt)
    window = cm.window
    assert window is not None
    snap = window.snapshot()
    # Every published block's window K/V left through release_window_blocks or release,
    # cached: anchors = the first need + 1 = 5 blocks and the 5 before the end (block 20);
    # the 10 in between are plain.
    assert snap["num_cached_blocks"] == 20 and snap["num_held_blocks"] == 0
    assert snap["num_anchor_blocks"] == 10 and snap["num_free_blocks"] == 63 - 20
    # Plain blocks go first: evicting 10 leaves exactly the anchors.
    assert window.evict(10) == 10
    assert window.num_anchor_blocks == 10 and window.num_evictable_blocks == 10
    # The whole prompt and one token: the match covers all 20 blocks (the cap); boundary 20
    # needs blocks 16..19 (anchors) -> a hit of 40 tokens.
    assert cm.begin("b", ROOT, prompt + [7]) == 40
    cm.release("b")
    # A prompt sharing 30 tokens (33 long: cap 16 blocks): boundary 15 needs blocks 11..14,
    # evicted; the deepest servable boundary is 5 (blocks 1..4 anchors): 10 tokens hit, 20
    # window_evicted, block 15 (2 tokens) cold, 1 unaligned.
    assert cm.begin("c", ROOT, prompt[:30] + [1, 2, 3]) == 10
    miss = cm.miss_breakdown("c")
    assert miss == {"cold": 2, "evicted": 0, "isolated": 0, "unaligned_tail": 1,
                    "store_timeout": 0, "store_rejected": 0, "window_evicted": 20}
    cm.record_admission("c")
    assert cm.miss_tokens["window_evicted"] == 20
    cm.check_integrity()
    cm.release("c")
    cm.check_integrity()


def test_window_pool_pressure_takes_plain_blocks_before_anchors() -> None:
    # 16 usable window blocks: a 20-block prompt computed 4 tokens at a time caches what left
    # its window; a second, unrelated request then needs room and takes plain blocks first.
    cm = _manager(window_num_blocks=17)
    first = list(range(100, 140))
    _compute(cm, "a", first)
    window = cm.window
    assert window is not None
    anchors_before = window.num_anchor_blocks
    assert window.num_cached_blocks == 16 and anchors_before == 10  # 4 plain ones evicted
    other = list(range(500, 510))
    _compute(cm, "b", other)
    # b (5 blocks) needed room: plain blocks went first, every anchor of a stayed.
    assert window.num_anchor_blocks >= anchors_before
    assert cm.begin("c", ROOT, first + [9]) == 40
    cm.release("c")
    cm.check_integrity()


def test_the_window_pool_running_short_fails_the_allocation_and_changes_nothing() -> None:
    cm = _manager(window_num_blocks=6)  # 5 usable blocks
    cm.begin("a", ROOT, list(range(20)))
    free_full = cm.num_free_blocks
    assert not cm.allocate("a", 12)  # 6 window blocks needed
    assert cm.num_free_blocks == free_full and cm.block_table("a") == []
    assert cm.window_table("a") == []
    assert cm.allocate("a", 10)
    assert len(cm.block_table("a")) == 5 and all(cm.window_table("a"))
    cm.release("a")
    cm.check_integrity()


def test_fork_under_window_groups_declines() -> None:
    cm = _manager()
    prompt = list(range(9))
    cm.begin("p", ROOT, prompt)
    assert cm.allocate("p", 9)
    cm.publish("p", prompt, 9)
    assert cm.fork("p", "p#1", num_computed_tokens=9) is None
    assert not cm.is_active("p#1")
    cm.release("p")
    cm.check_integrity()


def test_window_table_without_groups_is_refused() -> None:
    cm = CacheManager(8, B)
    cm.begin("a", ROOT, [1, 2, 3])
    with pytest.raises(ValueError, match="window_table"):
        cm.window_table("a")
    with pytest.raises(ValueError, match="window_num_blocks"):
        CacheManager(8, B, window_tokens=W)
    with pytest.raises(ValueError, match="num_blocks"):
        WindowBlocks(1, W, B)


@settings(max_examples=60, deadline=None)
@given(holes=st.sets(st.integers(0, 19), max_size=8), shared=st.integers(1, 40))
def test_the_hit_is_the_deepest_boundary_every_window_block_before_serves(
        holes: set[int], shared: int) -> None:
    """A cached 20-block path with chosen window blocks dropped: ``begin`` hits exactly where
    ``deepest_window_hit`` (the rule on block indices) says, and the rest of the token match
    is ``window_evicted``."""
    cm = _manager()
    prompt = list(range(1000, 1040))
    _compute(cm, "a", prompt)
    window = cm.window
    assert window is not None
    # Hashes of the path's 20 blocks, from the tree (the node holding the whole prompt).
    cm.begin("probe", ROOT, prompt + [0])
    node = cm._requests["probe"].cursor
    cm.release("probe")
    hashes = list(path_hashes_backward(node, 20))[::-1]
    for j in holes:
        assert window.evict_cached(hashes[j])
    query = prompt[:shared] + [1, 2, 3]
    num_matched = min(shared, (len(query) - 1)) // B
    live = [j not in holes for j in range(num_matched)]
    want = deepest_window_hit(num_matched, {W: live}, B)
    assert cm.begin("q", ROOT, query) == want * B
    assert cm.miss_breakdown("q")["window_evicted"] == (num_matched - want) * B
    cm.check_integrity()
    cm.release("q")
    cm.check_integrity()


def test_evicting_a_path_from_the_tree_drops_its_window_blocks() -> None:
    """Window blocks whose full-attention blocks left the tree cannot serve a lookup: the
    tree's eviction drops them from the window pool too (one block at a time, and a run)."""
    cm = _manager()
    _compute(cm, "a", list(range(100, 140)))
    window = cm.window
    assert window is not None and window.num_cached_blocks == 20
    assert cm.evict(1) == 1  # the leaf's tail block: its window block goes with it
    assert window.num_cached_blocks == 19
    assert cm.evict(5) == 5
    assert window.num_cached_blocks == 14
    assert cm.reset_prefix_cache() == 14
    assert window.num_cached_blocks == 0 and window.num_free_blocks == 63
    cm.check_integrity()


def _sessions_then_newcomer(cm: CacheManager) -> int:
    """Two sessions share a 12-token system prompt (6 blocks) and take 12 turns each, every
    turn 10 tokens deeper, through a small window pool; then a new session with the same system
    prompt arrives. Returns its hit in tokens."""
    system = list(range(900, 912))
    histories = [system + [1000 + s] * 10 for s in range(2)]
    for turn in range(12):
        for s, history in enumerate(histories):
            _compute(cm, f"s{s}t{turn}", history)
            history += [2000 + 100 * s + turn] * 10
    hit = cm.begin("newcomer", ROOT, system + [7] * 5)
    cm.release("newcomer")
    cm.check_integrity()
    return hit


def test_the_shared_system_prompt_stays_while_sessions_go_deeper(monkeypatch) -> None:
    """A hit deep in a session holds only the window before its own boundary; the window runs
    of the shared prefix it went through (the sequence's first blocks, the junction where
    sessions diverge) are touched on every hit, as a tree hit touches its whole path, so a new
    session still reuses the whole system prompt once older anchors are evicted."""
    cm = _manager(window_num_blocks=30, num_blocks=512)
    assert _sessions_then_newcomer(cm) == 12
    assert cm.window is not None and cm.window.evicted_blocks_total > 0
    # Without the touch the system prompt's window blocks age out first: reuse collapses.
    monkeypatch.setattr(WindowBlocks, "touch", lambda self, hashes: None)
    assert _sessions_then_newcomer(_manager(window_num_blocks=30, num_blocks=512)) == 0

"""The rules of window-bounded residency on block indices: blocks a window hit needs, the
deepest boundary every window group can serve, and the window blocks kept for resuming."""

from __future__ import annotations

import pytest

from radixkv.cache.window_rules import anchor_blocks, deepest_window_hit, window_blocks_needed

T, F = True, False


@pytest.mark.parametrize("window, block_size, blocks", [
    (512, 16, 32),   # Gemma 3: 511 tokens before a query, 31.9 blocks
    (8, 4, 2), (9, 4, 2), (10, 4, 3), (5, 1, 4), (1, 4, 0), (128, 16, 8)])
def test_window_blocks_needed(window: int, block_size: int, blocks: int) -> None:
    assert window_blocks_needed(window, block_size) == blocks


def test_every_live_block_serves_the_whole_match() -> None:
    assert deepest_window_hit(10, {8: [T] * 10}, 4) == 10
    assert deepest_window_hit(0, {8: []}, 4) == 0
    assert deepest_window_hit(6, {1: [F] * 6}, 4) == 6  # W = 1 reads no earlier key


def test_the_hit_ends_where_a_window_run_is_whole() -> None:
    # W = 8, B = 4: a boundary needs its 2 blocks before it live (1 for boundary 1).
    live = [T, T, T, T, F, F, T, T, T, F]
    assert deepest_window_hit(10, {8: live}, 4) == 9
    assert deepest_window_hit(7, {8: live}, 4) == 4   # 5-7 short: blocks 4, 5 tombstoned
    assert deepest_window_hit(10, {8: [T] * 8 + [F, F]}, 4) == 8
    assert deepest_window_hit(5, {8: [F] * 5}, 4) == 0
    assert deepest_window_hit(3, {8: [F, T, T]}, 4) == 3  # boundary 3 needs blocks 1, 2 only


def test_every_window_group_must_serve_the_boundary() -> None:
    # W = 16 needs 4 blocks: its tombstone at block 6 leaves boundaries 8-10 short.
    groups = {8: [T] * 10, 16: [T, T, T, T, T, T, F, T, T, T]}
    assert deepest_window_hit(10, groups, 4) == 6
    assert deepest_window_hit(10, {8: [T] * 10, 16: [T] * 10}, 4) == 10


def test_anchors_keep_the_resume_point_and_the_boundary_before_it() -> None:
    # A 38-token prompt, B = 4, W = 8: resumed at boundary 9, or at 8 when the next request
    # diverges inside block 8; blocks 6, 7, 8 serve both.
    kept = anchor_blocks([38], 8, 4)
    assert kept == {6, 7, 8}
    live = [i in kept for i in range(9)]
    assert deepest_window_hit(9, {8: live}, 4) == 9
    assert deepest_window_hit(8, {8: live}, 4) == 8
    # Keeping only the 2 blocks a hit at 9 reads would lose the whole hit at 8.
    assert deepest_window_hit(8, {8: [i in {7, 8} for i in range(9)]}, 4) == 0


def test_anchors_at_a_junction_and_a_leaf_end() -> None:
    kept = anchor_blocks([20, 38], 8, 4)
    assert kept == {2, 3, 4, 6, 7, 8}
    live = [i in kept for i in range(10)]
    assert [h for h in range(10) if deepest_window_hit(h, {8: live}, 4) == h] == [0, 4, 5, 8, 9]
    assert anchor_blocks([3], 8, 4) == set()       # no whole block before the end
    assert anchor_blocks([8], 512, 16) == set()
    assert anchor_blocks([40], 512, 16) == {0, 1}  # clipped at block 0


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="^window_tokens: must be a positive int, got 0"):
        window_blocks_needed(0, 4)
    with pytest.raises(ValueError, match="^block_size: must be a positive int, got True"):
        window_blocks_needed(8, True)
    with pytest.raises(ValueError, match="^live: 3 entries for window 8, 4 matched blocks"):
        deepest_window_hit(4, {8: [T, T, T]}, 4)
    with pytest.raises(ValueError, match="^end_tokens: must be ints >= 0, got -1"):
        anchor_blocks([4, -1], 8, 4)

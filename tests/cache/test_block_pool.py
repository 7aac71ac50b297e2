"""BlockPool.to_cached: the publish hand-over's checks, default (O(1)) and per block."""

from __future__ import annotations

from array import array

import pytest

from radixkv.cache.pool import BlockPool


def _counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free_blocks, pool.num_private_blocks, pool.num_cached_blocks


@pytest.mark.parametrize("check_every_block", [False, True])
def test_to_cached_moves_counts_only(monkeypatch, check_every_block: bool) -> None:
    monkeypatch.setattr(BlockPool, "check_every_block", check_every_block)
    pool = BlockPool(8)
    ids = pool.allocate(5)
    assert ids == [0, 1, 2, 3, 4]
    pool.to_cached(array("q", ids[:3]))
    assert _counts(pool) == (3, 2, 3)
    pool.to_cached(ids[3:4])
    pool.to_cached([])
    assert _counts(pool) == (3, 1, 4)
    assert [pool.ref_count(b) for b in range(5)] == [1, 1, 1, 1, 1]
    pool.check_integrity()


@pytest.mark.parametrize("check_every_block", [False, True])
def test_to_cached_refuses_bad_ends_and_changes_nothing(monkeypatch,
                                                        check_every_block: bool) -> None:
    monkeypatch.setattr(BlockPool, "check_every_block", check_every_block)
    pool = BlockPool(8)
    ids = pool.allocate(4)
    before = _counts(pool)
    with pytest.raises(RuntimeError, match="block 7: expected owned, found free"):
        pool.to_cached([0, 1, 7])  # a free block at the end
    with pytest.raises(RuntimeError, match="out of range"):
        pool.to_cached([9, 1])
    pool.incref(ids[0])
    with pytest.raises(RuntimeError, match="block 0: cannot publish a block with 2 owners"):
        pool.to_cached(ids)  # shared (forked) first block
    pool.free([ids[0]])
    pool.to_cached(ids[:2])
    with pytest.raises(RuntimeError, match="4 blocks given, 2 private"):
        pool.to_cached(ids)  # more blocks than are private (two are already the tree's)
    assert _counts(pool) == (before[0], 2, 2)
    pool.begin_step()
    pool.free([ids[3]])  # deferred: owner count 0 until end_step
    with pytest.raises(RuntimeError, match="block 3: cannot publish a block with 0 owners"):
        pool.to_cached([ids[2], ids[3]])
    assert pool.end_step() == [3]
    pool.check_integrity()


def test_check_every_block_finds_a_shared_middle_block(monkeypatch) -> None:
    pool = BlockPool(8)
    ids = pool.allocate(5)
    pool.incref(ids[2])
    monkeypatch.setattr(BlockPool, "check_every_block", True)
    with pytest.raises(RuntimeError, match="block 2: cannot publish a block with 2 owners"):
        pool.to_cached(ids)
    assert _counts(pool) == (3, 5, 0)
    pool.free([ids[2]])
    pool.to_cached(ids)
    assert _counts(pool) == (3, 0, 5)


def test_free_cached_refuses_repeats_and_excess_atomically() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    pool.to_cached(ids[:2])
    with pytest.raises(RuntimeError, match="block 0: given twice to free_cached"):
        pool.free_cached([0, 0])
    with pytest.raises(RuntimeError, match="3 blocks given, 2 cached"):
        pool.free_cached([0, 1, 2])
    with pytest.raises(RuntimeError, match="block 3: expected owned, found free"):
        pool.free_cached([1, 3])
    assert _counts(pool) == (1, 1, 2)  # nothing changed by the failed calls
    pool.free_cached([1, 0])
    assert _counts(pool) == (3, 1, 0)
    assert pool.allocate(3) == [3, 1, 0]  # each block handed out once
    pool.check_integrity()


def test_free_is_all_or_nothing() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    with pytest.raises(RuntimeError, match="block 3: expected owned, found free"):
        pool.free([ids[0], 3])
    with pytest.raises(RuntimeError, match="block 1: freed 2 times, has 1 owners"):
        pool.free([0, 1, 1])
    assert _counts(pool) == (2, 2, 0)
    pool.incref(1)
    pool.free([1, 1, 0])  # two owners, two frees
    assert _counts(pool) == (4, 0, 0)
    pool.check_integrity()


def test_counts_must_be_ints() -> None:
    pool = BlockPool(4)
    for bad in (True, 1.0, "1", -1):
        with pytest.raises(ValueError, match="num: must be an int >= 0"):
            pool.allocate(bad)
    assert _counts(pool) == (4, 0, 0)


def test_check_every_block_refuses_a_repeated_block(monkeypatch) -> None:
    monkeypatch.setattr(BlockPool, "check_every_block", True)
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match=r"to_cached: a block is given twice in \[0, 0\]"):
        pool.to_cached([0, 0])
    assert _counts(pool) == (1, 3, 0)

"""Physical KV block ids: free list, ownership state, reference counts.

Blocks are ``0 .. num_blocks-1``. The pool tracks who *owns* each block:

* ``FREE``: no content, on the free list;
* ``PRIVATE``: owned by one or more running requests (ref count ≥ 1); not in the tree;
* ``CACHED``: owned by the radix tree (published, content immutable). Whether a cached block
  is *evictable* or *locked* is a property of its tree node (``lock_ref``), so the tree keeps
  those two counts; ``CacheManager`` combines both views into the four states of DESIGN.md §4.

The pool never evicts: when ``allocate`` cannot be served, the cache manager asks the tree to
evict leaves, returns their blocks with :meth:`free_cached`, and retries.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

FREE = 0
PRIVATE = 1
CACHED = 2
STATE_NAMES = {FREE: "free", PRIVATE: "private", CACHED: "cached"}


class BlockPool:
    """Ownership bookkeeping for ``num_blocks`` KV blocks.

    Args:
        num_blocks: M, number of physical blocks (> 0).

    Raises:
        ValueError: naming ``num_blocks`` if it is not a positive int.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # FIFO free list: freshly freed blocks are reused last, so a fresh pool hands out 0, 1, 2…
        self._free: deque[int] = deque(range(num_blocks))
        self._state = [FREE] * num_blocks
        self._ref = [0] * num_blocks
        self._num_private = 0
        self._num_cached = 0

    # ---- gauges -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no content (on the free list)."""
        return len(self._free)

    @property
    def num_private_blocks(self) -> int:
        """Blocks owned by running requests and not in the tree."""
        return self._num_private

    @property
    def num_cached_blocks(self) -> int:
        """Blocks owned by the radix tree (evictable or locked)."""
        return self._num_cached

    def state(self, block_id: int) -> int:
        """Return ``FREE``, ``PRIVATE`` or ``CACHED`` for ``block_id``."""
        return self._state[block_id]

    def ref_count(self, block_id: int) -> int:
        """Return how many requests own private ``block_id`` (0 unless private)."""
        return self._ref[block_id]

    # ---- transitions --------------------------------------------------------------------
    def allocate(self, num: int) -> list[int] | None:
        """Take ``num`` free blocks as private blocks of one request (ref count 1).

        All-or-nothing: returns None and changes nothing if fewer than ``num`` are free.

        Args:
            num: Blocks wanted (≥ 0).

        Returns:
            The block ids in free-list order, or None.

        Raises:
            ValueError: naming ``num`` if negative.
        """
        if num < 0:
            raise ValueError(f"num: must be >= 0, got {num}")
        if num > len(self._free):
            return None
        popleft = self._free.popleft
        ids = [popleft() for _ in range(num)]
        for block_id in ids:
            self._state[block_id] = PRIVATE
            self._ref[block_id] = 1
        self._num_private += num
        return ids

    def incref(self, block_id: int) -> None:
        """Add an owner to a private block (a forked sequence sharing its tail)."""
        self._expect(block_id, PRIVATE)
        self._ref[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner of each private block; blocks with no owner left become free.

        Raises:
            RuntimeError: if a block is not private (double free, or a cached block).
        """
        for block_id in block_ids:
            self._expect(block_id, PRIVATE)
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._state[block_id] = FREE
                self._num_private -= 1
                self._free.append(block_id)

    def to_cached(self, block_ids: Iterable[int]) -> None:
        """Hand private blocks (ref count 1) over to the tree after they are published.

        Raises:
            RuntimeError: if a block is not private or still shared by several owners.
        """
        for block_id in block_ids:
            self._expect(block_id, PRIVATE)
            if self._ref[block_id] != 1:
                raise RuntimeError(
                    f"block {block_id}: cannot publish a block with {self._ref[block_id]} owners"
                )
            self._state[block_id] = CACHED
            self._ref[block_id] = 0
            self._num_private -= 1
            self._num_cached += 1

    def free_cached(self, block_ids: Iterable[int]) -> None:
        """Return blocks the tree evicted to the free list.

        Raises:
            RuntimeError: if a block is not cached.
        """
        for block_id in block_ids:
            self._expect(block_id, CACHED)
            self._state[block_id] = FREE
            self._num_cached -= 1
            self._free.append(block_id)

    def _expect(self, block_id: int, state: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise RuntimeError(f"block {block_id}: out of range [0, {self.num_blocks})")
        if self._state[block_id] != state:
            raise RuntimeError(
                f"block {block_id}: expected {STATE_NAMES[state]}, "
                f"found {STATE_NAMES[self._state[block_id]]}"
            )

    def check_integrity(self) -> None:
        """Verify free list, states, ref counts and counters agree.

        Raises:
            AssertionError: describing the first disagreement found.
        """
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "free list holds a block twice"
        counts = {FREE: 0, PRIVATE: 0, CACHED: 0}
        for block_id, state in enumerate(self._state):
            counts[state] += 1
            assert (state == FREE) == (block_id in free_set), (
                f"block {block_id}: state {STATE_NAMES[state]} disagrees with free-list membership"
            )
            if state == PRIVATE:
                assert self._ref[block_id] >= 1, f"block {block_id}: private with ref count 0"
            else:
                assert self._ref[block_id] == 0, (
                    f"block {block_id}: {STATE_NAMES[state]} with ref count {self._ref[block_id]}"
                )
        assert counts[PRIVATE] == self._num_private, (
            f"private counter {self._num_private} != {counts[PRIVATE]} private blocks"
        )
        assert counts[CACHED] == self._num_cached, (
            f"cached counter {self._num_cached} != {counts[CACHED]} cached blocks"
        )

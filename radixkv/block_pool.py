"""Physical KV block ids: free list, ownership state, reference counts.

Blocks are ``0 .. num_blocks-1``. The pool tracks who *owns* each block:

* ``FREE``: no content, on the free list;
* ``PRIVATE``: owned by one or more running requests (ref count ≥ 1); not in the tree;
* ``CACHED``: owned by the radix tree (published, content immutable). Whether a cached block
  is *evictable* or *locked* is a property of its tree node (``lock_ref``), so the tree keeps
  those two counts; ``CacheManager`` combines both views into the four states of DESIGN.md §4.

The pool never evicts: when ``allocate`` cannot be served, the cache manager asks the tree to
evict leaves, returns their blocks with :meth:`free_cached`, and retries.

**Deferred free.** Between :meth:`begin_step` and :meth:`end_step` a forward step is in flight
and may still write any private block it was given. A private block whose last owner lets go
during that window stays ``PRIVATE`` with ref count 0 ("deferred": still in use by the step,
never handed out) and joins the free list only at :meth:`end_step`. Cached blocks need no such
care: a published block is never written again.
"""

from __future__ import annotations

from collections import deque
from operator import itemgetter
from typing import Iterable, Sequence

FREE = 0
PRIVATE = 1
CACHED = 2
STATE_NAMES = {FREE: "free", PRIVATE: "private", CACHED: "cached"}

# One ownership byte per block (a compact bytearray: one read and one write per block on the
# hot paths, and the whole pool's state stays in the CPU cache): ``_OWN_FREE``, ``_OWN_CACHED``,
# or the owner count of a private block (0 = deferred free, at most ``MAX_OWNERS``).
_OWN_FREE = 255
_OWN_CACHED = 254
MAX_OWNERS = 253


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
        self._own = bytearray([_OWN_FREE]) * num_blocks
        self._num_private = 0
        self._num_cached = 0
        self._in_step = False
        self._deferred: list[int] = []

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
    def num_deferred_blocks(self) -> int:
        """Private blocks released during the in-flight step, freed at :meth:`end_step`."""
        return len(self._deferred)

    @property
    def in_step(self) -> bool:
        """Whether a forward step is in flight (between ``begin_step`` and ``end_step``)."""
        return self._in_step

    @property
    def num_cached_blocks(self) -> int:
        """Blocks owned by the radix tree (evictable or locked)."""
        return self._num_cached

    def state(self, block_id: int) -> int:
        """Return ``FREE``, ``PRIVATE`` or ``CACHED`` for ``block_id``."""
        own = self._own[block_id]
        return FREE if own == _OWN_FREE else CACHED if own == _OWN_CACHED else PRIVATE

    def ref_count(self, block_id: int) -> int:
        """Return how many requests own private ``block_id`` (0 unless private)."""
        own = self._own[block_id]
        return own if own <= MAX_OWNERS else 0

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
        own = self._own
        for block_id in ids:
            own[block_id] = 1
        self._num_private += num
        return ids

    def incref(self, block_id: int) -> None:
        """Add an owner to a private block (a forked sequence sharing a full, unpublished block).

        Raises:
            RuntimeError: if the block is not private, its free is deferred, or it already has
                ``MAX_OWNERS`` owners.
        """
        self._expect(block_id, PRIVATE)
        if self._own[block_id] <= 0:
            raise RuntimeError(f"block {block_id}: cannot share a block whose free is deferred")
        if self._own[block_id] >= MAX_OWNERS:
            raise RuntimeError(f"block {block_id}: already has {MAX_OWNERS} owners")
        self._own[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner of each private block; blocks with no owner left become free.

        During a step (:meth:`begin_step`) a block losing its last owner is deferred instead:
        it stays private with ref count 0 until :meth:`end_step`.

        Raises:
            RuntimeError: if a block is not private or has no owner left (double free, a cached
                block, or a deferred one).
        """
        own = self._own
        for block_id in block_ids:
            self._expect(block_id, PRIVATE)
            if own[block_id] <= 0:
                raise RuntimeError(f"block {block_id}: freed again while its free is deferred")
            own[block_id] -= 1
            if own[block_id] == 0:
                if self._in_step:
                    self._deferred.append(block_id)
                    continue
                own[block_id] = _OWN_FREE
                self._num_private -= 1
                self._free.append(block_id)

    def begin_step(self) -> None:
        """A forward step is about to run: from now on, released private blocks are deferred.

        Raises:
            RuntimeError: if a step is already in flight.
        """
        if self._in_step:
            raise RuntimeError("begin_step: a step is already in flight")
        self._in_step = True

    def end_step(self) -> list[int]:
        """The step finished writing: deferred blocks join the free list.

        Returns:
            The blocks freed now, in release order.

        Raises:
            RuntimeError: if no step is in flight.
        """
        if not self._in_step:
            raise RuntimeError("end_step: no step is in flight")
        self._in_step = False
        freed, self._deferred = self._deferred, []
        own = self._own
        for block_id in freed:
            own[block_id] = _OWN_FREE
            self._num_private -= 1
            self._free.append(block_id)
        return freed

    def to_cached(self, block_ids: Sequence[int]) -> None:
        """Hand private blocks (ref count 1) over to the tree after they are published.

        Raises:
            RuntimeError: if a block is not private or is shared by several owners (a fork) or
                none (deferred); nothing is changed then.
        """
        num = len(block_ids)
        if not num:
            return
        own = self._own
        # Validate in C (one gather) before changing anything: the publish hot path.
        try:
            owners = itemgetter(*block_ids)(own) if num > 1 else (own[block_ids[0]],)
        except (IndexError, TypeError):
            owners = ()
        if owners.count(1) != num or min(block_ids) < 0:
            for block_id in block_ids:
                self._expect(block_id, PRIVATE)
                if own[block_id] != 1:
                    raise RuntimeError(f"block {block_id}: cannot publish a block with "
                                       f"{own[block_id]} owners")
            raise RuntimeError(f"to_cached: invalid block ids {list(block_ids)}")
        for block_id in block_ids:
            own[block_id] = _OWN_CACHED
        self._num_private -= num
        self._num_cached += num

    def free_cached(self, block_ids: list[int]) -> None:
        """Return blocks the tree evicted to the free list.

        Raises:
            RuntimeError: if a block is not cached (nothing is changed then).
        """
        own = self._own
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks or own[block_id] != _OWN_CACHED:
                self._expect(block_id, CACHED)
        for block_id in block_ids:
            own[block_id] = _OWN_FREE
        self._num_cached -= len(block_ids)
        self._free.extend(block_ids)

    def _expect(self, block_id: int, state: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise RuntimeError(f"block {block_id}: out of range [0, {self.num_blocks})")
        if self.state(block_id) != state:
            raise RuntimeError(
                f"block {block_id}: expected {STATE_NAMES[state]}, "
                f"found {STATE_NAMES[self.state(block_id)]}"
            )

    def check_integrity(self) -> None:
        """Verify free list, states, ref counts and counters agree.

        Raises:
            AssertionError: describing the first disagreement found.
        """
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "free list holds a block twice"
        deferred = set(self._deferred)
        assert len(deferred) == len(self._deferred), "deferred list holds a block twice"
        assert self._in_step or not deferred, "blocks deferred while no step is in flight"
        counts = {FREE: 0, PRIVATE: 0, CACHED: 0}
        for block_id, own in enumerate(self._own):
            state = self.state(block_id)
            counts[state] += 1
            assert (state == FREE) == (block_id in free_set), (
                f"block {block_id}: state {STATE_NAMES[state]} disagrees with free-list membership"
            )
            if state == PRIVATE:
                assert (own >= 1) != (block_id in deferred), (
                    f"block {block_id}: private with ref count {own}, "
                    f"deferred={block_id in deferred}")
            else:
                assert own in (_OWN_FREE, _OWN_CACHED), f"block {block_id}: bad ownership {own}"
        assert counts[PRIVATE] == self._num_private, (
            f"private counter {self._num_private} != {counts[PRIVATE]} private blocks"
        )
        assert counts[CACHED] == self._num_cached, (
            f"cached counter {self._num_cached} != {counts[CACHED]} cached blocks"
        )

"""Physical KV block ids: free list, ownership, reference counts.

Blocks are ``0 .. num_blocks-1``. The pool tracks whether a block is owned and by how many:

* ``FREE``: no content, on the free list;
* ``OWNED`` with owner count ≥ 1: held by running requests (private; > 1 when a forked
  sequence shares it), or by the radix tree (published, content immutable; exactly one owner).

Publishing (:meth:`to_cached`) hands a block's single ownership from its request to the tree:
it checks the run (its end blocks and the private count; every block when
:attr:`BlockPool.check_every_block` is set) but writes nothing per block, only the
private/cached counters, because which owned blocks are cached is the tree's knowledge
(``node.block_ids``), as is whether a cached block is *evictable* or *locked* (``lock_ref``).
``CacheManager`` combines the pool, the tree and its requests into the four states of docs/design.md
§4 (free, private, cached-evictable, cached-locked), and its ``check_integrity`` verifies that
every block the tree holds is owned exactly once here and held privately by no request.

The pool never evicts: when ``allocate`` cannot be served, the cache manager asks the tree to
evict leaves, returns their blocks with :meth:`free_cached`, and retries.

**Deferred free.** Between :meth:`begin_step` and :meth:`end_step` a forward step is in flight
and may still write any private block it was given. A private block whose last owner lets go
during that window stays owned with owner count 0 ("deferred": still in use by the step,
never handed out) and joins the free list only at :meth:`end_step`. Cached blocks need no such
care: a published block is never written again.
"""

from __future__ import annotations

from array import array
from operator import itemgetter
from typing import Iterable, Sequence

import numpy as np

FREE = 0
OWNED = 1
STATE_NAMES = {FREE: "free", OWNED: "owned"}

# One ownership byte per block (a compact bytearray: the whole pool's state stays in the CPU
# cache): ``_OWN_FREE``, or the owner count of an owned block (0 = a private block whose free is
# deferred, at most ``MAX_OWNERS``).
_OWN_FREE = 255
#: Runs at least this long are freed through numpy (its fixed cost, ~0.6 us, is the Python
#: loop's for ~16 blocks here).
_SCATTER_MIN_BLOCKS = 32
#: The free list drops its taken front when that is at least this long (and half the array).
_COMPACT_MIN_BLOCKS = 256
MAX_OWNERS = 253


class BlockPool:
    """Ownership bookkeeping for ``num_blocks`` KV blocks.

    Args:
        num_blocks: M, number of physical blocks (> 0).

    Raises:
        ValueError: naming ``num_blocks`` if it is not a positive int.
    """

    #: Check every block handed to :meth:`to_cached` (a C-level gather, ~25 ns per block on
    #: the publish hot path) instead of the run's ends only. The cache manager's own
    #: bookkeeping guarantees it (a request publishes its private table tail; a fork shares
    #: only published blocks when prefix caching is on), and ``check_integrity`` verifies the
    #: result; tests turn this on.
    check_every_block: bool = False

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # FIFO free list: freshly freed blocks are reused last, so a fresh pool hands out 0, 1, 2…
        # The queue is ``_free[_free_head:]``, in an ``array('q')``: an evicted run's ids (an
        # array from the tree) join it in one copy, and an allocation takes a slice; the taken
        # front is dropped once it is at least half of the array (amortized O(1) per block).
        self._free = array("q", range(num_blocks))
        self._free_head = 0
        self._own = bytearray([_OWN_FREE]) * num_blocks
        # The same bytes as numpy sees them (a fixed-size buffer: never resized), for writing
        # a long run's ownership in one C loop.
        self._own_view = np.frombuffer(self._own, dtype=np.uint8)
        self._num_private = 0
        self._num_cached = 0
        self._in_step = False
        self._deferred: list[int] = []
        #: Counters: blocks taken off the free list by :meth:`allocate`, and blocks put back on
        #: it (a private block's last owner gone, a deferred block at :meth:`end_step`, an
        #: evicted cached block). ``allocated - freed`` is the number of owned blocks.
        self.allocated_blocks_total = 0
        self.freed_blocks_total = 0

    # ---- gauges -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no content (on the free list)."""
        return len(self._free) - self._free_head

    def free_block_ids(self) -> list[int]:
        """The free list, next to be allocated first (inspection and tests)."""
        return self._free[self._free_head :].tolist()

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
        """Return ``FREE`` or ``OWNED`` for ``block_id`` (the tree knows which are cached)."""
        return FREE if self._own[block_id] == _OWN_FREE else OWNED

    def ref_count(self, block_id: int) -> int:
        """Return the owner count of ``block_id``: 0 if free or deferred, 1 for a cached block."""
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
        if type(num) is not int or num < 0:
            raise ValueError(f"num: must be an int >= 0, got {num!r}")
        free, head = self._free, self._free_head
        end = head + num
        if end > len(free):
            return None
        ids = free[head:end].tolist()
        if 2 * end >= len(free) and end >= _COMPACT_MIN_BLOCKS:
            del free[:end]
            self._free_head = 0
        else:
            self._free_head = end
        own = self._own
        for block_id in ids:
            own[block_id] = 1
        self._num_private += num
        self.allocated_blocks_total += num
        return ids

    def incref(self, block_id: int) -> None:
        """Add an owner to a private block (a forked sequence sharing a full, unpublished block).

        Raises:
            RuntimeError: if the block is not private, its free is deferred, or it already has
                ``MAX_OWNERS`` owners.
        """
        self._expect(block_id, OWNED)
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
                block, or a deferred one), or is given more times than it has owners; nothing
                is changed then.
        """
        own = self._own
        block_ids = list(block_ids)
        for block_id in block_ids:  # check everything first: a failed call changes nothing
            self._expect(block_id, OWNED)
            if own[block_id] <= 0:
                raise RuntimeError(f"block {block_id}: freed again while its free is deferred")
        if len(set(block_ids)) != len(block_ids):
            for block_id in set(block_ids):
                if block_ids.count(block_id) > own[block_id]:
                    raise RuntimeError(f"block {block_id}: freed {block_ids.count(block_id)} "
                                       f"times, has {own[block_id]} owners")
        for block_id in block_ids:
            own[block_id] -= 1
            if own[block_id] == 0:
                if self._in_step:
                    self._deferred.append(block_id)
                    continue
                own[block_id] = _OWN_FREE
                self._num_private -= 1
                self.freed_blocks_total += 1
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
        self.freed_blocks_total += len(freed)
        return freed

    def to_cached(self, block_ids: Sequence[int]) -> None:
        """Hand private blocks (ref count 1) over to the tree after they are published.

        The single ownership passes from the request to the tree: nothing is written per block.
        The hot path checks the run's ends and the private count (O(1): a publish hands over
        its request's private table tail, in one piece); with :attr:`check_every_block` set
        (the test suite sets it) every block is checked before anything changes.

        Args:
            block_ids: The blocks (``array('q')`` or a list of ints).

        Raises:
            RuntimeError: if a checked block is not owned, is shared by several owners (a fork)
                or none (deferred), or more blocks are given than are private; nothing is
                changed then.
        """
        num = len(block_ids)
        if not num:
            return
        own = self._own
        first, last = block_ids[0], block_ids[-1]
        ok = (num <= self._num_private and 0 <= first < self.num_blocks
              and 0 <= last < self.num_blocks and own[first] == 1 and own[last] == 1)
        if ok and self.check_every_block and num > 1:
            try:  # one C-level gather
                ok = (itemgetter(*block_ids)(own).count(1) == num and min(block_ids) >= 0
                      and len(set(block_ids)) == num)
            except (IndexError, TypeError):
                ok = False
        if not ok:
            for block_id in block_ids:
                self._expect(block_id, OWNED)
                if own[block_id] != 1:
                    raise RuntimeError(f"block {block_id}: cannot publish a block with "
                                       f"{own[block_id]} owners")
            if len(set(block_ids)) != num:
                raise RuntimeError(f"to_cached: a block is given twice in {list(block_ids)}")
            raise RuntimeError(f"to_cached: {num} blocks given, {self._num_private} private "
                               f"(ids {list(block_ids)})")
        self._num_private -= num
        self._num_cached += num

    def free_cached(self, block_ids: Sequence[int]) -> None:
        """Return blocks the tree evicted (in eviction order) to the free list.

        Like :meth:`to_cached`, the hot path checks the run's ends and the cached count, then
        writes one ownership byte per block (the tree's bookkeeping guarantees the rest, and
        ``check_integrity`` verifies it); with :attr:`check_every_block` set every block is
        checked first. ``block_ids``: a list, or an ``array('q')`` (the cache's eviction path),
        whose ownership bytes a long run writes through numpy in one C loop.

        Raises:
            RuntimeError: if a checked block is not owned exactly once, appears twice, or more
                blocks are given than are cached (nothing is changed then).
        """
        num = len(block_ids)
        if num == 1:  # one block per decode step: the commonest
            self.free_one_cached(block_ids[0])
            return
        if not num:
            return
        own = self._own
        first, last = block_ids[0], block_ids[-1]
        if (num > self._num_cached or self.check_every_block or not 0 <= first < self.num_blocks
                or not 0 <= last < self.num_blocks or own[first] != 1 or own[last] != 1):
            self._check_free_cached(block_ids)
        if num >= _SCATTER_MIN_BLOCKS and type(block_ids) is array and block_ids.typecode == "q":
            self._own_view[np.frombuffer(block_ids, dtype=np.int64)] = _OWN_FREE
        else:
            for block_id in block_ids:
                own[block_id] = _OWN_FREE
        self._num_cached -= num
        self.freed_blocks_total += num
        self._free.extend(block_ids)

    def free_one_cached(self, block_id: int) -> None:
        """:meth:`free_cached` of one block (each decode step's eviction: the commonest), with
        the same checks and errors."""
        own = self._own
        if (self.check_every_block or not 0 <= block_id < self.num_blocks or own[block_id] != 1
                or not self._num_cached):
            self._check_free_cached([block_id])
        own[block_id] = _OWN_FREE
        self._num_cached -= 1
        self.freed_blocks_total += 1
        self._free.append(block_id)

    def _check_free_cached(self, block_ids: Sequence[int]) -> None:
        """Check every block of a :meth:`free_cached` call before anything changes."""
        own = self._own
        if len(block_ids) > self._num_cached:
            raise RuntimeError(f"free_cached: {len(block_ids)} blocks given, "
                               f"{self._num_cached} cached")
        seen: set[int] = set()
        for block_id in block_ids:
            if block_id in seen:
                raise RuntimeError(f"block {block_id}: given twice to free_cached")
            seen.add(block_id)
            if not 0 <= block_id < self.num_blocks or own[block_id] != 1:
                self._expect(block_id, OWNED)
                raise RuntimeError(f"block {block_id}: evicted from the tree with "
                                   f"{own[block_id]} owners")

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
        free_ids = self.free_block_ids()
        free_set = set(free_ids)
        assert len(free_set) == len(free_ids), "free list holds a block twice"
        deferred = set(self._deferred)
        assert len(deferred) == len(self._deferred), "deferred list holds a block twice"
        assert self._in_step or not deferred, "blocks deferred while no step is in flight"
        num_owned = 0
        for block_id, own in enumerate(self._own):
            is_free = own == _OWN_FREE
            assert is_free == (block_id in free_set), (
                f"block {block_id}: ownership {own} disagrees with free-list membership")
            if not is_free:
                num_owned += 1
                assert own <= MAX_OWNERS, f"block {block_id}: bad ownership {own}"
                assert (own == 0) == (block_id in deferred), (
                    f"block {block_id}: owner count {own}, deferred={block_id in deferred}")
        assert self._num_private >= 0 and self._num_cached >= 0, (
            f"negative counter: private {self._num_private}, cached {self._num_cached}")
        assert num_owned == self._num_private + self._num_cached, (
            f"{num_owned} owned blocks != private {self._num_private} + cached "
            f"{self._num_cached}")

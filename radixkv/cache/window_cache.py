"""Window groups' blocks under window-bounded residency (``--sliding-window-kv window``).

With KV groups (docs/sliding-window.md) the full-attention layers keep every block of a
sequence in the radix tree as before, while the window layers keep their own, smaller pool:
a request holds there only the blocks that overlap its last ``W - 1`` tokens (plus one block
of slack), and blocks that fall out of its window are either cached here under the chained
hash of their block (what the tree stores for the same position) or freed.

A cached window block is *held* while a request's window table has it and *evictable*
otherwise. Evictable blocks are ranked in two LRU lists: **anchors** (the window runs before a
request's prompt end, its final end, its own hit boundary, and the first
``ceil((W - 1) / B) + 1`` blocks of every sequence, where a shared system prompt shorter than
the window ends) and **plain** ones (every other block that left a window). An allocation
takes free blocks first, then plain blocks, then anchors (oldest first), so reuse across
sessions degrades as anchors age out and never collapses because out-of-window tails were
recycled first (vLLM issue #48435).

The tree is unchanged: a lookup's token walk yields ``m_full`` blocks; :meth:`WindowBlocks.resume_point`
then finds the deepest boundary ``h <= m_full`` whose ``min(h, ceil((W - 1) / B))`` blocks
before it are all cached here (``radixkv.cache.window_rules.deepest_window_hit``, the rule;
this walks backwards over the path's hashes and stops at the first servable boundary).

Block 0 is the null block of the runner's window pools (zeros, never written): never handed
out; a window table holds 0 at positions it released.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from typing import Iterable, Iterator

from radixkv.cache.tree.node import BLOCK_ID_TYPECODE, Node
from radixkv.cache.window_rules import anchor_blocks, window_blocks_needed

__all__ = ["WindowBlocks", "WindowTable", "path_hashes_backward"]


class WindowTable:
    """One request's window-group block table (one table serves every window group).

    Attributes:
        ids: Window block id per block position (``array('q')``); 0 where released or never
            needed (left of the window).
        start: First position that may hold a live id (every position before it is 0).
        anchors: Positions whose block is kept as an anchor when it leaves the window.
        num_registered: Leading positions whose live ids were offered to the hash map
            (``WindowBlocks.register``): the request's published blocks so far.
    """

    __slots__ = ("ids", "start", "anchors", "num_registered")

    def __init__(self, num_positions: int, anchors: set[int]) -> None:
        self.ids = array(BLOCK_ID_TYPECODE, bytes(8 * num_positions))
        self.start = num_positions
        self.anchors = anchors
        self.num_registered = num_positions

    def live(self) -> Iterator[tuple[int, int]]:
        """``(position, id)`` of every live entry."""
        ids = self.ids
        for pos in range(self.start, len(ids)):
            if ids[pos]:
                yield pos, ids[pos]


def path_hashes_backward(node: Node, num_blocks: int) -> Iterator[bytes]:
    """Chained hashes of the blocks ``num_blocks - 1, num_blocks - 2, …, 0`` of the path that
    ends at ``node``'s end (``num_blocks`` = the node's end depth in blocks), deepest first;
    lazily, one node at a time."""
    n: Node | None = node
    remaining = num_blocks
    while n is not None and n.parent is not None and remaining > 0:
        w = n.hash_size
        hb = n.hash_bytes
        for j in range(len(n.block_ids) - 1, -1, -1):
            yield bytes(hb[j * w:(j + 1) * w])
            remaining -= 1
            if remaining == 0:
                return
        n = n.parent


class WindowBlocks:
    """The window groups' block pool: free list, per-block holders, cached blocks by hash.

    Args:
        num_blocks: Blocks in each window group's pool, the null block 0 included (≥ 2).
        window_tokens: W, the largest window of the model's window groups (tokens a query sees,
            itself included); one table serves every group, sized for the largest.
        block_size: B, tokens per block (the full group's).

    Raises:
        ValueError: naming ``num_blocks`` (< 2), ``window_tokens`` or ``block_size``.
    """

    def __init__(self, num_blocks: int, window_tokens: int, block_size: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks: must be an int >= 2, got {num_blocks!r}")
        self.need = window_blocks_needed(window_tokens, block_size)
        self.num_blocks = num_blocks
        self.window_tokens = window_tokens
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._refs = [0] * num_blocks  # window tables holding the block
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._plain: OrderedDict[int, None] = OrderedDict()  # evictable, LRU first
        self._anchors: OrderedDict[int, None] = OrderedDict()  # evictable anchors, LRU first
        self._in_step = False
        self._deferred: list[int] = []
        #: Cached window blocks dropped to make room (counter).
        self.evicted_blocks_total = 0

    # ---- gauges -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (the null block never is)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks cached under a hash (held or evictable)."""
        return len(self._hash_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no request holds (plain + anchors)."""
        return len(self._plain) + len(self._anchors)

    @property
    def num_anchor_blocks(self) -> int:
        """Evictable cached blocks ranked as anchors (taken last)."""
        return len(self._anchors)

    def room(self) -> int:
        """Blocks an allocation can get now: free plus evictable."""
        return len(self._free) + len(self._plain) + len(self._anchors)

    def snapshot(self) -> dict[str, int]:
        """The ``/stats`` ``pool.window`` object: block counts of the window groups' pool."""
        held = self.num_blocks - 1 - len(self._free) - self.num_evictable_blocks \
            - len(self._deferred)
        return {"num_blocks": self.num_blocks, "num_free_blocks": len(self._free),
                "num_held_blocks": held, "num_cached_blocks": len(self._hash_of),
                "num_evictable_blocks": self.num_evictable_blocks,
                "num_anchor_blocks": len(self._anchors),
                "evicted_blocks_total": self.evicted_blocks_total}

    # ---- blocks -------------------------------------------------------------------------
    def take(self, num: int) -> list[int] | None:
        """``num`` blocks, held once each; evicts plain then anchor blocks (oldest first) when
        the free list is short. None (nothing changed) when free + evictable cannot cover it."""
        if num > self.room():
            return None
        short = num - len(self._free)
        if short > 0:
            self._evict(short)
        ids = [self._free.popleft() for _ in range(num)]
        refs = self._refs
        for i in ids:
            refs[i] = 1
        return ids

    def _evict(self, num: int) -> None:
        for lru in (self._plain, self._anchors):
            while num > 0 and lru:
                block_id, _ = lru.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block_id)]
                self._free.append(block_id)
                self.evicted_blocks_total += 1
                num -= 1

    def hold_cached(self, block_hash: bytes) -> int:
        """Hold the block cached under ``block_hash``; return its id (0: not cached)."""
        block_id = self._by_hash.get(block_hash, 0)
        if block_id:
            if self._refs[block_id] == 0:
                self._plain.pop(block_id, None)
                self._anchors.pop(block_id, None)
            self._refs[block_id] += 1
        return block_id

    def touch(self, block_hashes: Iterable[bytes]) -> None:
        """Mark the evictable blocks cached under ``block_hashes`` most recently used in their
        list (a hit went through the prefix they serve, without holding them)."""
        by_hash, plain, anchors = self._by_hash, self._plain, self._anchors
        for block_hash in block_hashes:
            block_id = by_hash.get(block_hash, 0)
            if block_id in anchors:
                anchors.move_to_end(block_id)
            elif block_id in plain:
                plain.move_to_end(block_id)

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether a block is cached under ``block_hash``."""
        return block_hash in self._by_hash

    def register(self, block_hash: bytes, block_id: int) -> None:
        """Cache the held block ``block_id`` under ``block_hash`` (its position's chained hash,
        once published); a hash already cached (another request's copy) keeps its block."""
        if block_hash not in self._by_hash and block_id not in self._hash_of:
            self._by_hash[block_hash] = block_id
            self._hash_of[block_id] = block_hash

    def unhold(self, block_id: int, *, anchor: bool) -> None:
        """A window table lets go of ``block_id``: once no table holds it, a cached block becomes
        evictable (an anchor when ``anchor`` or already one; most recently used), an uncached
        one is freed (at ``end_step`` while a step is in flight)."""
        refs = self._refs
        refs[block_id] -= 1
        if refs[block_id]:
            return
        if block_id in self._hash_of:
            if anchor or block_id in self._anchors:
                self._plain.pop(block_id, None)
                self._anchors[block_id] = None
                self._anchors.move_to_end(block_id)
            else:
                self._plain[block_id] = None
        elif self._in_step:
            self._deferred.append(block_id)
        else:
            self._free.append(block_id)

    def evict(self, num_blocks: int) -> int:
        """Drop up to ``num_blocks`` evictable cached blocks now, plain ones first, oldest
        first (a prefix-cache reset, memory pressure, tests); returns how many."""
        num = min(num_blocks, self.num_evictable_blocks)
        self._evict(num)
        return num

    def evict_cached(self, block_hash: bytes) -> bool:
        """Drop the block cached under ``block_hash`` now if no table holds it (tools and
        tests: a chosen hole in a cached run); returns whether one was dropped."""
        block_id = self._by_hash.get(block_hash, 0)
        if not block_id or self._refs[block_id]:
            return False
        self._plain.pop(block_id, None)
        self._anchors.pop(block_id, None)
        del self._by_hash[self._hash_of.pop(block_id)]
        self._free.append(block_id)
        self.evicted_blocks_total += 1
        return True

    def begin_step(self) -> None:
        """A forward step is in flight: blocks freed from now on wait for :meth:`end_step`."""
        self._in_step = True

    def end_step(self) -> None:
        """The step's K/V writes are done: free the deferred blocks."""
        self._in_step = False
        self._free.extend(self._deferred)
        self._deferred.clear()

    # ---- lookups ------------------------------------------------------------------------
    def resume_point(self, node: Node, num_matched_blocks: int) -> int:
        """The deepest hit boundary (in blocks, ``<= num_matched_blocks``) every window group
        can serve from cached blocks: the ``min(h, need)`` blocks before boundary h all cached,
        ``need = ceil((W - 1) / B)``. Reads the path's hashes backwards from ``node``'s end
        (the token match's end) and stops at the first servable boundary; 0 when none is.
        Agrees with :func:`radixkv.cache.window_rules.deepest_window_hit`."""
        need, by_hash = self.need, self._by_hash
        h = num_matched_blocks  # candidate boundary
        run = 0  # cached blocks ending at h
        pos = num_matched_blocks  # the next block to read is pos - 1
        for block_hash in path_hashes_backward(node, num_matched_blocks):
            if run >= min(h, need):
                return h
            pos -= 1
            if block_hash in by_hash:
                run += 1
            else:
                h, run = pos, 0
        return h if run >= min(h, need) else 0

    def anchors_for(self, num_prompt_tokens: int, hit_blocks: int) -> set[int]:
        """Positions kept as anchors when they leave a request's window: the runs before its
        prompt's end and its hit boundary, and the first ``need + 1`` blocks (a shared prefix
        shorter than the window resumes there)."""
        bs = self.block_size
        keep = anchor_blocks((num_prompt_tokens, hit_blocks * bs), self.window_tokens, bs)
        keep.update(range(self.need + 1))
        return keep

    def release_before(self, table: WindowTable, first_kept: int) -> None:
        """Unhold the table's entries at positions ``< first_kept`` (they left the window)."""
        ids, anchors = table.ids, table.anchors
        stop = min(first_kept, len(ids))
        for pos in range(table.start, stop):
            block_id = ids[pos]
            if block_id:
                ids[pos] = 0
                self.unhold(block_id, anchor=pos in anchors)
        table.start = max(table.start, stop)

    def release(self, table: WindowTable, final_anchor_start: int) -> None:
        """Unhold every live entry of a table (its request ended); positions at or past
        ``final_anchor_start`` (the run before the sequence's end) are anchors too."""
        ids, anchors = table.ids, table.anchors
        for pos in range(table.start, len(ids)):
            block_id = ids[pos]
            if block_id:
                ids[pos] = 0
                self.unhold(block_id, anchor=pos >= final_anchor_start or pos in anchors)
        table.start = len(ids)

    def check(self, tables: Iterable[WindowTable]) -> None:
        """Every block free, deferred, evictable or held, once; holders counted right.

        Raises:
            AssertionError: describing the first violation.
        """
        holders = [0] * self.num_blocks
        for table in tables:
            for _, block_id in table.live():
                holders[block_id] += 1
        assert holders == self._refs, "window blocks: holder counts disagree with the tables"
        assert holders[0] == 0 and 0 not in self._free, "the null window block was handed out"
        free = set(self._free) | set(self._deferred)
        assert len(free) == len(self._free) + len(self._deferred), "window free list repeats"
        evictable = set(self._plain) | set(self._anchors)
        for block_id in range(1, self.num_blocks):
            held = holders[block_id] > 0
            states = (block_id in free) + held + (block_id in evictable)
            assert states == 1, f"window block {block_id}: free/held/evictable {states} times"
            assert (block_id in evictable) <= (block_id in self._hash_of), (
                f"window block {block_id}: evictable but not cached")
        assert all(self._by_hash[h] == i for i, h in self._hash_of.items()), "hash maps disagree"



def table_for_hit(blocks: WindowBlocks, node: Node, num_hit_blocks: int,
                  num_prompt_tokens: int) -> WindowTable:
    """A new request's window table after a hit of ``num_hit_blocks`` blocks ending at
    ``node``'s end: the ``min(h, need)`` blocks before the boundary held from the cache
    (:meth:`WindowBlocks.resume_point` said they are there), the rest 0."""
    table = WindowTable(num_hit_blocks, blocks.anchors_for(num_prompt_tokens, num_hit_blocks))
    first = num_hit_blocks - min(num_hit_blocks, blocks.need)
    pos = num_hit_blocks
    for block_hash in path_hashes_backward(node, num_hit_blocks):
        pos -= 1
        if pos < first:
            break
        block_id = blocks.hold_cached(block_hash)
        assert block_id, "resume_point claimed a window block that is not cached"
        table.ids[pos] = block_id
    table.start = first
    return table


def register_published(blocks: WindowBlocks, table: WindowTable, cursor: Node,
                       num_published_blocks: int) -> None:
    """Cache the table's live blocks at positions published since the last call under their
    chained hashes (``cursor`` ends at ``num_published_blocks``)."""
    first = table.num_registered
    if num_published_blocks <= first:
        return
    pos = num_published_blocks
    ids = table.ids
    for block_hash in path_hashes_backward(cursor, num_published_blocks):
        pos -= 1
        if pos < first or pos < table.start:
            break
        if pos < len(ids) and ids[pos]:
            blocks.register(block_hash, ids[pos])
    table.num_registered = num_published_blocks


def shared_prefix_hashes(node: Node, num_blocks: int, need: int) -> list[bytes]:
    """Chained hashes of the window runs a hit at ``node``'s end passed through on its way
    (``num_blocks`` = that end, in blocks): the first ``need + 1`` blocks of the sequence and
    the ``need + 1`` before the end of the path's first node (the prefix every sequence under
    it shares, e.g. a system prompt, whose end is the junction where they diverge). A hit
    deeper down holds neither, so :meth:`WindowBlocks.touch` keeps them as recent as the
    sessions that go through them, as a tree hit keeps its whole path."""
    path: list[Node] = []
    n: Node | None = node
    while n is not None and n.parent is not None:
        path.append(n)
        n = n.parent
    if not path:
        return []
    path.reverse()
    first_end = len(path[0].block_ids)
    wanted = set(range(min(need + 1, num_blocks)))
    wanted.update(range(max(0, first_end - need - 1), min(first_end, num_blocks)))
    out: list[bytes] = []
    start = 0
    for n in path:
        count = len(n.block_ids)
        w, hb = n.hash_size, n.hash_bytes
        for pos in wanted:
            if start <= pos < start + count:
                j = pos - start
                out.append(bytes(hb[j * w:(j + 1) * w]))
        start += count
        if start > max(wanted, default=-1):
            break
    return out

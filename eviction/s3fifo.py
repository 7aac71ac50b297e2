"""S3-FIFO eviction (``s3fifo``): Yang, Zhang, Qiu, Yue, Vinayak, "FIFO queues are all you need
for cache eviction", SOSP 2023.

Three FIFO queues: a small queue ``S`` (10 % of the cached blocks) that every new object enters,
a main queue ``M`` and a ghost queue ``G`` of recently evicted ids. Each object carries a 2-bit
frequency (0…3) raised by hits. Eviction from ``S`` moves an object that was hit since it
entered to ``M`` and evicts the rest ("quick demotion": most objects are never reused), recording
them in ``G``; an object inserted while in ``G`` goes straight to ``M``. Eviction from ``M`` is
FIFO-reinsertion (CLOCK): an object with frequency > 0 is reinserted at the tail with its
frequency decremented.

On the radix tree the objects are nodes (runs of blocks, sized in blocks) and only evictable
leaves may be evicted: each queue's order is kept over all nodes the policy knows, and the
victim is the first *evictable leaf* of the chosen queue (a heap of ``(queue position, uid)``
with lazy deletion), so eviction stays leaf-first. A node created by a split (the tree cuts a
node where a lookup matched only part of it, i.e. a second request reused it) enters ``M`` with
frequency 1. Ghost ids are the chained hashes of evicted blocks (read from the node's ``hashes``
when the tree exposes them; without them the ghost is off).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

from .base import NodeView, VictimPolicy, register

_S, _M = 0, 1
_MAX_FREQ = 3


@register("s3fifo")
class S3FIFOPolicy(VictimPolicy):
    """S3-FIFO over radix-tree nodes.

    Args:
        small_fraction: Share of cached blocks the small queue may hold before it is evicted
            from (0.1 in the paper).
        ghost_factor: Ghost capacity in blocks as a multiple of the cached blocks (1.0 in the
            paper: as many entries as the main queue holds, roughly).
    """

    def __init__(self, small_fraction: float = 0.1, ghost_factor: float = 1.0) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction: must be in (0, 1), got {small_fraction}")
        self.small_fraction = small_fraction
        self.ghost_factor = ghost_factor
        self._seq = itertools.count()
        # uid -> [queue, position, freq, blocks]
        self._info: dict[int, list[int]] = {}
        self._size = [0, 0]  # blocks in S, M
        self._heaps: tuple[list, list] = ([], [])
        self._leaves: dict[int, NodeView] = {}
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._victim_hashes: list[bytes] | None = None

    # ---- bookkeeping --------------------------------------------------------------------
    def _state(self, node: NodeView, queue: int = _M, freq: int = 1) -> list[int]:
        """The node's state, registering an unknown node (split head) in ``queue``."""
        info = self._info.get(node.uid)
        if info is None:
            info = [queue, next(self._seq), freq, node.num_blocks]
            self._info[node.uid] = info
            self._size[queue] += node.num_blocks
        elif info[3] != node.num_blocks:  # shrunk by a split, or grown in place
            self._size[info[0]] += node.num_blocks - info[3]
            info[3] = node.num_blocks
        return info

    def _push(self, uid: int, info: list[int]) -> None:
        heap = self._heaps[info[0]]
        heapq.heappush(heap, (info[1], uid))
        if len(heap) > 2 * len(self._leaves) + 1024:  # drop stale entries
            live = [(p, u) for p, u in heap if u in self._leaves and self._info[u][1] == p]
            heapq.heapify(live)
            heap[:] = live

    def _first(self, queue: int) -> tuple[int, list[int]] | None:
        """First evictable leaf of ``queue`` (dropping stale heap entries)."""
        heap = self._heaps[queue]
        while heap:
            pos, uid = heap[0]
            info = self._info.get(uid)
            if uid in self._leaves and info is not None and info[0] == queue and info[1] == pos:
                return uid, info
            heapq.heappop(heap)
        return None

    def _move(self, uid: int, info: list[int], queue: int, freq: int) -> None:
        heapq.heappop(self._heaps[info[0]])
        self._size[info[0]] -= info[3]
        self._size[queue] += info[3]
        info[0], info[1], info[2] = queue, next(self._seq), freq
        self._push(uid, info)

    # ---- victim-policy protocol ---------------------------------------------------------
    def on_insert(self, node: NodeView, num_blocks: int) -> None:
        if node.uid in self._info:
            self._state(node)
            return
        block_hash = getattr(node, "block_hash", None)  # one hash, not the list (a tree node)
        if block_hash is not None:
            first = block_hash(0) if node.num_blocks else None
        else:
            hashes = getattr(node, "hashes", None)
            first = hashes[0] if hashes else None
        queue = _M if first is not None and first in self._ghost else _S
        self._state(node, queue, 0)

    def on_hit(self, node: NodeView) -> None:
        info = self._state(node)
        if info[2] < _MAX_FREQ:
            info[2] += 1

    def add_leaf(self, node: NodeView) -> None:
        info = self._state(node)
        self._leaves[node.uid] = node
        self._push(node.uid, info)

    def remove_leaf(self, node: NodeView) -> None:
        self._leaves.pop(node.uid, None)

    def choose_victim(self) -> NodeView | None:
        while True:
            s, m = self._first(_S), self._first(_M)
            if s is None and m is None:
                return None
            small = self._size[_S] >= self.small_fraction * (self._size[_S] + self._size[_M])
            if s is not None and (small or m is None):
                uid, info = s
                if info[2] >= 1:  # hit since it entered S: promote to M
                    self._move(uid, info, _M, 0)
                    continue
            else:
                uid, info = m  # type: ignore[misc]  # not None: both empty returned above
                if info[2] > 0:  # CLOCK: reinsert at the tail of M
                    self._move(uid, info, _M, info[2] - 1)
                    continue
            node = self._leaves[uid]
            hashes = getattr(node, "hashes", None)
            self._victim_hashes = list(hashes) if hashes is not None and info[0] == _S else None
            return node

    def on_evict(self, node: NodeView, num_blocks: int) -> None:
        info = self._info.get(node.uid)
        if info is not None:
            self._size[info[0]] += node.num_blocks - info[3]  # also catches an unseen split
            info[3] = node.num_blocks
            if node.num_blocks == 0:
                del self._info[node.uid]
        trimmed = self._victim_hashes
        self._victim_hashes = None
        if trimmed:
            ghost = self._ghost
            for h in trimmed[node.num_blocks : node.num_blocks + num_blocks]:
                ghost[h] = None
            limit = max(1024, int(self.ghost_factor * (self._size[_S] + self._size[_M])))
            while len(ghost) > limit:
                ghost.popitem(last=False)

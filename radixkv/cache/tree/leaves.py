"""The evictable-leaf index: every unlocked, childless, non-root node, in eviction order.

A :class:`LeafIndex` holds the leaves in the order the eviction policy wants: a
``sortedcontainers.SortedList`` of ``(priority, uid)`` for a priority-key policy (lowest evicted
first), or the policy's own structure for a victim-naming one (it is told every add / remove and
asked for victims). ``RadixTree`` owns one and tells it when a node becomes or stops being an
evictable leaf; the index knows nothing else of the tree.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar, cast

from sortedcontainers import SortedList

from radixkv.eviction import EvictionPolicy, NodeView, PriorityPolicy, VictimPolicy
from radixkv.eviction.cost_aware import CostAwarePolicy
from radixkv.eviction.fifo import FIFOPolicy
from radixkv.eviction.gdsf import GDSFPolicy
from radixkv.eviction.lfu import LFUPolicy
from radixkv.eviction.lru import LRUPolicy

#: Registered policies by how their key moves when a leaf loses its tail (``evict``'s docstring).
_KEY_ON_TRIM: dict[type, str] = {LRUPolicy: "same", LFUPolicy: "same", FIFOPolicy: "same",
                GDSFPolicy: "falls", CostAwarePolicy: "falls"}


class IndexedLeaf(NodeView, Protocol):
    """What the index reads and writes of a leaf besides the policy's view: a tree ``Node``, or
    the host store tier's entry (``radixkv.cache.store.host``)."""

    leaf_entry: object  # its index entry; None while not indexed
    last_access_s: float
    hit_count: int


LeafT = TypeVar("LeafT", bound=IndexedLeaf)


def key_on_trim(policy: EvictionPolicy) -> str:
    """How ``policy``'s key of a leaf moves when the leaf loses its tail block and no other
    event happens: ``"same"``, ``"falls"`` (never rises) or ``"any"``.

    A policy says so with a ``key_on_trim`` attribute; else the exact classes of ``lru``,
    ``lfu``, ``fifo`` (same) and ``gdsf``, ``cost`` (falls) are known (a subclass may key on
    more), and every other policy is ``"any"`` (re-ranked after each block).

    Raises:
        ValueError: naming ``eviction_policy`` for a declared value not among the three.
    """
    declared = getattr(policy, "key_on_trim", None)
    if declared is not None:
        if declared not in ("same", "falls", "any"):
            raise ValueError(f"eviction_policy: key_on_trim must be 'same', 'falls' or 'any', "
                             f"got {declared!r}")
        return declared
    return _KEY_ON_TRIM.get(type(policy), "any")


class LeafIndex(Generic[LeafT]):
    """Evictable leaves in eviction order; O(log n) per add / remove / first.

    Args:
        policy: A priority-key policy (kept in a ``SortedList`` of ``(priority, uid)``: lowest is
            evicted first, ``uid`` breaks ties) or a victim-naming policy (told about every
            add/remove and asked for victims).
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        if policy.kind not in ("priority", "victims"):
            raise ValueError(f"eviction_policy: policy kind {policy.kind!r} is not supported")
        self.policy = policy
        self.by_priority = policy.kind == "priority"
        #: ``policy`` seen as its kind (the same object; only the one ``by_priority`` picks is
        #: used): typed handles for the hot paths, no isinstance check per call.
        self.ranking = cast(PriorityPolicy, policy)
        self.naming = cast(VictimPolicy, policy)
        #: Whether the policy's ``on_evict`` does something (the base class's is a no-op that
        #: eviction skips).
        self.report_evict = type(policy).on_evict is not EvictionPolicy.on_evict
        #: A priority policy whose key of a leaf does not move when it loses its tail, and
        #: that needs no ``on_evict``: the first leaf stays first whatever it loses (the tree's
        #: one-block eviction takes its tail without consulting the policy).
        self.trim_keeps_order = (self.by_priority and not self.report_evict
                                 and key_on_trim(policy) == "same")
        self.sorted: SortedList = SortedList()
        self.nodes: dict[int, LeafT] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, node: LeafT) -> None:
        """Insert ``node`` under its current priority."""
        if self.by_priority:
            entry = (self.ranking.priority(node), node.uid)
            self.sorted.add(entry)
            node.leaf_entry = entry
        else:
            self.naming.add_leaf(node)
            node.leaf_entry = True
        self.nodes[node.uid] = node

    def remove(self, node: LeafT) -> None:
        """Remove ``node`` (which must be in the index)."""
        if self.by_priority:
            self.sorted.remove(node.leaf_entry)
        else:
            self.naming.remove_leaf(node)
        node.leaf_entry = None
        del self.nodes[node.uid]

    def reposition(self, node: LeafT) -> None:
        """Re-key ``node`` (in the index) after its priority inputs changed (a trimmed leaf).

        A priority policy whose key did not change (LRU, LFU, FIFO after a trim) costs one
        ``priority`` call and no sorted-list update.
        """
        if self.by_priority:
            entry = (self.ranking.priority(node), node.uid)
            if entry != node.leaf_entry:
                self.sorted.remove(node.leaf_entry)
                self.sorted.add(entry)
                node.leaf_entry = entry
        else:
            self.remove(node)
            self.add(node)

    def record_hit(self, node: LeafT, now: float) -> None:
        """A lookup matched ``node`` (indexed or not): bump ``hit_count``, set
        ``last_access_s``, re-key it if indexed, and tell a victim-naming policy."""
        indexed = node.leaf_entry is not None
        if indexed:
            self.remove(node)
        node.last_access_s = now
        node.hit_count += 1
        if indexed:
            self.add(node)
        if not self.by_priority:
            self.policy.on_hit(node)

    def first(self) -> LeafT | None:
        """The next victim, or None when no leaf is evictable."""
        if self.by_priority:
            return self.nodes[self.sorted[0][1]] if self.sorted else None
        victim = self.naming.choose_victim()
        if victim is None:
            return None
        node = self.nodes.get(victim.uid)
        if node is None:
            raise RuntimeError(f"eviction policy named {victim!r}, which is not an evictable leaf")
        return node

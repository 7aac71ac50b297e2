"""Eviction from the radix tree: block by block, tail first, each from the first-ranked leaf.

The rule: every evicted block is the tail block of the evictable leaf that ranks first *when
that block is taken*. A leaf that loses a block is re-ranked before its next block is taken, so a
policy that ranks a leaf by its last block (Belady's oracle keys a leaf by its tail block's next
use) can spare a long leaf's front once the never-reused tail is gone; taking the whole
shortfall from the first leaf and re-ranking afterwards (the earlier whole-shortfall rule) lost such
fronts. The blocks one leaf loses in a row are recorded as one run for the ghost list, with the
note ``on_evict`` returned last (for the run's first block in token order, the one a returning
request reaches first).

How a policy's key moves on a trim decides the path (each makes the rule's choices):

* **Unchanged** (``lru``, ``lfu``, ``fifo``: no ``num_blocks``, ``num_tokens`` or ``hashes`` in
  the key): the first leaf stays first whatever it loses, so its share goes in one slice with
  no key computed; ``on_evict`` is skipped when it is the base class's no-op. One block off a
  longer text leaf (each decode step's eviction once the pool is full: most calls) has a path
  of its own with the fewest operations.
* **Never rises** (``gdsf``, ``cost``: GreedyDual credits ``∝ C(depth, n) / n``, the mean
  recompute cost of the leaf's blocks, which only falls as its deepest blocks go, ``L`` and the
  other inputs being fixed until the next event): the first leaf stays first too; its share
  goes in one slice and one ``on_evict(leaf, n)`` reports it, as under the whole-shortfall
  rule, so these policies make exactly the choices they made under it.
* **Anything else** (``belady``, ``belady-cost``, the learned policies): one block at a time,
  each its own event (``on_evict(leaf, 1)``, then the leaf's new key); the leaf keeps losing
  blocks while its new key still sorts before the index's second entry (which cannot change
  meanwhile), so the sorted index is touched once per leaf, not per block.

A policy declares its case with ``key_on_trim = "same" | "falls" | "any"``; else the exact
classes named above are known and every other policy is ``"any"``. Victim-naming policies keep
their own order: the named leaf loses up to the whole shortfall, then is handed back to the
policy (``remove_leaf`` / ``add_leaf``) and the policy names the next victim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, MutableSequence, Protocol

from radixkv.cache.tree.edit import trim_tail
from radixkv.cache.tree.leaves import LeafIndex, key_on_trim
from radixkv.cache.tree.node import ghost_run_from_tuple as _ghost_run
from radixkv.eviction import EvictionPolicy

if TYPE_CHECKING:
    from radixkv.cache.tree.node import Node

__all__ = ["EvictionHost", "detach", "evict", "key_on_trim", "take_tail_block"]


class EvictionHost(Protocol):
    """What eviction reads and updates of the tree (``radix_tree.RadixTree``, which binds
    :func:`evict` and :func:`take_tail_block` as its methods). A structural type: this module
    stays below ``radix_tree`` (no import cycle) and no check runs on the hot path."""

    #: Blocks held by all nodes (eviction subtracts what it frees).
    num_cached_blocks: int
    #: Non-root nodes (eviction subtracts the leaves it detaches).
    num_nodes: int

    @property
    def leaves(self) -> LeafIndex[Node]: ...
    @property
    def policy(self) -> EvictionPolicy: ...
    @property
    def key_on_trim(self) -> str: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def trim_hook(self) -> Callable[[Node, int], None] | None: ...
    @property
    def root_child_keys(self) -> dict[object, dict[Node, None]]: ...
    def drop_bare_root(self, root: Node) -> None: ...


def evict(tree: EvictionHost, num_blocks: int, evicted: list | None = None,
          freed: MutableSequence[int] | None = None) -> MutableSequence[int]:
    """Evict up to ``num_blocks`` blocks, block by block, each the tail block of the leaf that
    ranks first when it is taken (the rule and its fast paths: this module's docstring).

    Args:
        tree: The tree; its counters, leaf index and root-key index are kept up to date.
        num_blocks: Blocks wanted.
        evicted: If given, one ``(key, GhostRun(tokens, hash_bytes, extras, note, hash_size))``
            entry per run trimmed off a leaf is appended for the ghost list: ``key`` (bytes) is
            the hash input of the run's first block (``parent hash || packed tokens ||
            extras``), the run's fields are in token order, ``note`` is what the policy's
            ``on_evict`` returned for its first block (usually None).
        freed: Where the freed block ids go (appended): a new list when None; the cache
            passes an ``array('q')``, so a long run's ids are copied in C and the pool frees
            them without a Python int per block.

    Returns:
        ``freed``: the freed block ids in eviction order (fewer than asked when nothing is
        evictable).
    """
    if freed is None:
        freed = []
    if num_blocks == 1:
        taken = take_tail_block(tree)
        if taken is not None:
            block_id, parent_hash, run_tokens, run_hash = taken
            if evicted is not None:
                evicted.append((parent_hash + run_tokens,
                                _ghost_run((run_tokens, run_hash, None, None, len(run_hash)))))
            freed.append(block_id)
            return freed
    if tree.leaves.by_priority and tree.trim_hook is None:
        path = tree.key_on_trim
        if path == "any":
            _evict_each(tree, num_blocks, evicted, freed)
        else:
            _evict_slices(tree, num_blocks, evicted, path == "same", freed)
        return freed
    _evict_named(tree, num_blocks, evicted, freed)
    return freed


def take_tail_block(tree: EvictionHost) -> tuple[int, bytes, bytearray, bytearray] | None:
    """The commonest eviction, one block (each decode step's once the pool is full), when it
    can skip the policy: the first leaf's tail block, taken if the policy's key of a leaf does
    not move on a trim and needs no ``on_evict`` (``LeafIndex.trim_keeps_order``), no
    ``trim_hook`` must see it, and the leaf is text that keeps a front block (so it stays a
    leaf, first in the order). The fewest Python operations: this is most of ``bench tree``'s
    evict time.

    Returns:
        ``(block id, parent hash, packed tokens, chained hash)`` of the block taken (the parent
        hash, ``bytes``, being the leaf's new last hash; the tokens and the hash are
        ``bytearray`` cuts), or None when the case does not apply (nothing changed: use
        :func:`evict`).
    """
    leaves = tree.leaves
    if not leaves.trim_keeps_order or tree.trim_hook is not None:
        return None
    sublists = leaves.sorted._lists  # type: ignore[attr-defined]  # private, not in the stubs (_evict_slices)
    if not sublists:
        return None
    victim = leaves.nodes[sublists[0][0][1]]
    ids = victim.block_ids
    if len(ids) < 2 or victim.extras is not None:
        return None
    tokens, hb = victim.tokens, victim.hash_bytes
    bb = tree.block_bytes
    run_tokens = tokens[-bb:]
    del tokens[-bb:]
    tree.num_cached_blocks -= 1
    w = victim.hash_size
    cut = len(hb) - w
    run_hash = hb[cut:]
    del hb[cut:]
    return ids.pop(), b"" + hb[-w:], run_tokens, run_hash  # (b"" +: bytes, fast)


def _evict_slices(tree: EvictionHost, num_blocks: int, evicted: list | None, same: bool,
                  freed: MutableSequence[int]) -> None:
    """Priority policies whose key of a leaf cannot rise when it loses its tail (``"same"``
    or ``"falls"``): the first leaf stays first, so its whole share goes in one slice.

    The hot path of every allocation that evicts (most take one block off a long leaf): kept
    to the fewest Python operations, as the per-call cost decides ``bench tree``'s evict
    ratio. ``same``: the key does not move, so the leaf is not re-keyed.
    """
    leaves = tree.leaves
    sorted_entries = leaves.sorted
    # ``_lists[0][0]`` is ``sorted_entries[0]`` without SortedList's Python-level index checks
    # (sortedcontainers keeps its entries in a list of sorted sublists, the first non-empty
    # while any entry is left).
    sublists = sorted_entries._lists  # type: ignore[attr-defined]  # private: not in the stubs
    nodes = leaves.nodes
    policy = leaves.ranking
    report = leaves.report_evict
    bb = tree.block_bytes
    left = num_blocks
    while left > 0 and sublists:
        entry = sublists[0][0]
        victim = nodes[entry[1]]
        ids = victim.block_ids
        tokens = victim.tokens
        n = len(ids)
        if left < n:  # the leaf keeps its front and stays first: its last share
            cut = n - left
            start = cut * bb
            if left == 1:
                freed.append(ids.pop())
            else:
                freed += ids[: cut - 1 : -1]  # the tail, last block first (one C copy)
                del ids[cut:]
            hb, w = victim.hash_bytes, victim.hash_size
            run_hashes = hb[cut * w :]  # one copy: no Python object per block
            del hb[cut * w :]
            run_tokens = tokens[start:]
            del tokens[start:]
            x = victim.extras
            run_x = None
            if x is not None:
                run_x = x[cut:]
                del x[cut:]
            tree.num_cached_blocks -= left
            note = policy.on_evict(victim, left) if report else None
            if evicted is not None:
                key = b"" + hb[-w:] + (run_tokens if left == 1 else run_tokens[:bb])
                if run_x is not None:
                    key += run_x[0]
                evicted.append((key, _ghost_run((run_tokens, run_hashes, run_x, note, w))))
            if not same:  # re-key it (an unmoved key stays put)
                new_entry = (policy.priority(victim), victim.uid)
                if new_entry != entry:
                    sorted_entries.remove(entry)
                    sorted_entries.add(new_entry)
                    victim.leaf_entry = new_entry
            return
        # The whole leaf goes: hand its buffers over to the ghost run, no copy (the detached
        # node is never written again).
        freed += ids[::-1]
        del ids[:]
        hashes = victim.hash_bytes
        victim.hash_bytes = bytearray()
        left -= n
        tree.num_cached_blocks -= n
        note = policy.on_evict(victim, n) if report else None
        if evicted is not None:
            x = victim.extras
            key = victim.parent.end_hash + tokens[:bb]  # type: ignore[union-attr]  # a leaf has a parent
            if x is not None:
                key += x[0]
                x = x[:]
            evicted.append((key, _ghost_run((tokens, hashes, x, note, victim.hash_size))))
        sorted_entries.pop(0)  # the victim's entry (SortedList's fast path for index 0)
        victim.leaf_entry = None
        del nodes[victim.uid]
        detach(tree, victim)


def _evict_each(tree: EvictionHost, num_blocks: int, evicted: list | None,
                freed: MutableSequence[int]) -> None:
    """Priority policies whose key of a leaf may move any way on a trim: one block at a time,
    each its own ``on_evict(leaf, 1)``; the leaf keeps losing blocks while its new key still
    sorts before the index's second entry (which cannot change meanwhile)."""
    leaves = tree.leaves
    policy = leaves.ranking
    sorted_entries, nodes = leaves.sorted, leaves.nodes
    priority, on_evict = policy.priority, policy.on_evict
    left = num_blocks
    sublists = sorted_entries._lists  # type: ignore[attr-defined]  # private, not in the stubs (_evict_slices)
    while left > 0 and sublists:
        entry = sublists[0][0]
        victim = nodes[entry[1]]
        ids, hb, w = victim.block_ids, victim.hash_bytes, victim.hash_size
        n = len(ids)
        second = sorted_entries[1] if len(sorted_entries) > 1 else None
        cut_hashes = []  # each block's hash as cut, last block first
        uid = victim.uid
        new_entry = None
        while True:
            freed.append(ids.pop())
            cut_hashes.append(hb[-w:])
            del hb[-w:]  # the policy may key the leaf by its new last hash
            note = on_evict(victim, 1)
            if len(cut_hashes) == left or not ids:
                break
            new_entry = (priority(victim), uid)
            if second is not None and not new_entry < second:
                break
            new_entry = None
        take = len(cut_hashes)
        cut_hashes.reverse()
        run_hashes = b"".join(cut_hashes)
        cut = n - take
        left -= take
        tree.num_cached_blocks -= take
        bb = 4 * victim.block_size
        tokens, x = victim.tokens, victim.extras
        if evicted is not None:
            # One copy of a partial run; a leaf that goes whole hands its buffer over (the
            # detached node is never written again).
            run_tokens = tokens[cut * bb :] if cut else tokens
            run_x = x[cut:] if x is not None else None
            parent_hash = (victim.end_hash if cut
                           else victim.parent.end_hash)  # type: ignore[union-attr]  # a leaf has a parent
            evicted.append((parent_hash + run_tokens[:bb] + (run_x[0] if run_x else b""),
                            _ghost_run((run_tokens, run_hashes, run_x, note, w))))
        if ids:  # still a leaf: trim the rest of it and re-key it (an unmoved key stays put)
            del tokens[cut * bb :]
            if x is not None:
                del x[cut:]
            if new_entry is None:
                new_entry = (priority(victim), victim.uid)
            if new_entry != entry:
                sorted_entries.remove(entry)
                sorted_entries.add(new_entry)
                victim.leaf_entry = new_entry
            continue
        leaves.remove(victim)
        detach(tree, victim)


def _evict_named(tree: EvictionHost, num_blocks: int, evicted: list | None,
                 freed: MutableSequence[int]) -> None:
    """Victim-naming policies, and any policy while a ``trim_hook`` (the store tier) must see
    each trimmed run before it goes: one ``trim_tail`` per run."""
    leaves = tree.leaves
    by_priority = leaves.by_priority
    whole = tree.key_on_trim != "any"
    record = evicted is not None
    goal = len(freed) + num_blocks
    while len(freed) < goal:
        victim = leaves.first()
        if victim is None:
            break
        ids = victim.block_ids
        # The shortfall at once from the leaf a victim-naming policy names, or a priority leaf
        # whose key cannot rise on a trim (the same choices, one run for the hook); block by
        # block (re-ranked after each) for any other priority policy.
        take = 1 if by_priority and not whole else min(goal - len(freed), len(ids))
        keep = take < len(ids) and by_priority
        if not keep:
            leaves.remove(victim)
        if tree.trim_hook is not None:
            tree.trim_hook(victim, take)
        run = trim_tail(victim, take, freed, record)
        tree.num_cached_blocks -= take
        note = tree.policy.on_evict(victim, take)
        if run is not None:
            evicted.append((run[0], _ghost_run((run[1], run[2], run[3], note,  # type: ignore[union-attr]  # run: only when evicted is a list
                                                victim.hash_size))))
        if ids:
            if keep:
                leaves.reposition(victim)
            else:
                leaves.add(victim)
            continue
        detach(tree, victim)


def detach(tree: EvictionHost, victim: Node) -> None:
    """Unlink a leaf left with no blocks (already out of the leaf index); its parent becomes
    an evictable leaf if it is left childless and unlocked, a root left bare is dropped."""
    parent: Node = victim.parent  # type: ignore[assignment]  # a leaf is never a root
    del parent.children[victim.key]
    if parent.parent is None:
        holders = tree.root_child_keys[victim.key]
        del holders[parent]
        if not holders:
            del tree.root_child_keys[victim.key]
        if not parent.children and not parent.lock_ref:
            tree.drop_bare_root(parent)
    victim.parent = None
    tree.num_nodes -= 1
    if parent.parent is not None and not parent.children and parent.lock_ref == 0:
        tree.leaves.add(parent)

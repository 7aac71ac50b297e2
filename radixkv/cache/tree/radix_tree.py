"""Radix tree of published KV blocks: match, insert, split, lock, evict.

One root per cache identity (keyed by its root hash). A node holds a run of full blocks (see
:mod:`radixkv.cache.tree.node`); children are keyed by their first block's exact token bytes plus its
extras, so the key is exact and the path from the root *is* the hash chain.

* ``match`` walks the tree comparing the prompt's packed tokens with each node's packed run in
  one ``memcmp`` per node (a binary search over block ranges finds a mismatch inside a run):
  O(matched blocks) bytes compared, O(matched nodes) Python steps, and nothing hashed (blocks
  are hashed once, when inserted).
* ``lock_ref`` of a node = number of request cursors at the node or anywhere below it, so a
  lock on a cursor node propagates to the root and every block on a held path is protected.
* A request cursor always sits at the *end* of a node: a match ending inside a node splits it,
  and a split keeps the deeper half in the original node object, so cursors stay valid.
* ``insert`` / ``extend_leaf`` live in :mod:`radixkv.cache.tree.insert`, ``evict`` in
  :mod:`radixkv.cache.tree.leaves` (mixins).
* Evictable leaves (``lock_ref == 0``, no children) live in a :class:`LeafIndex` keyed by the
  eviction policy; keys change only on events (insert, hit, unlock, split, trim, becoming a
  leaf). ``evict(k)`` trims blocks off the tail of the first leaf, so the cached set stays
  prefix-closed, in O(k log n).
* An identity root lives while it has children or locks: the last unlock or eviction that
  leaves it bare drops it, so a stream of one-off identities (cache salts) keeps no state.
  ``root()`` makes it again on the next use; ``lock`` re-attaches a dropped root object a
  caller still holds.
"""

from __future__ import annotations

import itertools
import time
from array import array
from typing import Callable, Iterable, Sequence

from radixkv.cache.hashing import as_packed_tokens as as_token_bytes
from radixkv.cache.tree.insert import TreeInsert
from radixkv.cache.tree.leaves import LeafEviction
from radixkv.cache.tree.node import (
    BLOCK_ID_TYPECODE,
    LeafIndex,
    MatchResult,
    Node,
    child_key,
    common_blocks,
    extras_agree,
)
from radixkv.eviction import EvictionPolicy


class RadixTree(LeafEviction, TreeInsert):
    """Prefix tree over cached blocks with policy-ordered evictable leaves.

    Args:
        block_size: B, tokens per block (> 0).
        policy: Eviction policy instance (priority-key or victim-naming).
        clock: Returns the current time; inject a counter in tests for determinism.

    Attributes:
        num_nodes: Non-root nodes.
        num_cached_blocks: Blocks held by all nodes.
        num_locked_blocks: Blocks in nodes with ``lock_ref > 0``.
        leaves: The evictable-leaf index.
    """

    def __init__(self, block_size: int, policy: EvictionPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy: must be an EvictionPolicy instance, got "
                             f"{type(policy).__name__} (use radixkv.eviction.get_policy)")
        self.block_size = block_size
        self.block_bytes = 4 * block_size
        self.policy = policy
        self.leaves = LeafIndex(policy)
        self._notify_policy = not self.leaves.by_priority
        self._clock = clock
        self._uids = itertools.count()
        self.roots: dict[bytes, Node] = {}
        # First-block key -> roots having a child with that key (cheap "isolated" miss check).
        self.root_child_keys: dict[object, dict[Node, None]] = {}  # insertion-ordered sets
        self.num_nodes = 0
        self.num_cached_blocks = 0
        self.num_locked_blocks = 0

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks in unlocked nodes; all reachable by repeated leaf eviction."""
        return self.num_cached_blocks - self.num_locked_blocks

    @property
    def num_evictable_leaves(self) -> int:
        """Nodes currently in the evictable-leaf index."""
        return len(self.leaves)

    def root(self, root_hash: bytes, tenant: str | None = None) -> Node:
        """Return (creating on first use) the root of the identity with hash ``root_hash``.

        A root with no children and no locks is dropped by the unlock or eviction that leaves
        it so (it holds nothing); call ``root()`` again rather than keeping the node.
        """
        node = self.roots.get(root_hash)
        if node is None:
            node = Node(next(self._uids), None, self.block_size, self._clock())
            node.root_hash = root_hash
            node.tenant = tenant
            self.roots[root_hash] = node
        return node

    def roots_holding(self, key: object, exclude: Node, limit: int | None = None) -> list[Node]:
        """Roots other than ``exclude`` with a child keyed ``key`` (same first block).

        Args:
            limit: At most this many (the first registered), in O(limit) however many
                identities hold the key.
        """
        holders = self.root_child_keys.get(key)
        if not holders:
            return []
        return list(itertools.islice((r for r in holders if r is not exclude), limit))

    def _drop_bare_root(self, root: Node) -> None:
        """Forget an identity root left with no children and no locks (it holds nothing)."""
        if self.roots.get(root.root_hash) is root:
            del self.roots[root.root_hash]

    # ---- walking and matching -----------------------------------------------------------
    def walk(self, start: Node, pb: bytes, px: Sequence[bytes] | None,
             max_blocks: int) -> tuple[list[tuple[Node, int]], int]:
        """Follow the cached prefix of packed tokens ``pb`` below ``start``; change nothing.

        Args:
            start: Node whose end the tokens continue (an identity root for a lookup).
            pb: Packed tokens (at least ``max_blocks`` full blocks).
            px: Extras per block of ``pb`` or None for text.
            max_blocks: Most blocks to match.

        Returns:
            ``(path, num_blocks)``: each visited child with the number of its leading blocks
            that matched (only the last entry can be short of the node), and the total.
        """
        bb = self.block_bytes
        end = max_blocks * bb
        node, pos = start, 0
        path: list[tuple[Node, int]] = []
        while pos < end:
            key = pb[pos : pos + bb]
            if px is not None and px[pos // bb]:
                key = (key, px[pos // bb])
            child = node.children.get(key)
            if child is None:
                break
            ct = child.tokens
            n = len(ct)
            room = end - pos
            if n <= room:  # the whole run may match: one memcmp, no copy
                j = n // bb
                if not pb.startswith(ct, pos):
                    j = common_blocks(pb, pos, ct, j, bb)
            else:
                j = room // bb
                if not pb.startswith(ct[:room], pos):
                    j = common_blocks(pb, pos, ct, j, bb)
            if px is not None or child.extras is not None:
                j = extras_agree(child.extras, px, pos // bb, j)
            path.append((child, j))
            pos += j * bb
            if j * bb < n:
                break
            node = child
        return path, pos // bb

    def match(self, root: Node, token_ids: Sequence[int] | bytes, max_blocks: int, *,
              extras: Sequence[bytes] | None = None, touch: bool = True) -> MatchResult:
        """Longest cached prefix of ``token_ids`` under ``root``, at most ``max_blocks`` blocks.

        Compares stored tokens and extras (no hashing). If the match ends inside a node, the
        node is split there so the returned node ends exactly at the match. Nothing is locked.

        Args:
            root: Identity root from :meth:`root`.
            token_ids: Prompt tokens, or the prompt already packed by ``pack_tokens``.
            max_blocks: Cap on matched blocks (the hit cap), ≥ 0.
            extras: Per-block extras of the prompt's full blocks, None for text.
            touch: Record the access (``hit_count``, ``last_access_s``) on the matched path;
                False leaves policy fields alone (see :meth:`touch_path`).

        Returns:
            A :class:`MatchResult`.
        """
        pb = token_ids if type(token_ids) is bytes else as_token_bytes(token_ids)
        if max_blocks * self.block_bytes > len(pb):
            max_blocks = len(pb) // self.block_bytes
        path, _ = self.walk(root, pb, extras, max_blocks)
        if not path:
            return MatchResult(root, array(BLOCK_ID_TYPECODE), root.root_hash)
        last, j = path[-1]
        if j < len(last.block_ids):
            last = self._split(last, j)
            path[-1] = (last, j)
        block_ids = array(BLOCK_ID_TYPECODE)
        for node, _ in path:
            block_ids += node.block_ids
        if touch:
            now = self._clock()
            for node, _ in path:
                self._touch(node, now)
        return MatchResult(last, block_ids, last.end_hash)

    def match_length(self, root: Node, token_ids: Sequence[int] | bytes, max_blocks: int, *,
                     extras: Sequence[bytes] | None = None) -> int:
        """Blocks :meth:`match` would return, without splitting, touching or locking anything."""
        pb = as_token_bytes(token_ids)
        return self.walk(root, pb, extras, min(max_blocks, len(pb) // self.block_bytes))[1]

    def _touch(self, node: Node, now: float) -> None:
        """Record a hit on ``node``; re-key it if it sits in the leaf index."""
        if node.leaf_entry is None:
            node.last_access_s = now
            node.hit_count += 1
        else:
            self.leaves.remove(node)
            node.last_access_s = now
            node.hit_count += 1
            self.leaves.add(node)
        if self._notify_policy:
            self.policy.on_hit(node)

    def touch_path(self, node: Node) -> None:
        """Record a hit on ``node`` and every ancestor (a deferred ``match(touch=True)``)."""
        now = self._clock()
        notify = self.policy.on_hit if self._notify_policy else None
        while node.parent is not None:
            if node.leaf_entry is None:  # the usual case: the path is locked by the request
                node.last_access_s = now
                node.hit_count += 1
                if notify is not None:
                    notify(node)
            else:
                self._touch(node, now)
            node = node.parent

    def _split(self, node: Node, j: int) -> Node:
        """Split ``node`` before its block ``j``; return the new head (blocks ``[0, j)``).

        The original object keeps the tail so cursors at its end stay valid; the head inherits
        the lock count (every cursor at or below the node is below the head too).
        """
        bb = self.block_bytes
        head = Node(next(self._uids), node.parent, self.block_size, node.created_s)
        head.key = node.key
        head.tokens = node.tokens[: j * bb]
        head.hashes = node.hashes[:j]
        head.block_ids = node.block_ids[:j]
        if node.extras is not None:
            head.extras = node.extras[:j]
            del node.extras[:j]
        head.lock_ref = node.lock_ref
        head.last_access_s = node.last_access_s
        head.hit_count = node.hit_count
        head.depth_tokens = node.depth_tokens
        head.tenant = node.tenant
        node.parent.children[head.key] = head  # type: ignore[union-attr]
        in_leaves = node.leaf_entry is not None
        if in_leaves:
            self.leaves.remove(node)
        del node.tokens[: j * bb], node.hashes[:j], node.block_ids[:j]
        node.key = child_key(bytes(node.tokens[:bb]), node.block_extras(0))
        node.parent = head
        node.depth_tokens += j * self.block_size
        head.children[node.key] = node
        if in_leaves:
            self.leaves.add(node)
        self.num_nodes += 1
        return head

    # ---- locks --------------------------------------------------------------------------
    def _lock_one(self, node: Node) -> None:
        if node.lock_ref == 0 and node.parent is not None:
            if node.leaf_entry is not None:
                self.leaves.remove(node)
            self.num_locked_blocks += len(node.block_ids)
        node.lock_ref += 1

    def lock(self, node: Node) -> None:
        """Add one cursor lock at ``node``; every ancestor up to the root is locked too.

        Raises:
            RuntimeError: if ``node`` is a dropped root whose hash has a new root meanwhile.
        """
        if node.parent is None and node.lock_ref == 0 and not node.children:
            # A bare root may have been dropped while its caller kept the object: re-attach.
            held = self.roots.setdefault(node.root_hash, node)
            if held is not node:
                raise RuntimeError(f"lock of a stale root {node!r}: get it again with root()")
        n: Node | None = node
        while n is not None:
            if n.lock_ref == 0 and n.parent is not None:
                if n.leaf_entry is not None:
                    self.leaves.remove(n)
                self.num_locked_blocks += len(n.block_ids)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: Node, *, touch: bool = True) -> None:
        """Remove one cursor lock at ``node`` (and on its ancestors).

        Args:
            node: The cursor node.
            touch: Set ``last_access_s`` on the path (False for a request that was never
                admitted, so a failed admission does not refresh recency).

        Raises:
            RuntimeError: if any node on the path is not locked (nothing is changed then).
        """
        n: Node | None = node
        while n is not None:
            if n.lock_ref <= 0:
                raise RuntimeError(f"unlock of {n!r} which is not locked")
            n = n.parent
        now = self._clock()
        n = node
        while n is not None:
            n.lock_ref -= 1
            if n.parent is not None:
                if touch:
                    n.last_access_s = now  # not in the leaf index while locked: no re-key
                if n.lock_ref == 0:
                    self.num_locked_blocks -= len(n.block_ids)
                    if not n.children:
                        self.leaves.add(n)
            elif n.lock_ref == 0 and not n.children:
                self._drop_bare_root(n)
            n = n.parent

    # ---- inspection ---------------------------------------------------------------------
    def iter_nodes(self) -> Iterable[Node]:
        """Yield every non-root node (depth-first)."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def check_integrity(self, cursors: Iterable[Node] | None = None,
                        hash_fn: Callable[[bytes], bytes] | None = None) -> set[int]:
        """Verify structure, locks, leaf index and counters; see ``radixkv.cache.tree.check``.

        Returns:
            The set of block ids the tree holds.
        """
        from radixkv.cache.tree.check import check_tree

        return check_tree(self, cursors, hash_fn)

"""Radix tree of published KV blocks: match, insert, split, lock, evict.

One root per cache identity (keyed by its root hash). A node holds a run of full blocks, each
``(token tuple, chained hash, block id)``; a node's children are keyed by their first block's
exact tokens plus an extras digest (empty until multimodal inputs exist), so the key is exact
and the path from the root *is* the hash chain.

* ``match`` walks the tree comparing the prompt's block tokens with the stored tokens: it is
  O(matched blocks) and hashes nothing (blocks are hashed once, when inserted).
* ``lock_ref`` of a node = number of request cursors at the node or anywhere below it, so a
  lock on a cursor node propagates to the root and every block on a held path is protected.
* A request cursor always sits at the *end* of a node: a match ending inside a node splits it,
  and a split keeps the deeper half in the original node object, so cursors stay valid.
* Evictable leaves (``lock_ref == 0``, no children) live in a sorted index keyed by the
  eviction policy's priority; keys change only on events (insert, hit, unlock, split, trim,
  becoming a leaf). ``evict(k)`` trims blocks off the tail of the lowest-priority leaf, so the
  cached set stays prefix-closed.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable, NamedTuple

from sortedcontainers import SortedList

from radixkv.eviction import EvictionPolicy

BlockTokens = tuple[int, ...]
HashBlock = Callable[[bytes, BlockTokens], bytes]


def child_key(tokens: tuple[int, ...], extras: bytes = b"") -> object:
    """Key of a child node: its first block's tokens, plus the extras digest when non-empty.

    Text blocks (no extras) use the bare token tuple so a lookup builds no extra object; a
    ``(tokens, extras)`` pair can never equal a tuple of ints, so the two forms cannot collide.
    """
    return (tokens, extras) if extras else tokens


class Node:
    """A run of cached blocks (or an identity root, which holds none).

    Attributes:
        uid: Unique id (creation order within the tree).
        parent: Parent node, None for a root.
        key: ``child_key(first block tokens, extras digest)``, the key in ``parent.children``.
        children: Child nodes by key.
        blocks: Token tuple of each block (B tokens each).
        hashes: Chained hash of each block.
        block_ids: Physical block id of each block.
        lock_ref: Request cursors at this node or below.
        last_access_s, hit_count, created_s: Policy inputs (clock units).
        depth_tokens: Tokens before this node's first block.
        block_size: B.
        root_hash: For a root, its identity root hash; else b"".
    """

    __slots__ = (
        "uid", "parent", "key", "children", "blocks", "hashes", "block_ids", "lock_ref",
        "last_access_s", "hit_count", "created_s", "depth_tokens", "block_size", "root_hash",
        "leaf_entry",
    )

    def __init__(self, uid: int, parent: Node | None, block_size: int, now: float) -> None:
        self.uid = uid
        self.parent = parent
        self.key: object = None
        self.children: dict[object, Node] = {}
        self.blocks: list[BlockTokens] = []
        self.hashes: list[bytes] = []
        self.block_ids: list[int] = []
        self.lock_ref = 0
        self.last_access_s = now
        self.hit_count = 0
        self.created_s = now
        self.depth_tokens = 0
        self.block_size = block_size
        self.root_hash = b""
        # The exact entry under which the node sits in the leaf index (None when not a leaf).
        self.leaf_entry: object = None

    @property
    def num_blocks(self) -> int:
        """Blocks held by the node."""
        return len(self.block_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens held by the node (``num_blocks * block_size``)."""
        return len(self.block_ids) * self.block_size

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def end_hash(self) -> bytes:
        """Chained hash of the node's last block (the root hash for a root)."""
        return self.hashes[-1] if self.hashes else self.root_hash

    def __repr__(self) -> str:
        return (f"Node(uid={self.uid}, depth_tokens={self.depth_tokens}, "
                f"num_blocks={self.num_blocks}, lock_ref={self.lock_ref})")


class MatchResult(NamedTuple):
    """Result of :meth:`RadixTree.match`.

    Attributes:
        node: The node at whose end the match stops (the root on a miss).
        block_ids: Matched physical block ids, in prompt order.
        last_hash: Chained hash of the last matched block (the root hash on a miss).
    """

    node: Node
    block_ids: list[int]
    last_hash: bytes


class InsertResult(NamedTuple):
    """Result of :meth:`RadixTree.insert`.

    Attributes:
        node: The new cursor node (the caller's lock now sits here).
        last_hash: Chained hash of the last block of the inserted run.
        inserted_ids: Block ids the tree took ownership of.
        duplicate_ids: Block ids whose content the tree already held (stay private).
    """

    node: Node
    last_hash: bytes
    inserted_ids: list[int]
    duplicate_ids: list[int]


class RadixTree:
    """Prefix tree over cached blocks with policy-ordered evictable leaves.

    Args:
        block_size: B, tokens per block (> 0).
        policy: Eviction policy instance (priority-key or victim-naming).
        clock: Returns the current time; inject a counter in tests for determinism.

    Attributes:
        num_nodes: Non-root nodes.
        num_cached_blocks: Blocks held by all nodes.
        num_locked_blocks: Blocks in nodes with ``lock_ref > 0``.
    """

    def __init__(self, block_size: int, policy: EvictionPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        if policy.kind not in ("priority", "victims"):
            raise ValueError(f"eviction_policy: policy kind {policy.kind!r} is not supported")
        self.block_size = block_size
        self.policy = policy
        self._clock = clock
        self._uids = itertools.count()
        self.roots: dict[bytes, Node] = {}
        self.num_nodes = 0
        self.num_cached_blocks = 0
        self.num_locked_blocks = 0
        self._by_priority = policy.kind == "priority"
        self._leaves: SortedList = SortedList()  # (priority, uid) entries, priority policies
        self._leaf_nodes: dict[int, Node] = {}    # uid -> node for every evictable leaf

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks in unlocked nodes; all reachable by repeated leaf eviction."""
        return self.num_cached_blocks - self.num_locked_blocks

    @property
    def num_evictable_leaves(self) -> int:
        """Nodes currently in the evictable-leaf index."""
        return len(self._leaf_nodes)

    def root(self, root_hash: bytes) -> Node:
        """Return (creating on first use) the root of the identity with hash ``root_hash``."""
        node = self.roots.get(root_hash)
        if node is None:
            node = Node(next(self._uids), None, self.block_size, self._clock())
            node.root_hash = root_hash
            self.roots[root_hash] = node
        return node

    # ---- leaf index ---------------------------------------------------------------------
    def _leaf_add(self, node: Node) -> None:
        if self._by_priority:
            entry = (self.policy.priority(node), node.uid)
            self._leaves.add(entry)
            node.leaf_entry = entry
        else:
            self.policy.add_leaf(node)
            node.leaf_entry = True
        self._leaf_nodes[node.uid] = node

    def _leaf_remove(self, node: Node) -> None:
        if self._by_priority:
            self._leaves.remove(node.leaf_entry)
        else:
            self.policy.remove_leaf(node)
        node.leaf_entry = None
        del self._leaf_nodes[node.uid]

    def _next_victim(self) -> Node | None:
        if self._by_priority:
            return self._leaf_nodes[self._leaves[0][1]] if self._leaves else None
        victim = self.policy.choose_victim()
        if victim is not None and victim.uid not in self._leaf_nodes:
            raise RuntimeError(f"eviction policy named {victim!r}, which is not an evictable leaf")
        return victim  # type: ignore[return-value]

    def _touch(self, node: Node, now: float, hit: bool) -> None:
        """Record an access; re-key the node if it sits in the leaf index."""
        in_leaves = node.leaf_entry is not None
        if in_leaves:
            self._leaf_remove(node)
        node.last_access_s = now
        if hit:
            node.hit_count += 1
        if in_leaves:
            self._leaf_add(node)

    # ---- match / split ------------------------------------------------------------------
    def match(self, root: Node, token_ids: tuple[int, ...], max_blocks: int) -> MatchResult:
        """Longest cached prefix of ``token_ids`` under ``root``, at most ``max_blocks`` blocks.

        Compares stored block tokens (no hashing). If the match ends inside a node, the node is
        split there so the returned node ends exactly at the match. Matched nodes are touched
        (``last_access_s``, ``hit_count``). Nothing is locked.

        Args:
            root: Identity root from :meth:`root`.
            token_ids: Prompt tokens as a tuple (slices are compared with stored tuples).
            max_blocks: Cap on matched blocks (the hit cap), ≥ 0.

        Returns:
            A :class:`MatchResult`.
        """
        if type(token_ids) is not tuple:
            token_ids = tuple(token_ids)  # slices must be tuples to compare with stored blocks
        bs = self.block_size
        end = min(max_blocks, len(token_ids) // bs) * bs
        node = root
        matched: list[int] = []
        path: list[Node] = []
        pos = 0
        while pos < end:
            child = node.children.get(token_ids[pos : pos + bs])  # text key = token tuple
            if child is None:
                break
            stored = child.blocks
            limit = min(len(stored), (end - pos) // bs)
            j = 1
            pos += bs
            while j < limit and stored[j] == token_ids[pos : pos + bs]:
                j += 1
                pos += bs
            if j < len(stored):
                child = self._split(child, j)
            matched += child.block_ids
            path.append(child)
            node = child
            if j < limit:  # mismatch inside the node: nothing deeper can match
                break
        if path:
            now = self._clock()
            for n in path:
                if n.leaf_entry is None:  # fast path: not in the leaf index, no re-key
                    n.last_access_s = now
                    n.hit_count += 1
                else:
                    self._touch(n, now, hit=True)
        return MatchResult(node, matched, node.end_hash)

    def _split(self, node: Node, j: int) -> Node:
        """Split ``node`` before its block ``j``; return the new head (blocks ``[0, j)``).

        The original object keeps the tail so cursors at its end stay valid; the head inherits
        the lock count (every cursor at or below the node is below the head too).
        """
        head = Node(next(self._uids), node.parent, self.block_size, node.created_s)
        head.key = node.key
        head.blocks = node.blocks[:j]
        head.hashes = node.hashes[:j]
        head.block_ids = node.block_ids[:j]
        head.lock_ref = node.lock_ref
        head.last_access_s = node.last_access_s
        head.hit_count = node.hit_count
        head.depth_tokens = node.depth_tokens
        node.parent.children[head.key] = head  # type: ignore[union-attr]
        in_leaves = node.leaf_entry is not None
        if in_leaves:
            self._leaf_remove(node)
        del node.blocks[:j], node.hashes[:j], node.block_ids[:j]
        node.key = child_key(node.blocks[0])
        node.parent = head
        node.depth_tokens += j * self.block_size
        head.children[node.key] = node
        if in_leaves:
            self._leaf_add(node)
        self.num_nodes += 1
        return head

    # ---- locks --------------------------------------------------------------------------
    def _lock_one(self, node: Node) -> None:
        if node.lock_ref == 0 and node.parent is not None:
            if node.leaf_entry is not None:
                self._leaf_remove(node)
            self.num_locked_blocks += node.num_blocks
        node.lock_ref += 1

    def lock(self, node: Node) -> None:
        """Add one cursor lock at ``node``; every ancestor up to the root is locked too."""
        n: Node | None = node
        while n is not None:
            self._lock_one(n)
            n = n.parent

    def unlock(self, node: Node) -> None:
        """Remove one cursor lock at ``node`` (and on its ancestors), touching the path.

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
                n.last_access_s = now  # not in the leaf index while locked: no re-key needed
                if n.lock_ref == 0:
                    self.num_locked_blocks -= n.num_blocks
                    if not n.children:
                        self._leaf_add(n)
            n = n.parent

    # ---- insert -------------------------------------------------------------------------
    def insert(self, cursor: Node, parent_hash: bytes, blocks: list[BlockTokens],
               block_ids: list[int], hash_block: HashBlock) -> InsertResult:
        """Publish full blocks continuing the chain at the end of ``cursor``.

        The caller holds one lock at ``cursor`` (its request cursor); that lock moves to the
        returned node. Where the tree already holds identical blocks (a concurrent request
        published them first), they are followed instead of inserted and the caller's copies
        are reported as duplicates. Only blocks not already in the tree are hashed, once each.

        Args:
            cursor: Node at whose end the blocks continue (locked by the caller).
            parent_hash: ``cursor.end_hash``, the chain value before ``blocks[0]``.
            blocks: Token tuple of each block (B tokens each).
            block_ids: The caller's physical block holding each block.
            hash_block: ``(parent_hash, tokens) -> hash`` for new blocks.

        Returns:
            An :class:`InsertResult`.
        """
        if cursor.lock_ref <= 0:
            raise RuntimeError(f"insert at {cursor!r} which the caller does not lock")
        if len(blocks) != len(block_ids):
            raise ValueError("block_ids: must have one id per block")
        now = self._clock()
        node, h, i, n = cursor, parent_hash, 0, len(blocks)
        duplicates: list[int] = []
        while i < n:
            key = child_key(blocks[i])
            child = node.children.get(key)
            if child is None:
                return self._add_run(node, h, blocks[i:], block_ids[i:], hash_block, now, duplicates)
            j = 1
            while j < child.num_blocks and i + j < n and child.blocks[j] == blocks[i + j]:
                j += 1
            if j < child.num_blocks:
                child = self._split(child, j)
            duplicates.extend(block_ids[i : i + j])
            # Move the caller's cursor one level down: it still counts in ``node`` and above.
            self._lock_one(child)
            child.last_access_s = now
            node, h, i = child, child.end_hash, i + j
        return InsertResult(node, h, [], duplicates)

    def _add_run(self, node: Node, h: bytes, blocks: list[BlockTokens], block_ids: list[int],
                 hash_block: HashBlock, now: float, duplicates: list[int]) -> InsertResult:
        hashes = []
        for tokens in blocks:
            h = hash_block(h, tokens)
            hashes.append(h)
        count = len(blocks)
        if node.parent is not None and not node.children and node.lock_ref == 1:
            # Only the caller holds this childless node: grow it in place (keeps runs compressed).
            node.blocks.extend(blocks)
            node.hashes.extend(hashes)
            node.block_ids.extend(block_ids)
            node.last_access_s = now
            new = node
        else:
            new = Node(next(self._uids), node, self.block_size, now)
            new.key = child_key(blocks[0])
            new.blocks, new.hashes, new.block_ids = list(blocks), hashes, list(block_ids)
            new.depth_tokens = node.depth_tokens + node.num_tokens
            new.lock_ref = 1  # the caller's cursor moves here; ancestors already count it
            node.children[new.key] = new
            self.num_nodes += 1
        self.num_cached_blocks += count
        self.num_locked_blocks += count
        return InsertResult(new, h, list(block_ids), duplicates)

    # ---- eviction -----------------------------------------------------------------------
    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to ``num_blocks`` blocks, tail-first from the lowest-priority leaves.

        Returns:
            Freed block ids in eviction order (fewer than asked when nothing is evictable).
        """
        freed: list[int] = []
        while len(freed) < num_blocks:
            victim = self._next_victim()
            if victim is None:
                break
            self._leaf_remove(victim)
            take = min(num_blocks - len(freed), victim.num_blocks)
            freed.extend(reversed(victim.block_ids[-take:]))
            del victim.blocks[-take:], victim.hashes[-take:], victim.block_ids[-take:]
            self.num_cached_blocks -= take
            self.policy.on_evict(victim, take)
            if victim.block_ids:
                self._leaf_add(victim)  # partially trimmed: still the same leaf
                continue
            parent = victim.parent
            del parent.children[victim.key]  # type: ignore[union-attr]
            victim.parent = None
            self.num_nodes -= 1
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                self._leaf_add(parent)  # type: ignore[arg-type]
        return freed

    # ---- inspection ---------------------------------------------------------------------
    def iter_nodes(self) -> Iterable[Node]:
        """Yield every non-root node (depth-first)."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def check_integrity(self, cursors: Iterable[Node] | None = None) -> set[int]:
        """Verify structure, lock counts, leaf index and counters.

        Args:
            cursors: When given, every request cursor (one entry per request); lock counts are
                then checked exactly (``lock_ref`` = cursors here + children's ``lock_ref``).

        Returns:
            The set of block ids the tree holds.

        Raises:
            AssertionError: describing the first violated invariant.
        """
        bs = self.block_size
        here: dict[int, int] = {}
        for c in cursors or ():
            here[c.uid] = here.get(c.uid, 0) + 1
        owned: set[int] = set()
        num_nodes = num_blocks = num_locked = 0
        leaves: set[int] = set()
        stack = list(self.roots.values())
        for root_hash, root in self.roots.items():
            assert root.root_hash == root_hash and not root.block_ids, f"bad root {root!r}"
        while stack:
            node = stack.pop()
            child_locks = 0
            for key, child in node.children.items():
                assert child.parent is node, f"{child!r}: parent pointer disagrees"
                assert child.key == key == child_key(child.blocks[0]), f"{child!r}: bad key"
                assert child.depth_tokens == node.depth_tokens + node.num_tokens, (
                    f"{child!r}: depth_tokens should be {node.depth_tokens + node.num_tokens}")
                child_locks += child.lock_ref
                stack.append(child)
            assert node.lock_ref >= child_locks, f"{node!r}: lock below its children's"
            if cursors is not None:
                assert node.lock_ref == child_locks + here.get(node.uid, 0), (
                    f"{node!r}: lock_ref != {here.get(node.uid, 0)} cursors + {child_locks} below")
            if node.parent is None:
                continue
            num_nodes += 1
            assert node.num_blocks >= 1, f"{node!r}: empty non-root node"
            assert len(node.blocks) == len(node.hashes) == node.num_blocks, f"{node!r}: ragged"
            assert all(len(t) == bs for t in node.blocks), f"{node!r}: partial block stored"
            for block_id in node.block_ids:
                assert block_id not in owned, f"block {block_id} held by two tree positions"
                owned.add(block_id)
            num_blocks += node.num_blocks
            if node.lock_ref > 0:
                num_locked += node.num_blocks
            is_leaf = node.lock_ref == 0 and not node.children
            assert (node.uid in self._leaf_nodes) == is_leaf, (
                f"{node!r}: evictable-leaf membership should be {is_leaf}")
            assert (node.leaf_entry is not None) == is_leaf, f"{node!r}: stale leaf entry"
            if is_leaf:
                leaves.add(node.uid)
                if self._by_priority:
                    assert node.leaf_entry == (self.policy.priority(node), node.uid), (
                        f"{node!r}: leaf key is stale")
        for c in cursors or ():
            n: Node | None = c
            while n is not None and n.parent is not None:
                n = n.parent
            assert n is not None and self.roots.get(n.root_hash) is n, f"cursor {c!r} detached"
        assert leaves == set(self._leaf_nodes), "leaf index holds nodes that are not leaves"
        if self._by_priority:
            assert len(self._leaves) == len(leaves), "sorted leaf index size disagrees"
        assert num_nodes == self.num_nodes, f"num_nodes {self.num_nodes} != {num_nodes}"
        assert num_blocks == self.num_cached_blocks, (
            f"num_cached_blocks {self.num_cached_blocks} != {num_blocks}")
        assert num_locked == self.num_locked_blocks, (
            f"num_locked_blocks {self.num_locked_blocks} != {num_locked}")
        return owned

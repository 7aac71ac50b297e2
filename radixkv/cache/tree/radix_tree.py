"""Radix tree of published KV blocks: the tree's bookkeeping over match, insert, lock, evict.

One root per cache identity; a node holds a run of full blocks (:mod:`.node`) keyed in its parent
by its first block's exact tokens plus extras, so the path from the root *is* the hash chain.
This class keeps the counters, the identity roots and their child-key index, the evictable-leaf
index (:mod:`.leaves`) and the policy's hooks; node edits are in :mod:`.edit`, run comparison and
the read-only walk in :mod:`.compare`. ``lock_ref`` of a node = request cursors at or below it
(a held path is locked to the root); a cursor sits at the *end* of a node (a match ending inside
a node splits it, keeping the deeper half in the original object). Leaf keys change only on
events; ``evict(k)`` takes k tail blocks, each from the leaf ranked first when it is taken
(:mod:`.evict`). A root left bare (no children, no locks) is dropped; ``lock`` re-attaches one
a caller still holds. See ``radixkv/cache/README.md`` for the lifetimes.
"""

from __future__ import annotations

import itertools
import time
from array import array
from typing import Callable, Iterable, Sequence

from radixkv.cache.hashing import as_packed_tokens as as_token_bytes
from radixkv.cache.tree.check import check_tree
from radixkv.cache.tree.compare import walk
from radixkv.cache.tree.edit import add_child, as_block_ids, grow_node, split_node
from radixkv.cache.tree.evict import evict as evict_blocks
from radixkv.cache.tree.evict import take_tail_block
from radixkv.cache.tree.leaves import LeafIndex, key_on_trim
from radixkv.cache.tree.node import (
    BLOCK_ID_TYPECODE,
    InsertResult,
    MatchResult,
    Node,
    RunHasher,
    hash_buffer,
)
from radixkv.config import check_block_size
from radixkv.eviction import EvictionPolicy


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
        num_retained_blocks: Blocks in retained nodes (``retain_refs``: a retention pinned at
            or below them; always locked).
        retained_blocks_by_tenant: The same, per tenant of the retentions (a block retained
            by two tenants counts for each).
        leaves: The evictable-leaf index.
    """

    def __init__(self, block_size: int, policy: EvictionPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_block_size(block_size)
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy: must be an EvictionPolicy instance, got "
                             f"{type(policy).__name__} (use radixkv.eviction.get_policy)")
        self.block_size = block_size
        self.block_bytes = 4 * block_size
        self.policy = policy
        self.leaves: LeafIndex[Node] = LeafIndex(policy)
        self._notify_policy = not self.leaves.by_priority
        #: How the policy's key moves when a leaf loses its tail (picks ``evict``'s path).
        self.key_on_trim = key_on_trim(policy)
        self._clock = clock
        policy.bind_clock(clock)
        self._uids = itertools.count()
        self.roots: dict[bytes, Node] = {}
        # First-block key -> roots having a child with that key (cheap "isolated" miss check).
        self.root_child_keys: dict[object, dict[Node, None]] = {}  # insertion-ordered sets
        self.num_nodes = 0
        self.num_cached_blocks = 0
        self.num_locked_blocks = 0
        self.num_retained_blocks = 0
        self.retained_blocks_by_tenant: dict[str | None, int] = {}
        #: Called as ``trim_hook(leaf, take)`` before ``evict`` trims a leaf's last ``take`` blocks.
        self.trim_hook: Callable[[Node, int], None] | None = None

    def now(self) -> float:
        """The tree's clock reading (what policy fields are stamped with)."""
        return self._clock()

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Use ``clock`` from now on (tests and replays move time); the policy is re-bound."""
        self._clock = clock
        self.policy.bind_clock(clock)

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

    def drop_bare_root(self, root: Node) -> None:
        """Forget an identity root left with no children and no locks (it holds nothing; the
        unlock or eviction that leaves it so calls this)."""
        if self.roots.get(root.root_hash) is root:
            del self.roots[root.root_hash]

    # ---- walking and matching -----------------------------------------------------------
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
        path, _ = walk(root, pb, extras, max_blocks, self.block_bytes)
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
                node.note_access_gap(now)
                self.leaves.record_hit(node, now)
        return MatchResult(last, block_ids, last.end_hash)

    def match_length(self, root: Node, token_ids: Sequence[int] | bytes, max_blocks: int, *,
                     extras: Sequence[bytes] | None = None) -> int:
        """Blocks :meth:`match` would return, without splitting, touching or locking anything."""
        pb = as_token_bytes(token_ids)
        return walk(root, pb, extras, min(max_blocks, len(pb) // self.block_bytes),
                    self.block_bytes)[1]

    def touch_path(self, node: Node, session_key: str | None = None) -> None:
        """Record a hit on ``node`` and every ancestor (a deferred ``match(touch=True)``); each
        takes ``session_key`` (the hitting request's session hint) as its ``session_key``."""
        now = self._clock()
        notify = self.policy.on_hit if self._notify_policy else None
        while node.parent is not None:
            node.session_key = session_key
            node.note_access_gap(now)
            if node.leaf_entry is None:  # the usual case: the path is locked by the request
                node.last_access_s = now
                node.hit_count += 1
                if notify is not None:
                    notify(node)
            else:
                self.leaves.record_hit(node, now)
            node = node.parent

    def _split(self, node: Node, j: int) -> Node:
        """Split ``node`` before its block ``j`` (:func:`~radixkv.cache.tree.edit.split_node`);
        return the new head. A leaf stays a leaf: it is re-indexed under its new key."""
        in_leaves = node.leaf_entry is not None
        if in_leaves:
            self.leaves.remove(node)
        head = split_node(node, j, next(self._uids))
        if in_leaves:
            self.leaves.add(node)
        self.num_nodes += 1
        return head

    # ---- publishing ---------------------------------------------------------------------
    def insert(self, cursor: Node, tokens: Sequence[int] | bytes, block_ids: Sequence[int],
               hasher: RunHasher, *, extras: Sequence[bytes] | None = None,
               known_hashes: Sequence[bytes] = (),
               ghost_notes: Sequence[tuple[int, object]] = (),
               session_key: str | None = None) -> InsertResult:
        """Publish full blocks continuing the chain at the end of ``cursor``.

        The caller's lock at ``cursor`` (its request cursor) moves to the returned node. Blocks
        the tree already holds (a concurrent request published them first) are followed, not
        inserted, and the caller's copies reported as duplicates. New blocks are hashed once.

        Args:
            cursor: Node at whose end the blocks continue (locked by the caller).
            tokens: The blocks' tokens, ``len(block_ids) * B`` ids or their packed bytes.
            block_ids: The caller's physical block of each block (ints, or an ``array('q')``).
            hasher: Hashes new blocks (``hash_blocks``).
            extras: Per-block extras, None for text.
            known_hashes: Chained hashes of the leading blocks already known (a lookup's ghost
                check), used instead of hashing them again.
            ghost_notes: ``(index in this run of an evicted run's last block, note)`` for runs
                this insert brings back from the ghost list (``note``: what the policy's
                ``on_evict`` returned); those inserted, not followed, go to the policy's
                ``on_ghost_hit`` with the node receiving them.
            session_key: The publishing request's session hint, set on the new node before
                the policy hears of it (its ``on_ghost_hit`` may read it); None leaves it unset.

        Raises:
            RuntimeError: if the caller does not lock ``cursor``.
            ValueError: naming ``block_ids`` if the sizes disagree.
            TypeError, OverflowError: if a block id is not an int64; nothing is changed then.
        """
        if cursor.lock_ref <= 0:
            raise RuntimeError(f"insert at {cursor!r} which the caller does not lock")
        tb = tokens if type(tokens) is bytes else as_token_bytes(tokens)
        ids = as_block_ids(block_ids)  # a bad id raises before any change
        count = len(ids)
        if len(tb) != count * self.block_bytes or (extras is not None and len(extras) != count):
            raise ValueError(f"block_ids: {count} ids for {len(tb) // 4} tokens "
                             f"(block size {self.block_size})")
        if extras is None and not known_hashes:
            last_hash = self.extend_leaf(cursor, tb, ids, hasher)
            if last_hash is not None:
                return InsertResult(cursor, last_hash, ids.tolist(), [])
        now = self._clock()
        node = cursor
        k = 0
        if cursor.children:
            path, k = walk(cursor, tb, extras, count, self.block_bytes)
            for child, j in path:
                if j < len(child.block_ids):
                    child = self._split(child, j)
                # Move the caller's cursor one level down: it still counts in ``node`` and above.
                self._lock_one(child)
                child.last_access_s = now
                node = child
        if k == count:
            return InsertResult(node, node.end_hash, [], ids.tolist())
        bb = self.block_bytes
        rest_tb = tb[k * bb :] if k else tb
        rest_ids = ids[k:] if k else ids
        rest_x = extras[k:] if extras is not None and k else extras
        known = known_hashes[k:count]  # a HashRun from a lookup's ghost probe, or bytes items
        num_known = len(known)
        new = hasher.hash_blocks(known[-1] if num_known else node.end_hash,
                                 rest_tb[num_known * bb :], self.block_size,
                                 rest_x[num_known:] if rest_x is not None else None)
        hash_size = len(new[0]) if new else len(known[-1])
        hb = hash_buffer(known) + b"".join(new) if num_known else b"".join(new)
        result = self._add_run(node, rest_tb, rest_ids, rest_x, hb, hash_size, now,
                               ids[:k].tolist())
        if session_key is not None:
            result.node.session_key = session_key
        notes = [note for i, note in ghost_notes if i >= k]
        if notes:
            self.policy.on_ghost_hit(result.node, notes)
        return result

    def extend_leaf(self, cursor: Node, tb: bytes | bytearray, block_ids: Sequence[int],
                    hasher: RunHasher) -> bytes | None:
        """Fast path of :meth:`insert`: text blocks appended to the leaf only the caller holds.

        The common case (a request publishing its prompt's suffix or generated blocks at the
        end of its own leaf): hash and append, nothing to walk, split or create. The caller's
        lock stays at ``cursor``. ``tb``: packed tokens of ``len(block_ids)`` full blocks.

        Returns:
            The chained hash of the last block, or None (nothing changed) when the fast path
            does not apply (``cursor`` has children, other locks, extras, is a root, or the
            sizes disagree): use :meth:`insert` then.
        """
        count = len(block_ids)
        if (cursor.lock_ref != 1 or cursor.children or not cursor.hash_bytes or not count
                or cursor.extras is not None or len(tb) != count * self.block_bytes):
            return None
        if type(block_ids) is not array or block_ids.typecode != BLOCK_ID_TYPECODE:
            block_ids = array(BLOCK_ID_TYPECODE, block_ids)  # a bad id raises before any change
        hb = cursor.hash_bytes
        hashes = hasher.hash_blocks(b"" + hb[-cursor.hash_size :], tb, self.block_size)
        cursor.block_ids += block_ids  # one memcpy
        cursor.tokens += tb
        hb += b"".join(hashes)
        # last_access_s: the caller's lock is released with touch=True (unlock), which sets it.
        self.num_cached_blocks += count
        self.num_locked_blocks += count
        if self._notify_policy:
            self.policy.on_insert(cursor, count)
        return hashes[-1]

    def _add_run(self, node: Node, tb: bytes, block_ids: Sequence[int],
                 extras: Sequence[bytes] | None, hash_bytes: bytes, hash_size: int, now: float,
                 duplicates: list[int]) -> InsertResult:
        """Add new blocks at the end of ``node`` (locked by the caller's cursor, which moves to
        the node holding them): grown in place when only the caller holds that childless node
        (keeps runs compressed), else a new child."""
        count = len(block_ids)
        ids = array(BLOCK_ID_TYPECODE, block_ids)
        if extras is not None and not any(extras):
            extras = None
        if node.parent is not None and not node.children and node.lock_ref == 1:
            grow_node(node, tb, ids, hash_bytes, extras)
            node.last_access_s = now
            new = node
        else:
            new = add_child(node, next(self._uids), tb, ids, hash_bytes, hash_size, extras, now)
            if node.parent is None:
                self.root_child_keys.setdefault(new.key, {})[node] = None
            self.num_nodes += 1
        self.num_cached_blocks += count
        self.num_locked_blocks += count
        if self._notify_policy:
            self.policy.on_insert(new, count)
        return InsertResult(new, b"" + hash_bytes[-hash_size:], ids.tolist(), duplicates)

    # ---- eviction -----------------------------------------------------------------------
    #: ``evict(num_blocks, evicted=None) -> freed block ids``: block by block, each the tail
    #: block of the leaf ranked first when it is taken (:func:`radixkv.cache.tree.evict.evict`,
    #: bound as a method: no wrapper frame on the allocation path).
    evict = evict_blocks
    #: ``take_tail_block() -> (block id, parent hash, tokens, hash) | None``: ``evict(1)`` with
    #: its result given apart, where that needs no policy call (the cache's hot path; see
    #: :func:`radixkv.cache.tree.evict.take_tail_block`).
    take_tail_block = take_tail_block

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
                self.drop_bare_root(n)
            n = n.parent

    # ---- retention pins (radixkv.cache.retention) ---------------------------------------
    def pin(self, node: Node, tenant: str | None) -> None:
        """A retention of ``tenant`` pins the path ending at ``node`` (a non-root node in the
        tree): one lock at ``node`` (as a cursor's) and one count in ``retain_refs`` of it and
        every ancestor; blocks that become retained are counted."""
        self.lock(node)
        node.pins += 1
        n: Node | None = node
        by_tenant = self.retained_blocks_by_tenant
        while n is not None and n.parent is not None:
            refs = n.retain_refs
            if refs is None:
                refs = n.retain_refs = {}
                self.num_retained_blocks += len(n.block_ids)
            before = refs.get(tenant, 0)
            if not before:
                by_tenant[tenant] = by_tenant.get(tenant, 0) + len(n.block_ids)
            refs[tenant] = before + 1
            n = n.parent

    def unpin(self, node: Node, tenant: str | None) -> None:
        """Undo one :meth:`pin` of ``tenant`` at ``node`` (its lock too, without touching
        ``last_access_s``: the blocks keep the recency of their last real access).

        Raises:
            RuntimeError: if ``node`` holds no pin of ``tenant`` (nothing is changed then).
        """
        if node.pins <= 0 or not node.retain_refs or not node.retain_refs.get(tenant):
            raise RuntimeError(f"unpin of {node!r}, which holds no retention pin of {tenant!r}")
        node.pins -= 1
        n: Node | None = node
        by_tenant = self.retained_blocks_by_tenant
        while n is not None and n.parent is not None:
            refs = n.retain_refs
            assert refs is not None, f"{n!r}: retained path without retain_refs"
            left = refs[tenant] - 1
            if left:
                refs[tenant] = left
            else:
                del refs[tenant]
                by_tenant[tenant] -= len(n.block_ids)
                if not by_tenant[tenant]:
                    del by_tenant[tenant]
                if not refs:
                    n.retain_refs = None
                    self.num_retained_blocks -= len(n.block_ids)
            n = n.parent
        self.unlock(node, touch=False)

    @staticmethod
    def retained_depth_blocks(node: Node, tenant: str | None = None, *,
                              any_tenant: bool = True) -> int:
        """Blocks of the path ending at ``node`` that are retained (by any tenant, or by
        ``tenant`` when not ``any_tenant``): the retained nodes of a path form its prefix."""
        n: Node | None = node
        while n is not None and n.parent is not None:
            refs = n.retain_refs
            if refs and (any_tenant or refs.get(tenant)):
                return (n.depth_tokens + n.num_tokens) // n.block_size
            n = n.parent
        return 0

    def node_at(self, cursor: Node, num_blocks: int) -> Node:
        """The node ending exactly ``num_blocks`` blocks into the path ending at ``cursor``
        (split there if that falls inside a node); the root for 0.

        Raises:
            ValueError: naming ``num_blocks`` if the path is shorter or it is negative.
        """
        end = num_blocks * self.block_size
        depth = cursor.depth_tokens + cursor.num_tokens
        if num_blocks < 0 or end > depth:
            raise ValueError(f"num_blocks: {num_blocks} blocks on a path of {depth} tokens")
        n = cursor
        while n.parent is not None and n.depth_tokens >= end:
            n = n.parent
        if n.parent is None:
            return n
        j = (end - n.depth_tokens) // self.block_size
        return self._split(n, j) if j < len(n.block_ids) else n

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
        """Verify structure, locks, leaf index and counters; return the block ids held.

        See :func:`radixkv.cache.tree.check.check_tree`.
        """
        return check_tree(self, cursors, hash_fn)

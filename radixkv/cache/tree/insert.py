"""Publishing blocks into the radix tree (a mixin of ``RadixTree``): ``insert`` with follow and
split where the tree already holds the blocks, ``extend_leaf`` (the fast path: a request
extending the text leaf only it holds), each new block hashed exactly once.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from radixkv.cache.hashing import as_packed_tokens as as_token_bytes
from radixkv.cache.tree.node import BLOCK_ID_TYPECODE, InsertResult, Node, child_key

if TYPE_CHECKING:
    from radixkv.eviction import EvictionPolicy


class RunHasher(Protocol):
    """What ``insert`` needs to hash new blocks (``radixkv.cache.hashing.BlockHasher`` is one)."""

    def hash_blocks(self, parent_hash: bytes, token_bytes: bytes, block_size: int,
                    extras: Sequence[bytes] | None = None) -> list[bytes]: ...


class TreeInsert:
    """``insert`` / ``extend_leaf`` over the attributes ``RadixTree`` defines."""

    block_size: int
    block_bytes: int
    policy: EvictionPolicy
    num_nodes: int
    num_cached_blocks: int
    num_locked_blocks: int
    root_child_keys: dict
    _notify_policy: bool
    _clock: Callable[[], float]
    # Also uses RadixTree.walk, _split, _lock_one and _uids.

    def insert(self, cursor: Node, tokens: Sequence[int] | bytes, block_ids: list[int],
               hasher: RunHasher, *, extras: Sequence[bytes] | None = None,
               known_hashes: Sequence[bytes] = ()) -> InsertResult:
        """Publish full blocks continuing the chain at the end of ``cursor``.

        The caller holds one lock at ``cursor`` (its request cursor); that lock moves to the
        returned node. Where the tree already holds identical blocks (a concurrent request
        published them first), they are followed instead of inserted and the caller's copies
        are reported as duplicates. Only blocks not already in the tree are hashed, once each.

        Args:
            cursor: Node at whose end the blocks continue (locked by the caller).
            tokens: The blocks' tokens, ``len(block_ids) * B`` ids or their packed bytes.
            block_ids: The caller's physical block holding each block (ints, or an
                ``array('q')``).
            hasher: Hashes new blocks (``hash_blocks``).
            extras: Per-block extras, None for text.
            known_hashes: Chained hashes already computed for the leading blocks of the run
                (e.g. by a lookup's ghost check); used instead of hashing them again.

        Returns:
            An :class:`InsertResult`.

        Raises:
            RuntimeError: if the caller does not lock ``cursor``.
            ValueError: naming ``block_ids`` if the sizes disagree.
            TypeError, OverflowError: if a block id is not an int64; nothing is changed then.
        """
        if cursor.lock_ref <= 0:
            raise RuntimeError(f"insert at {cursor!r} which the caller does not lock")
        tb = tokens if type(tokens) is bytes else as_token_bytes(tokens)
        if type(block_ids) is not array or block_ids.typecode != BLOCK_ID_TYPECODE:
            block_ids = array(BLOCK_ID_TYPECODE, block_ids)  # a bad id raises before any change
        count = len(block_ids)
        if len(tb) != count * self.block_bytes or (extras is not None and len(extras) != count):
            raise ValueError(f"block_ids: {count} ids for {len(tb) // 4} tokens "
                             f"(block size {self.block_size})")
        if extras is None and not known_hashes:
            last_hash = self.extend_leaf(cursor, tb, block_ids, hasher)
            if last_hash is not None:
                return InsertResult(cursor, last_hash, block_ids.tolist(), [])
        now = self._clock()
        node = cursor
        k = 0
        if cursor.children:
            path, k = self.walk(cursor, tb, extras, count)
            for child, j in path:
                if j < len(child.block_ids):
                    child = self._split(child, j)
                # Move the caller's cursor one level down: it still counts in ``node`` and above.
                self._lock_one(child)
                child.last_access_s = now
                node = child
        if k == count:
            return InsertResult(node, node.end_hash, [], block_ids.tolist())
        bb = self.block_bytes
        rest_tb = tb[k * bb :] if k else tb
        rest_ids = block_ids[k:] if k else block_ids
        rest_x = extras[k:] if extras is not None and k else extras
        known = list(known_hashes[k:count])
        hashes = known + hasher.hash_blocks(known[-1] if known else node.end_hash,
                                            rest_tb[len(known) * bb :], self.block_size,
                                            rest_x[len(known) :] if rest_x is not None else None)
        return self._add_run(node, rest_tb, rest_ids, rest_x, hashes, now, block_ids[:k].tolist())

    def extend_leaf(self, cursor: Node, tb: bytes, block_ids: Sequence[int],
                    hasher: RunHasher) -> bytes | None:
        """Fast path of :meth:`insert` for text blocks continuing a leaf only the caller holds.

        The common case (a request publishing its prompt's suffix or its generated blocks at
        the end of its own leaf): hash the blocks and append them to the node, nothing to walk,
        split or create. The caller's lock stays at ``cursor``.

        Args:
            cursor: The caller's cursor node (locked by the caller).
            tb: Packed tokens of ``len(block_ids)`` full blocks (``bytes``).
            block_ids: Physical block of each (a list, or an ``array('q')``).
            hasher: Hashes the new blocks.

        Returns:
            The chained hash of the last block, or None (nothing changed) when the fast path
            does not apply: ``cursor`` has children, other locks, extras, is a root, or the
            sizes disagree; use :meth:`insert` then.
        """
        count = len(block_ids)
        if (cursor.lock_ref != 1 or cursor.children or not cursor.hashes or not count
                or cursor.extras is not None or len(tb) != count * self.block_bytes):
            return None
        if type(block_ids) is not array or block_ids.typecode != BLOCK_ID_TYPECODE:
            block_ids = array(BLOCK_ID_TYPECODE, block_ids)  # a bad id raises before any change
        hashes = hasher.hash_blocks(cursor.hashes[-1], tb, self.block_size)
        cursor.block_ids += block_ids  # one memcpy
        cursor.tokens += tb
        cursor.hashes += hashes
        # last_access_s: the caller's lock is released with touch=True (unlock), which sets it.
        self.num_cached_blocks += count
        self.num_locked_blocks += count
        if self._notify_policy:
            self.policy.on_insert(cursor, count)
        return hashes[-1]

    def _add_run(self, node: Node, tb: bytes, block_ids: Sequence[int],
                 extras: Sequence[bytes] | None, hashes: list[bytes], now: float,
                 duplicates: list[int]) -> InsertResult:
        count = len(block_ids)
        ids = array(BLOCK_ID_TYPECODE, block_ids)
        if extras is not None and not any(extras):
            extras = None
        if node.parent is not None and not node.children and node.lock_ref == 1:
            # Only the caller holds this childless node: grow it in place (keeps runs compressed).
            if extras is not None or node.extras is not None:
                old = node.extras if node.extras is not None else [b""] * len(node.block_ids)
                node.extras = old + (list(extras) if extras is not None else [b""] * count)
            node.block_ids += ids
            node.tokens += tb
            node.hashes += hashes
            node.last_access_s = now
            new = node
        else:
            new = Node(next(self._uids), node, self.block_size, now)
            new.key = child_key(tb[: self.block_bytes], extras[0] if extras is not None else b"")
            new.tokens = bytearray(tb)
            new.extras = list(extras) if extras is not None else None
            new.hashes, new.block_ids = hashes, ids
            new.depth_tokens = node.depth_tokens + len(node.block_ids) * self.block_size
            new.lock_ref = 1  # the caller's cursor moves here; ancestors already count it
            node.children[new.key] = new
            if node.parent is None:
                self.root_child_keys.setdefault(new.key, {})[node] = None
            self.num_nodes += 1
        self.num_cached_blocks += count
        self.num_locked_blocks += count
        if self._notify_policy:
            self.policy.on_insert(new, count)
        return InsertResult(new, hashes[-1], ids.tolist(), duplicates)

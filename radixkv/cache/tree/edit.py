"""Node-level edits of the radix tree: split a node, grow one, add a child, trim a tail.

Each function changes the nodes it is given and their parent/child links, nothing else: the
tree's counters, its evictable-leaf index, its root-key index and the policy's hooks are the
caller's (``RadixTree``) business. Block ids are ``array('q')`` runs; tokens packed uint32-LE.
"""

from __future__ import annotations

from array import array
from typing import MutableSequence, Sequence

from radixkv.cache.tree.node import BLOCK_ID_TYPECODE, Node, child_key


def split_node(node: Node, j: int, uid: int) -> Node:
    """Split ``node`` before its block ``j`` (0 < j < num_blocks); return the new head.

    The head (uid ``uid``) takes blocks ``[0, j)`` and ``node``'s place under its parent; the
    original object keeps the tail, so cursors at its end stay valid. The head inherits the lock
    count (every cursor at or below the node is below the head too), its retention counts
    (``retain_refs``, not ``pins``) and the policy fields (``max_children`` at least 1: the tail
    is its child).
    """
    bb = 4 * node.block_size
    head = Node(uid, node.parent, node.block_size, node.created_s)
    head.key = node.key
    head.tokens = node.tokens[: j * bb]
    w = node.hash_size
    head.hash_bytes = node.hash_bytes[: j * w]
    head.hash_size = w
    head.block_ids = node.block_ids[:j]
    if node.extras is not None:
        head.extras = node.extras[:j]
        del node.extras[:j]
    head.lock_ref = node.lock_ref
    head.last_access_s = node.last_access_s
    head.hit_count = node.hit_count
    head.depth_tokens = node.depth_tokens
    head.tenant = node.tenant
    head.session_key = node.session_key
    head.request_end_s = node.request_end_s
    head.access_gaps = node.access_gaps
    head.last_hit_s = node.last_hit_s
    head.max_children = max(node.max_children, 1)
    # Retentions at or below the node are below the head too; its pins stay with the tail,
    # which still ends where they end.
    head.retain_refs = dict(node.retain_refs) if node.retain_refs else None
    node.parent.children[head.key] = head  # type: ignore[union-attr]  # a split node is no root
    del node.tokens[: j * bb], node.hash_bytes[: j * w], node.block_ids[:j]
    node.key = child_key(bytes(node.tokens[:bb]), node.block_extras(0))
    node.parent = head
    node.depth_tokens += j * node.block_size
    head.children[node.key] = node
    return head


def grow_node(node: Node, tb: bytes, ids: array, hash_bytes: bytes,
              extras: Sequence[bytes] | None) -> None:
    """Append full blocks (packed tokens ``tb``, ids, chained hashes concatenated at the
    node's ``hash_size``, extras or None) to ``node``."""
    if extras is not None or node.extras is not None:
        old = node.extras if node.extras is not None else [b""] * len(node.block_ids)
        node.extras = old + (list(extras) if extras is not None else [b""] * len(ids))
    node.block_ids += ids
    node.tokens += tb
    node.hash_bytes += hash_bytes


def add_child(parent: Node, uid: int, tb: bytes, ids: array, hash_bytes: bytes, hash_size: int,
              extras: Sequence[bytes] | None, now: float) -> Node:
    """A new child of ``parent`` holding the given full blocks (chained hashes concatenated,
    ``hash_size`` bytes each), locked once (the caller's cursor)."""
    bb = 4 * parent.block_size
    new = Node(uid, parent, parent.block_size, now)
    new.key = child_key(tb[:bb], extras[0] if extras is not None else b"")
    new.tokens = bytearray(tb)
    new.extras = list(extras) if extras is not None else None
    new.hash_bytes, new.hash_size, new.block_ids = bytearray(hash_bytes), hash_size, ids
    new.depth_tokens = parent.depth_tokens + len(parent.block_ids) * parent.block_size
    new.lock_ref = 1  # the caller's cursor moves here; ancestors already count it
    parent.children[new.key] = new
    if len(parent.children) > parent.max_children:
        parent.max_children = len(parent.children)
    return new


def trim_tail(node: Node, take: int, freed: MutableSequence[int], record: bool) -> tuple | None:
    """Remove the last ``take`` blocks of ``node``, appending their ids to ``freed`` (last first).

    Args:
        node: A leaf with at least ``take`` blocks (a non-root node).
        take: Blocks to remove, ≥ 1.
        freed: Receives the removed block ids, in eviction (reverse token) order.
        record: Describe the removed run for the ghost list.

    Returns:
        With ``record``: ``(key, tokens, hash_bytes, extras)``: ``key`` is the hash input of
        the run's first block (``parent hash || packed tokens || extras``), then the run's
        packed tokens, chained hashes (concatenated, ``node.hash_size`` bytes each) and extras
        (None for text), in token order. Else None.
    """
    ids = node.block_ids
    bb = 4 * node.block_size
    freed.extend(reversed(ids[-take:]))
    run = None
    if record:
        first, w, x = len(ids) - take, node.hash_size, node.extras
        parent_hash = (node.block_hash(first - 1) if first
                       else node.parent.end_hash)  # type: ignore[union-attr]  # a leaf is no root
        run_tokens = bytes(node.tokens[first * bb :])
        run_x = x[first:] if x is not None else None
        run = (parent_hash + run_tokens[:bb] + (run_x[0] if run_x else b""), run_tokens,
               bytes(node.hash_bytes[first * w :]), run_x)
    del node.tokens[-take * bb :], node.hash_bytes[-take * node.hash_size :], ids[-take:]
    if node.extras is not None:
        del node.extras[-take:]
    return run


def as_block_ids(block_ids: Sequence[int]) -> array:
    """``block_ids`` as an ``array('q')`` (itself if it is one); a bad id raises TypeError or
    OverflowError before anything changes."""
    if type(block_ids) is array and block_ids.typecode == BLOCK_ID_TYPECODE:
        return block_ids
    return array(BLOCK_ID_TYPECODE, block_ids)

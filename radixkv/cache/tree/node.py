"""Radix-tree nodes, their child keys, and the results of a match and an insert.

A :class:`Node` holds a run of full KV blocks of one cache identity: their tokens packed as
little-endian uint32 (one ``bytearray``, ``num_blocks * B * 4`` bytes, so a run is compared with
one ``memcmp``), their extras (multimodal keys, None for an all-text run), chained hashes and
physical block ids. A node is keyed in its parent by its first block's exact token bytes (plus
its extras when non-empty), so a lookup never needs a hash.

Node-level edits (split, grow, trim) are in :mod:`radixkv.cache.tree.edit`, run comparison in
:mod:`radixkv.cache.tree.compare`, the evictable-leaf index in :mod:`radixkv.cache.tree.leaves`.
"""

from __future__ import annotations

from array import array
from functools import partial
from typing import NamedTuple, Protocol, Sequence

from radixkv.cache.hashing import unpack_tokens

#: ``array`` typecode of block-id runs (8-byte signed): a match concatenates runs in C, without
#: touching one Python int per block.
BLOCK_ID_TYPECODE = "q"
#: Gaps between successive accesses a node keeps (``Node.access_gaps``), for policies that
#: predict the next reuse from the last few (LRB, Song et al., NSDI 2020, keeps 32; 4 suffice
#: for the predictor's features here).
MAX_ACCESS_GAPS = 4


def child_key(first_block: bytes, extras: bytes = b"") -> object:
    """Key of a child node: its first block's packed tokens, paired with its extras if any.

    Text blocks use the bare ``bytes`` so a lookup builds no extra object; a ``(bytes, extras)``
    pair never equals a ``bytes``, so a text prompt cannot match a multimodal block by key.
    """
    return (first_block, extras) if extras else first_block


class Node:
    """A run of cached blocks (or an identity root, which holds none).

    Attributes:
        uid: Unique id (creation order within the tree).
        parent: Parent node, None for a root.
        key: ``child_key(first block bytes, first block extras)``: the key in ``parent.children``.
        children: Child nodes by key.
        tokens: Packed uint32-LE tokens of every block (``num_blocks * B * 4`` bytes).
        extras: Extras of each block (``b""`` for text), or None when every block is text.
        hashes: Chained hash of each block.
        block_ids: Physical block id of each block (``array('q')``).
        lock_ref: Request cursors at this node or below (a held path is locked to the root).
        last_access_s, hit_count, created_s: Policy inputs (clock units).
        depth_tokens: Tokens before this node's first block.
        block_size: B.
        root_hash: For a root, its identity root hash; else b"".
        tenant: Tenant label of the identity (inherited from the root), for policies and stats.
        leaf_entry: Entry in the leaf index (None when the node is not an evictable leaf).
        session_key: Session hint (``prompt_cache_key`` / ``user``) of the latest request that
            published into or hit the node; None when that request gave none.
        request_end_s: Clock reading when the latest request holding the node released it
            (None before any release).
        access_gaps: The last ``MAX_ACCESS_GAPS`` gaps between successive accesses of the node
            (its insert, then each hit), newest last, clock units; ``()`` before a hit.
        last_hit_s: Clock reading of the latest access counted in ``access_gaps`` (the insert,
            then each hit).
        max_children: Most children the node ever had at once.
    """

    __slots__ = (
        "uid", "parent", "key", "children", "tokens", "extras", "hashes", "block_ids", "lock_ref",
        "last_access_s", "hit_count", "created_s", "depth_tokens", "block_size", "root_hash",
        "tenant", "leaf_entry", "session_key", "request_end_s", "access_gaps", "last_hit_s",
        "max_children",
    )

    def __init__(self, uid: int, parent: Node | None, block_size: int, now: float) -> None:
        self.uid = uid
        self.parent = parent
        self.key: object = None
        self.children: dict[object, Node] = {}
        self.tokens = bytearray()
        self.extras: list[bytes] | None = None
        self.hashes: list[bytes] = []
        self.block_ids = array(BLOCK_ID_TYPECODE)
        self.lock_ref = 0
        self.last_access_s = now
        self.hit_count = 0
        self.created_s = now
        self.depth_tokens = 0
        self.block_size = block_size
        self.root_hash = b""
        self.tenant: str | None = parent.tenant if parent is not None else None
        self.leaf_entry: object = None
        self.session_key: str | None = None
        self.request_end_s: float | None = None
        self.access_gaps: tuple[float, ...] = ()
        self.last_hit_s = now
        self.max_children = 0

    def note_access_gap(self, now: float) -> None:
        """A lookup matches the node at clock ``now``: append the gap since its previous access
        (its insert, or its previous hit) to ``access_gaps``, at most ``MAX_ACCESS_GAPS`` kept.
        The caller counts the hit (``hit_count``, ``last_access_s``) and re-keys the node."""
        gaps = self.access_gaps + (now - self.last_hit_s,)
        self.access_gaps = gaps[1:] if len(gaps) > MAX_ACCESS_GAPS else gaps
        self.last_hit_s = now

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

    def block_tokens(self, j: int) -> tuple[int, ...]:
        """Token ids of block ``j`` (slow path: tests and debugging)."""
        step = 4 * self.block_size
        return unpack_tokens(bytes(self.tokens[j * step : (j + 1) * step]))

    def block_extras(self, j: int) -> bytes:
        """Extras encoding of block ``j`` (``b""`` for a text block)."""
        return self.extras[j] if self.extras is not None else b""

    @property
    def blocks(self) -> list[tuple[int, ...]]:
        """Token ids of every block (slow path: tests and debugging)."""
        return [self.block_tokens(j) for j in range(len(self.block_ids))]

    def __repr__(self) -> str:
        return (f"Node(uid={self.uid}, depth_tokens={self.depth_tokens}, "
                f"num_blocks={self.num_blocks}, lock_ref={self.lock_ref})")


class MatchResult(NamedTuple):
    """Result of ``RadixTree.match``.

    Attributes:
        node: The node at whose end the match stops (the root on a miss).
        block_ids: Matched physical block ids, in prompt order (``array('q')``).
        last_hash: Chained hash of the last matched block (the root hash on a miss).
    """

    node: Node
    block_ids: list[int]
    last_hash: bytes


class InsertResult(NamedTuple):
    """Result of ``RadixTree.insert``.

    Attributes:
        node: The new cursor node (the caller's lock now sits here).
        last_hash: Chained hash of the last block of the inserted run.
        inserted_ids: Block ids the tree took ownership of (a sequence; do not modify).
        duplicate_ids: Block ids whose content the tree already held (they stay private).
    """

    node: Node
    last_hash: bytes
    inserted_ids: list[int]
    duplicate_ids: list[int]


class GhostRun(NamedTuple):
    """Blocks evicted from one chain of leaf tails, in token order.

    Built by the tree's eviction (``RadixTree.evict``), kept by the cache's ghost list
    (``radixkv.cache.ghost.GhostList``).

    Attributes:
        tokens: Packed tokens of the run (``len(hashes) * B * 4`` bytes; a ``bytearray`` cut
            off the evicted node, never written again).
        hashes: Chained hash of each block.
        extras: Extras of each block, or None for text.
        note: What the eviction policy's ``on_evict`` returned for the run's first block (the
            last one taken; None: nothing), handed back to its ``on_ghost_hit`` when the run is
            inserted again, or to its ``on_ghost_drop`` when the ghost list forgets it first.
    """

    tokens: bytes | bytearray
    hashes: list[bytes]
    extras: list[bytes] | None
    note: object = None


#: ``GhostRun`` from a 4-tuple in C (the NamedTuple constructor is a Python-level function; the
#: eviction path makes one per evicted run).
ghost_run_from_tuple = partial(tuple.__new__, GhostRun)


class RunHasher(Protocol):
    """What ``RadixTree.insert`` needs to hash new blocks (``hashing.BlockHasher`` is one)."""

    def hash_blocks(self, parent_hash: bytes, token_bytes: bytes, block_size: int,
                    extras: Sequence[bytes] | None = None) -> list[bytes]: ...

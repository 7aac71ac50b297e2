"""Radix-tree nodes, their child keys, and the results of a match and an insert.

A :class:`Node` holds a run of full KV blocks of one cache identity: their tokens packed as
little-endian uint32 (one ``bytearray``, ``num_blocks * B * 4`` bytes, so a run is compared with
one ``memcmp``), their extras (multimodal keys, None for an all-text run), chained hashes (one
``bytearray`` too, ``hash_size`` bytes per block: cutting, recording and forgetting an evicted
run then touch one buffer, not a Python object per block) and physical block ids. A node is
keyed in its parent by its first block's exact token bytes (plus its extras when non-empty), so
a lookup never needs a hash.

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


def split_hashes(buf: bytes | bytearray, hash_size: int, start: int = 0) -> list[bytes]:
    """Concatenated chained hashes (``hash_size`` bytes each) as a list, from block ``start``."""
    return [b"" + buf[i : i + hash_size] for i in range(start * hash_size, len(buf), hash_size)]


class HashRun(Sequence[bytes]):
    """Chained hashes of consecutive blocks as one buffer, read as a sequence of ``bytes``.

    What a lookup recovers from the ghost list and hands to ``insert(known_hashes=…)``: the
    buffer goes from the ghost run into the node without a Python object per block. Slicing
    (step 1) gives a ``HashRun``; an index gives one hash.

    Args:
        buf: ``len(self) * hash_size`` bytes.
        hash_size: Bytes per hash (> 0).
    """

    __slots__ = ("buf", "hash_size")

    def __init__(self, buf: bytes, hash_size: int) -> None:
        self.buf = buf
        self.hash_size = hash_size

    def __len__(self) -> int:
        return len(self.buf) // self.hash_size

    def __getitem__(self, index):
        w = self.hash_size
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("HashRun: slices take step 1")
            return HashRun(self.buf[start * w : max(start, stop) * w], w)
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"hash {index} of {n}")
        start = (index % n) * w
        return b"" + self.buf[start : start + w]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal by value, so unhashable (as a list)

    def __repr__(self) -> str:
        return f"HashRun({len(self)} hashes of {self.hash_size} bytes)"


def hash_buffer(hashes: Sequence[bytes]) -> bytes:
    """``hashes`` (a :class:`HashRun` or ``bytes`` items) concatenated."""
    return hashes.buf if type(hashes) is HashRun else b"".join(hashes)


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
        hash_bytes: Chained hash of each block, concatenated (``num_blocks * hash_size`` bytes).
        hash_size: Bytes per chained hash (16 for xxh3-128; 0 before the node holds a block).
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
        pins: Retention pins held exactly at this node (each is also one lock, counted in
            ``lock_ref`` like a request cursor; ``radixkv.cache.retention``).
        retain_refs: Retentions pinned at this node or below, by tenant (None: none); a node
            with any is *retained*. Retained nodes of a path form its prefix.
    """

    __slots__ = (
        "uid", "parent", "key", "children", "tokens", "extras", "hash_bytes", "hash_size",
        "block_ids", "lock_ref",
        "last_access_s", "hit_count", "created_s", "depth_tokens", "block_size", "root_hash",
        "tenant", "leaf_entry", "session_key", "request_end_s", "access_gaps", "last_hit_s",
        "max_children", "pins", "retain_refs",
    )

    def __init__(self, uid: int, parent: Node | None, block_size: int, now: float) -> None:
        self.uid = uid
        self.parent = parent
        self.key: object = None
        self.children: dict[object, Node] = {}
        self.tokens = bytearray()
        self.extras: list[bytes] | None = None
        self.hash_bytes = bytearray()
        self.hash_size = 0
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
        self.pins = 0
        self.retain_refs: dict[str | None, int] | None = None

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
        h = self.hash_bytes
        # ``b"" +`` makes bytes of the bytearray slice at half the cost of ``bytes()``.
        return b"" + h[-self.hash_size :] if h else self.root_hash

    def block_hash(self, j: int) -> bytes:
        """Chained hash of block ``j`` (negative: from the end). IndexError when out of range."""
        n = len(self.block_ids)
        if not -n <= j < n:
            raise IndexError(f"block {j} of a node with {n} blocks")
        w = self.hash_size
        start = (j % n) * w
        return b"" + self.hash_bytes[start : start + w]

    def hash_list(self, start: int = 0) -> list[bytes]:
        """Chained hashes of blocks ``[start, num_blocks)`` as a list (one ``bytes`` each)."""
        return split_hashes(self.hash_bytes, self.hash_size, start)

    @property
    def hashes(self) -> list[bytes]:
        """Chained hash of each block, in token order (a new list: ``NodeView.hashes``)."""
        return split_hashes(self.hash_bytes, self.hash_size)

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
    block_ids: array
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
        tokens: Packed tokens of the run (``num_blocks * B * 4`` bytes; a ``bytearray`` cut
            off the evicted node, never written again).
        hash_bytes: Chained hash of each block, concatenated (``hash_size`` bytes each; cut off
            the node like ``tokens``).
        extras: Extras of each block, or None for text.
        note: What the eviction policy's ``on_evict`` returned for the run's first block (the
            last one taken; None: nothing), handed back to its ``on_ghost_hit`` when the run is
            inserted again, or to its ``on_ghost_drop`` when the ghost list forgets it first.
        hash_size: Bytes per chained hash.
    """

    tokens: bytes | bytearray
    hash_bytes: bytes | bytearray
    extras: list[bytes] | None
    note: object = None
    hash_size: int = 16

    @property
    def num_blocks(self) -> int:
        """Blocks in the run."""
        return len(self.hash_bytes) // self.hash_size

    @property
    def hashes(self) -> list[bytes]:
        """Chained hash of each block, in token order (a new list)."""
        return split_hashes(self.hash_bytes, self.hash_size)


#: ``GhostRun`` from a 5-tuple ``(tokens, hash_bytes, extras, note, hash_size)`` in C (the
#: NamedTuple constructor is a Python-level function; the eviction path makes one per evicted
#: run).
ghost_run_from_tuple = partial(tuple.__new__, GhostRun)


class RunHasher(Protocol):
    """What ``RadixTree.insert`` needs to hash new blocks (``hashing.BlockHasher`` is one)."""

    def hash_blocks(self, parent_hash: bytes, token_bytes: bytes | bytearray, block_size: int,
                    extras: Sequence[bytes] | None = None) -> list[bytes]: ...

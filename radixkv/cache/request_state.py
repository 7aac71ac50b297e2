"""Per-request cache state: what ``CacheManager`` keeps for each active request.

A :class:`RequestState` is made by ``begin`` (or ``fork``), advanced by ``allocate`` and
``publish`` and dropped by ``release``; its block ids and tree nodes are valid only while the
request is active (see ``radixkv/cache/README.md``).
"""

from __future__ import annotations

from array import array
from typing import Sequence

from radixkv.cache.hashing import MMItem
from radixkv.cache.miss_causes import empty_breakdown
from radixkv.cache.tree.node import Node
from radixkv.cache.window_cache import WindowTable


class RequestState:
    """Cache-side state of one active request (a plain slots class: built on every lookup).

    Attributes:
        root: The identity root node (None when prefix caching is off).
        cursor: Tree node at whose end the request's cached/published prefix ends (it holds one
            lock there); None when prefix caching is off.
        last_hash: Chained hash of the last published/matched block (root hash at first).
        block_table: Physical block per block position (``array('q')``).
        num_cached_tokens: m, the capped hit returned by ``begin``.
        num_published_blocks: Leading positions that are in the tree (matched or published).
        mm_items: The request's multimodal items (sorted ``MMItem`` tuples).
        duplicate_ids: Private blocks at published positions whose content the tree already had
            (a concurrent request published it first); freed at release.
        num_computed_tokens: Most tokens reported computed (``publish``), at least m.
        miss: Missed prompt tokens by cause, from the lookup.
        known_hashes: Chained hashes the lookup recovered from the ghost list for positions
            ``known_start, …`` (a sequence of ``bytes``: a ``HashRun`` over one buffer from
            the ghost list, or a list), reused by ``publish`` instead of hashing those blocks
            again.
        known_start: Block position of ``known_hashes[0]``.
        ghost_notes: ``(block position, note, run)`` of the eviction policy's notes on the
            evicted runs (``GhostRun``) the lookup found whole (position of each run's last
            block), handed to the tree's ``insert`` with the known hashes.
        session_key: The request's session hint (``prompt_cache_key`` / ``user``), or None.
        known_tokens: The packed prompt the lookup compared (immutable ``bytes``, token 0
            first): ``publish`` reuses a known hash only for these very tokens.
        admitted: The hit was recorded on the matched path (first successful allocate).
        counted: The miss breakdown was added to the cumulative counters.
        match_node: Node at whose end the lookup's match stopped (None on a miss).
        num_store_tokens: Tokens of ``num_cached_tokens`` the store tier loaded.
        num_slot_tokens: Token slots of ``block_table`` the request filled or is filling: the
            most ``num_tokens`` given to ``allocate`` (``begin``'s m, a fork's computed tokens
            at first); the rest of its last block is tail waste.
        window: The request's window-group block table under window-bounded residency
            (``radixkv.cache.window_cache``); None without window KV groups.
    """

    __slots__ = ("root", "cursor", "last_hash", "block_table", "num_cached_tokens",
                 "num_published_blocks", "mm_items", "duplicate_ids", "num_computed_tokens",
                 "miss", "known_hashes", "known_start", "known_tokens", "admitted", "counted",
                 "match_node", "ghost_notes", "num_store_tokens", "session_key",
                 "num_slot_tokens", "window")

    def __init__(self, root: Node | None, cursor: Node | None, last_hash: bytes,
                 block_table: array, num_cached_tokens: int, num_published_blocks: int,
                 mm_items: tuple[MMItem, ...] = (), *, duplicate_ids: list[int] | None = None,
                 num_computed_tokens: int = 0, miss: dict[str, int] | None = None,
                 known_hashes: Sequence[bytes] | None = None, known_start: int = 0,
                 known_tokens: bytes = b"", admitted: bool = False, counted: bool = False,
                 match_node: Node | None = None,
                 ghost_notes: list[tuple] | None = None, session_key: str | None = None) -> None:
        self.root = root
        self.cursor = cursor
        self.last_hash = last_hash
        self.block_table = block_table
        self.num_cached_tokens = num_cached_tokens
        self.num_published_blocks = num_published_blocks
        self.mm_items = mm_items
        self.duplicate_ids = duplicate_ids if duplicate_ids is not None else []
        self.num_computed_tokens = num_computed_tokens
        self.miss = miss if miss is not None else empty_breakdown()
        self.known_hashes = known_hashes if known_hashes is not None else []
        self.known_start = known_start
        self.known_tokens = known_tokens
        self.admitted = admitted
        self.counted = counted
        self.match_node = match_node
        self.ghost_notes = ghost_notes if ghost_notes is not None else []
        self.num_store_tokens = 0
        self.session_key = session_key
        self.num_slot_tokens = num_computed_tokens
        self.window: WindowTable | None = None

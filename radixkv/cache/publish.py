"""Publishing: insert a request's full computed blocks into the tree (``CacheManager.publish``).

The fast path (a request extending the leaf only it holds, text only) appends the blocks to
that leaf and hands their ownership to the tree without a per-block pool write; otherwise the
tree's general ``insert`` follows blocks another request published first and splits or adds
nodes. Every new block is hashed exactly once; hashes a lookup recovered from the ghost list
are reused for the very tokens it compared.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from radixkv.cache.events import KVEventLog
from radixkv.cache.hashing import BlockHasher, block_extras, pack_tokens, validate_mm_items
from radixkv.cache.pool import BlockPool
from radixkv.cache.request_state import RequestState
from radixkv.cache.store.bridge import write_published
from radixkv.cache.store.tier import StoreTier
from radixkv.cache.tree.node import Node
from radixkv.cache.tree.radix_tree import RadixTree
from radixkv.config import check_int


class PublishTarget(Protocol):
    """What publishing reads of the cache (``CacheManager``, which calls :func:`publish`)."""

    @property
    def tree(self) -> RadixTree: ...
    @property
    def pool(self) -> BlockPool: ...
    @property
    def hasher(self) -> BlockHasher: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def events(self) -> KVEventLog | None: ...
    @property
    def store(self) -> StoreTier | None: ...


def publish(cache: PublishTarget, req: RequestState, token_ids: Sequence[int] | bytes,
            num_computed_tokens: int, mm_items: Sequence[Sequence] | None) -> list:
    """Insert every full, computed block of ``req`` not yet published into ``cache.tree``.

    Arguments, errors and effects as ``CacheManager.publish``; ``req`` is advanced in place
    (``num_computed_tokens``, ``num_published_blocks``, ``cursor``, ``last_hash``, duplicates)
    and the inserted blocks pass from the request to the tree in ``cache.pool``.
    ``cache.events`` records the newly inserted run (none when every block was already
    cached); ``cache.store``, in ``all`` write mode, is asked to write it. The node receiving
    the blocks takes ``req.session_key``.

    Returns:
        The ghost runs (``GhostRun``) this insert brought back whose notes went to the policy's
        ``on_ghost_hit`` (for ``GhostList.came_back``); usually empty.
    """
    tree, pool, hasher, events = cache.tree, cache.pool, cache.hasher, cache.events
    store = cache.store
    if store is not None and store.write_mode != "all":
        store = None
    session_key = req.session_key
    bs = tree.block_size
    packed = isinstance(token_ids, (bytes, bytearray))
    if packed and len(token_ids) & 3:
        raise ValueError(f"token_ids: packed tokens need a multiple of 4 bytes, got "
                         f"{len(token_ids)}")
    num_tokens = len(token_ids) >> 2 if packed else len(token_ids)
    if type(num_computed_tokens) is not int or num_computed_tokens < 0:
        check_int("num_computed_tokens", num_computed_tokens)
    if num_computed_tokens > num_tokens:
        raise ValueError(f"num_computed_tokens: {num_computed_tokens} exceeds the "
                         f"{num_tokens} token_ids given")
    num_full = num_computed_tokens // bs
    if num_full > len(req.block_table):
        raise ValueError(f"num_computed_tokens: {num_computed_tokens} exceeds the "
                         f"{len(req.block_table)} allocated blocks")
    items = validate_mm_items(mm_items, num_tokens) if mm_items is not None else None
    if num_computed_tokens > req.num_computed_tokens:
        req.num_computed_tokens = num_computed_tokens
    if items is not None and items != req.mm_items:
        req.mm_items, req.known_hashes, req.ghost_notes = items, [], []
    start = req.num_published_blocks
    if num_full <= start or not cache.enable_prefix_caching:
        return []
    cursor: Node = req.cursor  # type: ignore[assignment]  # None only with prefix caching off
    root_hash = req.root.root_hash  # type: ignore[union-attr]  # as cursor
    # (a slice of the engine's bytearray is a bytearray: fine for the fast path, which only
    # hashes and appends it; the general insert keys children by bytes)
    tb: bytes | bytearray = (token_ids[start * 4 * bs : num_full * 4 * bs]  # type: ignore[assignment]  # packed: bytes
                             if packed else pack_tokens(token_ids[start * bs : num_full * bs]))
    # An array slice (one memcpy): the fast path appends it to the leaf's array as is.
    ids = req.block_table[start:num_full]
    if not req.mm_items and not req.known_hashes:
        last_hash = tree.extend_leaf(cursor, tb, ids, hasher)
        if last_hash is not None:  # the request extended its own leaf
            pool.to_cached(ids)
            req.last_hash = last_hash
            req.num_published_blocks = num_full
            if events is not None:
                events.stored(root_hash, cursor, len(ids))
            if store is not None:
                write_published(store, root_hash, cursor, len(ids))
            cursor.session_key = session_key
            return []
    if type(tb) is not bytes:
        tb = bytes(tb)
    extras = block_extras(req.mm_items, num_full, bs, start) if req.mm_items else None
    known: Sequence[bytes] = ()
    noted: list[tuple] = []
    if req.known_hashes:
        offset = start - req.known_start
        num_known = min(len(req.known_hashes) - offset, num_full - start)
        n = num_known * 4 * bs
        # Reuse a recovered hash only for the tokens the lookup compared it with.
        if offset >= 0 and num_known > 0 and req.known_tokens.startswith(
                tb if len(tb) == n else memoryview(tb)[:n], start * 4 * bs):
            known = req.known_hashes[offset : offset + num_known]
            noted = [(pos - start, note, run) for pos, note, run in req.ghost_notes
                     if start <= pos < start + num_known]
        elif offset >= 0:
            req.known_hashes = []
        if num_full >= req.known_start + len(req.known_hashes):
            req.known_hashes = []
        if not req.known_hashes:
            req.ghost_notes = []
    result = tree.insert(cursor, tb, ids, hasher, extras=extras, known_hashes=known,
                         ghost_notes=[(i, note) for i, note, _ in noted], session_key=session_key)
    result.node.session_key = session_key
    pool.to_cached(result.inserted_ids)
    if events is not None and result.inserted_ids:
        events.stored(root_hash, result.node, len(result.inserted_ids))
    if store is not None and result.inserted_ids and not req.mm_items:
        write_published(store, root_hash, result.node, len(result.inserted_ids))
    if result.duplicate_ids:
        req.duplicate_ids += result.duplicate_ids
    req.cursor = result.node
    req.last_hash = result.last_hash
    req.num_published_blocks = num_full
    # The insert handed the notes of runs at or past the blocks it followed (k of them: the
    # duplicates) to on_ghost_hit.
    k = len(result.duplicate_ids)
    return [run for i, _, run in noted if i >= k]

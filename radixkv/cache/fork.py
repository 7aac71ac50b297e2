"""Forking: start a sequence as a copy of a running one (``n > 1``; ``CacheManager.fork``).

Full computed blocks are shared (published ones through a tree lock, unpublished ones through
pool reference counts); the partial tail block, which both sequences write next, is copied
(copy-on-write): the caller copies the K/V of each returned ``(src, dst)`` pair.
"""

from __future__ import annotations

from typing import Callable

from radixkv.cache.pool import BlockPool
from radixkv.cache.request_state import RequestState
from radixkv.cache.tree.radix_tree import RadixTree


def fork(parent: RequestState, tree: RadixTree, pool: BlockPool, block_size: int,
         enable_prefix_caching: bool, num_computed_tokens: int | None,
         take_blocks: Callable[[int], list[int] | None],
         ) -> tuple[RequestState, list[tuple[int, int]]] | None:
    """The child's state and the ``(src, dst)`` block copies, sharing ``parent``'s blocks.

    Args:
        parent: The running request's state.
        tree, pool: Where the shared blocks are locked / reference-counted.
        block_size: B.
        enable_prefix_caching: Whether full computed blocks must be published before a fork.
        num_computed_tokens: An int ≥ 0 (validated by the caller), or None for the parent's
            most computed tokens.
        take_blocks: Returns that many private blocks (evicting if short), or None.

    Returns:
        ``(child state, copies)``, or None when no block can be found for the tail copy
        (nothing changed then).

    Raises:
        ValueError: naming ``num_computed_tokens`` if outside the parent's table or published
            prefix, ``parent_request_id`` if full computed blocks are not published yet.
    """
    bs = block_size
    computed = parent.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
    if not parent.num_published_blocks * bs <= computed <= len(parent.block_table) * bs:
        raise ValueError(f"num_computed_tokens: {computed} outside the parent's "
                         f"{len(parent.block_table)} blocks / published prefix")
    num_full, has_tail = divmod(computed, bs)
    if enable_prefix_caching and parent.num_published_blocks < num_full:
        raise ValueError(f"parent_request_id: publish its {num_full} full computed blocks "
                         f"before forking ({parent.num_published_blocks} published)")
    copies: list[tuple[int, int]] = []
    table = parent.block_table[:num_full]
    if has_tail:
        ids = take_blocks(1)
        if ids is None:
            return None
        copies.append((parent.block_table[num_full], ids[0]))
        table.append(ids[0])
    if parent.cursor is not None:
        tree.lock(parent.cursor)
    for block_id in [*parent.duplicate_ids,
                     *parent.block_table[parent.num_published_blocks : num_full]]:
        pool.incref(block_id)
    child = RequestState(
        parent.root, parent.cursor, parent.last_hash, table, parent.num_cached_tokens,
        parent.num_published_blocks, parent.mm_items,
        duplicate_ids=list(parent.duplicate_ids), num_computed_tokens=computed,
        admitted=True, counted=True, known_hashes=list(parent.known_hashes),
        known_start=parent.known_start, known_tokens=parent.known_tokens,
        ghost_notes=list(parent.ghost_notes), session_key=parent.session_key)
    return child, copies
